"""Running uv: where its binary is, the environment it gets (cache, CA bundle), progress while it works,
and its failures turned into envtool's one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .errors import BadInput
from .errors import EnvtoolError, Unsatisfiable


class UvFailed(EnvtoolError):
    """uv exited non-zero for a reason envtool could not name more precisely."""


def uv_binary() -> str:
    override = os.environ.get("ENVTOOL_UV")
    if override:
        return override
    try:
        # optional: uv is imported only where it is used
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        import shutil

        found = shutil.which("uv")
        if found:
            return found
        raise EnvtoolError("uv not found: install envtool with its dependencies (`pip install envtool-llm`) "
                           "or put uv on PATH") from None


def uv_env(ca_bundle: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if ca_bundle:
        if not Path(ca_bundle).is_file():
            raise BadInput(f"--ca-bundle {ca_bundle}: no such file")
        env["SSL_CERT_FILE"] = ca_bundle
    env.setdefault("UV_NO_PROGRESS", "1")
    env.pop("VIRTUAL_ENV", None)  # uv would otherwise warn that it does not match the project environment
    env.update(extra or {})
    return env


def tls_verify(ca_bundle: str | None):
    """What `requests` should trust: --ca-bundle, else SSL_CERT_FILE (which requests alone ignores), else its own."""
    return ca_bundle or os.environ.get("SSL_CERT_FILE") or True


def run_uv(args: list[str], *, what: str, env: dict[str, str], cwd: Path | None = None,
           quiet: bool = False) -> subprocess.CompletedProcess:
    """Run `uv ARGS`, showing a spinner with `what` on a terminal; raise a one-line error on failure."""
    cmd = [uv_binary(), *args]
    if quiet or not sys.stderr.isatty():
        result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    else:
        # start-up: rich imported only when this runs
        from rich.console import Console

        with Console(stderr=True).status(what):
            result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise explain_failure(result.stderr, what)
    return result


MISSING_WHEEL = re.compile(r"Because (?P<name>[\w.\-]+)==(?P<version>[\w.+\-]+) has no (?:usable|.*?-compatible) wheels")
# (uv wraps a long URL onto the next line, and under a split by markers names the package mid-sentence: "Because all
# versions of torch depend on pytorch-triton-rocm and pytorch-triton-rocm was not found in the package registry")
MISSING_URL = re.compile(r"Failed to download `(?P<name>[\w.\-]+) @\s*(?P<url>[^`\s]+)")
HTTP_STATUS = re.compile(r"HTTP status (?:client|server) error \((?P<status>[^)]+)\)")
NOT_ON_INDEX = re.compile(r"(?:Because|and) (?P<name>[\w.\-]+) was not found in the package registry")


def explain_failure(stderr: str, what: str) -> EnvtoolError:
    """Name the package and wheel that is missing when that is why uv failed; else uv's own error line."""
    # uv wraps its sentences to the terminal (and its tree prefixes: │ ╰─▶): the patterns read them unwrapped
    flat = re.sub(r"[ \t]*\n[ \t│╰─▶]*", " ", stderr)
    missing = MISSING_WHEEL.search(flat)
    if missing:
        name, version = missing["name"], missing["version"]
        return MissingWheel(name, version, None, stderr)
    absent = NOT_ON_INDEX.search(flat)
    if absent:  # an index that does not carry the package at all (flash-attn-3 on a PyTorch index folder)
        pin = re.search(rf"depends on {re.escape(absent['name'])}==(?P<version>[\w.+\-]+?)[,\s]", flat)
        return MissingWheel(absent["name"], pin["version"] if pin else None, None, stderr, "not on its index")
    url = MISSING_URL.search(flat)
    status = HTTP_STATUS.search(flat)
    if url and status and status["status"].startswith("404"):
        return MissingWheel(url["name"], None, url["url"], stderr, status["status"])
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "cause:", "×"))] or lines[-1:]
    hint = ""
    if "certificate" in stderr.lower():
        hint = " (an index behind a proxy or mirror with its own CA? pass --ca-bundle FILE or set SSL_CERT_FILE)"
    text = " ".join(errors)
    return UvFailed(f"{what} failed: uv says: {text[:300]}{' … ' + text[-300:] if len(text) > 600 else text[300:]}{hint}")


class MissingWheel(Unsatisfiable):
    """A package the plan needs has no wheel for the target; envtool never builds those from source."""

    def __init__(self, name: str, version: str | None, url: str | None, stderr: str, status: str | None = None):
        self.name, self.version, self.url, self.stderr, self.status = name, version, url, stderr, status
        if url:
            text = (f"{name}: the prebuilt wheel {url.rsplit('/', 1)[-1]} could not be downloaded from {url}"
                    f"{f' ({status})' if status else ''}; envtool never builds {name} from source: "
                    f"`envtool resolve --no-flash-attn` skips it, or ENVTOOL_FLASH_ATTN_URL names a mirror")
        elif status == "not on its index":
            wanted = f"{name}=={version}" if version else f"{name} (no version of it)"
            text = f"{wanted} is not on the index it comes from; envtool never builds {name} from source"
        else:
            text = (f"no prebuilt wheel of {name}=={version} for the target (Python, platform); "
                    f"envtool never builds {name} from source")
        super().__init__(text)
