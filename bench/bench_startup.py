"""A trainer process's start-up cost: `python -m trainer train` of a tiny model for one step on CPU (the shape of
the hundreds of training subprocesses CI starts), against the same run with the imports it no longer makes forced
first (deepspeed, peft, bitsandbytes, transformers' Trainer and get_scheduler: what accelerate's unwrap_model,
transformers' set_seed, Trainer.get_optimizer_cls_and_kwargs and get_scheduler pulled in for a config with no
`deepspeed:`, adapter or 8-bit optimizer). Both are timed in the same session, interleaved; the medians of wall
and CPU seconds (the child's user + system) are compared. A run with -X importtime (not timed) then lists which of
those modules the plain run still imports: none is the aim, and the script exits 1 otherwise.

Usage: PYTHONPATH=. python bench/bench_startup.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("deepspeed", "peft", "bitsandbytes", "transformers.trainer", "transformers.optimization")
RUN = "import runpy, sys; sys.argv = ['trainer', *sys.argv[1:]]; runpy.run_module('trainer', run_name='__main__')"
FORCED = "import deepspeed, peft, bitsandbytes, transformers.trainer, transformers.optimization; " + RUN


def timed(code: str, config: Path, env: dict, output_dir: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of `python -c code train config`, started afresh in an empty output_dir."""
    shutil.rmtree(output_dir, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, "train", str(config)], env=env, check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imported(config: Path, env: dict, output_dir: Path) -> list[str]:
    """Which HEAVY modules a plain run imports (from its -X importtime lines)."""
    shutil.rmtree(output_dir, ignore_errors=True)
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", RUN, "train", str(config)], env=env,
                         check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).stderr
    names = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", out, re.M))
    return [m for m in HEAVY if m in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="envtool-bench-startup-"))
    try:
        sys.path.insert(0, str(ROOT))
        from trainer.model.tiny import make_tiny_model

        model = make_tiny_model(work / "tiny-model", family="llama", seed=0)
        cfg = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yml").read_text())
        cfg.update(base_model=str(model), datasets=[{"path": str(ROOT / "examples/data/tiny-alpaca.jsonl"),
                                                     "type": "alpaca"}],
                   dataset_prepared_path=str(work / "prepared"), output_dir=str(work / "out"), max_steps=1,
                   val_set_size=0, auto_resume_from_checkpoints=False)
        for key in ("evals_per_epoch", "eval_sample_packing"):
            cfg.pop(key, None)
        config = work / "config.yml"
        config.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1"}
        env.pop("ENVTOOL_PLAN", None)
        timed(RUN, config, env, work / "out")  # warm the page cache, the .pyc files and the prepared data
        plain, forced = [], []
        for _ in range(args.runs):
            forced.append(timed(FORCED, config, env, work / "out"))
            plain.append(timed(RUN, config, env, work / "out"))
        still = imported(config, env, work / "out")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(runs, i):
        return statistics.median(r[i] for r in runs)

    print(f"python -m trainer train, tiny model, 1 step on CPU: median of {args.runs} interleaved runs")
    print(f"  heavy imports forced (before): wall {med(forced, 0):5.2f} s   CPU {med(forced, 1):5.2f} s")
    print(f"  as the trainer runs now:       wall {med(plain, 0):5.2f} s   CPU {med(plain, 1):5.2f} s")
    print(f"  ratio now/before: wall {med(plain, 0) / med(forced, 0):.2f}   CPU {med(plain, 1) / med(forced, 1):.2f}"
          f"   (CPU saved per process: {med(forced, 1) - med(plain, 1):.2f} s)")
    print(f"  of {', '.join(HEAVY)} the run imports: {', '.join(still) or 'none'}")
    return 1 if still else 0


if __name__ == "__main__":
    sys.exit(main())
