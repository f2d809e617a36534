"""The compatibility facts, read from the same matrices/*.toml the resolver reads (one copy of every fact).

The trainer must run in images that carry no resolver, so this reads the TOML with tomllib directly;
the resolver's matrix.py checks the same files' schema (tests keep the two readings in step).
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

from matrices.catalog import matrix_dir  # the same directory (and ENVTOOL_MATRIX_DIR override) as the resolver's


@lru_cache(maxsize=None)
def _table(directory: str, name: str) -> dict:
    with open(Path(directory) / f"{name}.toml", "rb") as f:
        return tomllib.load(f)


def table(name: str) -> dict:
    """The parsed matrices/NAME.toml (cached per directory)."""
    return _table(str(matrix_dir()), name)


def rows(name: str, key: str) -> list[dict]:
    """The [[key]] rows of matrices/NAME.toml."""
    return list(table(name).get(key, []))


def feature(name: str) -> dict:
    """A [[feature]] row of packages.toml: a library feature's hardware floor (e.g. 'bnb_4bit')."""
    for row in rows("packages", "feature"):
        if row["name"] == name:
            return row
    raise KeyError(f"packages.toml has no [[feature]] row named {name!r}")
