"""How the chunked cross-entropy splits the loss (trainer/objectives/chunked_loss.py), read by it and by the memory
estimate alike (one copy): the chunk size, and which config fields say a model changes its logits after the head."""

from __future__ import annotations

import re
from typing import NamedTuple

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


# --------------------------------------------------------------------------- which path: chosen by cost

# The chunked path must save at least this share of the head's FLOPs to be taken for time alone: the count leaves out
# its gather of the target tokens' hidden states and, per chunk, the head's weight-gradient add (measured on CPU:
# bench/bench_loss_path.py).
TIME_MARGIN = 0.9
# The full path is taken only where its logits (12 bytes per token per entry: logits_bytes in trainer/fit/memory.py)
# would use at most this share of the memory free as the step starts (the forward's activations are not allocated
# yet then); above it the chunked loss saves memory.
MEMORY_SHARE = 0.25


class LossPath(NamedTuple):
    """How one step's loss runs, and why: the numbers the choice compared are kept with it."""

    path: str  # "chunked" (the head on the target tokens, a chunk at a time) | "full" (the model's own logits)
    rule: str  # which rule chose it: setting | one_chunk | time | memory | cheaper
    chunks: int  # chunks of target tokens (1: nothing recomputed); 0 on the full path
    chunked_flops: float  # the head's FLOPs, forward and backward, on each path
    full_flops: float
    full_logits_bytes: float  # what the full path's logits hold at their peak
    free_bytes: float | None  # memory free as the step starts (None: not known)
    reason: str

    @property
    def recompute(self) -> bool:
        return self.chunks > 1


def head_flops(tokens: int, hidden: int, vocab: int, head_trains: bool, recompute: bool) -> float:
    """The output head's matmul FLOPs over `tokens` positions, forward and backward: 2·H·V a token forward, as much
    for the hidden states' gradient, as much again for the head's own where it trains, and one more forward where
    the chunk is recomputed in the backward (activation checkpointing)."""
    per_token = 2 * hidden * vocab * (2 + (1 if head_trains else 0) + (1 if recompute else 0))
    return float(tokens) * per_token


def choose_path(positions: int, targets: int, head_shape: tuple[int, int], *, head_trains: bool,
                setting: bool | None = None, num_chunks: int | None = None, free_bytes: float | None = None,
                budget: int | None = None) -> LossPath:
    """The loss path for a step whose micro-batch has `positions` tokens (what the full path runs the head over) of
    which `targets` are scored, through a head of weight shape (vocabulary, hidden) `head_shape`, the config's
    `chunked_cross_entropy` being `setting` (None: unset) and
    `chunked_cross_entropy_num_chunks` `num_chunks`. In order:

    1. the config's `chunked_cross_entropy: true` / `false`: that path (Axolotl's reading);
    2. the target logits fit one chunk: chunked, nothing recomputed: the head runs on the targets only, never on
       more FLOPs than the full path's (taken where it saves at least 1 - TIME_MARGIN of them);
    3. several chunks, each recomputed in the backward: chunked where its FLOPs stay within TIME_MARGIN of the full
       path's (a step whose prompts are most of its tokens);
    4. the full logits would take more than MEMORY_SHARE of the free memory: chunked (it saves memory);
    5. otherwise the full logits: cheaper (every token, or nearly, a target: train_on_inputs, pretraining,
       completion data) and they fit.
    """
    vocab, hidden = head_shape
    size = chunk_tokens(max(targets, 1), vocab, budget, num_chunks)
    chunks = -(-max(targets, 1) // size)
    full = head_flops(positions, hidden, vocab, head_trains, False)
    chunked = head_flops(targets, hidden, vocab, head_trains, chunks > 1)
    logits = float(positions) * vocab * 12
    facts = dict(chunked_flops=chunked, full_flops=full, full_logits_bytes=logits, free_bytes=free_bytes)
    gflops = f"{chunked / 1e9:,.1f} vs {full / 1e9:,.1f} GFLOPs in the head"
    in_chunks = f"{chunks} chunks, each recomputed in the backward" if chunks > 1 else "one chunk, nothing recomputed"
    if setting is not None:
        if setting:
            return LossPath("chunked", "setting", chunks, **facts,
                            reason=f"chunked_cross_entropy: true ({targets:,} target tokens in {in_chunks})")
        return LossPath("full", "setting", 0, **facts, reason="chunked_cross_entropy: false")
    saves_time = chunked <= TIME_MARGIN * full
    if saves_time:
        share = f"{targets:,} of {positions:,} tokens are targets"
        return LossPath("chunked", "one_chunk" if chunks == 1 else "time", chunks, **facts,
                        reason=f"cheaper: {share}; the head on them only, {in_chunks} ({gflops})")
    if free_bytes is not None and logits > MEMORY_SHARE * free_bytes:
        return LossPath("chunked", "memory", chunks, **facts,
                        reason=f"saves memory: the full logits would hold {logits / 2**30:,.2f} GiB of the "
                               f"{free_bytes / 2**30:,.2f} GiB free ({in_chunks}; {gflops})")
    return LossPath("full", "cheaper", 0, **facts,
                    reason=f"cheaper: {targets:,} of {positions:,} tokens are targets, so the chunked loss would "
                           f"save little ({gflops} with {in_chunks}), and the full logits "
                           + (f"fit ({logits / 2**30:,.2f} GiB of {free_bytes / 2**30:,.2f} GiB free)"
                              if free_bytes is not None else f"take {logits / 2**30:,.2f} GiB"))


def describe(setting: bool | None, num_chunks: int | None, every_token_a_target: bool) -> str:
    """The dry run's and validate's line: the path the config asks for, or how each step's is chosen."""
    count = f", {num_chunks} chunks of target tokens" if num_chunks else ""
    if setting is True:
        return f"chunked cross-entropy (chunked_cross_entropy: true{count}) wherever the model allows it"
    if setting is False:
        return "full logits (chunked_cross_entropy: false)"
    if every_token_a_target:
        return ("chosen each step by cost: the full logits while they fit (every token is a target, so the chunked "
                "loss would only add its recompute), the chunked loss where they would not (chunked_cross_entropy "
                "unset)")
    return ("chosen each step by cost: the chunked loss (the head on the target tokens only, nothing recomputed while "
            "they fit one chunk) where the prompts' tokens make it cheaper, the full logits where nearly every token "
            "is a target and they fit (chunked_cross_entropy unset)")
