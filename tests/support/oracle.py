"""What a test needs beyond the `train` and `dev` extras, as tests read it: the Axolotl oracle (.ci/setup installs
axolotl's source under .ci-cache/axolotl-oracle), another extra's module (`qat`'s torchao, ...), a tool .ci/setup
installs. Missing, the test is skipped with the reason on a developer's machine and fails under CI, which installs
everything (nothing is skipped there for lack of it)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest


def missing(message: str, module_level: bool = False) -> None:
    """Skip (here) or fail (under CI) for a missing requirement named in `message`."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=module_level)


def require(path: Path, shown: Path | None = None) -> None:
    """The oracle's file or folder `path` is there (see the module's docstring)."""
    if not path.exists():
        missing(f"the Axolotl oracle is not installed at {shown or path} (.ci/setup installs it)")


def require_extra(module: str, extra: str) -> ModuleType:
    """`module`, of envtool's `extra`, imported at a test module's top (see the module's docstring): without it the
    whole test module is skipped here, and is a collection error under CI."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"{module} is not installed: envtool's `{extra}` extra (pip install '.[{extra}]'; .ci/setup installs "
                "every extra)", module_level=True)
        raise


def require_setup(path: Path, what: str) -> None:
    """A file or folder .ci/setup makes (`what` names it) is there (see the module's docstring)."""
    if not path.exists():
        missing(f"{what} is not at {path}: `bash .ci/setup` makes it")
