"""One signal forwarder: while envtool waits for what it started (the trainer, torchrun, a container), the signals a
scheduler or the user sends to envtool are handed to it, and envtool's own handlers come back however the wait ends.
launch.py sends them on to the trainer's processes (`forwarding_to`), docker.py to the container."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterable


@contextlib.contextmanager
def forwarding(names: Iterable[str], send: Callable[[int], None]):
    """While the body runs, each signal named in `names` (SIGTERM, ...) that reaches envtool calls `send(number)`
    instead of its handler. Signals reach the main thread only: elsewhere nothing is installed."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for name in names:
            number = getattr(signal, name)
            previous[number] = signal.signal(number, lambda number, _frame: send(number))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
