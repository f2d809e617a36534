"""Files envtool writes are written atomically: a temporary file beside the target, then one rename."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, executable: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    if executable:
        tmp.chmod(0o755)
    tmp.replace(path)
