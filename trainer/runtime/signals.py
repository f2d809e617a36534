"""Temporary outputs that do not outlive their command: merge-lora's `.merged.tmp-<pid>/` and export's
`.<name>.gguf.tmp-<pid>` (each written beside its output and renamed at the end).

1. `stop_cleanly(what)`: while it is entered, SIGTERM, SIGUSR1 and SIGHUP raise `Stopped` (exit 128 + the signal's
   number, as a shell reports a signal death) in the main thread, so the caller's `except BaseException` removes its
   temporary output before the process ends; Ctrl-C already raises KeyboardInterrupt. Without it the default action
   of SIGTERM ends the process with the half-written output left for good.
2. `remove_leftovers(parent, name, say)`: what a killed run left (SIGKILL, a lost node: no handler runs) is removed
   by the next run of the same command: every `.<name>.tmp-<pid>` in `parent` whose process is gone, named once.
   One whose process still runs (a concurrent command) is left alone.
3. `pause_at(point, say)`: with ENVTOOL_PAUSE_AT=point the command prints one line there and waits (at most 10
   minutes) for a signal, then goes on (trainer/runtime/stop.py: the run's points) or, inside `stop_cleanly`,
   stops. A seam on the real path, for tests and for rehearsing a scheduler's signal at the worst moment. Points:
   `final-eval`, `final-save` (train), `merge-shard` (merge-lora, after its first shard), `export-tensors` (export,
   the GGUF header written, the tensors not yet).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from trainer.errors import Stopped

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGHUP")
PAUSE_ENV = "ENVTOOL_PAUSE_AT"


def pause_at(point: str, say=print, until=lambda: False, limit: float = 600.0) -> None:
    """ENVTOOL_PAUSE_AT=point: say so and wait until `until()` or a handler's exception (see the module doc)."""
    if os.environ.get(PAUSE_ENV) != point:
        return
    say(f"paused at {point} ({PAUSE_ENV}): waiting for a stop signal")
    deadline = time.monotonic() + limit
    while not until() and time.monotonic() < deadline:
        time.sleep(0.05)


@contextmanager
def stop_cleanly(what: str):
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(number, _frame):
        name = signal.Signals(number).name
        raise Stopped(f"{what}: stopped by {name}; its partial output was removed (run the same command again)",
                      128 + number)

    previous = {}
    for name in SIGNALS:
        number = getattr(signal, name)
        previous[number] = signal.signal(number, handle)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_leftovers(parent: Path, name: str, say=print) -> list[Path]:
    """Remove `.<name>.tmp-<pid>` files and folders in `parent` whose process has ended; return them."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    pattern = re.compile(re.escape(f".{name}.tmp-") + r"(\d{1,10})")
    removed = []
    for path in parent.iterdir():
        found = pattern.fullmatch(path.name)
        if not found or int(found.group(1)) == os.getpid() or alive(int(found.group(1))):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as err:
            say(f"note: cannot remove {path}, left by an interrupted run: {err.strerror or err}")
            continue
        removed.append(path)
        say(f"note: removed {path}, the partial output of an interrupted run (process {found.group(1)})")
    return removed
