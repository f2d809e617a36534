"""Axolotl's `model_quantization_config` (a transformers quantization-config class, by name) and
`model_quantization_config_kwargs` (its arguments).

Only the case Axolotl's gpt-oss examples use is supported: `Mxfp4Config` with `dequantize: true`. gpt-oss
checkpoints store their MoE experts in MXFP4 (4-bit values in blocks of 32 sharing an 8-bit exponent);
transformers' Mxfp4HfQuantizer cannot train them (its `is_trainable` is False), so `dequantize: true` has
it expand them to ordinary weights while loading, and training is then ordinary training. Any other class
name, or MXFP4 kept quantized, is refused in one line (trainer/config/model.py checks the keys).
"""

from __future__ import annotations

from typing import Any

from trainer.config.model import check_quantization_config as check  # the rules live with the key


def build(name: str | None, kwargs: dict[str, Any] | None):
    """The transformers config object for from_pretrained(quantization_config=...), or None."""
    if name is None:
        return None
    check(name, kwargs)
    # heavy: transformers loads only when this runs
    from transformers import Mxfp4Config

    return Mxfp4Config(**(kwargs or {}))
