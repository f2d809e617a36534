"""A stand-in for torch.nn.attention.varlen.varlen_attn where the real one cannot run (CPU: torch 2.13's CPU build
has no aten::_flash_attention_forward kernel).

Same signature as the installed torch's (tests/trainer/model/test_attention_varlen.py compares them), the same argument
checks, and flash-attention's semantics computed the plain way, one sequence at a time with SDPA and an explicit
mask: query i of a sequence (Lq queries, Lk keys, aligned bottom-right as flash-attn 2.1+ does) sees key j iff
i + Lk - Lq - left <= j <= i + Lk - Lq + right, a negative bound meaning none (flash-attn's window_size; torch's
varlen.py: (-1, -1) full, (-1, 0) causal, (W, 0) causal with a window); the scale defaults to 1/sqrt(dim).
`varlen_attn_2_10` is torch 2.10.0's form (positional is_causal; no scale, window or GQA keywords), as its wheel's
torch/nn/attention/varlen.py has it. Every call is recorded in CALLS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS: list[dict] = []


def _reference(query, key, value, cu_seq_q, cu_seq_k, scale, left, right):
    outs = []
    for i in range(len(cu_seq_q) - 1):
        q = query[cu_seq_q[i]:cu_seq_q[i + 1]].transpose(0, 1)  # [heads, Lq, dim]
        k = key[cu_seq_k[i]:cu_seq_k[i + 1]].transpose(0, 1)
        v = value[cu_seq_k[i]:cu_seq_k[i + 1]].transpose(0, 1)
        lq, lk = q.shape[1], k.shape[1]
        qi = torch.arange(lq)[:, None] + (lk - lq)
        kj = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            allowed &= kj >= qi - left
        if right >= 0:
            allowed &= kj <= qi + right
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                             enable_gqa=q.shape[0] != k.shape[0])
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _check_heads(query, key, enable_gqa):  # torch 2.12+'s checks, with its words
    num_heads_q, num_heads_k = query.size(1), key.size(1)
    if not enable_gqa and num_heads_q != num_heads_k:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={num_heads_q} and "
                         f"Hkv={num_heads_k}. Try setting enable_gqa=True for GQA.")
    if enable_gqa and num_heads_q % num_heads_k != 0:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got "
                         f"Hq={num_heads_q} and Hkv={num_heads_k}.")


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux=None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
):
    _check_heads(query, key, enable_gqa)
    assert isinstance(max_q, int) and isinstance(max_k, int)  # the custom op's schema: ints, not tensors
    assert cu_seq_q.dtype == torch.int32 and cu_seq_q[-1] == query.shape[0] and cu_seq_k[-1] == key.shape[0]
    CALLS.append({"form": "2.13", "window_size": tuple(window_size), "scale": scale, "enable_gqa": enable_gqa,
                  "sequences": len(cu_seq_q) - 1, "max_q": max_q})
    left, right = window_size
    return _reference(query, key, value, cu_seq_q, cu_seq_k, scale, left, right)


def varlen_attn_2_10(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    return_aux=None,
):
    if query.size(1) != key.size(1):  # 2.10's docstring: key/value [T_k, H, D], as many heads as the query
        raise ValueError("the 2.10 form takes as many key/value heads as query heads")
    CALLS.append({"form": "2.10", "is_causal": is_causal, "sequences": len(cu_seq_q) - 1, "max_q": max_q})
    return _reference(query, key, value, cu_seq_q, cu_seq_k, None, -1, 0 if is_causal else -1)


# ---------------------------------------------------------------------------- FlashAttention-3's Python interface
# flash_attn_interface, the module the flash_attn_3 wheel installs (built from flash-attention's hopper/) and
# transformers' flash_attention_3 imports (modeling_flash_attention_utils._lazy_imports). Signatures as in
# Dao-AILab/flash-attention hopper/flash_attn_interface.py (commit 01afd16d248c4c7d0f9aed1914084f16c490eaed, read
# through the search tool's read_file): GQA by fewer key/value heads, causal aligned bottom-right, window_size
# (left, right) inclusive, softmax_scale default 1/sqrt(headdim); the output alone unless return_attn_probs.
# The kernels themselves (flash_attn_3._C) are CUDA only.


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    assert softcap == 0.0 and qv is None and seqused_q is None and seqused_k is None and not return_attn_probs
    CALLS.append({"form": "fa3_varlen", "window_size": tuple(window_size), "scale": softmax_scale, "causal": causal,
                  "sequences": len(cu_seqlens_q) - 1, "max_q": int(max_seqlen_q)})
    left, right = window_size
    if causal:
        right = 0
    return _reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    batch, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * lq
    cu_k = torch.arange(batch + 1, dtype=torch.int32) * lk
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                 cu_q, cu_k, lq, lk, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap)
    CALLS[-1]["form"] = "fa3"
    return out.view(batch, lq, *out.shape[1:])


def flash_attn_with_kvcache(*args, **kwargs):  # generation with a cache: not exercised by these tests
    raise NotImplementedError("stand-in: flash_attn_with_kvcache")


def fa3_module():
    """The stand-in as an importable `flash_attn_interface` module."""
    import importlib.machinery
    import types

    module = types.ModuleType("flash_attn_interface")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn_interface", None)  # no distribution: transformers
    # still finds flash-attn 3 unavailable (it needs the flash-attn-3 distribution and CUDA), so nothing else moves
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module
