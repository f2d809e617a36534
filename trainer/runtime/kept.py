"""Answers kept on disk between processes: what transformers says of a model's config (its class's attention, its
shape on the meta device), which costs a validate, dry run or fit most of its time (importing transformers' model
code, 5-8 s of CPU) and never changes for the same config.json and the same transformers. Each answer is a JSON
file under $XDG_CACHE_HOME/envtool/<kind>/, named by a hash of what it depends on (`key`); a missing, damaged or
unwritable one only means the question is asked again."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
import hashlib
import json
import os
import tempfile


def directory(kind: str) -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "envtool" / kind


def key(fmt: int, *parts: bytes) -> str | None:
    """The name of an answer that depends on `parts`, the answer's format `fmt` and the installed transformers'
    version; None where transformers is not installed (nothing is kept then)."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    digest = hashlib.sha256(b"%d\0%s" % (fmt, version.encode()))
    for part in parts:
        digest.update(b"\0" + part)
    return digest.hexdigest()


def read(kind: str, name: str | None) -> dict | None:
    if name is None:
        return None
    try:
        kept = json.loads((directory(kind) / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) else None


def keep(kind: str, name: str | None, answer: dict) -> None:
    if name is None:
        return
    try:
        text = json.dumps(answer)
        directory(kind).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory(kind), suffix=".tmp", delete=False) as out:
            out.write(text)
        os.replace(out.name, directory(kind) / f"{name}.json")  # whole or not at all: readers never see half
    except (OSError, TypeError, ValueError):  # a read-only home, a value JSON cannot hold: asked again next time
        return
