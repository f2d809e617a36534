"""What the kept model answers save (trainer/runtime/kept.py): the CPU seconds of `python -m trainer validate`,
`envtool fit` and `envtool train --dry-run` on the tiny example, each run with an empty cache folder (the baseline:
transformers' model code imported to answer, as every run did before) and again with the answers that first run
kept. Both are timed in the same session, interleaved; the medians of the child's CPU (user + system) are compared.
The outputs of the two runs must be the same (the script exits 1 otherwise).

Usage: PYTHONPATH=. python bench/bench_kept.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMANDS = {
    "validate": [sys.executable, "-m", "trainer", "validate", "CONFIG", "--gpu", "a100"],
    "fit": [str(BIN / "envtool"), "fit", "CONFIG", "--gpu", "a100", "--json"],
    "dry run": [str(BIN / "envtool"), "train", "CONFIG", "--gpu", "a100", "--dry-run", "--json"],
}


def timed(argv: list[str], env: dict) -> tuple[float, str]:
    """(CPU seconds, stdout) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed: {out.stderr.strip().splitlines()[-1:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="envtool-bench-kept-"))
    failed = False
    try:
        sys.path.insert(0, str(ROOT))
        from trainer.model.tiny import make_tiny_model

        model = make_tiny_model(work / "tiny-model", family="llama", seed=0)
        config = work / "config.yml"
        config.write_text((ROOT / "examples" / "tiny-cpu.yml").read_text().replace("outputs/tiny-model", str(model)))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        env.pop("ENVTOOL_PLAN", None)
        print(f"the tiny example on an A100 (named): median CPU seconds of {args.runs} interleaved runs")
        for name, command in COMMANDS.items():
            argv = [str(config) if a == "CONFIG" else a for a in command]
            cold, warm = [], []
            for k in range(args.runs):
                cache = work / f"cache-{name}-{k}"
                first, first_out = timed(argv, {**env, "XDG_CACHE_HOME": str(cache)})  # nothing kept: asks
                again, again_out = timed(argv, {**env, "XDG_CACHE_HOME": str(cache)})  # reads what it kept
                cold.append(first)
                warm.append(again)
                if first_out != again_out:
                    failed = True
                    print(f"  {name}: the output with the kept answers differs from the one without")
                shutil.rmtree(cache, ignore_errors=True)
            c, w = statistics.median(cold), statistics.median(warm)
            print(f"  {name:9s} nothing kept (before): {c:5.2f} s   answers kept: {w:5.2f} s   ratio {w / c:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
