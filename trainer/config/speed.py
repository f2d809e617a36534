"""The memory and speed options users turn on in Axolotl: activation offloading, selective checkpointing, ALST's
tiled MLP and torch.compile, with their rules (what they become on a GPU: trainer/model/memory_options.py; what they
cost or save: trainer/fit/memory.py).

Each key means what Axolotl's schema says it means (utils/schemas/config.py, training.py, validation.py of
axolotl-ai-cloud/axolotl); where a value asks for something this trainer does not implement it is refused in one
line with what to write instead. `gradient_checkpointing: offload` / `offload_disk` are Axolotl's deprecated
spellings of `gradient_checkpointing: true` with `activation_offloading: true` / `disk` (its validator rewrites
them so); read here through `offloading(cfg)`, the one place that says whether activations are offloaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Axolotl's INDUCTOR_COMPILE_OPTIONS_ALLOWLIST (utils/schemas/enums.py): torch._inductor.config flags it sets
COMPILE_OPTIONS = frozenset({
    "coordinate_descent_tuning", "coordinate_descent_check_all_directions", "shape_padding", "epilogue_fusion",
    "max_autotune_gemm", "fx_graph_cache", "assume_aligned_inputs", "comprehensive_padding",
    "decompose_mem_bound_mm", "triton.cudagraphs",
})
# tiled_mlp's slice when tiled_mlp_num_shards is unset (Axolotl's monkeypatch/tiled_mlp/patch.py)
TOKENS_PER_SHARD = 32768
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")


class SelectiveCheckpointing(BaseModel):  # Axolotl's SelectiveCheckpointingConfig (utils/schemas/training.py)
    model_config = ConfigDict(extra="forbid")
    # ops whose outputs the forward keeps instead of the backward recomputing them: "attention" (SDPA's and
    # flash-attention's forward ops) or substrings of torch op names ("aten::mm": every matmul)
    save: list[str] = Field(default_factory=lambda: ["attention"])
    save_sliding_window: bool = False  # also keep sliding-window layers' attention (default: recomputed, it is cheap)
    recompute_layer_types: list[str] | None = None  # config.layer_types recomputed (default sliding/chunked)
    # `offload` (the kept ops in CPU memory): a memory option not implemented here, named in the run's memory note
    # (its matrices/axolotl_keys.toml row)


class SpeedKeys(BaseModel):
    activation_offloading: bool | Literal["legacy", "disk", "hidden_states"] = False
    selective_checkpointing: SelectiveCheckpointing | bool | None = None
    tiled_mlp: bool | None = None
    tiled_mlp_num_shards: int | None = Field(None, ge=1)
    # tiled_mlp_use_original_mlp: inert (matrices/axolotl_keys.toml: the tiles run the model's own MLP)
    torch_compile: bool | Literal["auto"] | None = None
    torch_compile_backend: str | None = None
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = None
    torch_compile_options: dict[str, bool | int | float | str] | None = None

    def _check_speed(self) -> None:
        """Axolotl's own rules for these keys (utils/schemas/validation.py), and what is refused here."""
        if offloading(self) and not self.gradient_checkpointing:
            raise ValueError("activation_offloading needs gradient_checkpointing: true (as in Axolotl: the layers "
                             "are recomputed from their inputs, which are what goes to CPU memory)")
        sac = selective(self)
        if sac is not None:
            if not self.gradient_checkpointing:
                raise ValueError("selective_checkpointing needs gradient_checkpointing: true (it chooses what a "
                                 "checkpointed layer keeps)")
            if (self.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
                raise ValueError("selective_checkpointing needs non-reentrant checkpointing "
                                 "(gradient_checkpointing_kwargs.use_reentrant: false)")
            bad = [s for s in sac.save if s != "attention" and any(s in op for op in MATMUL_OPS)]
            if bad and self.adapter:
                raise ValueError(f"selective_checkpointing.save: {bad} match matmuls, which cannot be kept with a "
                                 "LoRA adapter (peft adds the adapter's output into the base layer's in place); use "
                                 "save: [attention] or train without an adapter (as Axolotl)")
        unknown = sorted(set(self.torch_compile_options or {}) - COMPILE_OPTIONS)
        if unknown:
            raise ValueError(f"torch_compile_options: {', '.join(unknown)} not allowed (Axolotl's allowlist: "
                             f"{', '.join(sorted(COMPILE_OPTIONS))})")


def offloading(cfg) -> str | None:
    """How activations are offloaded: None (not), or Axolotl's value (true, legacy, disk, hidden_states), the
    deprecated gradient_checkpointing: offload / offload_disk read as Axolotl's validator rewrites them."""
    value = getattr(cfg, "activation_offloading", False)
    if value:
        return "true" if value is True else str(value)
    return {"offload": "true", "offload_disk": "disk"}.get(cfg.gradient_checkpointing)


def selective(cfg) -> SelectiveCheckpointing | None:
    value = getattr(cfg, "selective_checkpointing", None)
    if not value:
        return None
    return SelectiveCheckpointing() if value is True else value


def compiling(cfg) -> bool:
    return bool(getattr(cfg, "torch_compile", None))
