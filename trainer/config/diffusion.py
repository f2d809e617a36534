"""Diffusion LM training (Axolotl's `plugins: [axolotl.integrations.diffusion.DiffusionPlugin]` + `diffusion:`).

The LLaDA recipe as Axolotl's DiffusionTrainer implements it (src/axolotl/integrations/diffusion/trainer.py and
utils.py at 067b021c8b87): for each sequence draw t ~ U(0, 1), set p = (1 - eps) t + eps, replace each answer
token (label != -100; never BOS/EOS/pad) by the mask token with probability p, run the model with
bidirectional attention on the noisy ids, read each token's prediction from the previous position's logits
(`shift_logits_to_input_positions`), and train cross-entropy on the masked tokens only, divided by p
(`importance_weighting`); a sequence's loss is that sum over its answer-token count, and the batch's loss
is the mean over sequences.

Here the noise of a sequence is drawn from its own generator seeded by (seed, optimizer step, dataset
index), so a resumed run re-draws exactly the same masks, and micro-batch size, accumulation, packing and
the number of processes do not change what is trained (the loss is the mean over the step's sequences).
Evaluation uses step -1: the same masks at every evaluation.

noise_schedule, min_mask_ratio, max_mask_ratio and num_diffusion_steps are read by Axolotl's inference CLI
only (its trainer samples t uniformly), so training does not use them either; they are validated as
Axolotl does. generate_samples (with the generation_* keys) regenerates the answers of a few validation
examples every generation_interval steps with Axolotl's reverse process (generation.py: confidence-ordered
unmasking) and writes them to output_dir/samples.jsonl; it draws from its own generator, so training is the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from trainer.errors import ConfigError

PLUGIN = "axolotl.integrations.diffusion.DiffusionPlugin"
PLUGINS = (PLUGIN, "axolotl.integrations.diffusion.plugin.DiffusionPlugin")


class DiffusionConfig(BaseModel):
    """Axolotl's DiffusionConfig (src/axolotl/integrations/diffusion/args.py): the same keys, ranges and defaults."""

    model_config = ConfigDict(extra="forbid")

    noise_schedule: Literal["linear", "cosine"] = "linear"
    min_mask_ratio: float = Field(0.1, ge=0.0, le=1.0)
    max_mask_ratio: float = Field(0.9, ge=0.0, le=1.0)
    num_diffusion_steps: int = Field(128, ge=1)
    eps: float = Field(1e-3, ge=0.0, le=1.0)
    importance_weighting: bool = True
    mask_token_id: int | None = None
    mask_token_str: str | None = None
    generate_samples: bool = True
    generation_interval: int = Field(100, ge=1)
    num_generation_samples: int = Field(3, ge=1)
    generation_steps: int = Field(128, ge=1)
    generation_temperature: float = Field(0.0, ge=0.0)
    generation_max_length: int = Field(100, ge=1)
    _special_ids: list[int] = PrivateAttr(default_factory=list)  # never masked: set when the tokenizer loads

    @property
    def special_ids(self) -> list[int]:
        return self._special_ids

    @model_validator(mode="after")
    def _ratios(self) -> DiffusionConfig:
        if self.min_mask_ratio > self.max_mask_ratio:
            raise ValueError("min_mask_ratio must be <= max_mask_ratio")
        return self


def enabled(cfg) -> bool:
    return any(p in PLUGINS for p in cfg.plugins or [])


def check(cfg) -> list[str]:
    """Config-level rules; returns notes. `diffusion:` needs the plugin (Axolotl reads it only then)."""
    if cfg.diffusion is not None and not enabled(cfg):
        raise ConfigError(f"diffusion: needs plugins: [{PLUGIN}]")
    if not enabled(cfg):
        return []
    if cfg.objective != "sft":
        raise ConfigError("plugins: the diffusion plugin trains SFT data, not rl: preference pairs or reward models")
    if cfg.use_eaft:
        raise ConfigError("use_eaft: not with the diffusion plugin (each replaces the loss)")
    if cfg.tokenizer_use_mistral_common:
        raise ConfigError("tokenizer_use_mistral_common: not with the diffusion plugin (its mask token is added to a "
                          "transformers tokenizer)")
    if (cfg.requested_attention or "").startswith("flash_attention_"):  # FA2, FA3, FA4: causal kernels
        raise ConfigError("diffusion: needs a bidirectional attention mask, which flash-attention does not take; "
                          "set attn_implementation: sdpa (as Axolotl's diffusion examples do) or eager")
    if cfg.diffusion is None:  # the plugin alone: Axolotl's defaults
        cfg.diffusion = DiffusionConfig()
    d = cfg.diffusion
    notes = ["diffusion: noise_schedule, min_mask_ratio, max_mask_ratio and num_diffusion_steps are read by "
             "Axolotl's inference only (its trainer draws the mask ratio uniformly, as here)"]
    if d.generate_samples:
        notes.append(f"diffusion.generate_samples: every {d.generation_interval} steps, samples go to "
                     "output_dir/samples.jsonl (not with FSDP, ZeRO-3 or tensor parallelism)")
    return notes


class DiffusionKeys(BaseModel):
    diffusion: DiffusionConfig | None = None  # with plugins: [axolotl.integrations.diffusion.DiffusionPlugin]
