"""How fast `envtool resolve --gpu t4 --json` answers, as a ratio to a bare `python -c pass`.

Both are timed in the same run, interleaved, and the medians compared (absolute times on shared machines
mean little). Target: <= 8x. Usage: python bench/bench_resolve_startup.py [--runs 20]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENVTOOL = Path(sys.executable).parent / "envtool"


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    # An installed wheel has its bytecode compiled at install time; an editable checkout under
    # PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every module on every run.
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(root / p) for p in ("resolver", "matrices"))],
                   check=True)
    baseline_cmd = [sys.executable, "-c", "pass"]
    resolve_cmd = [str(ENVTOOL), "resolve", "--gpu", "t4", "--json"]
    for cmd in (baseline_cmd, resolve_cmd):  # warm the page cache and .pyc files
        timed(cmd)
    baseline, resolve = [], []
    for _ in range(args.runs):
        baseline.append(timed(baseline_cmd))
        resolve.append(timed(resolve_cmd))
    b, r = statistics.median(baseline), statistics.median(resolve)
    print(f"python -c pass:                      median {b * 1000:7.1f} ms over {args.runs} runs")
    print(f"envtool resolve --gpu t4 --json:     median {r * 1000:7.1f} ms over {args.runs} runs")
    print(f"ratio: {r / b:.1f}x (target <= 8x)")


if __name__ == "__main__":
    main()
