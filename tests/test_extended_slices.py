"""The extended tier's turns in CI (tests/support/extended.py): every listed test is in exactly one of four slices of
about equal measured time, .ci/run runs one slice per commit with the marked tests and prints it, and a slice's
tests leave the `extended` marker for that run only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.extended import SLICES, listed, slices

ROOT = Path(__file__).resolve().parents[1]


def test_every_extended_test_is_in_exactly_one_slice_of_about_equal_time():
    tests = listed()
    dealt = slices(tests)
    assert len(dealt) == SLICES
    files = [name for chosen in dealt for name in chosen]
    assert sorted(files) == sorted({node.split("::")[0] for node in tests})  # each file once
    times = [sum(chosen.values()) for chosen in dealt]
    assert max(times) <= 1.25 * sum(times) / SLICES, times  # no slice a quarter over the mean
    assert slices(tests) == dealt  # the same list deals the same slices


def test_ci_runs_the_commits_slice_and_prints_it():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"ENVTOOL_EXTENDED_SLICE=\$\(\( \$\(git rev-list --count HEAD.*\) % 4 \)\)", ci)
    assert "export ENVTOOL_EXTENDED_SLICE" in ci and "python -m tests.support.extended" in ci
    out = subprocess.run([sys.executable, "-m", "tests.support.extended", "2"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.splitlines()
    assert out[0].startswith(f"extended slice 3 of {SLICES}: ")
    assert {line.split()[0] for line in out[1:]} == set(slices(listed())[2])


@pytest.mark.slow
def test_a_slice_leaves_the_extended_tier_for_that_run_only():
    """pytest --collect-only -m extended over two listed files, without a slice and with the slice holding one of them:
    that file's tests are no longer `extended` (they run in their own tier), the other's still are."""
    dealt = slices(listed())
    first = next(i for i, chosen in enumerate(dealt) if "tests/trainer/parallel/test_ray.py" in chosen)
    other = next(name for i, chosen in enumerate(dealt) if i != first for name in chosen
                 if name.startswith("tests/trainer/"))
    files = ["tests/trainer/parallel/test_ray.py", other]

    def collected(**env) -> set[str]:  # (CI's own run sets ENVTOOL_EXTENDED_SLICE: each call says its own)
        base = {k: v for k, v in os.environ.items() if k != "ENVTOOL_EXTENDED_SLICE"}
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
                              "no:cacheprovider", "-m", "extended", *files], capture_output=True, text=True, cwd=ROOT,
                             env={**base, **env}, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}

    assert collected() == set(files)
    assert collected(ENVTOOL_EXTENDED_SLICE=str(first)) == {other}
