"""Local dataset files (JSON, JSON Lines, CSV, parquet), loaded with `datasets`; a file that cannot be read is one
line that names it, and for JSON the line and column where it breaks (DataError, exit 2).

`datasets` reports a malformed JSON Lines row as "DatasetGenerationError: An error occurred while generating the
dataset", with pyarrow's "JSON parse error ... in row 3" (a row of one of its blocks, not a line of the file) in the
chain of causes. When a load fails, the file is read again here with the standard json module, one line at a time
(or whole, for a JSON array), to name the first line that is not a JSON object; CSV and parquet errors are given
as the reader's own first line (pandas' "Expected 2 fields in line 3, saw 3" already names the line).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

from trainer.errors import DataError

SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".txt": "text"}


def cause(err: BaseException) -> str:
    """The first line of the innermost exception in err's chain (the reader's own words)."""
    seen, inner = set(), err
    while (inner.__cause__ or inner.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text.splitlines()[0][:300]}" if text else type(inner).__name__


def _json_value(value, where: str) -> str | None:
    if isinstance(value, dict):
        return None
    kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
    return f"{where}: {kind}, not a JSON object (one object per row)"


class Malformed(Exception):
    """Where a JSON / JSON Lines file stops being one JSON object per row ("line N[, column C]: what")."""


def json_rows(path: Path):
    """The rows of `path` (JSON Lines, or one JSON array of objects), each a dict, read one line at a time (a JSON
    array whole); raises Malformed at the first place that is not a JSON object per row."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):  # one JSON array
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            line = path.read_bytes()[:err.start].count(b"\n") + 1
            raise Malformed(f"line {line}: not UTF-8 text ({err.reason})") from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise Malformed(f"line {err.lineno}, column {err.colno}: not valid JSON ({err.msg})") from None
        if isinstance(rows, list):
            for i, row in enumerate(rows):
                if (p := _json_value(row, f"element {i}")) is not None:
                    raise Malformed(p)
                yield row
            return
        raise Malformed(_json_value(rows, "line 1") or "line 1: one JSON object, not one per row")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise Malformed(f"line {number}: not UTF-8 text ({err.reason})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise Malformed(f"line {number}, column {err.colno}: not valid JSON ({err.msg})") from None
            problem = _json_value(value, f"line {number}")
            if problem:
                raise Malformed(problem)
            yield value


def json_problem(path: Path) -> str | None:
    """Where `path` (JSON Lines, or one JSON array of objects) first stops being JSON objects, as "line N[, column
    C]: what"; None when every row is a JSON object."""
    try:
        for _ in json_rows(path):
            pass
    except Malformed as err:
        return str(err)
    return None


def problem(path: Path, builder: str, err: BaseException) -> str:
    """Why `path` did not load as `builder`, naming the place where that can be found ("line 4, column 35: not
    valid JSON (...)"), to follow the file's name."""
    where = json_problem(path) if builder == "json" else None
    if where:
        return f" {where}"
    if builder == "parquet":
        return f": not a readable parquet file ({cause(err)})"
    return f": cannot be read as {builder} ({cause(err)})"


@contextmanager
def quiet_datasets():
    """datasets logs its own "Failed to load JSON from file ..." before raising; the error line says it instead."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_file(path: Path, builder: str, label: str):
    """One local file as a datasets.Dataset (split "train"); DataError naming it (and the line) when it is
    malformed. `label` is how the config names the dataset."""
    # heavy: datasets loads only when this runs
    import datasets

    try:
        with quiet_datasets():
            return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:
        raise DataError(f"dataset {label}{problem(path, builder, err)}") from None


def directory_problem(directory: Path, err: BaseException) -> str:
    """Why a local dataset directory did not load, to follow its name: the first of its data files that does not
    read (by the same checks as one file), else the loader's own words."""
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES):
        builder = SUFFIXES[path.suffix.lower()]
        where = json_problem(path) if builder == "json" else None
        if where:
            return f": {path.relative_to(directory)} {where}"
    return f": {cause(err)}"
