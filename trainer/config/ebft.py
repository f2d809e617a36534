"""The `ebft:` block of rl: ebft (Energy-Based Fine-Tuning) and the strided mode's rules; the method and its
tensor math are trainer/objectives/ebft_strided.py. The structured mode's rules (with the trl: block) are
trainer/config/ebft_structured.py, its objective trainer/objectives/ebft_structured.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer.config import ebft_structured
from trainer.errors import ConfigError


class EbftConfig(BaseModel):
    """Axolotl's `ebft:` block, its names and defaults (utils/schemas/config.py EBFTConfig)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["structured", "strided"] = "structured"  # Axolotl's default
    feature_layers: list[float] = [0.25, 0.5, 0.75]  # fractions of depth: hidden_states[int(f * num_layers)]
    embed_method: Literal["last_token", "mean_pooling", "completion_mean", "concat"] = "last_token"
    use_whitening: bool = False
    alignment_coef: float = 1.0
    diversity_coef: float = 1.0
    ce_coef: float = 0.0
    adaptive_max_tokens: bool = True  # structured mode's vLLM max_tokens (not read in strided mode, as Axolotl)
    gt_length_multiplier: float = Field(1.5, ge=0.1)  # structured mode only, as above
    stride: int = Field(8, ge=1)
    context_length: int = Field(8, ge=1)  # the first anchor: block b starts at context_length + b * stride
    generate_max_len: int = Field(8, ge=1)
    n_samples_per_prompt: int = Field(4, ge=1)
    temperature: float = Field(0.6, ge=0.0)  # 0: greedy
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    rl_coef: float = 1.0
    advantage_estimator: Literal["rloo", "group_norm", "reinforce"] = "rloo"
    min_completion_prefix: int = Field(0, ge=0)  # structured data: anchors start this far into the completion

    def layer_indices(self, num_layers: int) -> list[int]:
        return [int(f * num_layers) for f in self.feature_layers]

    @property
    def estimator(self) -> str:
        """Axolotl falls back from RLOO to plain REINFORCE with one sample (no leave-one-out baseline)."""
        return "reinforce" if self.n_samples_per_prompt == 1 and self.advantage_estimator == "rloo" else self.advantage_estimator


def check(cfg) -> list[str]:
    """rl: ebft and the ebft block agree, and ask only for what is implemented here. Returns notes."""
    e = cfg.ebft
    if cfg.rl != "ebft":
        if e is not None:
            raise ConfigError("ebft: only with rl: ebft")
        return []
    if e is None:
        raise ConfigError("rl: ebft needs an ebft: block (Axolotl's rule), with mode: structured (prompts and a "
                          "ground_truth, GRPO-style generation) or mode: strided (documents)")
    if e.mode == "structured":
        return ebft_structured.check(cfg)
    if cfg.trl is not None and cfg.trl.model_dump(exclude_defaults=True):
        raise ConfigError("trl: not read with ebft.mode: strided (Axolotl's strided trainer samples with "
                          "ebft.temperature, ebft.top_p, ebft.n_samples_per_prompt and ebft.generate_max_len); remove the trl: block")
    if e.embed_method in ("completion_mean", "concat"):
        raise ConfigError(f"ebft.embed_method: {e.embed_method} is a structured-mode pooling; Axolotl's strided trainer "
                          "pools last_token or mean_pooling only (and silently uses last_token otherwise); choose one")
    if any(not 0.0 <= f <= 1.0 for f in e.feature_layers) or not e.feature_layers:
        raise ConfigError("ebft.feature_layers: fractions of the model's depth in [0, 1], at least one")
    for key in ("sample_packing", "deepspeed", "fsdp", "fsdp_config", "fsdp_version", "val_set_size", "load_in_8bit"):
        if getattr(cfg, key, None):
            why = {"sample_packing": "each row is one document padded to sequence_len, as Axolotl's transforms make it",
                   "val_set_size": "no evaluation loss is defined for rl: ebft here (Axolotl's examples set 0)",
                   "load_in_8bit": "the feature forward of an LLM.int8 base is not tested here"}.get(
                key, "the feature network would need the whole weights; this trainer runs rl: ebft with DDP only")
            raise ConfigError(f"{key}: not with rl: ebft ({why})")
    for i, ds in enumerate(cfg.datasets):
        if not isinstance(ds.type, str) or "." not in ds.type:
            raise ConfigError(f"datasets.{i}.type: rl: ebft reads rows through a transform named module.function "
                              f"(e.g. ebft_pretrain.transform, ebft_strided_structured.transform), got {ds.type!r}")
    if num_blocks(cfg.sequence_len, e.generate_max_len, e.context_length, e.stride) <= 0:
        raise ConfigError(f"ebft: sequence_len {cfg.sequence_len} leaves no anchor (needs at least context_length + "
                          f"generate_max_len = {e.context_length + e.generate_max_len} tokens)")
    notes = ["rl: ebft: rollouts, features and the policy forward run with sdpa and an explicit strided mask, whatever "
             "the attention setting (Axolotl: flex_attention block masks on GPUs, eager dense masks elsewhere: the "
             "same attention pattern)"]
    if e.n_samples_per_prompt == 1:
        notes.append("ebft.n_samples_per_prompt: 1 has no diversity term and no leave-one-out baseline (REINFORCE "
                     "with the raw reward, as Axolotl)")
    return notes


def num_blocks(seq_len: int, gen_len: int, anchor: int, stride: int) -> int:
    """Anchors a_b = anchor + b * stride whose ground-truth block [a_b, a_b + gen_len) lies in the document."""
    return (seq_len - gen_len - anchor) // stride + 1


class EbftKeys(BaseModel):
    ebft: EbftConfig | None = None  # Axolotl's ebft: block (rl: ebft; checked by check above)
