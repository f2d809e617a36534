"""Keeping packed sequences apart, per attention backend (attention.toml's `packing` column), and the
backend a model's own code accepts.

- position_ids (flash_attention_2/3, flash Hub kernels): transformers unpads by position_ids (cu_seqlens from where they restart at 0),
  so the collator flattens the micro-batch into one row and passes no mask.
- sdpa and eager: transformers 5.x does NOT isolate packed sequences from position_ids when the model
  runs with a KV cache (use_cache defaults to True, even in training); measured: the logits of the second
  packed sequence differ by ~0.5 (tests/trainer/test_attention.py). So we pass an explicit 4D
  block-diagonal causal mask [batch, 1, q, k], which transformers uses as given. sdpa takes it as bool;
  eager adds it to the scores, so it gets 0 / -inf floats.
- row_position_ids (flex_attention): no mask; with no KV cache (every forward here passes use_cache=False)
  transformers finds the sequences where position_ids restart and builds flex's BlockMask from them. A dense
  mask would reach flex as a score_mod that captures the tensor, which torch 2.13's compiled CPU flex
  corrupts memory on (checked here); the BlockMask is also the fast path on GPUs.
"""

from __future__ import annotations

import torch

from trainer import facts

PACKING = {row["transformers"]: row.get("packing", "bool_mask") for row in facts.rows("attention", "backend")}
# backends that separate packed sequences by position_ids (one flattened row, no mask)
FLASH_BACKENDS = tuple(name for name, packing in PACKING.items() if packing == "position_ids")


def needs_mask(attention: str) -> bool:
    """Whether the collator passes a 4D mask (bool_mask, float_mask) rather than position_ids alone."""
    return PACKING.get(attention, "bool_mask") in ("bool_mask", "float_mask")


def block_causal_mask(segments: torch.Tensor, attention: str) -> torch.Tensor:
    """segments: [batch, seq] segment id per token. Token i may attend to token j iff both are in the
    same segment and j <= i. sdpa takes a bool mask (True = attend); eager adds the mask to its scores,
    so it gets 0 / -inf-like floats."""
    seq = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = (same & causal)[:, None, :, :]
    if PACKING.get(attention) == "float_mask":
        mask = torch.zeros(allowed.shape, dtype=torch.float32)
        return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed


def for_model(cfg, runtime, local_only: bool) -> list[str]:
    """Fit runtime.attention to what the model's transformers class accepts, with a note for each change:
    - a class without sdpa (gpt-oss: its attention sinks) gets eager, as transformers itself would;
    - a class that lists its own flash implementations (gpt-oss: `_compatible_flash_implementations`, kernels
      that apply the sinks) would be switched by transformers to the first of them, fetched from the Hub, even
      where attention.toml says it does not run: the first of them that runs here, else flex_attention where it
      runs and the class supports it, else eager;
    - flex_attention on a class without flex support: sdpa, else eager.
    The model's config is read from the local files or cache only when `local_only` (validate, no download); a
    model that cannot be read keeps the hardware's choice."""
    from matrices import catalog
    from trainer.hardware import attention_backends

    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(cfg.base_model, trust_remote_code=cfg.trust_remote_code,
                                            local_files_only=local_only)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # not readable here (a hub id with no cache, remote code): transformers decides at load
        return []
    cc = runtime.gpu.compute_capability
    runs = [b for b in attention_backends() if catalog.backend_runs_on(b, cc)]
    attention, why = runtime.attention, ""
    compatible = getattr(cls, "_compatible_flash_implementations", None) or []
    if PACKING.get(attention) == "position_ids" and compatible and attention not in compatible:
        kernel = next((b["transformers"] for b in runs if b["transformers"] in compatible), None)
        flex = cls._supports_flex_attn and any(b["transformers"] == "flex_attention" for b in runs)
        attention = kernel or ("flex_attention" if flex else "eager")
        why = (f"{cls.__name__} runs flash attention only through {', '.join(compatible)}, "
               f"{'of which ' + kernel + ' runs here' if kernel else 'none of which runs on ' + runtime.gpu.describe()}")
    elif attention == "sdpa" and not cls._supports_sdpa:
        attention, why = "eager", f"{cls.__name__} has no sdpa path (transformers' _supports_sdpa is False)"
    elif attention == "flex_attention" and not cls._supports_flex_attn:
        attention = "sdpa" if cls._supports_sdpa else "eager"
        why = f"{cls.__name__} has no flex_attention path"
    if attention == runtime.attention:
        return []
    note = f"attention: {runtime.attention} -> {attention} ({why})"
    runtime.attention = attention
    runtime.changes.append(note)
    return [note]
