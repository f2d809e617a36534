"""The Axolotl oracle (.ci/setup installs axolotl's source under .ci-cache/axolotl-oracle) as tests read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def require(path: Path, shown: Path | None = None) -> None:
    """The oracle's file or folder `path` is there; else this test fails under CI (which installs it: nothing is
    skipped there for lack of it) and is skipped on a developer's machine without it."""
    if path.exists():
        return
    message = f"the Axolotl oracle is not installed at {shown or path} (.ci/setup installs it)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
