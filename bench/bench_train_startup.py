"""A second `envtool train` that reuses its environment: time from the command to the trainer's first step,
against the trainer started directly in the same environment (`python -m trainer train`). Aim: within 2 s.

Setup (not timed): the real CPU stack is served from a PEP 503 index on 127.0.0.1 (.ci-cache/pypi-mirror, filled
by .ci/setup), and a first `envtool train --isolated` builds the environment cached for the plan. Then, runs
interleaved: `envtool train CONFIG --gpu cpu ... --isolated` (plan, find the cached environment, launch) and
`<cached env>/bin/python -m trainer train CONFIG` with ENVTOOL_PLAN set (what envtool launches). Also the
active-environment path (`envtool train` without --isolated: doctor probes the running interpreter first)
against `python -m trainer train` in it. The first step is the first row of output_dir/metrics.jsonl; the
process is then stopped. Prints the medians and the differences. Usage: python bench/bench_train_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.pypi import MIRROR, build_indexes, index_env, serve  # noqa: E402

BIN = Path(sys.executable).parent
PLAN_ARGS = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64"]


def to_first_step(cmd: list[str], env: dict, output_dir: Path) -> float:
    """Seconds from starting `cmd` to the first training row in output_dir/metrics.jsonl."""
    shutil.rmtree(output_dir, ignore_errors=True)
    metrics = output_dir / "metrics.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while True:
            if metrics.is_file() and '"loss"' in metrics.read_text():
                return time.perf_counter() - start
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[:3]} exited {proc.returncode} before its first step")
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="envtool-bench-train-"))
    try:
        from trainer.model.tiny import make_tiny_model

        model = make_tiny_model(work / "tiny-model", family="llama", seed=0)
        cfg = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yml").read_text())
        cfg.update(base_model=str(model), datasets=[{"path": str(ROOT / "examples/data/tiny-alpaca.jsonl"),
                                                     "type": "alpaca"}],
                   dataset_prepared_path=str(work / "prepared"), output_dir=str(work / "out"), max_steps=1000)
        config = work / "config.yml"
        config.write_text(yaml.safe_dump(cfg))
        env = {**{k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")},
               "ENVTOOL_CACHE_DIR": str(work / "cache"), "UV_CACHE_DIR": str(work / "uv-cache"),
               "UV_PYTHON_DOWNLOADS": "never", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        plan = json.loads(subprocess.run([str(BIN / "envtool"), "resolve", "--json", *PLAN_ARGS], env=env,
                                         capture_output=True, text=True, check=True).stdout)
        build_indexes(work / "index", plan, [], real_torch=next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
        envtool = [str(BIN / "envtool"), "train", str(config), *PLAN_ARGS]
        with serve(work / "index") as url:  # the first run builds the cached environment (not timed)
            first = subprocess.run([*envtool, "--isolated", "--index-url", f"{url}/pypi/", "--dry-run", "--json"],
                                   env={**env, **index_env(url)}, capture_output=True, text=True, check=True)
            setup = json.loads(first.stdout)
            cfg["max_steps"] = 1
            config.write_text(yaml.safe_dump(cfg))
            subprocess.run([*envtool, "--isolated", "--index-url", f"{url}/pypi/"], env={**env, **index_env(url)},
                           capture_output=True, check=True)
            cfg["max_steps"] = 1000
            config.write_text(yaml.safe_dump(cfg))
        direct_env = {**env, **setup["env"]}
        cached_python = str(Path(setup["environment"]["path"]) / "bin" / "python")
        pairs = {
            "cached environment": ([*envtool, "--isolated"], [cached_python, "-m", "trainer", "train", str(config)]),
            "active environment": (envtool, [sys.executable, "-m", "trainer", "train", str(config)]),
        }
        results = {}
        for name, (through, direct) in pairs.items():
            to_first_step(through, env, work / "out")  # warm the page cache
            via, plain = [], []
            for _ in range(args.runs):
                via.append(to_first_step(through, env, work / "out"))
                plain.append(to_first_step(direct, direct_env, work / "out"))
            results[name] = (statistics.median(via), statistics.median(plain))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"time to the trainer's first step (tiny model on CPU), median of {args.runs} interleaved runs")
    for name, (via, plain) in results.items():
        print(f"  {name}: envtool train {via:5.2f} s   trainer directly {plain:5.2f} s   "
              f"difference {via - plain:+5.2f} s (aim <= 2 s)")


if __name__ == "__main__":
    main()
