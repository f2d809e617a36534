"""Mixture-of-experts weights as transformers 5 stores them: fused 3-D nn.Parameters (Mixtral's and Qwen3-MoE's
`experts.gate_up_proj` [experts, 2 x width, hidden] and `experts.down_proj`), not nn.Linear layers.

Two consequences for k-bit training, handled here:

1. bitsandbytes quantizes nn.Linear layers only, so its load leaves the experts in the load dtype, and peft's
   prepare_model_for_kbit_training then casts every 16-bit parameter that is not bitsandbytes' to fp32: a
   Mixtral-8x7B QLoRA would hold its 45B expert parameters in fp32 (~170 GB). Frozen experts are hidden from that
   cast (`kept_from_upcast`) and keep the dtype they loaded in, as Axolotl leaves them.
2. With Axolotl's `quantize_moe_experts`, each expert tensor is quantized the moment transformers sets it on its
   module (`quantized_on_load`), and its full-precision copy dropped, so the load never holds all the experts in
   16 bits: NF4/FP4 through bitsandbytes' own parametrization of a bare parameter (bitsandbytes.nn.parametrize,
   made for MoE experts), int8 with one absmax per row through bitsandbytes' LLM.int8 row-wise functions. The
   model's own expert forward runs unchanged: reading `experts.gate_up_proj` dequantizes it (once per forward,
   parametrize's cache), so the forward equals dequantize-then-matmul. bitsandbytes >= 0.48 runs both on CPU.

Expert parallelism (expert_parallel_size) is transformers' own (trainer/parallel/mesh.py): `check_expert_parallel`
stops a model it cannot split before the load, and `sharded_experts` counts what the load split.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.utils.parametrize as P

from trainer.errors import ConfigError


def is_expert(name: str, param) -> bool:
    """A fused expert tensor: 3-D or more and named for experts (Axolotl's test; a vision tower's 4-D convolution
    weight is not an expert)."""
    return param is not None and param.ndim >= 3 and "expert" in name.lower()


def float_experts(model):
    """(module, parameter name, qualified name) of each expert tensor still held as floats."""
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            full = f"{module_name}.{name}" if module_name else name
            if is_expert(full, param) and param.is_floating_point():
                yield module, name, full


@contextmanager
def kept_from_upcast(model):
    """Hide the frozen expert tensors from peft's prepare_model_for_kbit_training (which casts every fp16/bf16
    parameter that is not bitsandbytes' to fp32) and freeze them, as it freezes the rest; they come back in their
    own dtype and in their place in the module's parameter order. Yields how many were kept."""
    orders, hidden = {}, []
    for module, name, _ in list(float_experts(model)):
        orders.setdefault(id(module), (module, list(module._parameters)))
        param = module._parameters.pop(name)
        param.requires_grad_(False)
        hidden.append((module, name, param))
    try:
        yield len(hidden)
    finally:
        for module, name, param in hidden:
            module._parameters[name] = param
        for module, order in orders.values():
            kept = dict(module._parameters)
            module._parameters.clear()
            module._parameters.update({k: kept[k] for k in order if k in kept})
            module._parameters.update(kept)


class Int8Rows(torch.nn.Module):
    """Dequantize an int8 tensor with one absmax per row (bitsandbytes' LLM.int8 row-wise format) on access."""

    def __init__(self, row_stats: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("row_stats", row_stats)
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        # heavy: bitsandbytes loads only when this runs
        import bitsandbytes.functional as F

        rows = F.int8_vectorwise_dequant(q.reshape(-1, q.shape[-1]), self.row_stats)
        return rows.reshape(q.shape).to(self.dtype)


def _cache_during_forward(module) -> None:
    """Dequantize each expert tensor once per forward of its module (parametrize's cache), not once per read:
    the expert loop reads it once per expert hit. Cleared after the forward, also when a non-reentrant
    checkpoint's recompute stops the forward early (always_call)."""
    if getattr(module, "_int8_cache_hooks", False):
        return

    def enter(mod, args):
        mod._int8_cache = P.cached()
        mod._int8_cache.__enter__()

    def leave(mod, args, output):
        cache = mod.__dict__.pop("_int8_cache", None)
        if cache is not None:
            cache.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    module._int8_cache_hooks = True


def quantize(module, name: str, how: dict) -> None:
    """Replace module.<name> (a float expert tensor) by its quantized storage and a dequantizing parametrization."""
    # heavy: bitsandbytes loads only when this runs
    import bitsandbytes.functional as F
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from trainer.model.expert_lora import remember_order

    remember_order(module)  # expert LoRA nests peft's wrappers in this order (trainer/model/expert_lora.py)
    param = module._parameters[name]
    if how["bits"] == 4:
        replace_parameter_4bit(module, name, compress_statistics=how["double_quant"], quant_type=how["quant_type"],
                               blocksize=how.get("blocksize"))
        return
    dtype, last = param.dtype, param.shape[-1]
    q = torch.empty(param.shape, dtype=torch.int8, device=param.device)
    stats = []
    for i, matrix in enumerate(param.data):  # an expert at a time: its fp32 copy is the only transient
        rows, scale, _ = F.int8_vectorwise_quant(matrix.reshape(-1, last).float())  # fp32 in: exact absmax/127
        q[i] = rows.reshape(matrix.shape)
        stats.append(scale)
    setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
    del param
    stats = torch.cat(stats)
    P.register_parametrization(module, name, Int8Rows(stats, dtype), unsafe=True)
    _cache_during_forward(module)


def scheme(bnb_config) -> dict:
    """The experts' format from the BitsAndBytesConfig the linear layers load with (bits, quant type, double
    quantization), so experts and linear layers share one quantization."""
    if bnb_config.load_in_4bit:
        return {"bits": 4, "quant_type": bnb_config.bnb_4bit_quant_type,
                "double_quant": bool(bnb_config.bnb_4bit_use_double_quant)}
    return {"bits": 8}


def quantize_remaining(model, how: dict) -> int:
    """Quantize every expert tensor still held as floats (a model built from its config, or one set outside the
    loader's per-tensor path). Returns how many."""
    found = list(float_experts(model))
    for module, name, _ in found:
        quantize(module, name, how)
    return len(found)


@contextmanager
def quantized_on_load(how: dict | None):
    """While transformers loads a checkpoint: quantize each expert tensor as it is set on its module and free the
    16-bit tensor at once. transformers 5 sets every loaded tensor through core_model_loading.set_param_for_module
    (the one call wrapped here, restored afterwards); its caching-allocator warm-up, which reserves the whole
    model's 16-bit size on the GPU up front, is skipped for the same reason. Yields a list that receives the
    quantized names."""
    done: list[str] = []
    if how is None:
        yield done
        return
    # heavy: transformers loads only when this runs
    import transformers.core_model_loading as loading
    import transformers.modeling_utils as modeling

    original = getattr(loading, "set_param_for_module", None)
    if original is None:
        raise ConfigError("quantize_moe_experts: this transformers has no core_model_loading.set_param_for_module "
                          "to quantize experts as they load (transformers 5 has); upgrade transformers")

    def set_and_quantize(model, target_name, param_value, *args, **kwargs):
        original(model, target_name, param_value, *args, **kwargs)
        path, _, name = target_name.rpartition(".")
        module = model.get_submodule(path) if path else model
        param = module._parameters.get(name)
        if is_expert(target_name, param) and param.is_floating_point():
            quantize(module, name, how)
            done.append(target_name)
            param_value.data = torch.empty(0, dtype=param_value.dtype, device=param_value.device)

    warmup = getattr(modeling, "caching_allocator_warmup", None)
    loading.set_param_for_module = set_and_quantize
    if warmup is not None:
        modeling.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield done
    finally:
        loading.set_param_for_module = original
        if warmup is not None:
            modeling.caching_allocator_warmup = warmup


def check_expert_parallel(source: str, ep: int, trust_remote_code: bool, extra: dict) -> None:
    """expert_parallel_size: the model must be a mixture of experts whose expert count ep divides, with an expert
    plan in transformers (`base_model_ep_plan`: Mixtral, Qwen3-MoE, DeepSeek, ...). Raises ConfigError naming the
    key and value; reads config.json only."""
    # heavy: transformers loads only when this runs
    from transformers import AutoConfig

    from trainer.config.parallel import expert_count_reason

    config = extra.get("config")  # base_model_config / cls_model_config: the config the model loads with
    if config is None:
        kwargs = {k: v for k, v in extra.items() if k == "revision"}
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot read the model's config from {source}: {str(err).splitlines()[0]}") from None
    reason = expert_count_reason(config, ep)
    if reason is not None:
        raise ConfigError(reason)
    plans = [getattr(c, "base_model_ep_plan", None) for c in (config, getattr(config, "text_config", None))]
    if not any(plans):
        raise ConfigError(f"expert_parallel_size: {ep}: transformers has no expert-parallel plan for model_type "
                          f"{config.model_type} (its config class declares no base_model_ep_plan); use "
                          "expert_parallel_size: 1")


def sharded_experts(model) -> tuple[int, int]:
    """(MoE expert modules whose experts the load split over the expert-parallel ranks, all MoE expert modules):
    transformers marks each split one `_is_expert_parallel`."""
    found = [m for name, m in model.named_modules()
             if any(is_expert(f"{name}.{n}", p) for n, p in m._parameters.items())]
    return sum(bool(getattr(m, "_is_expert_parallel", False)) for m in found), len(found)


def as_loaded(model, weights: dict) -> dict:
    """A checkpoint's tensors under the model's own names: transformers saves MoE experts in the checkpoint's original
    layout (experts.0.gate_proj.weight ..., reverted by save_pretrained) and fuses them only while from_pretrained
    loads (experts.gate_up_proj); a resume that sets the weights itself applies the same conversions, transformers'
    own (the model's `_weight_conversions`, or its type's default mapping). Weights already named as the model's
    come back unchanged."""
    own = set(model.state_dict())
    if all(k in own for k in weights):
        return weights
    # heavy: transformers loads only when this runs
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                 rename_source_key)

    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict = {}
    for key, tensor in sorted(weights.items(), key=lambda kv: dot_natural_key(kv[0])):
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            pending.setdefault(name, WeightRenaming(key, name)).add_tensor(name, key, key, tensor)
        else:
            pending.setdefault(name, deepcopy(by_pattern[pattern])).add_tensor(name, key, pattern, tensor)
    out = {}
    for name, transform in pending.items():
        for target, value in transform.convert(name, model=model, config=model.config).items():
            out[target] = value[0] if isinstance(value, list) else value
    return out
