"""NVFP4 QAT on hardware without FP4 tensor cores (CPU, A100, H100, ...): torchao's NVFP4 fake-quantized linear
with its FP4 GEMM emulated in float32.

torchao 0.18's NVFP4FakeQuantizedLinear (torchao/prototype/qat/nvfp4.py) quantizes the activations and the
weights with NVFP4Tensor.to_nvfp4 and multiplies them with a real FP4 GEMM (_addmm_nvfp4_dispatch ->
torch._scaled_mm on float4_e2m1fn_x2 with e4m3 block scales), which only sm_100+ runs. The subclass here keeps
torchao's path where the GPU has FP4 tensor cores (the floor is matrices/packages.toml [[feature]]
torchao_nvfp4_gemm) and elsewhere replaces only that GEMM, following _addmm_nvfp4_dispatch step by step:

  1. activations and weights quantized by torchao's own NVFP4Tensor.to_nvfp4, with the same per-tensor scales
     (per_tensor_amax_to_scale) and e4m3 block scales as torchao's forward (use_triton_kernel=False);
  2. each operand's FP4 values times its e4m3 block scales, by torchao's NVFP4Tensor.dequantize in float32 --
     exact (an FP4 value has 2 significant bits, an e4m3 scale 4: the product fits float32, bf16 and TF32);
  3. F.linear of the two in float32: each product is exact and the sums accumulate in float32, as _scaled_mm
     does with use_fast_accum=False (on a GPU that allows TF32 the operands are exact in TF32 too);
  4. cast to the input's dtype, times the product of the two per-tensor scales (cast to that dtype), plus the
     bias, in the order the dispatch applies them.

pytorch/ao issue #3102 found that "dequantize to bf16 + F.linear" does not match the FP4 GEMM: rounding the
dequantized operands (per-tensor scale included) and the products to bf16 loses what the FP4 GEMM keeps. Here
nothing is rounded before the float32 sums; tests/trainer/model/test_nvfp4.py checks the result against the exact
float64 value of the FP4 GEMM. The backward pass is torchao's (straight-through: gradients from the dequantized
operands, in the input's dtype), and it also gives the bias its gradient, which torchao 0.18's backward drops
(returns None: on sm_100+, where torchao's own path runs unchanged, linear biases such as Qwen2's q/k/v stay
as loaded).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.prototype.qat.nvfp4 import (
    NVFP4FakeQuantizeConfig,
    NVFP4FakeQuantizedLinear,
    _NVFP4QuantizedForwardFakeQuantizedBackward,
)

from trainer import facts

NATIVE_FEATURE = "torchao_nvfp4_gemm"  # packages.toml: where torch._scaled_mm runs the FP4 GEMM


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def native_floor() -> tuple[int, int]:
    return _cc(facts.feature(NATIVE_FEATURE)["min_cc"])


@lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def runs_natively(device: torch.device) -> bool:
    """Does this device run torchao's real FP4 GEMM (FP4 tensor cores)?"""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= native_floor()


def quantize(data: torch.Tensor, config: NVFP4FakeQuantizeConfig) -> NVFP4Tensor:
    """torchao's NVFP4 quantization of an operand, as NVFP4FakeQuantizedLinear's forward does it (the per-tensor
    scale from the tensor's amax, the block layout of the config), without triton kernels."""
    per_tensor_scale = per_tensor_amax_to_scale(torch.max(torch.abs(data))) if config.use_per_tensor_scale else None
    return NVFP4Tensor.to_nvfp4(data, per_tensor_scale=per_tensor_scale,
                                is_swizzled_scales=config.use_swizzled_scales, use_triton_kernel=False)


def block_scaled(t: NVFP4Tensor) -> torch.Tensor:
    """The operand _scaled_mm multiplies: FP4 values times e4m3 block scales (no per-tensor scale), in float32,
    by torchao's own dequantize (exact in float32)."""
    return NVFP4Tensor(t.qdata, t.scale, t.block_size, t.orig_dtype, None, None, t.is_swizzled_scales, False,
                       None).dequantize(torch.float32)


def emulated_addmm(a: NVFP4Tensor, w: NVFP4Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a @ w.T (+ bias) as torchao's _addmm_nvfp4_dispatch computes it, with the FP4 GEMM done in float32."""
    out_dtype = a.orig_dtype
    with torch.autocast(a.qdata.device.type, enabled=False):  # float32 whatever autocast region it is called in
        result = torch.nn.functional.linear(block_scaled(a), block_scaled(w)).to(out_dtype)
    scales = [s for s in (a.per_tensor_scale, w.per_tensor_scale) if s is not None]
    if scales:
        result = result * (scales[0] * scales[1] if len(scales) == 2 else scales[0]).to(out_dtype)
    if bias is not None:
        result = result + bias.to(out_dtype)
    return result


class _EmulatedForwardFakeQuantizedBackward(_NVFP4QuantizedForwardFakeQuantizedBackward):
    """torchao's autograd function with the FP4 GEMM emulated. Backward is torchao's, plus the bias gradient
    torchao 0.18's returns None for (the bias is not quantized: its gradient is the sum of the output's)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, _input, weight, bias, activation_config, weight_config):
        a, w = quantize(_input, activation_config), quantize(weight, weight_config)
        ctx.save_for_backward(a, w)
        return emulated_addmm(a, w, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        grad_input, grad_weight, *_ = _NVFP4QuantizedForwardFakeQuantizedBackward.backward(ctx, grad_output)
        grad_bias = grad_output.sum(0) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None


class EmulatedNVFP4FakeQuantizedLinear(NVFP4FakeQuantizedLinear):
    """torchao's NVFP4FakeQuantizedLinear: its own forward on FP4 tensor cores, the emulated FP4 GEMM elsewhere.
    QATConfig(step="convert") turns it back into nn.Linear as it does torchao's class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_natively(x.device):
            return super().forward(x)
        shape = x.shape
        out = _EmulatedForwardFakeQuantizedBackward.apply(x.reshape(-1, shape[-1]).contiguous(), self.weight,
                                                          self.bias, self.activation_config, self.weight_config)
        assert out.dtype == x.dtype
        return out.view(*shape[:-1], out.shape[-1])


def emulate(model: torch.nn.Module) -> int:
    """Turn torchao's NVFP4 fake-quantized linears into the emulating subclass (same parameters and configs).
    Returns how many."""
    swapped = 0
    for module in model.modules():
        if type(module) is NVFP4FakeQuantizedLinear:
            module.__class__ = EmulatedNVFP4FakeQuantizedLinear
            swapped += 1
    return swapped
