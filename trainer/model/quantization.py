"""QLoRA and 8-bit loading: bitsandbytes through transformers' BitsAndBytesConfig and peft's k-bit preparation.

Hardware floors are not written here: each mode names its [[feature]] row of matrices/packages.toml
(load_in_4bit -> bnb_4bit, load_in_8bit -> bnb_int8_loading), whose min_cc, cpu flag, reason and source
`validate` quotes. bitsandbytes >= 0.48 runs both on CPU (its CPU backend), so CPU training works too.

The BitsAndBytesConfig is Axolotl's: NF4 with double quantization, compute in the training precision,
`bnb_config_kwargs` on top (Axolotl's key for any other BitsAndBytesConfig argument).
"""

from __future__ import annotations

import importlib.util

from trainer import facts
from trainer.errors import ConfigError, HardwareError

MODES = {"load_in_4bit": "bnb_4bit", "load_in_8bit": "bnb_int8_loading"}


def mode(cfg) -> str | None:
    """'load_in_4bit', 'load_in_8bit' or None."""
    return next((key for key in MODES if getattr(cfg, key)), None)


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def hardware_notes(cfg, gpu) -> list[str]:
    """Check the quantized loading against the GPU's floor; raise HardwareError, or return what validate says."""
    key = mode(cfg)
    if key is None:
        return []
    feat = facts.feature(MODES[key])
    if gpu.cc is None:
        if not feat.get("cpu"):
            raise HardwareError(f"{key}: {feat['reason']} needs a CUDA GPU (source: {feat['source']})")
        return [f"{key}: bitsandbytes {feat['reason']} on CPU (its CPU backend; slow, for trying configs out)"]
    floor = _cc(feat["min_cc"])
    if gpu.cc < floor:
        other = [k for k, f in MODES.items() if k != key and gpu.cc >= _cc(facts.feature(f)["min_cc"])]
        hint = f"; use {other[0]}: true instead" if other else ""
        raise HardwareError(
            f"{key}: bitsandbytes {feat['reason']} needs sm_{floor[0]}{floor[1]}+ but {gpu.describe()} is below "
            f"(source: {feat['source']}){hint}")
    return [f"{key}: bitsandbytes {feat['reason']} (needs sm_{floor[0]}{floor[1]}+; {gpu.describe()} has it)"]


def bnb_config(cfg, compute_dtype, sharded: bool = False):
    """The BitsAndBytesConfig for the config's load_in_4bit / load_in_8bit (None when neither)."""
    # heavy: torch and transformers load only when this runs
    import torch
    from transformers import BitsAndBytesConfig

    key = mode(cfg)
    if key is None:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{key}: the bitsandbytes package is not installed in this environment "
                          "(install envtool's `train` extra)")
    if key == "load_in_4bit":
        kwargs = {"load_in_4bit": True, "llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False,
                  "bnb_4bit_compute_dtype": compute_dtype, "bnb_4bit_use_double_quant": True,
                  "bnb_4bit_quant_type": "nf4"}
        if sharded:  # FSDP/DeepSpeed flatten parameters: the packed 4-bit storage must share the float dtype
            kwargs["bnb_4bit_quant_storage"] = compute_dtype
    else:
        kwargs = {"load_in_8bit": True}
    extra = dict(cfg.bnb_config_kwargs or {})
    for name, value in list(extra.items()):  # YAML gives dtypes as strings
        if name.endswith("_dtype") or name.endswith("_storage"):
            extra[name] = getattr(torch, str(value).removeprefix("torch."), value)
    kwargs.update(extra)
    try:
        return BitsAndBytesConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"bnb_config_kwargs: {str(err).splitlines()[0]}") from None


def keep_trainable_layout(model) -> int:
    """bitsandbytes 0.50 on CPUs with AVX512-BF16 repacks a 4-bit weight for fast inference the first time the
    layer runs in eval mode, and keeps it: later training forwards then go through a kernel with no autograd,
    so no gradient reaches the layers below (torch warns "an autograd kernel was not registered ... silently
    incorrect"). An evaluation in the middle of training would break QLoRA from then on; switch the repacking
    off on the model being trained. Returns the number of layers changed."""
    # heavy: bitsandbytes loads only when this runs
    import bitsandbytes as bnb

    changed = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed
