"""Keeping packed sequences apart, per attention backend (attention.toml's `packing` column), and the
backend a model's own code accepts.

- position_ids (flash_attention_2/3, flash Hub kernels, and torch's own varlen_attn, which the trainer registers
  with transformers: trainer/model/attention_varlen.py): the attention derives cu_seqlens from where position_ids
  restart at 0, so the collator flattens the micro-batch into one row and passes no mask.
- sdpa and eager: transformers 5.x does NOT isolate packed sequences from position_ids when the model
  runs with a KV cache (use_cache defaults to True, even in training); measured: the logits of the second
  packed sequence differ by ~0.5 (tests/trainer/batch/test_attention.py). So we pass an explicit 4D
  block-diagonal causal mask [batch, 1, q, k], which transformers uses as given. sdpa takes it as bool;
  eager adds it to the scores, so it gets 0 / -inf floats.
- row_position_ids (flex_attention): no mask; with no KV cache (every forward here passes use_cache=False)
  transformers finds the sequences where position_ids restart and builds flex's BlockMask from them. A dense
  mask would reach flex as a score_mod that captures the tensor, which torch 2.13's compiled CPU flex
  corrupts memory on (checked here); the BlockMask is also the fast path on GPUs.
"""

from __future__ import annotations

import torch

from trainer.runtime.hardware import attention_backends, packing, varlen_kernels

# backends that separate packed sequences by position_ids (one flattened row, no mask): flash-attn's and torch's
FLASH_BACKENDS = tuple(b["transformers"] for b in attention_backends() if b.get("packing") == "position_ids") \
    + tuple(v["name"] for v in varlen_kernels())


def needs_mask(attention: str) -> bool:
    """Whether the collator passes a 4D mask (bool_mask, float_mask) rather than position_ids alone."""
    return packing(attention) in ("bool_mask", "float_mask")


def block_causal_mask(segments: torch.Tensor, attention: str) -> torch.Tensor:
    """segments: [batch, seq] segment id per token. Token i may attend to token j iff both are in the
    same segment and j <= i. sdpa takes a bool mask (True = attend); eager adds the mask to its scores,
    so it gets 0 / -inf-like floats."""
    seq = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = (same & causal)[:, None, :, :]
    if packing(attention) == "float_mask":
        mask = torch.zeros(allowed.shape, dtype=torch.float32)
        return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed

