"""Precision, attention and kernel keys, and their rules. What they become on a given GPU is decided by
trainer/runtime/hardware.py (precision, attention) and trainer/model/kernels.py (liger, where triton runs)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from trainer import facts
from trainer.errors import ConfigError

# The attention backends a config may name: matrices/attention.toml's rows (one copy of the fact; the resolver
# and trainer/runtime/hardware.py read the same table), e.g. flash_attention_2, sdpa, flex_attention, Hub kernel ids.
Attention = Literal[tuple(row["name"] for row in facts.rows("attention", "backend"))]

# Axolotl's legacy attention flags -> the attn_implementation each means
LEGACY_ATTENTION = {
    "flash_attention": "flash_attention_2",
    "sdp_attention": "sdpa",
    "xformers_attention": "xformers",
    "eager_attention": "eager",
    "flex_attention": "flex_attention",
}

# The flag that asks for FlashAttention as such, not for one implementation of it (Axolotl's only such spelling:
# its newer attn_implementation takes exact backend names and refuses short forms like "flash"). The plan serves
# it by the fastest FlashAttention kernels that run with the newest torch (FA3, torch's varlen_attn, the flash-attn
# 2 wheel); `attn_implementation: flash_attention_2` asks for that wheel itself.
GENERIC_FLASH = "flash_attention"

LIGER = "axolotl.integrations.liger.LigerPlugin"
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"

# Plugin path -> None (accepted: its keys are handled here) or the note/refusal for it.
ACCEPTED_PLUGINS = {
    LIGER: None,
    "axolotl.integrations.liger.plugin.LigerPlugin": None,
    CCE: None,
    "axolotl.integrations.cut_cross_entropy.plugin.CutCrossEntropyPlugin": None,
    # its MoE backends are read (use_sonicmoe, use_scattermoe, expert_backend: trainer/model/expert_kernels.py)
    "axolotl.integrations.kernels.KernelsPlugin": "its own kernels are not loaded: same training, slower; its MoE "
                                                  "backend keys are read: SonicMoE runs through transformers where "
                                                  "the GPU takes it",
    # diffusion LM training: an objective (trainer/config/diffusion.py, trainer/objectives/diffusion.py)
    "axolotl.integrations.diffusion.DiffusionPlugin": None,
    "axolotl.integrations.diffusion.plugin.DiffusionPlugin": None,
    # sparse fine-tuning: ConstantPruningModifier keeps the weights' zeros (trainer/model/sparsity.py)
    "axolotl.integrations.llm_compressor.LLMCompressorPlugin": None,
    "axolotl.integrations.llm_compressor.plugin.LLMCompressorPlugin": None,
    # expert parallelism: expert_parallel_size (trainer/config/parallel.py, trainer/parallel/mesh.py)
    "axolotl.integrations.expert_parallel.ExpertParallelPlugin": None,
    "axolotl.integrations.expert_parallel.plugin.ExpertParallelPlugin": None,
    "axolotl.integrations.swanlab.SwanLabPlugin": "SwanLab logging is not supported; metrics go to "
                                                  "output_dir/metrics.jsonl",
}
REFUSED_PLUGINS = {
    "axolotl.integrations.kd.KDPlugin": "knowledge distillation is not supported",
    "axolotl.integrations.grokfast.GrokfastPlugin": "grokfast gradient filtering is not supported",
    "axolotl.integrations.spectrum.SpectrumPlugin": "spectrum layer selection is not supported",
    "axolotl.integrations.lm_eval.LMEvalPlugin": "lm-eval runs are not part of training here",
}
AXOLOTL_INTEGRATIONS = "axolotl.integrations."


def axolotl_plugin_name(path: str) -> str:
    """The plugin a `plugins:` entry loads, by Axolotl's load_plugin (axolotl/integrations/base.py): the module as
    written, and where no such module exists, the same name under axolotl.integrations. (`liger.LigerPlugin` is
    Axolotl's axolotl.integrations.liger.LigerPlugin)."""
    under = AXOLOTL_INTEGRATIONS + path
    if not path.startswith("axolotl.") and (under in ACCEPTED_PLUGINS or under in REFUSED_PLUGINS):
        return under
    return path


class HardwareKeys(BaseModel):
    # resolved against the GPU by trainer.runtime.hardware
    bf16: bool | Literal["auto"] = "auto"
    fp16: bool | None = None
    fp32_master_weights: bool = False  # full fine-tunes under bf16: fp32 weights under autocast (default: bf16 weights, as Axolotl)
    tf32: bool | Literal["auto"] = "auto"
    attn_implementation: Attention | None = None
    flash_attention: bool | None = None  # legacy flags, same meaning as attn_implementation
    sdp_attention: bool | None = None
    xformers_attention: bool | None = None
    eager_attention: bool | None = None
    flex_attention: bool | None = None  # Axolotl's deprecated flag for attn_implementation: flex_attention
    # Scalable-Softmax attention (trainer/model/ssmax.py): scores x (factor log n + bias), flex_attention only
    scaling_softmax: bool = False
    scaling_softmax_factor: float | None = None  # 0 or unset: 0.43, as Axolotl
    scaling_softmax_bias: float | None = None  # unset: 0

    # kernels and plugins (applied where the plan says triton kernels run, else switched off with a note)
    plugins: list[str] | None = None
    liger_rope: bool = False
    liger_rms_norm: bool = False
    liger_layer_norm: bool = False
    liger_glu_activation: bool = False
    liger_swiglu: bool = False
    liger_cross_entropy: bool = False
    liger_fused_linear_cross_entropy: bool = False
    liger_rms_norm_gated: bool = False
    # Liger's token scaling: each target token's loss times its predicted probability (detached), with the Liger
    # plugin and liger_fused_linear_cross_entropy, as Axolotl (trainer/objectives/chunked_loss.py)
    liger_use_token_scaling: bool = False
    cut_cross_entropy: bool = False
    # Axolotl's chunked loss: true/false take that path (the same loss and gradients either way); unset, each step's
    # path is chosen by cost (trainer/runtime/loss_chunks.py choose_path: the chunked loss where it saves time or
    # memory, the full logits where they are cheaper)
    chunked_cross_entropy: bool | None = None
    # Axolotl's: the target tokens in that many chunks; 0 = unset, as Axolotl reads it
    chunked_cross_entropy_num_chunks: int | None = Field(None, ge=0)
    lora_mlp_kernel: bool = False
    lora_qkv_kernel: bool = False
    lora_o_kernel: bool = False

    @field_validator("plugins")
    @classmethod
    def _axolotl_names(cls, plugins: list[str] | None) -> list[str] | None:
        return [axolotl_plugin_name(p) for p in plugins] if plugins is not None else None

    @property
    def token_scaling(self) -> bool:
        """liger_use_token_scaling as Axolotl reads it: with its Liger plugin listed (without it the key is not in
        Axolotl's schema) and liger_fused_linear_cross_entropy, the loss its patch scales."""
        return bool(self.liger_use_token_scaling and self.liger_fused_linear_cross_entropy
                    and LIGER in (self.plugins or []))

    @property
    def requested_attention(self) -> str | None:
        """attn_implementation, or the legacy flag that says the same."""
        for flag, name in LEGACY_ATTENTION.items():
            if getattr(self, flag):
                return name
        return self.attn_implementation

    @property
    def asks_flash_kernels(self) -> bool:
        """`flash_attention: true`: FlashAttention kernels, whichever implementation serves them best (GENERIC_FLASH)."""
        return getattr(self, GENERIC_FLASH) is True

    def _check_precision(self) -> None:
        if self.bf16 is True and self.fp16:
            raise ValueError("bf16 and fp16 are both true; choose one (or bf16: auto)")

    def _check_attention(self) -> None:
        flags = [f for f in LEGACY_ATTENTION if getattr(self, f)]
        if len(flags) > 1 or (flags and self.attn_implementation):
            raise ValueError(f"choose one attention setting, got {', '.join(flags + (['attn_implementation'] if self.attn_implementation else []))}")
        if self.liger_use_token_scaling and LIGER in (self.plugins or []) and not self.liger_fused_linear_cross_entropy:
            raise ValueError("liger_use_token_scaling: needs liger_fused_linear_cross_entropy: true (the loss it scales; "
                             "Axolotl's LigerArgs refuses it without)")
        if self.token_scaling and (self.context_parallel_size or 1) > 1:
            raise ValueError("liger_use_token_scaling: not with context_parallel_size > 1 here yet (the split "
                             "sequence's loss is computed apart)")
        if self.scaling_softmax and self.requested_attention != "flex_attention":
            raise ValueError("scaling_softmax: needs attn_implementation: flex_attention (SSMax is a score_mod of "
                             "flex_attention; Axolotl refuses it with any other attention too)")


def check_plugins(cfg) -> list[str]:
    """Raise ConfigError for unknown or refused plugins; return notes for the accepted ones."""
    notes, problems = [], []
    for path in cfg.plugins or []:
        if path in REFUSED_PLUGINS:
            problems.append(f"plugins: {path} is not supported ({REFUSED_PLUGINS[path]})")
        elif path not in ACCEPTED_PLUGINS and path.startswith(AXOLOTL_INTEGRATIONS):
            problems.append(f"plugins: {path} is not supported (an Axolotl integration this trainer does not "
                            f"implement; supported: {', '.join(sorted({p.split('.')[2] for p in ACCEPTED_PLUGINS}))})")
        elif path not in ACCEPTED_PLUGINS:
            # Axolotl imports the module and runs its hooks, which may change anything in the run
            problems.append(f"plugins: {path} is a plugin module of your own, not an Axolotl integration; running "
                            "plugin code is not supported here (its hooks could change what is trained), remove it")
        elif ACCEPTED_PLUGINS[path]:
            notes.append(f"plugins: {path} is off ({ACCEPTED_PLUGINS[path]})")
    if problems:
        raise ConfigError("; ".join(problems))
    return notes
