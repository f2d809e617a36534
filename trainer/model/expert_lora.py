"""LoRA on quantized MoE experts: `lora_target_parameters` naming expert tensors that `quantize_moe_experts` holds as
bitsandbytes NF4/FP4 or int8 (trainer/model/experts.py), as Axolotl trains Gemma 4, GLM-4.5-Air and GLM-4.7-Flash.

peft's ParamWrapper adds the adapter to a bare parameter by registering a parametrization on it for the duration of
the wrapped module's forward. On a tensor that is already parametrized (the experts' dequantization) peft 0.22 goes
wrong three ways, each seen on a tiny Mixtral:

1. Its injection matches a parametrized tensor by full module name only and nests the wrappers in the sorted order of
   those names, while on an unquantized model it nests them in the module's definition order: the saved adapter's keys
   (`experts.lora_A` vs `experts.base_layer.lora_A`) would then not load onto an unquantized base (merge-lora, vLLM).
   `plain_for_peft` lets peft see the module as it is unquantized during injection: each quantized tensor stands in
   as a zero-byte parameter of its shape and dtype in definition order, the quantization put back afterwards.
2. Its forward reads the tensor's current value while registering the LoRA parametrization (for its dtype, and in
   torch's own check of a new parametrization), inside the outer wrapper's `parametrize.cached()`: the cache keeps the
   dequantized tensor without the adapter and the experts' forward reads that, so the inner adapter trains nothing
   (its gradient is None). The stale entry is dropped once the adapter is registered; `ParamWrapper.get_param`
   answers for a quantized tensor with a zero-byte stand-in of its dequantized dtype and shape (one dequantization
   fewer per forward).
3. Its clean-up after the forward removes only `_LoraParameterProxy` when the tensor has other parametrizations, but
   the single-adapter forward registers `_LoraFactorsProxy`: the adapter's delta stays on the tensor and is added
   again at every forward. The clean-up removes the proxy it registered, whichever class.

Fixes 2 and 3 change peft's behaviour only for a tensor parametrized by something other than LoRA itself; an
unquantized model trains exactly as peft trains it. A deviation from "use the library as is", kept as small as the
bugs: Axolotl patches the same peft internals (src/axolotl/monkeypatch/moe_quant.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.utils.parametrize as P

ORDER = "_expert_param_order"  # set by experts.quantize: the module's parameter names before quantization


def remember_order(module) -> None:
    """Record the module's parameter names in definition order, before the first of them is quantized."""
    if not hasattr(module, ORDER):
        object.__setattr__(module, ORDER, list(module._parameters))


def _dequantized(module, name: str):
    """(dtype, shape) the quantized tensor `name` reads as, without dequantizing it; None if not known."""
    chain = module.parametrizations[name]
    original = chain.original
    first = chain[0]
    state = getattr(first, "quant_state", None)  # bitsandbytes' Bnb4bitParametrization
    if state is not None:
        return state.dtype, tuple(state.shape)
    if hasattr(first, "row_stats"):  # experts.Int8Rows
        return first.dtype, tuple(original.shape)
    return None


def _quantized(module, name: str) -> bool:
    return P.is_parametrized(module, name) and _dequantized(module, name) is not None


@contextmanager
def plain_for_peft(model):
    """While peft injects or loads adapters: each module with quantized experts looks as it does unquantized (its own
    class, a zero-byte parameter of the dequantized shape and dtype for each quantized tensor, in definition order), so
    peft matches and nests its wrappers exactly as on the unquantized model. The quantization is put back after."""
    hidden = []
    for module in list(model.modules()):
        if not hasattr(module, ORDER) or not P.is_parametrized(module):
            continue
        chains = module._modules["parametrizations"]
        names = [n for n in chains if _quantized(module, n)]
        if not names:
            continue
        cls = module.__class__
        others = dict(module._parameters)
        stand_ins = {}
        for name in names:
            dtype, shape = _dequantized(module, name)
            device = chains[name].original.device
            stand_ins[name] = torch.nn.Parameter(torch.empty((), dtype=dtype, device=device).expand(shape),
                                                 requires_grad=False)
        module._modules.pop("parametrizations")
        module.__class__ = cls.__bases__[0]  # parametrize's generated subclass -> the model's own class
        module._parameters.clear()
        for name in getattr(module, ORDER):
            if name in stand_ins:
                module._parameters[name] = stand_ins[name]
            elif name in others:
                module._parameters[name] = others[name]
        module._parameters.update({k: v for k, v in others.items() if k not in module._parameters})
        hidden.append((module, cls, chains, others))
    try:
        yield
    finally:
        for module, cls, chains, others in hidden:
            module._parameters.clear()
            module._parameters.update(others)
            module._modules["parametrizations"] = chains
            module.__class__ = cls


def patch_peft() -> None:
    """Fixes 2 and 3 of the module's docstring on peft's ParamWrapper (idempotent)."""
    # heavy: peft loads only when this runs
    from peft.tuners.lora import layer

    wrapper = layer.ParamWrapper
    if getattr(wrapper, "_envtool_quantized_experts", False):
        return
    get_param, remove, activate = wrapper.get_param, wrapper._remove_parametrizations, wrapper._activate_lora
    factors = getattr(layer, "_LoraFactorsProxy", None)
    proxies = tuple(c for c in (layer._LoraParameterProxy, factors) if c is not None)

    def quantized_get_param(self):
        base = self.get_base_layer()
        name = self.parameter_name
        if not _quantized(base, name):
            return get_param(self)
        dtype, shape = _dequantized(base, name)
        chain = base.parametrizations[name]
        if len(chain) > 1 and isinstance(chain[-1], proxies):  # LoRA's own proxy on top: peft's usual read
            return get_param(self)
        return torch.empty((), dtype=dtype, device=chain.original.device).expand(shape)

    def remove_own_proxy(self):
        base = self.get_base_layer()
        chain = base.parametrizations[self.parameter_name] if P.is_parametrized(base, self.parameter_name) else ()
        if len(chain) > 1 and isinstance(chain[-1], proxies) and _dequantized(base, self.parameter_name):
            del chain[len(chain) - 1]
            return
        remove(self)

    @contextmanager
    def activate_fresh(self, active_adapters):
        with activate(self, active_adapters):
            base = self.get_base_layer()
            if _quantized(base, self.parameter_name):  # the value cached without the adapter (fix 2)
                P._cache.pop((id(base), self.parameter_name), None)
            yield

    wrapper.get_param = quantized_get_param
    wrapper._activate_lora = activate_fresh
    wrapper._remove_parametrizations = remove_own_proxy
    wrapper._envtool_quantized_experts = True


def has_quantized_experts(model) -> bool:
    return any(hasattr(m, ORDER) and P.is_parametrized(m) for m in model.modules())


@contextmanager
def for_peft(model):
    """Around get_peft_model / PeftModel.from_pretrained on a model whose experts are quantized: peft patched (fixes 2
    and 3) and the modules shown plain (fix 1). A model without quantized experts passes through untouched."""
    if not has_quantized_experts(model):
        yield
        return
    patch_peft()
    with plain_for_peft(model):
        yield
