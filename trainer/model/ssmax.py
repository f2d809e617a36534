"""scaling_softmax: Scalable-Softmax attention (SSMax, https://arxiv.org/abs/2501.19399), as Axolotl's patch of
flex_attention (monkeypatch/scaled_softmax_attn.py) computes it, written here from what it does:

    softmax(score * (s * log(n) + b))      score = q.k * scaling, n = the query's position + 1, at least 2

with s = scaling_softmax_factor (0 or unset: 0.43) and b = scaling_softmax_bias (unset: 0). n comes from the batch's
position_ids (restarting per packed sequence), read as Axolotl reads them: flattened over the batch and indexed by the
query's index, so every row takes the first row's positions; without position_ids, the query's index.

On a CUDA GPU the attention is flex_attention with that score_mod (Axolotl requires attn_implementation:
flex_attention), compiled as transformers compiles flex. Where flex_attention does not train (CPU: its backward is
CUDA-only) the plan runs sdpa instead; SSMax then runs as the same formula in plain torch (scores, mask, softmax in
float32), in place of sdpa.
"""

from __future__ import annotations

import torch

DEFAULT_FACTOR = 0.43


def _factors(cfg) -> tuple[float, float]:
    return cfg.scaling_softmax_factor or DEFAULT_FACTOR, cfg.scaling_softmax_bias or 0.0


def _n(position_ids, q_idx):
    flat = position_ids.reshape(-1) if position_ids is not None else None
    n = (flat[q_idx] + 1) if flat is not None else (q_idx + 1)
    return torch.clamp(n.float(), min=2.0)


def flex_forward(s: float, b: float):
    """transformers' flex_attention forward with SSMax's score_mod (Axolotl's)."""
    # heavy: flex_attention and transformers' attention integrations load only with scaling_softmax
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import compile_friendly_flex_attention
    from transformers.integrations.sdpa_attention import repeat_kv

    def forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        if kwargs.get("dropout", 0.0) > 0:
            raise ValueError("flex_attention does not support dropout")
        position_ids = kwargs.get("position_ids")
        block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
        score_mask = None if block_mask is not None else attention_mask
        if score_mask is not None:
            score_mask = score_mask[:, :, :, : key.shape[-2]]

        def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
            score = score * (s * torch.log(_n(position_ids, q_idx)) + b)
            if softcap is not None:
                score = softcap * torch.tanh(score / softcap)
            if score_mask is not None:
                score = score + score_mask[batch_idx][0][q_idx][kv_idx]
            return score

        gqa = True
        if query.shape[1] & (query.shape[1] - 1):  # flex's GQA wants a power-of-two number of query heads
            key = repeat_kv(key, query.shape[1] // key.shape[1])
            value = repeat_kv(value, query.shape[1] // value.shape[1])
            gqa = False
        lse = query.device.type != "cpu"
        out = compile_friendly_flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                              enable_gqa=gqa, scale=scaling, kernel_options=kwargs.get("kernel_options"),
                                              return_lse=lse, training=module.training)
        out, logsumexp = out if lse else (out, None)
        return out.transpose(1, 2).contiguous(), (logsumexp.to(value.dtype) if logsumexp is not None else None)

    return forward


def math_forward(s: float, b: float):
    """The same SSMax in plain torch, for where flex_attention does not train (the sdpa the plan runs instead)."""
    # heavy: transformers' attention integrations load only with scaling_softmax
    from transformers.integrations.sdpa_attention import repeat_kv

    def forward(module, query, key, value, attention_mask, **kwargs):  # (transformers' attention interface)
        dropout, scaling = kwargs.get("dropout", 0.0), kwargs.get("scaling")
        key = repeat_kv(key, query.shape[1] // key.shape[1])
        value = repeat_kv(value, query.shape[1] // value.shape[1])
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
        q_idx = torch.arange(query.shape[2], device=query.device)
        factor = s * torch.log(_n(kwargs.get("position_ids"), q_idx)) + b
        scores = scores * factor.view(1, 1, -1, 1)
        if attention_mask is None:
            causal = q_idx[:, None] >= torch.arange(key.shape[2], device=query.device)[None, :]
            scores = scores.masked_fill(~causal, float("-inf"))
        elif attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[:, :, :, : key.shape[2]], float("-inf"))
        else:
            scores = scores + attention_mask[:, :, :, : key.shape[2]].float()
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # (a fully masked padding row: zeros)
        if dropout and module.training:
            probs = torch.nn.functional.dropout(probs, p=dropout)
        out = torch.matmul(probs.to(value.dtype), value)
        return out.transpose(1, 2).contiguous(), None

    return forward


def install(cfg, attention: str, say) -> None:
    """Replace the attention the model runs (`attention`: flex_attention, or sdpa/eager where flex does not train)
    with SSMax's, for this process (as Axolotl patches transformers' table)."""
    if not cfg.scaling_softmax:
        return
    # heavy: transformers loads only when this runs
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    s, b = _factors(cfg)
    ALL_ATTENTION_FUNCTIONS[attention] = flex_forward(s, b) if attention == "flex_attention" else math_forward(s, b)
    how = "flex_attention's score_mod" if attention == "flex_attention" else f"plain torch in place of {attention}"
    say(f"scaling_softmax: attention scores x ({s:g} log n + {b:g}) (SSMax), by {how}")
