"""One manifest rule for what the trainer writes and later trusts: checkpoints (trainer/outputs/checkpoint.py) and
dataset caches (trainer/data/prepare.py).

A manifest maps every file under its folder (by relative path, the manifest itself aside) to its size and sha256,
and is written last. `damage(root, files)` says why a folder cannot be trusted, or None; a manifest proves only what
it lists, so one that proves less than the folder holds is damage too:
1. every entry is {"size": a whole number >= 0, "sha256": 64 hex digits} under a relative path inside the folder
   (an entry without a size or hash, or `../x`, is damage, never a KeyError);
2. every file in the folder is listed (a manifest listing no files, or not the weights, or not the data: damage);
3. every listed file is there, with its size, and (up to `hash_limit` bytes in all; None: always) its hash.
Callers turn the reason into their own fallback: the previous checkpoint, or the cache prepared again.
`write` and `load` are the manifest file itself: written last and atomically, read back; a checkpoint's nests the
map under "files", a dataset cache's is the map (each the format its folders on disk already have).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath

HEX64 = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def files_under(root: Path, manifest: str, derived: tuple[str, ...] = ()) -> list[Path]:
    """Every file under root but the manifest, sorted; `derived`: prefixes of top-level folders that hold caches
    made from the folder later, with their own keys (a dataset cache's reference-<key>/ log-probs), not part of it."""
    root = Path(root)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != manifest
                  and not p.relative_to(root).parts[0].startswith(derived))


def describe(root: Path, manifest: str, derived: tuple[str, ...] = ()) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of every file under root but the manifest (and `derived`)."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in files_under(root, manifest, derived)}


def write(root: Path, manifest: str, derived: tuple[str, ...] = (), key: str | None = None) -> None:
    """The manifest of every file under `root` (but `derived`), written last, atomically (a temp file renamed);
    `key`: the map nested under it ({"files": ...})."""
    root = Path(root)
    files = describe(root, manifest, derived)
    tmp = root / f".{manifest}.tmp"
    tmp.write_text(json.dumps({key: files} if key else files, indent=1))
    os.replace(tmp, root / manifest)


def load(root: Path, manifest: str, key: str | None = None):
    """The map a manifest `write` wrote (under `key` where given), unchecked (`damage` checks it). Raises OSError
    (FileNotFoundError: there is none) or ValueError (it does not parse, or is not an object)."""
    data = json.loads((Path(root) / manifest).read_text())
    if key is None:
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{manifest} is not a JSON object")
    return data.get(key)


def _entry_problem(name, want) -> str | None:
    if not isinstance(name, str) or not name:
        return f"names a file {name!r}"
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name:
        return f"names {name!r}, outside its folder"
    if not isinstance(want, dict):
        return f"entry {name!r} is not a size and a hash"
    size = want.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"entry {name!r} has {'no size' if 'size' not in want else f'size {size!r}'}"
    digest = want.get("sha256")
    if not isinstance(digest, str) or not HEX64.fullmatch(digest):
        return f"entry {name!r} has {'no sha256' if 'sha256' not in want else 'a sha256 that is not 64 hex digits'}"
    return None


def damage(root: Path, files, manifest: str, hash_limit: int | None = None, derived: tuple[str, ...] = ()) -> str | None:
    """Why the folder at `root` is not what its manifest's `files` ({path: {"size", "sha256"}}) proves, or None
    (see the module doc for the rule)."""
    root = Path(root)
    if not isinstance(files, dict):
        return f"{manifest} lists no files"
    for name, want in files.items():
        problem = _entry_problem(name, want)
        if problem:
            return f"{manifest} {problem}"
    unlisted = [p.relative_to(root).as_posix() for p in files_under(root, manifest, derived)
                if p.relative_to(root).as_posix() not in files]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        return f"{unlisted[0]}{more} is not in {manifest}, which proves only what it lists"
    for name, want in files.items():
        file = root / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["size"]:
            return f"{name} is {file.stat().st_size} bytes, the manifest says {want['size']}"
    if hash_limit is None or sum(w["size"] for w in files.values()) <= hash_limit:
        for name, want in files.items():
            if sha256_file(root / name) != want["sha256"]:
                return f"the bytes of {name} changed since it was written (its sha256 does not match the manifest)"
    return None
