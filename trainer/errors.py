"""The one exception family users can cause, each with its documented exit code.

2 = bad input (config, hardware request, missing file); 1 = failure while doing the work.
The CLI turns these into one stderr line; ``--debug`` shows the traceback.
"""

import json
import os
import time


class TrainerError(Exception):
    exit_code = 1
    # several problems found in one pass (`several` below): (kind, line), kind config | file | hardware | model;
    # the CLI prints one line each
    problems: list[tuple[str, str]] = []
    config = None  # with problems from reading a config: the config as far as it could be read (else None)


class ConfigError(TrainerError):
    """The YAML config is invalid: unknown or unsupported key, bad value."""

    exit_code = 2


class HardwareError(TrainerError):
    """The config asks for something the GPU cannot do (e.g. bf16 on Turing)."""

    exit_code = 2


MAX_PROBLEM_LINES = 25  # error lines printed for one config (trainer's and envtool's alike); more are counted


def capped(lines: list[str], prefix: str = "") -> list[str]:
    """At most MAX_PROBLEM_LINES lines: a config with thousands of bad values gets the first ones and a count."""
    if len(lines) <= MAX_PROBLEM_LINES:
        return lines
    return lines[:MAX_PROBLEM_LINES - 1] + [f"{prefix}... and {len(lines) - MAX_PROBLEM_LINES + 1} more problems"]


def several(problems: list[tuple[str, str]], config=None) -> TrainerError:
    """One error for every problem found in one pass (each (kind, line)): a HardwareError when they are all the
    hardware's, else a ConfigError. Its message joins the lines with '; '; `.problems` keeps them apart."""
    problems = list(dict.fromkeys(problems))  # (a rule checked again by a later pass says it once)
    kinds = {kind for kind, _ in problems}
    err = (HardwareError if kinds == {"hardware"} else ConfigError)("; ".join(line for _, line in problems))
    err.problems, err.config = list(problems), config
    return err


class DataError(TrainerError):
    """A dataset file is missing or a row does not fit its prompt format."""

    exit_code = 2


class TrainingError(TrainerError):
    """Training itself failed: NaN/inf loss, a collective timed out, a checkpoint cannot be read."""

    exit_code = 1


LINE_LIMIT = 2000  # an error line longer than this is cut in its middle: the start says what, the end the fix
PART_LIMIT = 600  # one problem of a '; '-joined list (a quoted 100 KB value) is cut alone, so the others stay whole


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 2 // 3], text[-(limit // 3):]
    return f"{head} … [{len(text) - len(head) - len(tail)} characters cut] … {tail}"


def readable(line: str, limit: int = LINE_LIMIT) -> str:
    """An error message as one readable line: line breaks and control characters become spaces, a problem that
    quotes a huge value (a 100 KB key, a config's whole text) is cut in its middle, and a line naming thousands of
    problems keeps its start and end with the cut named between them."""
    line = "".join(c if c.isprintable() else " " for c in " ".join(str(line).splitlines()))
    return _cut("; ".join(_cut(part, PART_LIMIT) for part in line.split("; ")), limit)


ERROR_DIR_ENV = "ENVTOOL_ERROR_DIR"  # set by `envtool train` around torchrun: where each rank leaves its error


def record(line: str, exit_code: int) -> bool:
    """Under `envtool train`'s multi-process launcher (``ENVTOOL_ERROR_DIR`` set), write this rank's error line and
    exit code to ``rank-<RANK>.json`` there (atomically) instead of printing it: the launcher prints the first
    failure's line once and exits with its code, where torchrun alone would print every rank's line, its own
    48-line report and exit 1. False (print it yourself) without a launcher or when the file cannot be written."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    rank = os.environ.get("RANK", "0")
    path = os.path.join(folder, f"rank-{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": int(rank), "line": line, "exit_code": exit_code, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
    except (OSError, ValueError):
        return False
    return True


class Stopped(TrainerError):
    """A stop request (SIGTERM, SIGUSR1, Ctrl-C) was honoured: every rank finished the same step and the
    checkpoint is saved. Not a failure: the message says where the checkpoint is and how to continue; the exit
    code says why (trainer/runtime/stop.py: 138 = requeue me, 130 = Ctrl-C)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def no_home() -> str | None:
    """Why this process has no home directory, or None. Caches and settings live under it (~/.cache, the Hugging Face
    cache): HOME unset for a user without a passwd entry (a container run with an arbitrary uid) is one line from
    `envtool` and `python -m trainer` (exit 2), not a traceback deep in a cache path."""
    # start-up: pathlib imported only when this runs
    from pathlib import Path

    try:
        Path.home()
        return None
    except (RuntimeError, KeyError):
        return (f"no home directory: HOME is not set and user {os.getuid()} has no passwd entry; set HOME to a "
                "writable folder (caches go under $HOME/.cache)")


class ServerFailed(TrainingError):
    """A service the step needs (GRPO's vLLM server) failed while the step waited for it: the message names the URL.
    One process keeps the last finished step in a checkpoint first (trainer/train.py abandon_step)."""


class StepAbandoned(Exception):
    """A stop request arrived while the step was waiting for a service (GRPO's vLLM server): the step is given up
    before it changed anything, so that the run stops now with the last finished step, not after the wait
    (trainer/train.py abandon_step). Not an error: the loop turns it into its Stopped."""
