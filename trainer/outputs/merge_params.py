"""merge-lora for LoRA on bare parameters (lora_target_parameters; peft's ParamWrapper), such as the fused 3-D MoE
expert tensors transformers 5 builds (Mixtral's and Qwen3-MoE's `experts.gate_up_proj` [experts, 2 x width,
hidden], `experts.down_proj`).

Which saved factors belong to which parameter is peft's own answer: the adapter's LoraConfig applied to the base
model built on the meta device (no weights read), each ParamWrapper naming its parameter, its expert count and its
layout (peft nests one wrapper per parameter on a module, so `experts.lora_A` and `experts.base_layer.lora_A` are
two parameters). The update is peft's ParamWrapper.get_delta_weight: A (experts x r, in) and B (out, r x experts)
reshaped per expert, delta[e] = scaling * B_e @ A_e, in (experts, out, in) or (experts, in, out) as the parameter
is laid out. Checkpoints keep the experts unfused (transformers converts them while loading: experts.0.w1 ...), so
each fused update goes back to the checkpoint's tensors by transformers' own reverse conversion (the one
save_pretrained applies), tried first on meta tensors for the names, then computed one fused tensor at a time,
while the shards stream past.
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import ConfigError

PREFIX = "base_model.model."


def wrappers(final: Path, base: Path, trust_remote_code: bool) -> dict:
    """{module name of each ParamWrapper, as the adapter's keys spell it: (parameter it adapts, its shape, experts,
    in/out swapped)} for the adapter in `final` on the base built on the meta device."""
    # heavy: peft loads only when this runs
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig.from_pretrained(str(final))
    lora.inference_mode = True
    model = get_peft_model(meta_model(base, trust_remote_code), lora, low_cpu_mem_usage=True)
    found = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            owner = name[len(PREFIX):] if name.startswith(PREFIX) else name
            while ".base_layer" in owner:
                owner = owner.replace(".base_layer", "", 1)
            param = getattr(module.get_base_layer(), module.parameter_name)
            found[name[len(PREFIX):] if name.startswith(PREFIX) else name] = (
                f"{owner}.{module.parameter_name}", tuple(param.shape), module.num_experts,
                bool(module._did_swap_in_out_features))
    return found


def meta_model(base: Path, trust_remote_code: bool):
    # heavy: torch and transformers load only when this runs
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def fused_delta(part, experts: int, swapped: bool):
    """peft's ParamWrapper.get_delta_weight in fp32."""
    # heavy: torch loads only when this runs
    import torch

    A, B = part.A.float(), part.B.float()
    if experts == 1:
        return B @ A * part.scaling
    A = A.reshape(experts, -1, A.shape[-1])  # experts x rank x in
    B = B.reshape(B.shape[0], -1, experts)  # out x rank x experts
    return torch.einsum("o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", B, A) * part.scaling


class Fused:
    """One adapted parameter's update, split into the checkpoint's tensors when the first of them is asked for and
    dropped when the last is taken: one fused update in memory at a time."""

    def __init__(self, name: str, part, experts: int, swapped: bool, model, names: list[str]):
        self.name, self.part, self.experts, self.swapped, self.model = name, part, experts, swapped, model
        self.names, self.pieces = names, None

    def take(self, checkpoint_name: str):
        # heavy: transformers loads only when this runs
        from transformers.core_model_loading import revert_weight_conversion

        if self.pieces is None:
            delta = fused_delta(self.part, self.experts, self.swapped)
            self.pieces = ({self.name: delta} if self.names == [self.name]
                           else revert_weight_conversion(self.model, {self.name: delta}))
        piece = self.pieces.pop(checkpoint_name)
        if not self.pieces:
            self.pieces = {}
        return piece


def checkpoint_names(model, name: str, shape: tuple, weight_map: dict) -> list[str]:
    """The checkpoint tensors a loaded parameter comes from: itself, or what transformers' reverse conversion makes
    of it (on a meta tensor: names only)."""
    # heavy: torch and transformers load only when this runs
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    if name in weight_map:
        return [name]
    names = sorted(revert_weight_conversion(model, {name: torch.empty(shape, device="meta")}))
    missing = [n for n in names if n not in weight_map]
    if missing or not names:
        raise ConfigError(f"merge-lora: the adapter changes {name}, which the base checkpoint holds neither as such "
                          f"nor as {missing[0] if missing else 'anything transformers converts to it'}")
    return names


def add_param_deltas(adapter, found: dict, base: Path, weight_map: dict, trust_remote_code: bool, delta_type) -> None:
    """Replace each ParamWrapper's factors in adapter.deltas (keyed by the wrapper's module) by one Delta per
    checkpoint tensor it changes (delta_type(module, kind="dense", dense=...))."""
    model = meta_model(base, trust_remote_code)
    for module, (name, shape, experts, swapped) in found.items():
        part = adapter.deltas.pop(f"{module}.weight", None)
        if part is None:
            raise ConfigError(f"merge-lora: the adapter has no LoRA factors for {name}, which its config targets")
        names = checkpoint_names(model, name, shape, weight_map)
        fused = Fused(name, part, experts, swapped, model, names)
        for checkpoint_name in names:
            adapter.deltas[checkpoint_name] = delta_type(checkpoint_name, kind="dense",
                                                         dense=lambda n=checkpoint_name, f=fused: f.take(n))
