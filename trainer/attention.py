"""Keeping packed sequences apart, per attention backend.

- flash_attention_2/3: transformers unpads by position_ids (cu_seqlens from where they restart at 0),
  so the collator flattens the micro-batch into one row and passes no mask.
- sdpa and eager: transformers 5.x does NOT isolate packed sequences from position_ids when the model
  runs with a KV cache (use_cache defaults to True, even in training); measured: the logits of the second
  packed sequence differ by ~0.5 (tests/trainer/test_attention.py). So we pass an explicit 4D
  block-diagonal causal mask [batch, 1, q, k], which transformers uses as given.
"""

from __future__ import annotations

import torch

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")


def block_causal_mask(segments: torch.Tensor, attention: str) -> torch.Tensor:
    """segments: [batch, seq] segment id per token. Token i may attend to token j iff both are in the
    same segment and j <= i. sdpa takes a bool mask (True = attend); eager adds the mask to its scores,
    so it gets 0 / -inf-like floats."""
    seq = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = (same & causal)[:, None, :, :]
    if attention == "eager":
        mask = torch.zeros(allowed.shape, dtype=torch.float32)
        return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed
