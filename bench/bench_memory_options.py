"""The memory options on CPU: peak memory and time of one training forward and backward, each option against the plain
path it replaces, and the estimate's activations for the same setup (trainer/fit/memory.py).

    PYTHONPATH=. python bench/bench_memory_options.py [--hidden 512] [--layers 4] [--tokens 4096] [--compile] [--json]

A Llama of the given size (the tiny tokenizer) is written once; each option then runs in its own process (so one's
peak is not another's), loaded through the trainer's own load_model with the option in its config: the peak resident
memory above what the process held before the forward (ru_maxrss) and the seconds of the forward and backward are the
figures, and the loss is printed so the paths can be seen to agree. Activation offloading has nothing to offload on the
CPU and is not run; torch.compile only with --compile (its first call compiles, so its time is the compile's).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {  # name -> (config keys, the path it is compared with)
    "plain": ({}, None),
    "tiled_mlp": ({"tiled_mlp": True, "tiled_mlp_num_shards": 4}, "plain"),
    "checkpointing": ({"gradient_checkpointing": True}, "plain"),
    "checkpointing+selective(attention)": ({"gradient_checkpointing": True, "selective_checkpointing": True},
                                           "checkpointing"),
    "checkpointing+selective(aten::mm)": ({"gradient_checkpointing": True,
                                           "selective_checkpointing": {"save": ["aten::mm"]}}, "checkpointing"),
    "checkpointing+tiled_mlp": ({"gradient_checkpointing": True, "tiled_mlp": True, "tiled_mlp_num_shards": 4},
                                "checkpointing"),
    "torch_compile": ({"torch_compile": True}, "plain"),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one(model_dir: str, name: str, tokens: int) -> dict:
    import time

    import torch

    from trainer.config import parse_config
    from trainer.data.prepare import load_tokenizer
    from trainer.fit import memory, memory_model
    from trainer.model import memory_options
    from trainer.model.load import load_model
    from trainer.runtime.hardware import Runtime, adapt, gpu_from_name

    keys = OPTIONS[name][0]
    cfg, _ = parse_config({"base_model": model_dir, "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                           "learning_rate": 1e-3, "sequence_len": tokens, "micro_batch_size": 1,
                           "attn_implementation": "sdpa", **keys})
    rt = adapt(cfg, gpu_from_name("cpu"))
    rt = Runtime(gpu=rt.gpu, attention=rt.attention, precision="fp32", tf32=False)
    torch.manual_seed(0)
    model = load_model(cfg, rt, load_tokenizer(cfg))
    memory_options.compile_model(cfg, model, True, lambda text: None)
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    before = rss_bytes()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    rt.compile = bool(cfg.torch_compile)
    s = memory.setup_from(cfg, rt, 1)
    acts = memory.activation_terms(memory_model.model_shape(model_dir), s, tokens=tokens, row_len=tokens)
    rebuilt = acts.layer_full if s.checkpointing else acts.tile
    return {"option": name, "peak_mb": peak / 2 ** 20, "seconds": seconds, "loss": float(loss),
            "estimate_mb": (acts.saved + rebuilt + acts.grads) / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (model dir, option): the child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.tokens)))
        return
    from trainer.model.tiny import build_model, build_tokenizer

    with tempfile.TemporaryDirectory() as model_dir:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, "llama", seed=0, hidden_size=args.hidden, layers=args.layers)
        model.config.max_position_embeddings = max(args.tokens, 4096)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        rows = {}
        for name in OPTIONS:
            if name == "torch_compile" and not args.compile:
                continue
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--one", model_dir, name],
                                 capture_output=True, text=True, cwd=ROOT, check=True)
            rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    for name, row in rows.items():
        base = OPTIONS[name][1]
        if base in rows:
            row["peak_vs"] = f"{row['peak_mb'] / rows[base]['peak_mb']:.2f}x {base}"
            row["time_vs"] = f"{row['seconds'] / rows[base]['seconds']:.2f}x {base}"
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"llama hidden {args.hidden}, {args.layers} layers, {args.tokens} tokens, fp32 on CPU (one forward+backward)")
    for name, row in rows.items():
        print(f"  {name:36s} peak {row['peak_mb']:7.0f} MB (estimate {row['estimate_mb']:6.0f})  "
              f"{row['seconds']:6.2f} s  loss {row['loss']:.6f}  {row.get('peak_vs', '')}  {row.get('time_vs', '')}")


if __name__ == "__main__":
    main()
