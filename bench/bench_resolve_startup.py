"""How fast `envtool resolve --gpu a100 --json` (and `--gpu auto`) answers, as a ratio to a bare `python -c pass`.

Both run with the same interpreter, interleaved in pairs (baseline, then envtool) so that a busy machine slows
both alike; each side's median and spread (min-max) are printed for wall-clock and CPU time (user + system, the
child's own), and the ratio of the medians. Absolute times on a shared machine mean little; the ratio is the
figure. Target (issue 46): <= 4x on wall-clock.

envtool is run as its console script runs it: `from <module> import main; sys.exit(main())` with the entry point
read from pyproject.toml (the installed script of an editable checkout may name an older one). Its modules are
compiled first, as an installed wheel has them: under PYTHONDONTWRITEBYTECODE an editable checkout would
recompile every module on every run. The matrix cache (~/.cache/envtool) is warmed by the first, untimed run.

Usage: python bench/bench_resolve_startup.py [--pairs 15] [--gpu a100 --gpu auto]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def entry_point() -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts["envtool"]


def envtool_cmd(*args: str) -> list[str]:
    module, func = entry_point().split(":")
    code = f"import sys; sys.argv[0] = 'envtool'; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code, *args]


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one run of `cmd` (its output discarded; a failure stops the bench)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:6.1f} ms (min {min(values) * 1000:6.1f}, " \
           f"max {max(values) * 1000:6.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=15, help="interleaved (baseline, envtool) pairs per case")
    parser.add_argument("--gpu", action="append", help="resolve's --gpu; repeatable (default: a100 and auto)")
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error("--pairs: at least 5")
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(ROOT / p) for p in ("resolver", "matrices",
                                                                                        "trainer/errors.py"))],
                   check=True)
    env_note = " PYTHONPATH=" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    print(f"interpreter: {sys.executable} (Python {sys.version.split()[0]}){env_note}")
    print(f"envtool entry point: {entry_point()}; {args.pairs} interleaved pairs per case")
    baseline_cmd = [sys.executable, "-c", "pass"]
    for gpu in args.gpu or ["a100", "auto"]:
        resolve_cmd = envtool_cmd("resolve", "--gpu", gpu, "--json")
        for cmd in (baseline_cmd, resolve_cmd):  # warm the page cache, the .pyc files and the matrix cache
            timed(cmd)
        base, env = [], []
        for _ in range(args.pairs):
            base.append(timed(baseline_cmd))
            env.append(timed(resolve_cmd))
        print(f"\n`envtool resolve --gpu {gpu} --json`")
        for i, what in enumerate(("wall", "CPU ")):
            b, r = [x[i] for x in base], [x[i] for x in env]
            ratios = [y / x for x, y in zip(b, r)]
            print(f"  {what} python -c pass: {summary(b)}")
            print(f"  {what} envtool resolve: {summary(r)}")
            print(f"  {what} ratio of medians: {statistics.median(r) / statistics.median(b):.2f}x "
                  f"(pairwise ratios {min(ratios):.2f}-{max(ratios):.2f}x)")
    print("\ntarget: wall ratio <= 4x")


if __name__ == "__main__":
    main()
