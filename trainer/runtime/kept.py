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
import stat
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


MAX_BYTES = 1 << 20  # a kept answer is a few KB; anything larger is not one


def read(kind: str, name: str | None) -> dict | None:
    """The answer kept as `name`, or None. The cache is outside the project's control, so it is read as untrusted: a
    regular file only (not a link, a FIFO or a device: no wait, no endless read), at most MAX_BYTES, JSON holding a
    mapping; anything else is damage, and the question is asked again. Callers check the values' types."""
    if name is None:
        return None
    try:
        fd = os.open(directory(kind) / f"{name}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return None
        data = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        kept = json.loads(data) if len(data) <= MAX_BYTES else None
    except (ValueError, RecursionError):
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
