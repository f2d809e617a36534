"""Every wheel a lock needs, downloaded and hash-checked into one directory, for installs with no network.

The wheelhouse holds the wheels and `requirements.txt` (`name==version --hash=...` per package), which
`envtool install --offline` hands to `uv pip sync --no-index --require-hashes`.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from .errors import BadInput, EnvtoolError
from .uvrun import tls_verify

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REQUIREMENTS = "requirements.txt"


class Wheel(NamedTuple):
    name: str
    version: str
    filename: str
    url: str | None  # None: a local file (envtool's own wheel, a file:// index, a --find-links directory)
    path: Path | None
    sha256: str


def supported_tags(python: str, platform: str) -> list:
    """The wheel tags a CPython `python` on Linux `platform` accepts, most specific first."""
    # start-up: packaging imported only when this runs
    from packaging.tags import compatible_tags, cpython_tags

    version = tuple(int(x) for x in python.split("."))
    platforms = [f"manylinux_2_{minor}_{platform}" for minor in range(40, 16, -1)]
    platforms += [f"manylinux2014_{platform}", f"manylinux2010_{platform}", f"manylinux1_{platform}",
                  f"linux_{platform}"]
    return [*cpython_tags(version, platforms=platforms),
            *compatible_tags(version, interpreter=f"cp{python.replace('.', '')}", platforms=platforms)]


def wheel_location(env_dir: Path, package: dict, wheel: dict) -> tuple[str, str | None, Path | None]:
    """Where a uv.lock wheel entry lives: (file name, URL to download, local path), exactly one of the last two.

    Indexes write links as they like and uv keeps them as served: download.pytorch.org percent-encodes the `+` of
    a local version (`torch-2.8.0%2Bcu126-...whl`), so the file name is the URL's last segment *unquoted*. Wheels
    of a local (`file://`) index or a --find-links directory are recorded as a `path` (absolute, or relative to
    the lock directory); a `file://` URL is a path too. Only a wheel with neither (envtool's own, from a `path`
    source) lives beside the lock."""
    url = wheel.get("url")
    if url and urlsplit(url).scheme == "file":
        url, local = None, unquote(urlsplit(url).path)
    else:
        local = wheel.get("path")
    if url:
        return unquote(urlsplit(url).path.rsplit("/", 1)[-1]), url, None
    if local:
        path = env_dir / local  # an absolute path stays itself
        return path.name, None, path
    source = package.get("source", {})
    base = env_dir / source["path"] if "path" in source else env_dir
    path = base if base.is_file() else base / wheel["filename"]
    return path.name, None, path


def locked_wheels(env_dir: Path, python: str, platform: str) -> list[Wheel]:
    """For each package in uv.lock, the wheel that installs on the target (best tag first)."""
    # start-up: packaging imported only when this runs
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    lock = tomllib.loads((env_dir / "uv.lock").read_text())
    rank = {tag: i for i, tag in enumerate(supported_tags(python, platform))}
    chosen = []
    for package in lock.get("package", []):
        if "virtual" in package.get("source", {}) or "editable" in package.get("source", {}):
            continue
        options = []
        for wheel in package.get("wheels", []):
            filename, url, path = wheel_location(env_dir, package, wheel)
            try:
                tags = parse_wheel_filename(filename)[3]
            except InvalidWheelFilename as e:
                raise EnvtoolError(f"uv.lock: {package['name']}=={package['version']}: {e}") from None
            best = min((rank[t] for t in tags if t in rank), default=None)
            if best is not None:
                options.append((best, filename, url, path, wheel))
        if not options:
            raise EnvtoolError(f"uv.lock has no wheel of {package['name']}=={package['version']} for Python "
                               f"{python} on {platform} (an sdist-only package cannot go into a wheelhouse)")
        _, filename, url, path, wheel = min(options, key=lambda o: o[0])
        if "hash" in wheel:
            sha256 = wheel["hash"].removeprefix("sha256:")
        elif path is not None and path.is_file():
            sha256 = _sha256(path)  # uv records no hash for a --find-links file: the file itself is the source
        else:
            raise EnvtoolError(f"uv.lock has no hash for {filename} and it is not on this disk ({path or url})")
        chosen.append(Wheel(package["name"], package["version"], filename, url, path, sha256))
    return chosen


def fill(env_dir: Path, wheelhouse: Path, python: str, platform: str, ca_bundle: str | None = None,
         quiet: bool = False, secrets: dict | None = None) -> list[Wheel]:
    """Download (or copy) every locked wheel into `wheelhouse`, checking each sha256 before it lands."""
    wheels = locked_wheels(env_dir, python, platform)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    todo = [w for w in wheels if not _has(wheelhouse / w.filename, w.sha256)]
    if todo:
        # optional: requests is imported only where it is used
        import requests
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                      disable=quiet or not sys.stderr.isatty(), transient=True) as progress:
            task = progress.add_task(f"Filling the wheelhouse ({len(todo)} wheels)", total=None)
            for w in todo:
                _fetch(w, wheelhouse, progress, task, requests, ca_bundle, secrets)
    lines = [f"{w.name}=={w.version} --hash=sha256:{w.sha256}" for w in wheels]
    tmp = wheelhouse / f".{REQUIREMENTS}.tmp"
    tmp.write_text("# Written by `envtool lock --wheelhouse`; install with `envtool install --offline`.\n"
                   + "\n".join(lines) + "\n")
    tmp.replace(wheelhouse / REQUIREMENTS)
    return wheels


def _has(path: Path, sha256: str) -> bool:
    return path.is_file() and _sha256(path) == sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch(w: Wheel, wheelhouse: Path, progress, task, requests, ca_bundle: str | None,
           secrets: dict | None = None) -> None:
    # start-up: resolver.credentials imported only when this runs
    from .credentials import auth_for, given, redact

    tmp = wheelhouse / f".{w.filename}.part"
    if w.url is None:
        try:
            shutil.copyfile(w.path, tmp)
        except OSError as e:
            raise EnvtoolError(f"copying {w.filename} from {w.path} failed: {e.strerror}") from None
    else:
        try:
            with requests.get(w.url, stream=True, timeout=60, verify=tls_verify(ca_bundle),
                              auth=auth_for(w.url, secrets if secrets is not None else given([]))) as r:
                r.raise_for_status()
                with open(tmp, "wb") as f:
                    for chunk in r.iter_content(1 << 20):
                        f.write(chunk)
                        progress.advance(task, len(chunk))
        except requests.RequestException as e:
            tmp.unlink(missing_ok=True)
            raise EnvtoolError(f"downloading {w.filename} failed: {redact(str(e))}") from None
    if _sha256(tmp) != w.sha256:
        tmp.unlink()
        raise EnvtoolError(f"{w.filename}: sha256 does not match uv.lock ({w.sha256[:12]}…); "
                           f"the index served a different file — refusing it")
    tmp.replace(wheelhouse / w.filename)


def check(wheelhouse: Path) -> Path:
    requirements = wheelhouse / REQUIREMENTS
    if not requirements.is_file():
        raise BadInput(f"{wheelhouse}: no {REQUIREMENTS}; fill it with `envtool lock ... --wheelhouse {wheelhouse}`")
    return requirements
