"""Objectives: what the one training loop trains (see base.py for the interface).

sft (the default), reward and prm (reward_model / process_reward_model), and with `rl:` the preference methods
dpo, ipo, orpo, kto and simpo, ebft (strided; structured: generating), and grpo / gdpo (generating). Everything one method needs sits
with it: its data (the class's prepare_data hook: its own builder, e.g. preference_data.py), its loss, its
evaluation and its packing capacity. The loop and the CLI reach a method only through this module.
"""

from __future__ import annotations


import importlib
from typing import TYPE_CHECKING
from trainer.config import Config
from trainer.config.diffusion import enabled as diffusion_enabled
from trainer.objectives.base import Objective

if TYPE_CHECKING:  # (collate imports torch: validate, the dry run and fit describe objectives without it)
    from trainer.batch.collate import Collator


# cfg.objective -> "module:Class" (each imported only when a config asks for it)
OBJECTIVES: dict[str, str] = {
    "diffusion": "diffusion:Diffusion",  # sft with Axolotl's DiffusionPlugin (trainer/config/diffusion.py)
    "sft": "sft:SFT",  # plain or entropy-weighted (use_eaft) token losses
    "vision": "vision:VisionSFT",  # sft with processor_type: conversations with images (trainer/config/vision.py)
    "reward": "reward:Reward",  # reward_model / process_reward_model (not rl methods, as in Axolotl)
    "prm": "prm:PRM",
    "grpo": "grpo:GRPO",  # online RL on generated completions
    "gdpo": "grpo:GRPO",
    "dpo": "dpo:DPO",
    "ipo": "dpo:DPO",
    "ebft": "ebft:EBFT",  # strided EBFT (trainer/objectives/ebft_strided.py)
    "ebft_structured": "ebft_structured:EBFTStructured",  # ebft.mode: structured, GRPO with feature-matching rewards
    "orpo": "orpo:ORPO",
    "simpo": "simpo:SimPO",
    "kto": "kto:KTO",
}


def objective_class(cfg: Config) -> type[Objective]:
    """The class that trains this config (cfg.objective, with Axolotl's diffusion plugin as its own SFT)."""
    kind = "diffusion" if cfg.objective == "sft" and diffusion_enabled(cfg) else cfg.objective
    if kind == "sft" and cfg.processor_type:
        kind = "vision"
    if kind == "ebft" and cfg.ebft is not None and cfg.ebft.mode == "structured":
        kind = "ebft_structured"
    module, name = OBJECTIVES[kind].split(":")
    return getattr(importlib.import_module(f"trainer.objectives.{module}"), name)


def describe(cfg: Config) -> str | None:
    """validate's line about what this config trains (None: plain SFT says nothing)."""
    return objective_class(cfg).describe(cfg)


def build(cfg: Config, collator: Collator, token_loss_sum) -> Objective:
    # start-up: the chunked loss (torch) imported only when this runs
    from trainer.objectives import chunked_loss

    chunked_loss.configure(cfg)  # the config's chunked_cross_entropy keys, for every objective's loss
    return objective_class(cfg).from_config(cfg, collator, token_loss_sum)


def prepare(cfg: Config, tokenizer, rank: int = 0, log=print):
    """The tokenized train/validation data this config's objective trains on (trainer.data.prepare.Prepared)."""
    return objective_class(cfg).prepare_data(cfg, tokenizer, rank, log)


def check_services(cfg: Config) -> None:
    """Before a training run loads anything slow: the services the objective needs answer (Objective.check_services)."""
    objective_class(cfg).check_services(cfg)


def capacity(cfg: Config, packing: bool) -> int | None:
    """Bin capacity for the packing sampler (None: no packing): the objective's own (pairs pack both sequences)."""
    return objective_class(cfg).capacity(cfg, packing)
