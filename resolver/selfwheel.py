"""envtool's own wheel, for locked environments and images: the trainer and `envtool doctor` run there.

It is repacked from the installed distribution (its packages and its METADATA), which works the same for an
editable checkout and for an installed wheel, needs no build backend and no network, and gives the same bytes
(so the same lock hash) for the same code.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from . import DISTRIBUTION

PACKAGES = ("resolver", "trainer", "matrices", "dockerfiles")
FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def _package_files(name: str) -> list[tuple[str, Path]]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    return sorted(
        (f"{name}/{p.relative_to(root).as_posix()}", p)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )


def wheel_prefix() -> str:
    """The start of envtool's wheel file names, `envtool_llm-` (the distribution name as wheels spell it)."""
    return re.sub(r"[-_.]+", "_", DISTRIBUTION).lower() + "-"


def build(dest: Path) -> Path:
    """Write `envtool_llm-VERSION-py3-none-any.whl` into `dest` and return its path."""
    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError:
        # start-up: resolver.errors imported only when this runs
        from .errors import EnvtoolError

        raise EnvtoolError(f"the distribution {DISTRIBUTION} is not installed in {sys.prefix} (a checkout installed "
                           f"before the rename is named envtool): install it again, `pip install -e .` in the clone "
                           f"or `bash .ci/setup`") from None
    version = dist.version
    info = f"{wheel_prefix()}{version}.dist-info"
    entries: list[tuple[str, bytes]] = []
    for name in PACKAGES:
        entries += [(arcname, path.read_bytes()) for arcname, path in _package_files(name)]
    entries.append((f"{info}/METADATA", dist.read_text("METADATA").encode()))
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        entries.append((f"{info}/entry_points.txt", entry_points.encode()))
    entries.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: envtool\nRoot-Is-Purelib: true\n"
                                     b"Tag: py3-none-any\n"))
    record = "".join(f"{n},sha256={_b64(hashlib.sha256(d).digest())},{len(d)}\n" for n, d in entries)
    entries.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))

    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{wheel_prefix()}{version}-py3-none-any.whl"
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in entries:
            z.writestr(zipfile.ZipInfo(arcname, FIXED_TIME), data, zipfile.ZIP_DEFLATED)
    tmp.replace(path)
    return path


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
