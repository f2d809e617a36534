"""torch's own varlen attention as a transformers attention backend, and cuDNN SDPA kept off masked calls.

1. `varlen_attn` (torch.nn.attention.varlen, torch >= 2.10: FA2's varlen kernels built into torch, forward and
   backward, sm_80+). transformers 5.23 has no attn_implementation for it, so `install` registers one through its
   AttentionInterface under the name of torch.toml's [[varlen]] row. It is transformers' flash-attention path
   (integrations/flash_attention.py, modeling_flash_attention_utils.py) with torch's kernel in flash-attn's
   place, using transformers' own helpers for each case:
   - packed rows: the collator flattens the micro-batch into one row whose position_ids restart at 0 per
     sequence; cu_seqlens and max_seqlen come from them (`prepare_fa_kwargs_from_position_ids`), once per forward;
   - padding (generation, a 2-D mask): unpadded to the real tokens and padded back (`_upad_input`, `_pad_input`);
   - rows of equal length and no mask: each row one sequence.
   No 4-D mask is ever built: the mask function registered with it is flash-attention's (None, or the 2-D padding
   mask). The kernel's keywords differ per torch release, read from its signature at call time:
     2.10   varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
     2.11   ..., *, return_aux=None, scale=None, window_size=(-1, -1)   (is_causal gone: (-1, 0) is causal)
     2.12+  ..., enable_gqa=False, seqused_k=None, block_table=None, num_splits=None
   (read from the PyPI wheels' torch/nn/attention/varlen.py: 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1). Where a
   keyword is missing the same numbers come another way: no `scale` -> the query scaled by scale * sqrt(d) (the
   kernel divides by sqrt(d)); no `enable_gqa` -> the key/value heads repeated; no `window_size` (2.10) -> no
   sliding window (trainer/model/attention.py keeps such models on the mask). Sliding windows are flash-attn's
   inclusive (left, right) bounds, as transformers converts them: (sliding_window - 1, 0) when causal.
   The kernel runs on CUDA only: torch 2.13's CPU build has no `aten::_flash_attention_forward` for CPU tensors
   (NotImplementedError, checked by tests/trainer/model/test_attention_varlen.py).

2. Where a build puts cuDNN attention first for SDPA (torch.toml [[cudnn_sdpa]]: cuDNN SDPA has open correctness
   bugs with explicit masks) and the run still passes masks to SDPA, `install` wraps transformers' sdpa backend so
   that every call with a mask runs under torch.nn.attention.sdpa_kernel without CUDNN_ATTENTION (the other SDPA
   kernels that were enabled stay enabled); calls without a mask are left alone. Inside the attention function, so
   activation checkpointing's recomputation takes the same path as the forward.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.runtime.hardware import varlen_kernels

NAME = varlen_kernels()[0]["name"]  # "varlen_attn": what transformers gets as attn_implementation


def kernel():
    """torch.nn.attention.varlen.varlen_attn, looked up at every call (a test puts its stand-in there)."""
    # heavy: torch loads only when this runs
    from torch.nn.attention import varlen

    return varlen.varlen_attn


@lru_cache(maxsize=8)
def _keywords(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


class Seqlens(NamedTuple):
    """Where the packed sequences start and end (cumulative lengths, int32) and the longest, for queries and keys."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def call_kernel(query, key, value, seqlens: Seqlens, *, causal: bool, window: int | None = None,
                scale: float | None = None):
    """varlen_attn on [tokens, heads, dim] tensors, in whatever form this torch release takes: `window` is
    transformers' sliding_window (tokens a query sees, itself included), `scale` the softmax scale (None:
    1/sqrt(dim))."""
    cu_seq_q, cu_seq_k, max_q, max_k = seqlens
    fn = kernel()
    takes = _keywords(fn)
    kwargs = {}
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in takes:
            kwargs["enable_gqa"] = True
        else:  # 2.10, 2.11: one key/value head per query head
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if scale is not None:
        if "scale" in takes:
            kwargs["scale"] = scale
        elif scale != query.shape[-1] ** -0.5:  # 2.10 always divides by sqrt(dim)
            query = query * (scale * query.shape[-1] ** 0.5)
    if "window_size" in takes:
        left = window - 1 if window is not None and window < max_k else -1
        kwargs["window_size"] = (left, 0 if causal else left)
    else:
        if window is not None and window < max_k:
            raise ValueError(f"{NAME}: this torch's varlen_attn has no window_size (torch >= 2.11), and the model "
                             f"has a sliding window of {window}")
        kwargs["is_causal"] = causal
    return fn(query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k), **kwargs)


class _Lengths:
    """cu_seqlens and max_seqlen of the last position_ids seen: every layer of one forward (and a checkpointed
    layer's recomputation) gets the same tensor, so they are derived once per forward (one device sync, not one
    per layer). Holds the tensor itself, so `is` cannot match a different one at a reused address."""

    position_ids = None
    lengths = None

    @classmethod
    def of(cls, position_ids):
        if cls.position_ids is not position_ids:
            # heavy: transformers loads only when this runs
            from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

            (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
            cls.position_ids, cls.lengths = position_ids, (cu_q, cu_k, int(max_q), int(max_k))
        return cls.lengths


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface: query [b, heads, q, d], key/value [b, kv_heads, k, d] -> ([b, q, heads,
    d], None), as transformers' flash_attention_forward. transformers passes these five positionally and the rest
    (dropout, scaling, sliding_window, softcap, is_causal, s_aux, the packed lengths) by keyword."""
    # heavy: transformers loads only when this runs
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, _pad_input, _unpad_input, _upad_input

    dropout, softcap, s_aux = kwargs.get("dropout", 0.0), kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is not None or s_aux is not None or dropout:
        what = "soft-capped logits" if softcap is not None else "attention sinks" if s_aux is not None else "dropout"
        raise ValueError(f"{NAME} takes no {what} (trainer/model/attention.py keeps such models on sdpa's mask)")
    batch, q_len = query.shape[0], query.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [b, len, heads, d], as flash-attn takes them
    target = get_target_dtype(q, module)  # fp32 after RoPE under autocast: back to the autocast dtype
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)
    is_causal = kwargs.get("is_causal")
    causal = module.is_causal if is_causal is None else is_causal
    options = dict(causal=causal, window=kwargs.get("sliding_window"), scale=kwargs.get("scaling"))
    if attention_mask is not None:  # padding (a 2-D mask): only the real tokens go in
        q, k, v, indices, (cu_q, cu_k), (max_q, max_k) = _upad_input(q, k, v, attention_mask, q_len, _unpad_input)
        out = call_kernel(q, k, v, Seqlens(cu_q, cu_k, int(max_q), int(max_k)), **options)
        return _pad_input(out, indices, batch, q_len), None
    heads, k_len = q.shape[2], k.shape[1]
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in given):
        cu_q, cu_k, max_q, max_k = given
    elif _is_packed_sequence(kwargs.get("position_ids"), batch):  # the collator's one flattened row
        cu_q, cu_k, max_q, max_k = _Lengths.of(kwargs["position_ids"])
    else:  # each row one sequence
        rows = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k = rows * q_len, rows * k_len, q_len, k_len
    out = call_kernel(q.reshape(-1, heads, q.shape[-1]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                      Seqlens(cu_q, cu_k, max_q, max_k), **options)
    return out.view(batch, q_len, heads, -1), None


class _WithoutCudnn:
    on = False  # set by install() for the run; read by every sdpa call
    masked_calls = 0  # masked SDPA calls that ran with cuDNN attention off (the tests read it)


def sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' sdpa backend; a call with a mask runs without cuDNN attention where the run asks for it."""
    # heavy: transformers loads only when this runs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or not _WithoutCudnn.on:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    enabled = [b for b, on in ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
                               (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
                               (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled())) if on]
    _WithoutCudnn.masked_calls += 1
    with sdpa_kernel(enabled or [SDPBackend.MATH]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def install(runtime) -> None:
    """Before a model loads: register the varlen backend (transformers accepts NAME from then on) and set whether
    masked SDPA calls keep cuDNN off (runtime.mask_without_cudnn)."""
    # heavy: transformers loads only when this runs
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)  # None, or the 2-D padding mask: no 4-D mask
    _WithoutCudnn.on = bool(runtime.mask_without_cudnn)
    if _WithoutCudnn.on:
        AttentionInterface.register("sdpa", sdpa_forward)
