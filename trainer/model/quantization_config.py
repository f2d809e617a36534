"""Axolotl's `model_quantization_config` (a transformers quantization-config class, by name) and
`model_quantization_config_kwargs` (its arguments).

Only the case Axolotl's gpt-oss examples use is supported: `Mxfp4Config` with `dequantize: true`. gpt-oss
checkpoints store their MoE experts in MXFP4 (4-bit values in blocks of 32 sharing an 8-bit exponent);
transformers' Mxfp4HfQuantizer cannot train them (its `is_trainable` is False), so `dequantize: true` has
it expand them to ordinary weights while loading, and training is then ordinary training. Any other class
name, or MXFP4 kept quantized, is refused in one line.
"""

from __future__ import annotations

from typing import Any

SUPPORTED = "Mxfp4Config"


def check(name: str | None, kwargs: dict[str, Any] | None) -> None:
    """Raise ValueError (one line) for anything but Mxfp4Config(dequantize=True, ...its other arguments)."""
    if name is None:
        if kwargs:
            raise ValueError("model_quantization_config_kwargs needs model_quantization_config")
        return
    if name != SUPPORTED:
        raise ValueError(f"model_quantization_config: {name!r} is not supported; only {SUPPORTED} with "
                         "dequantize: true (gpt-oss's MXFP4 experts loaded as trainable weights)")
    kwargs = kwargs or {}
    if kwargs.get("dequantize") is not True:
        raise ValueError("model_quantization_config: Mxfp4Config needs model_quantization_config_kwargs.dequantize: "
                         "true; transformers cannot train MXFP4 weights (Mxfp4HfQuantizer.is_trainable is False)")
    import importlib.util
    import inspect

    if importlib.util.find_spec("transformers") is None:  # judged where the resolver runs, without transformers:
        return  # the arguments are checked again by build() when the trainer loads the model
    from transformers import Mxfp4Config

    accepted = set(inspect.signature(Mxfp4Config.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"model_quantization_config_kwargs: {', '.join(unknown)} is not an argument of "
                         f"transformers' Mxfp4Config ({', '.join(sorted(accepted))})")


def build(name: str | None, kwargs: dict[str, Any] | None):
    """The transformers config object for from_pretrained(quantization_config=...), or None."""
    if name is None:
        return None
    check(name, kwargs)
    from transformers import Mxfp4Config

    return Mxfp4Config(**(kwargs or {}))
