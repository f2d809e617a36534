"""SFT on CPU: this trainer against TRL's SFTTrainer, same model, data, batch shape and steps, in one run.

Each trainer runs in its own process (so peak RSS is its own):
- ours: `python -m trainer train`, type alpaca (the response trained, the prompt not), no packing, its default loss
  (the chunked cross-entropy: trainer/objectives/chunked_loss.py);
- TRL:  trl.SFTTrainer on the same rows as prompt/completion pairs (completion-only loss, TRL's default for them),
  no packing, its defaults otherwise.
The model is a llama built from transformers' config with a 32,000-entry vocabulary (as Llama 2's / Mistral's), so the
loss over the vocabulary weighs as it does in real runs. tokens/s = real (non-pad) tokens of the timed steps / their
wall time (the first steps are warm-up); peak memory = the process's peak RSS, also net of a baseline process that
imports the same libraries and loads the model once.

    PYTHONPATH=. python bench/bench_sft_vs_trl.py [--steps 12] [--hidden 256] [--layers 2] [--vocab 32000]
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


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"instruction": words(rng.randint(8, 40)), "input": "",
                                "output": words(rng.randint(40, 160))}) + "\n")


def worker_ours(spec: dict) -> dict:
    import yaml

    from trainer.cli import main

    out = Path(spec["dir"]) / "ours"
    cfg = {"base_model": spec["model"], "datasets": [{"path": spec["data"], "type": "alpaca"}],
           "dataset_prepared_path": str(Path(spec["dir"]) / "prepared"), "output_dir": str(out),
           "sequence_len": spec["sequence_len"], "micro_batch_size": spec["batch"], "max_steps": spec["steps"],
           "learning_rate": 1e-5, "lr_scheduler": "constant", "attn_implementation": "sdpa", "seed": 0,
           "max_grad_norm": 1.0, "shuffle_merged_datasets": False, "sample_packing": False,
           "gradient_checkpointing": False, "save_strategy": "no"}
    path = Path(spec["dir"]) / "ours.yml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    assert main(["train", str(path)]) == 0
    total = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r][WARMUP:]
    return {"tokens": sum(r["tokens"] for r in steps), "seconds": sum(r["step_time_s"] for r in steps),
            "wall_s": total}


def worker_trl(spec: dict) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    prompt = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n### Instruction:\n{}\n\n### Response:\n")
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    data = datasets.Dataset.from_list([{"prompt": prompt.format(r["instruction"]), "completion": r["output"]}
                                       for r in rows])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation="sdpa", dtype=torch.float32)
    args = SFTConfig(output_dir=str(Path(spec["dir"]) / "trl"), per_device_train_batch_size=spec["batch"],
                     gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=1e-5,
                     lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                     max_length=spec["sequence_len"], use_cpu=True, bf16=False, seed=0, packing=False,
                     dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True, gradient_checkpointing=False)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.tokens = [], []

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()
            self.before = trainer._total_train_tokens if hasattr(trainer, "_total_train_tokens") else 0

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)
            self.tokens.append(trainer._total_train_tokens - self.before)

    timer = Timer()
    started = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[timer])
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch (both trainers)")
    parser.add_argument("--sequence-len", type=int, default=512)
    parser.add_argument("--worker")
    parser.add_argument("spec", nargs="?")
    args = parser.parse_args()
    if args.worker:
        result = {"ours": worker_ours, "trl": worker_trl, "baseline": worker_baseline}[args.worker](json.loads(args.spec))
        result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer.model.tiny import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_tokenizer()
        config = LlamaConfig(vocab_size=max(args.vocab, len(tokenizer)), hidden_size=args.hidden,
                             intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        write_rows(tmp / "rows.jsonl", args.batch * args.steps)
        spec = {"model": str(tmp / "model"), "data": str(tmp / "rows.jsonl"), "dir": str(tmp), "steps": args.steps,
                "batch": args.batch, "sequence_len": args.sequence_len}
        baseline = run("baseline", spec)["peak_mib"]
        ours, trl = run("ours", spec), run("trl", spec)
        print(f"model: llama, hidden {args.hidden}, {args.layers} layers, vocabulary {config.vocab_size}, "
              f"{params / 1e6:.1f}M parameters; {args.batch} rows/micro-batch, {args.steps} steps ({WARMUP} warm-up), "
              f"no packing, no gradient checkpointing, CPU, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
        print(f"baseline process (imports + model load): {baseline:.0f} MiB peak RSS")
        tps = {}
        for name, r in (("this trainer", ours), ("TRL SFTTrainer", trl)):
            tps[name] = r["tokens"] / r["seconds"]
            print(f"  {name:15s} {tps[name]:8,.0f} tokens/s ({r['tokens']:,} tokens in {r['seconds']:.1f} s); "
                  f"peak RSS {r['peak_mib']:,.0f} MiB (net {r['peak_mib'] - baseline:,.0f}); whole run {r['wall_s']:.1f} s")
        print(f"ratio tokens/s ours / TRL: {tps['this trainer'] / tps['TRL SFTTrainer']:.2f}x; peak RSS net of baseline "
              f"ours / TRL: {(ours['peak_mib'] - baseline) / max(trl['peak_mib'] - baseline, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
