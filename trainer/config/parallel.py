"""Parallelism keys: their rules, read without torch (the mesh, FSDP, DeepSpeed and context parallelism
themselves are trainer/parallel/)."""

from __future__ import annotations

from trainer.errors import ConfigError

# Model types whose layers mix tokens with something other than attention (state passed along the sequence).
RECURRENT_TYPES = {"mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2", "bamba",
                   "nemotron_h", "granitemoehybrid", "rwkv", "recurrent_gemma", "lfm2", "lfm2_moe", "qwen3_next",
                   "minimax", "plamo2", "xlstm", "kimi_linear"}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global",
                         "local", "hybrid"}


def check_context_parallel(cfg) -> list[str]:
    """Config-time checks for context_parallel_size above 1 (trainer/parallel/context_parallel.py); returns notes."""
    cp = cfg.context_parallel_size or 1
    if cp == 1:
        return []
    problems = []
    if cfg.sample_packing and cfg.micro_batch_size > 1:
        problems.append(f"context_parallel_size: {cp} with sample_packing needs micro_batch_size: 1 (as Axolotl "
                        f"requires; got {cfg.micro_batch_size}): raise gradient_accumulation_steps instead")
    if cfg.objective != "sft" or cfg.use_eaft or getattr(cfg, "diffusion", None) is not None:
        what = f"rl: {cfg.rl}" if cfg.rl else ("use_eaft" if cfg.use_eaft else
                                               "diffusion" if getattr(cfg, "diffusion", None) is not None
                                               else cfg.objective)
        problems.append(f"context_parallel_size: {cp} with {what}: context parallelism here splits SFT's "
                        "token loss only (preference, reward and diffusion losses are per sequence)")
    if cfg.do_causal_lm_eval:
        problems.append(f"context_parallel_size: {cp} with do_causal_lm_eval: its generation runs whole sequences "
                        "in one process, not split over the CP group")
    if cfg.tensor_parallel_size and cfg.tensor_parallel_size > 1 and not (cfg.fsdp_version or cfg.fsdp_config
                                                                           or cfg.fsdp):
        problems.append(f"context_parallel_size: {cp} with tensor_parallel_size: {cfg.tensor_parallel_size} "
                        "needs FSDP (fsdp_version: 2): the CP ranks shard the model with the data ranks")
    local = _local_config(cfg.base_model)
    reason = recurrent_reason(local) if local is not None else None
    if reason is not None:
        problems.append(context_refusal(cp, reason))
    if problems:
        raise ConfigError("; ".join(problems))
    return [f"context_parallel_size: {cp}: each sequence is split over {cp} ranks, keys and values all-gathered "
            "in every attention layer (exact attention; the attention backend becomes SDPA over the gathered "
            "keys); needs a multiple of {cp} processes, checked at launch; a model with Mamba/SSM layers "
            "(nemotron_h, falcon_h1, jamba, ...) is refused when it loads".replace("{cp}", str(cp))]


def _local_config(base_model):
    """A local model directory's config.json as attributes (None for hub ids: validate reads no network)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(str(base_model or "")).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    wrap = lambda d: SimpleNamespace(**{k: wrap(v) if isinstance(v, dict) else v for k, v in d.items()})  # noqa: E731
    return wrap(raw)


def context_refusal(cp: int, reason: str) -> str:
    return (f"context_parallel_size: {cp}: {reason}, which carry state from token to token, so a sequence "
            "cannot be split over ranks here; use context_parallel_size: 1")


def recurrent_reason(config) -> str | None:
    """Why this model's sequence cannot be split (None: every token mixer is attention)."""
    configs = [config] + [getattr(config, k) for k in ("text_config", "language_config")
                          if getattr(config, k, None) is not None]
    for c in configs:
        kind = getattr(c, "model_type", "") or ""
        if kind in RECURRENT_TYPES:
            return f"model_type {kind} has Mamba/SSM or other recurrent token-mixing layers"
        pattern = getattr(c, "hybrid_override_pattern", None)
        if isinstance(pattern, str) and "M" in pattern:
            return f"model_type {kind} has Mamba layers (hybrid_override_pattern {pattern})"
        for key in ("layer_types", "layers_block_type", "block_types"):
            types = getattr(c, key, None)
            if isinstance(types, (list, tuple)):
                other = sorted({str(t) for t in types} - ATTENTION_LAYER_TYPES)
                if other:
                    return f"model_type {kind} has {', '.join(other)} layers ({key})"
    return None
