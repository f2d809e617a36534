"""How the chunked cross-entropy splits the loss (trainer/objectives/chunked_loss.py), read by it and by the memory
estimate alike (one copy): the chunk size, and which config fields say a model changes its logits after the head."""

from __future__ import annotations

import re

CHUNK_LOGITS_BYTES = 256 * 2**20  # one chunk's fp32 logits: ~6% of the full logits at 152k x 4096

# config.json fields that change the logits after the head (Gemma 2's final_logit_softcapping, Cohere's logit_scale,
# Granite's logits_scaling, Falcon-H1's lm_head_multiplier); attention's own soft-capping is not one of them
AFTER_HEAD = re.compile(r"^(?!attn|attention)\w*(logit|lm_head|output)\w*(soft_?cap|scal|multiplier)\w*$")


def chunk_tokens(n_tokens: int, vocab_size: int, budget: int | None = None, num_chunks: int | None = None) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within the budget (a power of two, at least 16);
    with `num_chunks` (the config's chunked_cross_entropy_num_chunks, Axolotl's), the target tokens in that many
    chunks instead. Fewer, larger chunks than Liger's vocab/hidden rule: each chunk adds a whole weight-sized gradient
    to the head's, which at 148 chunks (152k vocabulary, hidden 1024) cost more than the matmuls on CPU."""
    if num_chunks:
        return max(1, -(-int(n_tokens) // int(num_chunks)))
    fit = max(16, (budget or CHUNK_LOGITS_BYTES) // (4 * max(vocab_size, 1)))
    return min(1 << (fit.bit_length() - 1), max(int(n_tokens), 1))


def after_head(fields: dict) -> str:
    """'key: value' of a field that says the model changes its logits after the head (set to something other than a
    no-op); '' where none."""
    for key, value in sorted(fields.items()):
        if isinstance(value, dict):  # a composite model's text_config / decoder
            found = after_head(value)
            if found:
                return f"{key}.{found}"
        elif AFTER_HEAD.match(str(key)) and value not in (None, False, 0, 1, 0.0, 1.0):
            return f"{key}: {value}"
    return ""
