"""Context parallelism (`context_parallel_size` above 1): each sequence split over the ranks of a CP group.

The scheme is Llama 3's (Axolotl's default `ring_attn_func: varlen_llama3` for packed data): the ranks of one
CP group read the same micro-batch, each keeps one contiguous slice of the sequence for every layer, and each
attention layer all-gathers the keys and values of the whole sequence over the group, then attends its local
queries to them with a mask built from global positions: causal, and only within the query's packed document
(documents start where position_ids restart at 0, as the collator lays them out). The attention is exactly
the single-process attention; only the order of floating-point sums differs.

- Labels are shifted over the whole sequence before it is split, so the target of a slice's last token (the
  next slice's first token) is not lost; the sequence is padded to a multiple of the CP size with label -100.
- position_ids are the global ones (RoPE as in one process).
- The all-gather is differentiable: its backward sums every rank's gradient for a slice onto the rank that
  owns it (reduce-scatter; gloo has none, so an all-reduce and a slice there).
- The loss: each rank's sum over its slice's target tokens, divided by the step's target-token count (the
  loop's normalisation), so the gradients summed over the CP group are the one-process gradient; DDP, FSDP and
  ZeRO average over all ranks, CP ranks included, and the loop scales by that count. The value returned is
  the CP group's summed loss (one extra all-reduce of a scalar), so logs and evaluations read as one process's.
- Backends: DDP, FSDP2 (sharding over dp_shard x cp flattened, as torchtitan's dp_shard_cp), DeepSpeed (CP ranks
  are data-parallel ranks to it), tensor parallelism (its own, innermost mesh dimension). Rank layout:
  rank = (data_rank * cp + cp_rank) * tp + tp_rank.

Token mixers that are not attention (Mamba/SSM, linear attention, short convolutions) carry state along the
sequence from token to token, so their sequence cannot be split this way: such models are refused when loaded.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.batch.labels import IGNORE
from trainer.config.parallel import context_refusal, recurrent_reason
from trainer.errors import ConfigError

NAME = "envtool_cp_allgather"  # the attention implementation registered with transformers

def check_model(model, cp: int) -> None:
    reason = recurrent_reason(model.config)
    if reason is not None:
        raise ConfigError(context_refusal(cp, reason))
    config = getattr(model.config, "text_config", None) or model.config
    if getattr(config, "attn_logit_softcapping", None):
        raise ConfigError(f"context_parallel_size: {cp}: model_type {config.model_type} soft-caps its attention "
                          "logits, which the SDPA kernels this attention runs on cannot do")
    if any(getattr(m, "sinks", None) is not None for m in model.modules()):
        raise ConfigError(f"context_parallel_size: {cp}: model_type {config.model_type} has attention sinks, "
                          "which the SDPA kernels this attention runs on cannot do")


# Keys x queries of one mask block: attention runs over blocks of local queries, each against the keys it can
# see (from the earliest document start among its queries to its last query), so the mask never holds
# local x whole-sequence entries at once (the point of splitting a long sequence); with more than one block,
# each is recomputed in the backward pass (activation checkpointing) instead of keeping its mask.
# ENVTOOL_CP_MASK_ELEMENTS overrides the size (memory only: the attention is the same).
MASK_ELEMENTS = int(os.environ.get("ENVTOOL_CP_MASK_ELEMENTS", 1 << 26))


class _State:
    group = None
    world = 1
    rank = 0
    query_index = None  # [local queries] global index of each local query
    starts = None  # [rows, whole sequence] global index where each token's document starts
    blocks = ()  # (first, end) local query indices and (lo, hi) global key indices of each block
    calls = 0  # attention layers that ran this forward


STATE = _State()


def plan_blocks(starts_local, first_global: int, limit: int = MASK_ELEMENTS) -> list[tuple[int, int, int, int]]:
    """Blocks of local queries: (a, b) local indices, (lo, hi) the global keys they may attend to. starts_local:
    [rows, local] document starts of the local tokens."""
    earliest = starts_local.min(0).values.cpu().tolist()
    n = len(earliest)
    hi_all = first_global + n
    size = max(1, min(n, limit // max(1, hi_all)))
    blocks = []
    for a in range(0, n, size):
        b = min(n, a + size)
        blocks.append((a, b, int(min(earliest[a:b])), first_global + b))
    return blocks


class Span(NamedTuple):
    """A block of local queries and the keys it may attend to: each query's global index, each token's document
    start ([rows, whole sequence]), and the global keys lo..hi-1."""

    query_index: torch.Tensor
    starts: torch.Tensor
    lo: int
    hi: int


def attend_block(module, query, key, value, span: Span, options: dict):
    """SDPA (transformers' own) of a block of queries against keys lo..hi-1: causal, same document, window.
    `options`: dropout, scaling, window, and whatever else transformers passes to its SDPA."""
    # heavy: transformers loads only when this runs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query_index, starts, lo, hi = span
    kwargs = dict(options)
    dropout, scaling, window = kwargs.pop("dropout"), kwargs.pop("scaling"), kwargs.pop("window")
    keys = torch.arange(lo, hi, device=query.device)
    allowed = keys[None, :] <= query_index[:, None]
    if window:  # transformers' sliding_window_overlay: key index > query index - window
        allowed = allowed & (keys[None, :] > query_index[:, None] - window)
    same = starts[:, query_index][:, :, None] == starts[:, lo:hi][:, None, :]
    mask = (allowed[None] & same)[:, None]
    out, _ = sdpa_attention_forward(module, query, key[:, :, lo:hi], value[:, :, lo:hi], mask, dropout=dropout,
                                    scaling=scaling, is_causal=False, **kwargs)
    return out


def attend(module, query, key, value, query_index, starts, blocks, **options):
    """Local queries [rows, heads, local, dim] against the whole sequence's keys/values; returns transformers'
    attention output layout [rows, local, heads, dim]. `options`: dropout (0.0), scaling (None), window (None),
    and whatever else transformers passes on to its SDPA."""
    options = {"dropout": 0.0, "scaling": None, "window": None, **options}
    if len(blocks) == 1:
        a, b, lo, hi = blocks[0]
        return attend_block(module, query, key, value, Span(query_index, starts, lo, hi), options)

    outs = []
    for a, b, lo, hi in blocks:
        outs.append(checkpoint(attend_block, module, query[:, :, a:b], key, value,
                               Span(query_index[a:b], starts, lo, hi), options, use_reentrant=False))
    return torch.cat(outs, dim=1)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of [batch, heads, seq, dim]); backward: the sum of every rank's
    gradient for this rank's slice."""

    @staticmethod
    def forward(ctx, tensor, group, world, rank):
        ctx.group, ctx.world, ctx.rank = group, world, rank
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            chunks = [c.contiguous() for c in grad.chunk(ctx.world, dim=2)]
            out = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=ctx.group)
            return out, None, None, None
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)  # gloo has no reduce_scatter
        return grad.chunk(ctx.world, dim=2)[ctx.rank].contiguous(), None, None, None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: local queries against the gathered keys and values."""
    STATE.calls += 1
    key = _GatherSeq.apply(key, STATE.group, STATE.world, STATE.rank)
    value = _GatherSeq.apply(value, STATE.group, STATE.world, STATE.rank)
    window = kwargs.pop("sliding_window", None)
    kwargs.pop("is_causal", None)
    out = attend(module, query, key, value, STATE.query_index, STATE.starts, STATE.blocks, dropout=dropout,
                 scaling=scaling, window=window, **kwargs)
    return out, None


def _no_mask(*args, **kwargs):
    return None  # the mask comes from global positions, in `attention`


def register() -> None:
    # heavy: transformers loads only when this runs
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _no_mask)


class ContextParallel:
    """One rank's CP group, and the loss function that splits each batch over it."""

    def __init__(self, model, cp: int, tp: int, rank: int, world: int):
        check_model(model, cp)
        self.cp, self.tp = cp, tp
        self.cp_rank = (rank // tp) % cp
        group = None
        for data in range(world // (cp * tp)):  # every rank creates every group, in the same order
            for t in range(tp):
                ranks = [(data * cp + c) * tp + t for c in range(cp)]
                made = dist.new_group(ranks)
                if rank in ranks:
                    group = made
        STATE.group, STATE.world, STATE.rank = group, cp, self.cp_rank
        self.group = group
        register()
        model.set_attn_implementation(NAME)

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        """The summed cross-entropy of this rank's slice (its gradient), valued at the whole CP group's sum."""
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        rows, length = ids.shape
        pad = (-length) % self.cp
        shifted = torch.cat([labels[:, 1:], torch.full((rows, 1), IGNORE, dtype=labels.dtype, device=labels.device)], 1)
        if pad:  # padding at the end: label -100, position 0 (a document of its own, after every real token)
            ids = F.pad(ids, (0, pad), value=0)
            shifted = F.pad(shifted, (0, pad), value=IGNORE)
            positions = F.pad(positions, (0, pad), value=0)
        total = length + pad
        n = total // self.cp
        local = slice(self.cp_rank * n, (self.cp_rank + 1) * n)
        # a document starts where position_ids restart: its start is the token's index minus its position
        starts = torch.arange(total, device=ids.device)[None, :] - positions
        first = self.cp_rank * n
        STATE.query_index = torch.arange(first, first + n, device=ids.device)
        STATE.starts = starts
        STATE.blocks = plan_blocks(starts[:, local], first)
        STATE.calls = 0
        logits = model(input_ids=ids[:, local], position_ids=positions[:, local], use_cache=False).logits
        if STATE.calls == 0:  # its own attention would have seen the local slice alone: wrong, so stop
            raise ConfigError(f"context_parallel_size: {self.cp}: this model's attention does not run through "
                              "transformers' attention interface, so its sequence cannot be split")
        mine = F.cross_entropy(logits.flatten(0, 1).float(), shifted[:, local].flatten(), ignore_index=IGNORE,
                               reduction="sum")
        whole = mine.detach().clone()
        dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=self.group)
        return mine + (whole - mine.detach())
