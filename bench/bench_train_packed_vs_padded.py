"""Training throughput on CPU, packed against padded, on a skewed length distribution.

Both runs go through `python -m trainer train` with the same model, data and number of steps; only
sample_packing and the micro-batch shape differ (packed: 1 bin of sequence_len tokens; padded: as many
sequences as fit sequence_len on average, padded to the longest). Throughput counts real (non-pad) tokens
per second of step time, from the metrics.jsonl each run writes; the first steps are warm-up and skipped.

    python bench/bench_train_packed_vs_padded.py [--steps 30] [--hidden 256] [--layers 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WORDS = "the quick brown fox jumps over a lazy dog while cats sleep and dogs play in the warm sun".split()


def write_data(path: Path, n: int, seed: int = 0) -> None:
    """Completion rows whose word counts are log-normal: most short, a long tail."""
    rng = random.Random(seed)
    words = np.clip(np.random.default_rng(seed).lognormal(np.log(40), 1.0, n), 4, 600).astype(int)
    with open(path, "w") as f:
        for k in words:
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(k))}) + "\n")


def run(config: dict, workdir: Path, name: str) -> dict:
    path = workdir / f"{name}.yml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run([sys.executable, "-m", "trainer", "train", str(path)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(l) for l in (Path(config["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r][3:]  # skip warm-up
    tokens = sum(r["tokens"] for r in steps)
    seconds = sum(r["step_time_s"] for r in steps)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequence-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per mode; the best of each counts")
    args = parser.parse_args()

    from trainer.model.tiny import build_model, build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_tokenizer()
        build_model(tokenizer, hidden_size=args.hidden, layers=args.layers).save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        write_data(tmp / "data.jsonl", 3000)
        base = {"base_model": str(tmp / "model"), "datasets": [{"path": str(tmp / "data.jsonl"), "type": "completion"}],
                "dataset_prepared_path": str(tmp / "prepared"), "sequence_len": args.sequence_len,
                "max_steps": args.steps, "learning_rate": 1e-4, "lr_scheduler": "constant",
                "attn_implementation": "sdpa", "logging_steps": 1, "seed": 0}
        from trainer.config import parse_config
        from trainer.data.prepare import load_tokenizer, prepare

        cfg, _ = parse_config(base)
        lengths = np.array(prepare(cfg, load_tokenizer(cfg), log=lambda *_: None).train["length"])
        per_batch = max(1, round(args.sequence_len / lengths.mean()))
        # Alternate the two and keep each one's best run, so load from other processes on the machine
        # skews the ratio as little as possible.
        runs = {"packed": [], "padded": []}
        for i in range(args.repeats):
            runs["packed"].append(run({**base, "sample_packing": True, "micro_batch_size": 1,
                                       "output_dir": str(tmp / f"packed{i}")}, tmp, f"packed{i}"))
            runs["padded"].append(run({**base, "sample_packing": False, "micro_batch_size": per_batch,
                                       "output_dir": str(tmp / f"padded{i}")}, tmp, f"padded{i}"))
        packed, padded = (max(runs[k], key=lambda r: r["tokens_per_s"]) for k in ("packed", "padded"))

    print(f"model: hidden {args.hidden}, {args.layers} layers; sequence_len {args.sequence_len}; "
          f"lengths mean {lengths.mean():.0f}, median {int(np.median(lengths))}, max {lengths.max()} tokens")
    print(f"packed: 1 bin/micro-batch, {packed['tokens_per_s']:,.0f} tokens/s "
          f"({packed['tokens']:,} tokens in {packed['seconds']:.1f} s over {packed['steps']} steps)")
    print(f"padded: {per_batch} sequences/micro-batch, {padded['tokens_per_s']:,.0f} tokens/s "
          f"({padded['tokens']:,} tokens in {padded['seconds']:.1f} s over {padded['steps']} steps)")
    for mode, results in runs.items():
        print(f"  {mode} runs: " + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results) + " tokens/s")
    print(f"best of {args.repeats} alternating runs each (wall-clock; other load on the machine adds noise)")
    print(f"ratio tokens/s packed / padded: {packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
