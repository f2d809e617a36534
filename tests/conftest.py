"""The test tiers (pyproject.toml [tool.pytest.ini_options]): `pytest` runs the fast tier, the unmarked unit and
policy tests; `pytest -m ""` runs everything (.ci/run does). A test that starts a training, torchrun, Docker or
takes more than a few seconds is marked `slow` (or `distributed` / `docker`).

This file keeps the tiers honest, and keeps the full run safe under pytest-xdist (`-n 2 --dist loadgroup`):

- Under CI (CI=true, which .ci/run sets) an unmarked test whose call takes more than FAST_TEST_CPU_SECONDS of CPU
  fails, naming the marker to add.
- Every `docker` test runs in one xdist group (one worker, one after another): their fixture removes the images a
  test added and prunes dangling images engine-wide, which would pull images from under a build on another worker.
- A marked test that uses a module-scoped fixture runs in its module's group, so the fixture is made once.
- The node ids in tests/extended.txt (measured heaviest end-to-end tests) get the `extended` marker: CI's run
  (`bash .ci/run`) leaves them out but for one slice of them (ENVTOOL_EXTENDED_SLICE, tests/support/extended.py),
  `bash .ci/run --extended` runs them all. A listed id that names no test fails a run of
  the whole suite, so the list cannot go stale silently.
"""

from __future__ import annotations

import importlib
import os
import resource
import time
from pathlib import Path

import pytest

TIER_MARKERS = ("slow", "distributed", "docker")
EXTENDED_LIST = Path(__file__).with_name("extended.txt")


def _extended_ids() -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in EXTENDED_LIST.read_text().splitlines())
    return {line for line in lines if line}


def _extended_slice() -> set[str]:
    """The files of tests/extended.txt whose tests this run takes out of the extended tier: ENVTOOL_EXTENDED_SLICE
    (set by .ci/run, tests/support/extended.py), none when unset."""
    index = os.environ.get("ENVTOOL_EXTENDED_SLICE", "")
    if not index:
        return set()
    if not index.isdigit():
        raise pytest.UsageError(f"ENVTOOL_EXTENDED_SLICE={index!r}: give a slice number (0-3), as .ci/run does")
    from tests.support.extended import listed, slices

    dealt = slices(listed())
    return set(dealt[int(index) % len(dealt)])

# What the guard measures: the CPU time (user + system) of the test's call phase -- not its fixtures' set-up --
# spent by the pytest process (all its threads) plus the child processes it waited for (subprocess.run,
# torchrun, `envtool ...`), from resource.getrusage(RUSAGE_SELF) and (RUSAGE_CHILDREN). CPU time moves far less
# than wall time when other processes load the machine (an xdist neighbour, a shared runner): on a 2-core machine
# at load 11, a `python -m trainer validate` subprocess took 12 s of CPU and 150 s of wall time. Tests that took
# more than 3 s of CPU there are marked, so the fast tier keeps a wide margin below the budget. A test that
# mostly waits (sleeps, a child it never reaps) uses little CPU: FAST_TEST_WALL_SECONDS catches those, with a
# 24x margin over the CPU budget for a loaded machine.
FAST_TEST_CPU_SECONDS = 5.0
FAST_TEST_WALL_SECONDS = 120.0
# A library's first import is paid by whichever test needs it first, and under xdist that test changes from run to
# run: trl, peft and datasets alone take ~5 s of CPU. With the guard on, each process imports them before its
# first test, so a test's count is its own work.
WARM_IMPORTS = ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "tokenizers",
                "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                "trainer.train", "trainer.setup", "trainer.cli")


def _cpu_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _is_fast_tier(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(name) for name in TIER_MARKERS)


_GUARD = os.environ.get("CI", "").lower() in ("true", "1", "yes")
_SPENT = pytest.StashKey[tuple[float, float]]()


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope in ("module", "class", "package")
                                    for defs in info.name2fixturedefs.values() if defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    extended = _extended_ids()
    chosen = _extended_slice()
    seen = set()
    for item in items:
        if item.nodeid in extended:
            if not item.get_closest_marker("slow") and not item.get_closest_marker("distributed") \
                    and not item.get_closest_marker("docker"):
                raise pytest.UsageError(f"tests/extended.txt: {item.nodeid} is in the fast tier; list only marked tests")
            if item.nodeid.split("::")[0] not in chosen:  # this run's slice runs in its own tier
                item.add_marker(pytest.mark.extended)
            seen.add(item.nodeid)
    whole_run = not config.args or [str(a).rstrip("/") for a in config.args] == ["tests"]
    # a listed id names no test: its file is gone, or was collected without it (a file skipped whole, for lack of an
    # optional extra on a developer's machine, collects nothing and proves nothing either way)
    collected = {item.nodeid.split("::")[0] for item in items}
    root = Path(__file__).resolve().parents[1]
    stale = sorted(i for i in extended - seen
                   if not (root / i.split("::")[0]).is_file() or i.split("::")[0] in collected)
    if whole_run and stale:  # (a run of some files or ids collects only those)
        raise pytest.UsageError(f"tests/extended.txt: {stale[0]} names no test ({len(stale)} such lines); "
                                "remove or rename it")
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.xdist_group("docker"))
        elif not _is_fast_tier(item) and _shares_a_module_fixture(item):
            # a marked test whose module-scoped fixture trains (ddp_runs, trained, one_process, ...) runs on the
            # worker that made it for the module's other tests, instead of each worker training it again
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_collection_finish(session):
    if _GUARD and any(_is_fast_tier(item) for item in session.items):
        for name in WARM_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:  # the test that needs it says so
                pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not (_GUARD and _is_fast_tier(item)):
        return (yield)
    cpu, wall = _cpu_seconds(), time.monotonic()
    try:
        return (yield)
    finally:
        item.stash[_SPENT] = (_cpu_seconds() - cpu, time.monotonic() - wall)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    spent = item.stash.get(_SPENT, None)
    if call.when == "call" and spent is not None and report.passed:
        cpu, wall = spent
        if cpu > FAST_TEST_CPU_SECONDS or wall > FAST_TEST_WALL_SECONDS:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} has no tier marker but took {cpu:.1f} s of CPU ({wall:.1f} s wall) in its call; "
                f"the fast tier allows {FAST_TEST_CPU_SECONDS:.0f} s of CPU ({FAST_TEST_WALL_SECONDS:.0f} s wall): "
                "mark it @pytest.mark.slow (or distributed / docker), or make it faster")
    return report
