"""A progress bar on stderr for the slow network commands (rich, shown only on a terminal)."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def progress(description: str, total: int | None):
    """Yields `advance(n)`; draws a transient bar (or a request counter when `total` is None) on a terminal."""
    if not sys.stderr.isatty():
        yield lambda n=1: None
        return
    # start-up: rich imported only when this runs
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    columns += [BarColumn(), MofNCompleteColumn()] if total else [TextColumn("{task.completed} requests")]
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
