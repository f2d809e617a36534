"""What a run reads before it trains, checked in seconds: the model is there, and each dataset's first rows fit its
`type` -- so `validate` and `envtool train --dry-run` find what the run would find 30-45 s in (after the
environment is built, the tokenizer loaded and the rows mapped).

- **The model** (`base_model`, `tokenizer_config`, `lora_model_dir` as hub ids; local paths are
  trainer.config's `missing_local_paths`): found in the Hugging Face cache, else asked of the Hub once (the probe of
  trainer/runtime/hub_access.py: one request, a short timeout, no retries). The Hub saying the repository, revision
  or file does not exist, or that it is gated, or not answering while the model is not cached, or HF_HUB_OFFLINE
  with nothing cached: one line each.
- **The rows**: local files (JSON Lines / JSON, CSV, parquet where pyarrow imports; a directory's first data file)
  and hub datasets already in the Hugging Face cache (their data files). A JSON file is read through (up to
  SCAN_LIMIT bytes; the first rows beyond) and its first malformed row named by file, line and column
  (trainer/data/files.py, the words the loader's failure gives). The first FIRST_ROWS rows go through the very
  function the run turns a row into text with (SFT: trainer/data/prepare.py `tokenize_example`, the formats of
  trainer/data/formats/; preference methods: formats/preference_prompts.py `render`), with `FieldsOnly` in the
  tokenizer's place: a row lacking a field its type reads is the run's own DataError line. No second list of which
  fields a type needs exists here. Reward models, GRPO and EBFT (their rows go through their own or the user's
  functions) have their files read, not their fields.

Nothing here imports torch, transformers or datasets: it runs in envtool's own environment too.
"""

from __future__ import annotations

import csv
import os
from itertools import islice
from pathlib import Path

from trainer.config import Config, DatasetConfig, looks_local
from trainer.data import files as local_files
from trainer.errors import DataError, TrainerError

FIRST_ROWS = 20  # rows of each dataset put through its format
SCAN_LIMIT = 64 << 20  # a JSON file up to this size is read through for malformed rows (about a second)
HUB_FILES = {**local_files.SUFFIXES}  # data files a hub dataset's snapshot may hold


class FieldsOnly:
    """The tokenizer's place while a row is rendered only to see that its fields are there: text -> one id per
    character, a chat template that renders every conversation turn by turn. Never a tokenizer's answer."""

    eos_token = ""
    bos_token_id = None
    chat_template = "fields only"
    backend = None

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False, **_):
        text = str(text)
        out = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def encode(self, text, add_special_tokens=True):
        return self(text)["input_ids"]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **_):
        text = "".join(f"<{m.get('role')}>{m.get('content')}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


# ---------------------------------------------------------------------------- the model


def hub_cache() -> Path:
    """Where huggingface_hub caches repositories (its own rule: HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def snapshot(kind: str, repo: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of a hub repository (kind: models | datasets) at `revision`, if any."""
    folder = hub_cache() / f"{kind}--{repo.replace('/', '--')}"
    ref = folder / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = folder / "snapshots" / commit if commit else None
    return path if path is not None and path.is_dir() else None


def _hub_answer(repo: str, marker: str, revision: str | None) -> str | None:
    """What the Hub says of `repo`'s `marker` file, as a problem to name, or None (there, or no clear answer).
    Raises OSError (with why) when the Hub does not answer."""
    # start-up: trainer.runtime.hub_access imported only when this runs
    from trainer.runtime.hub_access import endpoint, head

    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    err = head(f"{endpoint()}/{repo}/resolve/{revision or 'main'}/{marker}",
               {"Authorization": f"Bearer {token}"} if token else None)  # OSError (why) when nothing answers
    if err is None:
        return None
    code = err.headers.get("X-Error-Code", "") if err.headers else ""
    if code == "RepoNotFound" or (err.code == 404 and not code):
        return "no such model on the Hub (or a private one: set HF_TOKEN)"
    if code == "RevisionNotFound":
        return f"the Hub has no revision {revision} of it"
    if code == "EntryNotFound":
        return f"the Hub's repository has no {marker}"
    if code == "GatedRepo":
        return ("gated on the Hub: it needs a token with access (HF_TOKEN or `hf auth login`)" if not token else
                "gated on the Hub, and HF_TOKEN has no access to it (ask for access on its page)")
    return None  # a server error: the run will tell


def model_problems(cfg: Config) -> list[str]:
    """One line per model the config reads from the Hub that the run would not find (see the module's docstring)."""
    # start-up: trainer.runtime.hub_access imported only when this runs
    from trainer.runtime import hub_access

    problems = []
    revision = getattr(cfg, "revision_of_model", None)
    for key, repo, marker in hub_access.hub_models(cfg):
        rev = revision if key == "base_model" else None
        found = snapshot("models", repo, rev)
        if found is not None and (found / marker).exists():
            continue
        where = f"{key}: {repo} is not on this machine (no such directory, not in the Hugging Face cache {hub_cache()})"
        if hub_access.offline():
            problems.append(f"{where} and HF_HUB_OFFLINE is set: download it first (`hf download {repo}`) or unset "
                            "HF_HUB_OFFLINE")
            continue
        try:
            said = _hub_answer(repo, marker, rev)
        except OSError as err:
            problems.append(f"{where} and the Hugging Face Hub at {hub_access.endpoint()} does not answer ({err}): "
                            "give a local directory, download it where the Hub is reachable, or fix the network "
                            "(HF_ENDPOINT, a proxy)")
            continue
        if said:
            problems.append(f"{key}: {repo}: {said}")
    return problems


# ---------------------------------------------------------------------------- the rows


def _builder(path: Path, ds: DatasetConfig) -> str | None:
    return ds.ds_type or local_files.SUFFIXES.get(path.suffix.lower())


def _files(ds: DatasetConfig) -> list[tuple[Path, str]]:
    """(file, how the config names it) of the data the run reads first: a local file, the data files, a local
    directory's first data file, or a hub dataset's first cached data file of the split; [] when none is here."""
    data_files = [ds.data_files] if isinstance(ds.data_files, str) else list(ds.data_files or [])
    if not ds.path or ds.path in ("json", "csv", "parquet"):
        return [(Path(f).expanduser(), f) for f in data_files]
    path = Path(ds.path).expanduser()
    if path.is_file():
        return [(path, ds.path)]
    if path.is_dir():
        found = [path / f for f in data_files] if data_files else sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in local_files.SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        return [(p, f"{ds.path}/{p.relative_to(path)}") for p in found[:1]]
    if looks_local(ds.path) or ds.path.count("/") != 1:
        return []
    root = snapshot("datasets", ds.path, ds.revision)
    if root is None:
        return []
    candidates = [root / f for f in data_files] if data_files else sorted(
        p for p in root.rglob("*") if p.suffix.lower() in HUB_FILES and ds.split in p.relative_to(root).as_posix()
        and (ds.name is None or ds.name in p.relative_to(root).parts))
    return [(p, f"{ds.path} (cached: {p.relative_to(root)})") for p in candidates[:1] if p.exists()]


def first_rows(path: Path, builder: str, label: str, n: int = FIRST_ROWS) -> list[dict] | None:
    """The first `n` rows of a file as dicts; None where they cannot be read here (parquet without pyarrow).
    DataError naming the file, line and column for a malformed JSON row (read through up to SCAN_LIMIT)."""
    try:
        if builder == "json":
            rows = local_files.json_rows(path)
            first = list(islice(rows, n))
            if path.stat().st_size <= SCAN_LIMIT:
                for _ in rows:  # the rest: a malformed row further down fails the run as well
                    pass
            return first
        if builder == "csv":
            with open(path, newline="", encoding="utf-8") as f:
                return [dict(row) for row in islice(csv.DictReader(f), n)]
        if builder == "parquet":
            try:
                # heavy: pyarrow loads only when this runs
                import pyarrow.parquet as pq
            except ImportError:
                return None
            try:
                batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
            except Exception as err:
                raise DataError(f"dataset {label}: not a readable parquet file ({local_files.cause(err)})") from None
            return batch.to_pylist() if batch is not None else []
    except local_files.Malformed as err:
        raise DataError(f"dataset {label} {err}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"dataset {label}: not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise DataError(f"dataset {label}: cannot be read ({err.strerror or err})") from None
    return None


def _row_check(cfg: Config):
    """The function the run turns one row into text/tokens with, for this config's objective (None: not here)."""
    tokenizer = FieldsOnly()
    objective = cfg.objective
    if objective == "sft" and not cfg.tokenizer_use_mistral_common:
        # start-up: trainer.data.prepare, trainer.data.formats.preference_prompts imported only when this runs
        from trainer.data.prepare import tokenize_example

        return lambda row, ds: tokenize_example(row, ds, cfg, tokenizer)
    if objective in ("dpo", "ipo", "orpo", "simpo", "kto"):
        from trainer.data.formats.preference_prompts import label_of, render

        def check(row, ds):
            render(row, ds, tokenizer, objective == "kto")
            if objective == "kto":
                label_of(row, ds)

        return check
    return None


def row_problems(cfg: Config) -> list[str]:
    """One line per dataset whose file is malformed or whose first rows lack what its `type` reads."""
    problems = []
    check = _row_check(cfg)
    entries = [("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets or [])]
    for key, i, ds in [(key, i, ds) for key, group in entries for i, ds in enumerate(group)]:
        for path, label in _files(ds):
            builder = _builder(path, ds)
            if builder is None or not path.is_file():
                continue
            try:
                rows = first_rows(path, builder, label)
                for number, row in enumerate(rows or [], 1):
                    if check is not None:
                        try:
                            check(row, ds)
                        except DataError as err:
                            raise DataError(f"{key}.{i}: {err} (first seen in row {number} of {label})") from None
                        except TrainerError:
                            raise
                        except Exception:  # not a field the format reads: the run's own loader says what it is
                            break
            except TrainerError as err:
                problems.append(str(err))
    return problems
