"""The loss path chosen by cost (trainer/runtime/loss_chunks.py choose_path) against the other path, on full train steps.

    PYTHONPATH=. python bench/bench_loss_path.py [--pairs 5] [--layers 16] [--hidden 256] [--vocab 16000]

A llama-shaped model built from transformers' LlamaConfig (random weights, fp32, CPU, one thread), at a real model's
proportions: the output head's share of the step's matmul FLOPs is printed beside Qwen2.5-0.5B's and Llama-3-8B's
(their config.json sizes from bench/data/model_configs.toml, counted the same way). Each case runs the trainer's own
loss (trainer/objectives/loss.py token_loss_sum) one forward and backward per step, the two paths forced by the
config's chunked_cross_entropy (true: chunked, false: full logits) in interleaved pairs (full, chunked), after one
untimed step each; CPU time (time.process_time) and wall-clock medians with their spread, the ratio of the CPU
medians, and which path the unset key chooses for that step (with its reason). The cases:

- every token a target (train_on_inputs: true, pretraining, completion data), several chunks;
- prompt masking: a chat SFT step whose completions are 30% of its tokens, several chunks;
- prompt masking whose target logits fit one chunk at the real budget (nothing recomputed).

The chunk budget is cut from 256 MiB so that these short steps run several chunks, as a 152k vocabulary at 4096
tokens does at the real budget (--chunk-mib; the choice reads the same budget). Exit 1 if the chosen path's CPU median
is above the other's by more than the pairs' own spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def matmul_flops_per_token(hidden, inter, layers, heads, kv_heads, vocab, row, head_dim=None) -> tuple[float, float]:
    """(the head's, the whole forward's) matmul FLOPs per token: projections, MLP, attention scores at row length
    `row` (causal: half of row), and the head."""
    hd = head_dim or hidden // heads
    proj = hidden * (heads * hd) * 2 + hidden * (kv_heads * hd) * 2  # q, o; k, v
    mlp = 3 * hidden * inter
    scores = 2 * heads * hd * row / 2  # QK^T and AV over half the row on average (causal)
    body = 2 * layers * (proj + mlp + scores)
    head = 2 * hidden * vocab
    return head, body + head


def real_shares(row: int) -> list[str]:
    data = tomllib.loads((ROOT / "bench" / "data" / "model_configs.toml").read_text())["models"]
    out = []
    for name in ("Qwen/Qwen2.5-0.5B", "meta-llama/Meta-Llama-3-8B"):
        c = data[name]["config"]
        head, total = matmul_flops_per_token(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                                             c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"], row,
                                             c.get("head_dim"))
        out.append(f"{name} {head / total:.0%}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--row-len", type=int, default=512)
    parser.add_argument("--chunk-mib", type=int, default=16)
    args = parser.parse_args()
    if args.pairs < 3:
        parser.error("--pairs: at least 3")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.batch.labels import IGNORE
    from trainer.objectives import chunked_loss
    from trainer.objectives.loss import token_loss_sum

    torch.set_num_threads(1)
    inter = int(args.hidden * 2.6875)  # Llama's 11008/4096
    heads = max(1, args.hidden // 64)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=inter,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         max_position_embeddings=args.row_len, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    head, total = matmul_flops_per_token(args.hidden, inter, args.layers, heads, max(1, heads // 4), args.vocab,
                                         args.row_len)
    print(f"model: llama, hidden {args.hidden}, intermediate {inter}, {args.layers} layers, vocabulary {args.vocab:,}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, fp32, CPU, 1 thread; "
          f"{args.rows} x {args.row_len} tokens a step")
    print(f"the head's share of the step's matmul FLOPs: {head / total:.0%} (at this row length: "
          f"{', '.join(real_shares(args.row_len))})")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.rows, args.row_len), generator=g)
    n = args.rows * args.row_len
    cases = [("every token a target (train_on_inputs: true)", 0.0, args.chunk_mib),
             ("prompt masking, completions 30% of the tokens", 0.7, args.chunk_mib),
             ("prompt masking, the target logits in one chunk (the real 256 MiB budget)", 0.7, 256)]
    failed = False
    for title, masked, chunk_mib in cases:
        labels = ids.clone()
        prompt = int(args.row_len * masked)
        labels[:, :prompt] = IGNORE  # each row's prompt first, its completion after, as a chat row
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        chunked_loss.CHUNK_LOGITS_BYTES = chunk_mib * 2**20

        def step(setting):
            chunked_loss.configure(SimpleNamespace(chunked_cross_entropy=setting, chunked_cross_entropy_num_chunks=None))
            model.zero_grad(set_to_none=True)
            cpu, wall = time.process_time(), time.perf_counter()
            loss = token_loss_sum(model, batch)
            loss.backward()
            return time.process_time() - cpu, time.perf_counter() - wall, float(loss.detach())

        losses = {name: step(setting)[2] for name, setting in (("full", False), ("chunked", True))}  # untimed
        chunked_loss.configure(SimpleNamespace(chunked_cross_entropy=None, chunked_cross_entropy_num_chunks=None))
        chunked_loss.notes()
        slot = chunked_loss.decide(model, {"input_ids": ids})
        targets = int((labels[:, 1:] != IGNORE).sum())
        chosen = chunked_loss.choose(slot, n, targets)
        runs = {"full": [], "chunked": []}
        for _ in range(args.pairs):
            runs["full"].append(step(False))
            runs["chunked"].append(step(True))
        med = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
        other = "full" if chosen.path == "chunked" else "chunked"
        spread = max(max(r[0] for r in runs[chosen.path]) - min(r[0] for r in runs[chosen.path]), 0.0)
        ok = med[chosen.path] <= med[other] + spread
        failed |= not ok
        print(f"\n{title}: {targets:,} of {n:,} tokens are targets, chunks of {chunk_mib} MiB of fp32 logits")
        for name, values in runs.items():
            cpu = [r[0] for r in values]
            wall = [r[1] for r in values]
            print(f"  {name:8} CPU median {statistics.median(cpu):6.2f} s (min {min(cpu):.2f}, max {max(cpu):.2f}); "
                  f"wall median {statistics.median(wall):6.2f} s (min {min(wall):.2f}, max {max(wall):.2f})")
        print(f"  chunked / full, CPU medians: {med['chunked'] / med['full']:.2f}x; losses {losses['full']:.4f} / "
              f"{losses['chunked']:.4f}")
        print(f"  unset chunked_cross_entropy chooses: {chosen.path} (rule {chosen.rule}) - {chosen.reason}")
        print(f"  the chosen path is {'not the slower one' if ok else 'THE SLOWER ONE'} "
              f"({med[chosen.path]:.2f} vs {med[other]:.2f} s CPU)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
