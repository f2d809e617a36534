"""Objectives: what the one training loop trains (see base.py for the interface).

sft (the default), reward and prm (reward_model / process_reward_model), and with `rl:` the preference methods dpo, ipo, orpo, kto and simpo, ebft (strided), and grpo / gdpo (generating).
"""

from __future__ import annotations

from trainer.diffusion import enabled as diffusion_enabled
from trainer.collate import Collator
from trainer.config import Config
from trainer.objectives.base import Objective


def build(cfg: Config, collator: Collator, token_loss_sum) -> Objective:
    kind = cfg.objective
    packed = cfg.sample_packing
    if kind == "sft" and diffusion_enabled(cfg):  # Axolotl's DiffusionPlugin (trainer/diffusion.py)
        from trainer.objectives.diffusion import Diffusion

        return Diffusion(collator, cfg.diffusion, cfg.diffusion.special_ids, cfg.seed)
    if kind == "sft" and cfg.use_eaft:  # entropy-weighted token losses (trainer/eaft.py)
        from trainer.eaft import EaftLossSum
        from trainer.objectives.sft import SFT

        eaft = EaftLossSum(cfg.eaft_alpha, cfg.eaft_k)
        return SFT(collator, eaft, eval_loss_sum=eaft)
    if kind == "sft":
        from trainer.objectives.sft import SFT

        return SFT(collator, token_loss_sum)
    if kind in ("reward", "prm"):  # reward_model / process_reward_model (not rl methods, as in Axolotl)
        from trainer.objectives.prm import PRM
        from trainer.objectives.reward import Reward

        return Reward(collator, cfg.center_rewards_coefficient) if kind == "reward" else PRM(collator)
    if kind in ("grpo", "gdpo"):  # online RL on generated completions (trainer/objectives/grpo.py)
        from trainer.grpo_data import reward_functions
        from trainer.objectives.grpo import GRPO

        funcs = reward_functions(cfg)
        return GRPO(cfg, collator, funcs, [getattr(f, "__name__", n) for f, n in zip(funcs, cfg.trl.reward_funcs)])
    if kind in ("dpo", "ipo"):
        from trainer.objectives.dpo import DPO

        return DPO(collator, packed, cfg.beta, cfg.dpo_label_smoothing, ipo=kind == "ipo")
    if kind == "ebft":  # strided EBFT (trainer/ebft.py)
        from trainer.objectives.ebft import EBFT

        return EBFT(cfg, collator.pad_token_id)
    if kind == "orpo":
        from trainer.objectives.orpo import ORPO

        return ORPO(collator, packed, cfg.beta, nll_on_prompt=cfg.train_on_inputs)
    if kind == "simpo":
        from trainer.objectives.simpo import SimPO

        return SimPO(collator, packed, cfg.beta, cfg.simpo_gamma, cfg.cpo_alpha, cfg.dpo_label_smoothing)
    from trainer.objectives.kto import KTO

    return KTO(collator, packed, cfg.beta, cfg.kto_desirable_weight, cfg.kto_undesirable_weight)


def capacity(cfg: Config, packing: bool) -> int | None:
    """Bin capacity for the packing sampler: pairs pack up to 2 x sequence_len (both of a pair's sequences)."""
    if not packing or cfg.reward_model:  # a reward model's head scores one sequence per row
        return None
    return cfg.sequence_len * (2 if cfg.rl in ("dpo", "ipo", "orpo", "simpo") else 1)
