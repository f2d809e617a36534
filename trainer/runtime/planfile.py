"""Where the trainer finds the plan envtool made, and how it reads it: one rule, in one place.

The rule, first match wins:

1. ``ENVTOOL_PLAN`` (a path), set by ``envtool train``, by images, or by hand;
2. the running environment's own copy, ``<sys.prefix>/plan.json``, which ``envtool install`` writes into
   every environment it makes (a venv, or an interpreter given with ``--system`` / ``--python``);
3. ``./plan.json`` in the working directory.

The resolver writes ``plan_version`` MAJOR.MINOR; a plan of another major version is refused in one line
(newer minor versions only add fields, which this reader ignores). The trainer keeps the plan a plain dict;
it never imports the resolver.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer.errors import ConfigError

PLAN_FILE = "plan.json"  # the same name `envtool` writes everywhere (resolver.plan.PLAN_FILE)
PLAN_ENV = "ENVTOOL_PLAN"
PLAN_MAJOR = "1"  # the plan_version major this trainer reads


def read_plan(path: str | Path) -> dict:
    """Read and check a plan file: JSON, a `gpu` object, a plan_version this trainer understands."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"plan file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"plan file {path} is not valid JSON: {err}") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("gpu"), dict):
        raise ConfigError(f"plan file {path} has no 'gpu' object; was it written by envtool?")
    version = str(plan.get("plan_version", "1.0"))  # plans written before the field are 1.0
    if version.split(".")[0] != PLAN_MAJOR:
        raise ConfigError(f"plan file {path} has plan_version {version}; this trainer reads {PLAN_MAJOR}.x plans: "
                          f"make the plan again with this envtool, or train with the envtool that wrote it")
    return plan


def environment_plan() -> Path:
    """The running environment's own copy of its plan (written by `envtool install`)."""
    return Path(sys.prefix) / PLAN_FILE


def find_plan() -> tuple[dict, str] | None:
    """The plan and where it came from (for messages), by the rule above; None when there is none."""
    if os.environ.get(PLAN_ENV):
        return read_plan(os.environ[PLAN_ENV]), f"{PLAN_ENV}={os.environ[PLAN_ENV]}"
    own = environment_plan()
    if own.is_file():
        return read_plan(own), f"the environment's {own}"
    if Path(PLAN_FILE).is_file():
        return read_plan(PLAN_FILE), f"./{PLAN_FILE}"
    return None
