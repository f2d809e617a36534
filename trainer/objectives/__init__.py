"""Objectives: what the one training loop trains (see base.py for the interface).

sft (the default), reward and prm (reward_model / process_reward_model), and with `rl:` the preference methods
dpo, ipo, orpo, kto and simpo, ebft (strided), and grpo / gdpo (generating). Everything one method needs sits
with it: its data (the class's prepare_data hook: its own builder, e.g. preference_data.py), its loss, its
evaluation and its packing capacity. The loop and the CLI reach a method only through this module.
"""

from __future__ import annotations

from trainer.batch.collate import Collator
from trainer.config import Config
from trainer.config.diffusion import enabled as diffusion_enabled
from trainer.objectives.base import Objective


def objective_class(cfg: Config) -> type[Objective]:
    """The class that trains this config (cfg.objective, with Axolotl's diffusion plugin as its own SFT)."""
    kind = cfg.objective
    if kind == "sft" and diffusion_enabled(cfg):  # Axolotl's DiffusionPlugin (trainer/config/diffusion.py)
        from trainer.objectives.diffusion import Diffusion as cls
    elif kind == "sft":  # plain or entropy-weighted (use_eaft) token losses
        from trainer.objectives.sft import SFT as cls
    elif kind == "reward":  # reward_model / process_reward_model (not rl methods, as in Axolotl)
        from trainer.objectives.reward import Reward as cls
    elif kind == "prm":
        from trainer.objectives.prm import PRM as cls
    elif kind in ("grpo", "gdpo"):  # online RL on generated completions
        from trainer.objectives.grpo import GRPO as cls
    elif kind in ("dpo", "ipo"):
        from trainer.objectives.dpo import DPO as cls
    elif kind == "ebft":  # strided EBFT (trainer/objectives/ebft_strided.py)
        from trainer.objectives.ebft import EBFT as cls
    elif kind == "orpo":
        from trainer.objectives.orpo import ORPO as cls
    elif kind == "simpo":
        from trainer.objectives.simpo import SimPO as cls
    else:
        from trainer.objectives.kto import KTO as cls
    return cls


def build(cfg: Config, collator: Collator, token_loss_sum) -> Objective:
    return objective_class(cfg).from_config(cfg, collator, token_loss_sum)


def prepare(cfg: Config, tokenizer, rank: int = 0, log=print):
    """The tokenized train/validation data this config's objective trains on (trainer.data.prepare.Prepared)."""
    return objective_class(cfg).prepare_data(cfg, tokenizer, rank, log)


def capacity(cfg: Config, packing: bool) -> int | None:
    """Bin capacity for the packing sampler (None: no packing): the objective's own (pairs pack both sequences)."""
    return objective_class(cfg).capacity(cfg, packing)
