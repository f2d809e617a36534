"""The attention backend a model's own transformers class accepts, fitted after the hardware's choice
(trainer/runtime/hardware.py): gpt-oss, for one, has no sdpa path and runs flash attention only through kernels that
apply its attention sinks. No torch import here: validate calls it and stays fast."""

from __future__ import annotations

from matrices import catalog
from trainer.runtime.hardware import attention_backends, packing


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
    if local_only and not _config_at_hand(cfg.base_model):
        return []  # (cheap check first: validate stays fast, no transformers import for a model not here)
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(cfg.base_model, trust_remote_code=cfg.trust_remote_code,
                                            local_files_only=local_only)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # not readable here (a hub id with no cache, remote code): transformers decides at load
        return []
    cc = runtime.gpu.compute_capability
    runs = [b for b in attention_backends() if catalog.backend_runs_on(b, cc) and _installed(b, runtime.gpu)]
    attention, why = runtime.attention, ""
    compatible = getattr(cls, "_compatible_flash_implementations", None) or []
    if packing(attention) == "position_ids" and compatible and attention not in compatible:
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


def _installed(backend: dict, gpu) -> bool:
    """A backend's module is importable here; for `--gpu NAME` (another machine) it is assumed, as
    trainer/runtime/hardware.py does."""
    import importlib.util

    module = backend.get("module")
    return module is None or gpu.source == "--gpu" or importlib.util.find_spec(module) is not None


def _config_at_hand(model: str) -> bool:
    """Whether the model's config.json is on this machine: a local directory, or the Hub cache."""
    from pathlib import Path

    if Path(model, "config.json").is_file():
        return True
    if Path(model).exists() or model.count("/") != 1:
        return False
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:
        return False


def packed_masks(model) -> bool:
    """Per-layer-type masks for hybrid models (gpt-oss: sliding-window and full layers alternate), built by
    transformers' own mask functions from the position_ids the collator restarts per packed sequence.

    A single 4D mask from the collator reaches every layer as given, so sliding layers would attend past their
    window; and gpt-oss's forward does not pass position_ids to its mask creation, so position_ids alone would
    let packed sequences see each other. These models take `attention_mask` as a {layer type: mask} dict, which
    a forward pre-hook on the decoder fills (causal and sliding, per sequence, in the backend's form: bool,
    additive, or flex's BlockMask). Returns whether it was installed (not for models without sliding layers, nor
    for those whose forward takes no such dict)."""
    layer_types = set(getattr(model.config, "layer_types", None) or [])
    if layer_types - {"full_attention"} != {"sliding_attention"}:
        return False
    import inspect

    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    decoder = model.get_decoder()
    try:  # transformers' hybrid models take a prepared {layer type: mask} dict; a few do not (then as before)
        if "causal_mask_mapping := attention_mask, dict)" not in inspect.getsource(type(decoder).forward):
            return False
    except (OSError, TypeError):
        return False

    def hook(module, args, kwargs):
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or positions is None or isinstance(kwargs.get("attention_mask"), dict) \
                or packing(module.config._attn_implementation) == "position_ids":  # flash: cu_seqlens, its own window
            return None
        dtype = module.get_input_embeddings().weight.dtype  # the additive mask's dtype, as the model's own
        shape = dict(config=module.config, inputs_embeds=torch.empty(*ids.shape, 1, dtype=dtype, device=ids.device),
                     attention_mask=None, past_key_values=None, position_ids=positions)
        kwargs["attention_mask"] = {"full_attention": create_causal_mask(**shape),
                                    "sliding_attention": create_sliding_window_causal_mask(**shape)}
        return args, kwargs

    decoder.register_forward_pre_hook(hook, with_kwargs=True)
    return True
