"""DPO on CPU: this trainer against TRL's DPOTrainer, same model, data, batch shape and steps, from one run.

Each trainer runs in its own process (so peak RSS is its own), full fine-tune and LoRA:
- ours:  `python -m trainer train` with rl: dpo (reference log-probs precomputed once and cached; the
         one-time precompute is reported separately, and is excluded from tokens/s like TRL's model load);
- TRL:   trl.DPOTrainer with its defaults: full fine-tune keeps a reference model and runs its forward
         every step; LoRA runs the reference forward with the adapter disabled every step.
tokens/s = real (non-pad) chosen+rejected tokens of the timed steps / their wall time; the first steps are
warm-up and skipped. Peak memory = the process's peak RSS, also shown net of a baseline process that
imports the same libraries and loads the model once (what the training itself adds).

    python bench/bench_dpo_vs_trl.py [--steps 12] [--hidden 512] [--layers 4] [--pairs 2] [--no-gradient-checkpointing]

Both trainers run the same number of steps over exactly one epoch of the data, with the same gradient
checkpointing setting (on by default, as TRL's DPOConfig has it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WORDS = "the quick brown fox jumps over a lazy dog while cats sleep and dogs play in the warm sun".split()
WARMUP = 3


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    """chatml.prompt_pairs rows (TRL reads the same prompts and answers, rendered the same way)."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": words(rng.randint(8, 30)), "chosen": words(rng.randint(10, 60)),
                                "rejected": words(rng.randint(10, 60))}) + "\n")


def worker_ours(spec: dict) -> dict:
    import yaml

    from trainer.cli import main

    path = Path(spec["dir"]) / "ours.yml"
    cfg = {"base_model": spec["model"], "rl": "dpo", "rl_beta": 0.1,
           "datasets": [{"path": spec["data"], "type": "chatml.prompt_pairs"}],
           "dataset_prepared_path": str(Path(spec["dir"]) / "prepared"), "output_dir": str(Path(spec["dir"]) / "ours"),
           "sequence_len": spec["sequence_len"], "micro_batch_size": spec["pairs"], "max_steps": spec["steps"],
           "learning_rate": 1e-5, "lr_scheduler": "constant", "attn_implementation": "sdpa", "seed": 0,
           "max_grad_norm": 1.0, "shuffle_merged_datasets": False,
           "gradient_checkpointing": spec["gradient_checkpointing"], **({"adapter": "lora", "lora_r": 16,
                                                                       "lora_target_linear": True} if spec["lora"] else {})}
    path.write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    assert main(["train", str(path)]) == 0
    total = time.perf_counter() - started
    rows = [json.loads(line) for line in (Path(cfg["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r][WARMUP:]
    seconds = sum(r["step_time_s"] for r in steps)
    return {"tokens": sum(r["tokens"] for r in steps), "seconds": seconds, "wall_s": total}


def worker_trl(spec: dict) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    data = datasets.Dataset.from_list([{"prompt": f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n",
                                        "chosen": f"{r['chosen']}<|im_end|>", "rejected": f"{r['rejected']}<|im_end|>"}
                                       for r in rows])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation="sdpa", dtype=torch.float32)
    peft = None
    if spec["lora"]:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    args = DPOConfig(output_dir=str(Path(spec["dir"]) / "trl"), per_device_train_batch_size=spec["pairs"],
                     gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=1e-5,
                     lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                     max_length=spec["sequence_len"], use_cpu=True, bf16=False, seed=0, beta=0.1,
                     dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True,
                     gradient_checkpointing=spec["gradient_checkpointing"])

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.tokens, self.started = [], [], None

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()
            self.before = trainer._total_train_tokens

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)
            self.tokens.append(trainer._total_train_tokens - self.before)

    timer = Timer()
    started = time.perf_counter()
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft,
                         callbacks=[timer])
    trainer.train()
    total = time.perf_counter() - started
    return {"tokens": sum(timer.tokens[WARMUP:]), "seconds": sum(timer.times[WARMUP:]), "wall_s": total}


def worker_baseline(spec: dict) -> dict:
    import torch
    import trl  # noqa: F401  (both workers import it or the trainer's libraries)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    return {}


def run(kind: str, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(spec)], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2, help="pairs per micro-batch (both trainers)")
    parser.add_argument("--sequence-len", type=int, default=256)
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="both trainers without it (TRL's DPOConfig turns it on by default)")
    parser.add_argument("--worker")
    parser.add_argument("spec", nargs="?")
    args = parser.parse_args()
    if args.worker:
        result = {"ours": worker_ours, "trl": worker_trl, "baseline": worker_baseline}[args.worker](json.loads(args.spec))
        result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return

    from trainer.model.tiny import build_model, build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, hidden_size=args.hidden, layers=args.layers)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        write_pairs(tmp / "pairs.jsonl", args.pairs * args.steps)  # one epoch: the reference precompute covers what is trained
        base = {"model": str(tmp / "model"), "data": str(tmp / "pairs.jsonl"), "dir": str(tmp), "steps": args.steps,
                "pairs": args.pairs, "sequence_len": args.sequence_len,
                "gradient_checkpointing": not args.no_gradient_checkpointing}
        baseline = run("baseline", base)["peak_mib"]
        print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters "
              f"({params * 4 / 2**20:.0f} MiB fp32); {args.pairs} pairs/micro-batch, {args.steps} steps "
              f"({WARMUP} warm-up) = one epoch, gradient checkpointing {'off' if args.no_gradient_checkpointing else 'on'}"
              f" in both, CPU, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
        print(f"baseline process (imports + model load): {baseline:.0f} MiB peak RSS")
        for lora in (False, True):
            spec = {**base, "lora": lora}
            ours, trl = run("ours", spec), run("trl", spec)
            label = "LoRA" if lora else "full fine-tune"
            tps = {k: r["tokens"] / r["seconds"] for k, r in (("ours", ours), ("trl", trl))}
            print(f"{label}:")
            for name, r in (("this trainer", ours), ("TRL DPOTrainer", trl)):
                key = "ours" if name == "this trainer" else "trl"
                print(f"  {name:15s} {tps[key]:8,.0f} tokens/s ({r['tokens']:,} tokens in {r['seconds']:.1f} s); "
                      f"peak RSS {r['peak_mib']:,.0f} MiB (net {r['peak_mib'] - baseline:,.0f}); whole run {r['wall_s']:.1f} s")
            print(f"  ratio tokens/s ours / TRL: {tps['ours'] / tps['trl']:.2f}x; peak RSS ours / TRL: "
                  f"{ours['peak_mib'] / trl['peak_mib']:.2f}x (net of baseline: "
                  f"{(ours['peak_mib'] - baseline) / max(trl['peak_mib'] - baseline, 1e-9):.2f}x); whole run (ours includes "
                  f"data preparation and the reference precompute) {ours['wall_s'] / trl['wall_s']:.2f}x the time")


if __name__ == "__main__":
    main()
