"""Files envtool writes are written atomically: a temporary file beside the target, then one rename."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


def write_atomic(path: Path, text: str, executable: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    if executable:
        tmp.chmod(0o755)
    tmp.replace(path)


@contextlib.contextmanager
def one_writer(target: Path, what: str, say=None, suffix: str = "writer"):
    """Hold the lock of `target` (a venv, a lock directory) while writing it: `.<name>.writer` beside it, an
    flock the kernel releases when the holder exits however it exits (a dead holder's lock is simply taken
    over). A second writer waits, saying once on stderr which pid it waits for."""
    # start-up: fcntl imported only when this runs
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.{suffix}"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            message = f"waiting for pid {holder}, which is writing {what} {target}"
            (say or (lambda s: print(f"envtool: {s}", file=sys.stderr, flush=True)))(message)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()  # the lock file stays (removing it would race a waiter); the flock goes with the close
