"""One run per output_dir, and an output_dir that takes writes, both found before anything slow starts.

`claim(output_dir)` (rank 0, at the start of training):
1. creates output_dir and takes an exclusive lock on output_dir/.envtool-train.lock (flock). A second training on
   the same output_dir is refused in one line naming the first's pid and host, instead of interleaving
   metrics.jsonl and deleting each other's checkpoints. The kernel drops the lock when its process dies (a
   SIGKILL, a lost node), so a stale lock is taken over by the next run without asking;
2. writes, syncs and deletes a probe file: a read-only mount, a full disk or a quota is one line now, not a
   traceback at the first metrics row or checkpoint;
3. removes the temporary directories (`.tmp-checkpoint-*`, `.tmp-final`) a killed run left behind (no other run
   can be writing them: the lock is held).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path

from trainer.errors import TrainingError

LOCK = ".envtool-train.lock"


class Claim:
    def __init__(self, handle):
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the flock
            self.handle = None


def claim(output_dir: Path) -> Claim:
    # start-up: fcntl imported only when this runs
    import fcntl

    output_dir = Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        handle = open(output_dir / LOCK, "a+")
    except OSError as err:
        raise TrainingError(f"output_dir {output_dir} cannot be written: {err.strerror or err}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            handle.close()
            raise TrainingError(f"output_dir {output_dir}: cannot lock {LOCK}: {err.strerror}") from None
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise TrainingError(f"output_dir {output_dir} is in use by another training ({holder}); wait for it to "
                            "end, or give this run another output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    probe(output_dir)
    for leftover in [*output_dir.glob(".tmp-checkpoint-*"), output_dir / ".tmp-final"]:
        shutil.rmtree(leftover, ignore_errors=True)
    return Claim(handle)


def probe(output_dir: Path, size: int = 1 << 16) -> None:
    """Write `size` bytes, fsync, delete: refused writes (read-only, no space, quota) are one line now."""
    path = Path(output_dir) / f".write-probe-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise TrainingError(f"output_dir {output_dir} does not take writes: {err.strerror or err}; checkpoints, "
                            "metrics and the final model go there (free space, or choose another output_dir)") from None
    finally:
        try:
            path.unlink()
        except OSError:
            pass
