"""Quantization-aware training (Axolotl's `qat:`) through torchao's QAT API.

Before training, torchao's `quantize_(model, QATConfig(...))` swaps every nn.Linear (lm_head included, as
Axolotl does) for a fake-quantized linear: the forward pass sees weights (and activations) rounded to the
target format, the backward pass trains the full-precision weights (straight-through). `quantize_embedding`
does the same to nn.Embedding weights. `fake_quant_after_n_steps: N` trains the first N steps without fake
quantization (Axolotl's QATCallback: off at step 0, on from step N). At the end, `QATConfig(step="convert")`
swaps the layers back to nn.Linear / nn.Embedding (as Axolotl's convert_qat_model does), so checkpoints'
and the final model's weights are a plain HF model; quantize them with the same dtypes afterwards
(`axolotl quantize`, or torchao's PTQ config for the same scheme).

The dtype pairs are Axolotl's (src/axolotl/utils/quantization.py, get_quantization_config and
_make_qat_config at 067b021), built as explicit fake-quantize configs:

  activation / weight      fake quantization
  int8 / int4              per-token asymmetric int8 activations, int4 weights per group (group_size)
  none / int4              int4 weights per group (bf16 activations: torchao's mapping of Int4WeightOnlyConfig)
  float8 / float8          float8 e4m3 activations and weights
  float8 / int4            float8 e4m3 activations, int4 weights per group
  mxfp4 (either) / mxfp4   MXFP4 activations and weights, block 32 (torchao's emulated MX kernels)
  nvfp4 / nvfp4            NVFP4 activations and weights, block 16, e4m3 block and per-tensor scales

Where each runs is a fact of matrices/packages.toml ([[feature]] torchao_qat_fake_quant, torchao_qat_nvfp4).
torchao's NVFP4 QAT computes its forward as a real FP4 GEMM, which only FP4 tensor cores run ([[feature]]
torchao_nvfp4_gemm, sm_100+); there it runs unchanged, and everywhere else (CPU, A100, H100) trainer/model/nvfp4.py
emulates that GEMM in float32 from torchao's own quantized operands (the same numerics to float32 rounding,
slower). Either way the end is the same: `convert` gives plain nn.Linear layers holding the trained weights
(what torchao's QATConfig(step="convert") without a base config gives); serving them as NVFP4 afterwards
with NVFP4 activations (torchao's NVFP4DynamicActivationNVFP4WeightConfig) runs the real FP4 GEMM, so needs
sm_100+; NVFP4 weights alone (NVFP4WeightOnlyConfig) are dequantized for a plain matmul and serve anywhere.
Two choices differ from Axolotl's code, which fails or drifts there: nvfp4 uses torchao's own mapping of
NVFP4DynamicActivationNVFP4WeightConfig (Axolotl passes NVFP4WeightOnlyConfig, which torchao 0.17/0.18's
QATConfig rejects: "Unexpected base config"); weight-only int4 fake-quantizes for bf16 activations, as
torchao maps Int4WeightOnlyConfig (Axolotl's explicit config leaves torchao's float8-activation default).
Float8 scales have a floor of 1e-12, so padded (all-zero) rows do not turn into NaN (see fake_quantize_configs).
"""

from __future__ import annotations

import importlib.util
from functools import partial

from trainer import facts
from trainer.config.qat import QatConfig  # the block and its rules
from trainer.errors import ConfigError, HardwareError
from trainer.hooks import Hook


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def hardware_notes(cfg, gpu) -> list[str]:
    """qat's and fp8's floors (matrices/packages.toml); raise HardwareError where the GPU cannot run them."""
    notes = []
    if cfg.fp8:
        feat = facts.feature("torchao_float8_training")
        if gpu.cc is None:
            raise HardwareError(f"fp8: {feat['reason']} needs a CUDA GPU with sm_{feat['min_cc'].replace('.', '')}+, "
                                f"it cannot run on the CPU (source: {feat['source']}), remove fp8")
        if gpu.cc < _cc(feat["min_cc"]):
            raise HardwareError(f"fp8: {feat['reason']} needs sm_{feat['min_cc'].replace('.', '')}+ but "
                                f"{gpu.describe()} is below (source: {feat['source']}), remove fp8 (bf16 trains "
                                "the same model, more slowly than fp8 would on Hopper)")
        raise HardwareError(f"fp8: {feat['reason']} runs on {gpu.describe()}, but this trainer does not implement "
                            "float8 training (torchao's float8 linears), remove fp8 to train in bf16")
    if cfg.fp8_enable_fsdp_float8_all_gather:
        notes.append("fp8_enable_fsdp_float8_all_gather: no effect without fp8")
    if cfg.qat is None:
        return notes
    feat = facts.feature(cfg.qat.feature)
    floor = _cc(feat["min_cc"])
    what = f"qat ({cfg.qat.describe()})"
    if gpu.cc is None and not feat["cpu"]:
        raise HardwareError(f"qat: {cfg.qat.describe()} needs sm_{floor[0]}{floor[1]}+ and cannot run on the CPU "
                            f"({feat['reason']}, source: {feat['source']})")
    if gpu.cc is not None and gpu.cc < floor:
        raise HardwareError(f"qat: {cfg.qat.describe()} needs sm_{floor[0]}{floor[1]}+ but {gpu.describe()} is below "
                            f"({feat['reason']}, source: {feat['source']})")
    if cfg.qat.weight_dtype == "nvfp4":
        native = facts.feature("torchao_nvfp4_gemm")
        sm = f"sm_{native['min_cc'].replace('.', '')}+"
        if gpu.cc is not None and gpu.cc >= _cc(native["min_cc"]):
            return notes + [f"{what}: torchao's NVFP4 QAT with the real FP4 GEMM ({gpu.describe()} is {sm})"]
        where = "the CPU" if gpu.cc is None else gpu.describe()
        return notes + [f"{what}: emulated on {where}, the FP4 GEMM done in float32 (FP4 tensor cores need {sm}), "
                        "slower than on Blackwell, numerics as torchao's (trainer/model/nvfp4.py)"]
    if gpu.cc is None:
        return notes + [f"{what}: torchao fake quantization on CPU (plain torch ops)"]
    return notes + [f"{what}: torchao fake quantization (needs sm_{floor[0]}{floor[1]}+; {gpu.describe()} has it)"]


def _torchao():
    # heavy: torchao loads only when this runs
    import logging

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("qat: needs the torchao package, which is not installed (install envtool's `qat` extra: "
                          "pip install 'envtool-llm[qat]')")
    # torchao logs a warning per CUDA-only extension it cannot load on this machine; they are not used here
    logging.getLogger("torchao").setLevel(logging.ERROR)
    import torchao

    return torchao


def fake_quantize_configs(qat: QatConfig, for_embedding: bool = False):
    """(activation_config, weight_config): torchao fake-quantize configs for Axolotl's dtype pair."""
    # heavy: torch and torchao load only when this runs
    import torch

    _torchao()
    from torchao.quantization.qat.fake_quantize_config import (
        Float8FakeQuantizeConfig,
        Int4WeightFakeQuantizeConfig,
        IntxFakeQuantizeConfig,
    )

    w, a = qat.weight_dtype, None if for_embedding else qat.activation_dtype
    if w == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=qat.group_size or 32)
        return mx, mx
    if w == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig
        from torchao.quantization.qat.fake_quantize_config import _infer_fake_quantize_configs

        # torchao's own mapping; use_triton_kernel=False: no MSLK dependency (the same numerics)
        return _infer_fake_quantize_configs(NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False))
    # float8 scales get a floor of 1e-12 (torchao's own Int4WeightFakeQuantizer uses it for its float8 step): with
    # none, an all-zero row (a padded position's activations) has scale 0 and fake-quantizes to 0/0 = NaN
    float8 = partial(Float8FakeQuantizeConfig, dtype=torch.float8_e4m3fn, hp_value_lb=1e-12)
    if w == "float8_e4m3fn":
        weight = float8()
    else:  # int4 (the only other weight dtype the config admits)
        weight = Int4WeightFakeQuantizeConfig(
            group_size=qat.group_size or 128,
            activation_dtype=torch.float8_e4m3fn if a == "float8_e4m3fn" else torch.bfloat16)
    activation = {"int8": lambda: IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False),
                  "float8_e4m3fn": float8}.get(a, lambda: None)()
    return activation, weight


def prepare(model, qat: QatConfig) -> int:
    """Swap the model's linear layers (and embeddings with quantize_embedding) for torchao's fake-quantized ones.
    Returns the number of layers swapped."""
    # heavy: torch and torchao load only when this runs
    import torch

    _torchao()
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    block = {"nvfp4": 16, "mxfp4": 32}.get(qat.weight_dtype, qat.group_size if qat.weight_dtype == "int4" else None)
    if block:  # each layer's input dimension must split into whole groups/blocks
        kinds = (torch.nn.Linear, torch.nn.Embedding) if qat.quantize_embedding else (torch.nn.Linear,)
        odd = [(name, m.weight.shape[1]) for name, m in model.named_modules()
               if isinstance(m, kinds) and m.weight.shape[1] % block]
        if odd:
            raise ConfigError(f"qat: torchao cannot fake-quantize this model with {qat.describe()}: {odd[0][0]} has "
                              f"{odd[0][1]} input features, not a multiple of {block} (and {len(odd) - 1} more such "
                              "layers); pick a group_size that divides them")
    activation, weight = fake_quantize_configs(qat)
    try:
        quantize_(model, QATConfig(activation_config=activation, weight_config=weight, step="prepare"))
        if qat.quantize_embedding:
            _, embedding_weight = fake_quantize_configs(qat, for_embedding=True)
            quantize_(model, QATConfig(weight_config=embedding_weight, step="prepare"),
                      filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    except (ValueError, AssertionError) as err:  # a layer shape the format cannot tile (group/block size)
        raise ConfigError(f"qat: torchao cannot fake-quantize this model with {qat.describe()}: "
                          f"{str(err).splitlines()[0]}") from None
    from torchao.prototype.qat import MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear

    if qat.weight_dtype == "nvfp4":  # torchao's own FP4 GEMM on sm_100+, emulated in float32 elsewhere
        from trainer.model import nvfp4

        nvfp4.emulate(model)
    for module in model.modules():
        if isinstance(module, (MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear)):
            module.forward = partial(_master_precision_forward, module, module.forward)
    return sum(1 for m in model.modules() if is_fake_quantized(m))


def _master_precision_forward(module, forward, x):
    """torchao's MX/NVFP4 QAT linears quantize input and weight each from its own dtype and insist the output has
    the input's: under autocast (fp32 master weights, bf16/fp16 compute) the two differ and torchao's assertion
    fails. Run them outside autocast on the input cast to the weight's dtype: the fake-quantized values are the
    same (FP4 elements times power-of-two or e4m3 scales are exact in bf16 and fp32), the sums accumulate in fp32,
    and the output is cast back to the autocast dtype the next layer expects."""
    # heavy: torch loads only when this runs
    import torch

    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return forward(x)
    with torch.autocast(device, enabled=False):
        out = forward(x.to(module.weight.dtype))
    return out.to(torch.get_autocast_dtype(device))


def is_fake_quantized(module) -> bool:
    # heavy: torchao loads only when this runs
    from torchao.prototype.qat import MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    return isinstance(module, (FakeQuantizedLinear, FakeQuantizedEmbedding, MXFakeQuantizedLinear,
                               NVFP4FakeQuantizedLinear))


def set_fake_quant(model, enabled: bool) -> None:
    """Turn fake quantization on or off (Axolotl's toggle_fake_quant: the quantizers' `enabled` flags)."""
    # heavy: torchao loads only when this runs
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    for module in model.modules():
        if isinstance(module, (FakeQuantizedLinear, FakeQuantizedEmbedding)):
            for name in ("activation_fake_quantizer", "weight_fake_quantizer"):
                quantizer = getattr(module, name, None)
                if quantizer is not None and hasattr(quantizer, "enabled"):
                    quantizer.enabled = enabled


def fake_quant_on(qat: QatConfig, step: int) -> bool:
    """Is fake quantization on for the step that starts after `step` steps? (off before fake_quant_after_n_steps)"""
    return qat.fake_quant_after_n_steps is None or step >= qat.fake_quant_after_n_steps


def convert(model) -> None:
    """Swap fake-quantized layers back to nn.Linear / nn.Embedding with the trained weights (Axolotl's
    convert_qat_model: QATConfig(step="convert") with no base config quantizes nothing)."""
    # heavy: torchao loads only when this runs
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(step="convert"), filter_fn=lambda m, _: is_fake_quantized(m))


def apply(cfg, model, say=print) -> None:
    """qat: fake-quantize the model's layers at set-up (before sharding, as Axolotl); nothing without it."""
    if cfg.qat is not None:
        say(f"qat: {prepare(model, cfg.qat)} layers fake-quantized ({cfg.qat.describe()})")


class FakeQuantSchedule(Hook):
    """In the loop: fake quantization off until fake_quant_after_n_steps; at the end, plain layers again."""

    def __init__(self, qat: QatConfig, model, say=print):
        self.qat, self.model, self.say = qat, model, say

    def before_step(self, step: int) -> None:
        if self.qat.fake_quant_after_n_steps is not None:
            set_fake_quant(self.model, fake_quant_on(self.qat, step))

    def save_final(self, model, directory, tokenizer) -> bool:
        convert(model)  # fake-quantized layers back to nn.Linear/nn.Embedding (same weights, same names)
        self.say("qat: converted the fake-quantized layers back to plain ones; quantize the final model with the "
                 "same qat dtypes (e.g. `axolotl quantize` with this config)")
        return False


def hook(cfg, model, say=print) -> Hook | None:
    return FakeQuantSchedule(cfg.qat, model, say) if cfg.qat is not None else None
