"""DPO (sigmoid, with conservative label smoothing) and IPO, against precomputed reference log-probs.

As TRL's DPOTrainer defines them (trl/trainer/dpo_trainer.py, loss_type "sigmoid" and "ipo"):
    delta = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))            summed over completion tokens
    sigmoid: -(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)      (eps = dpo_label_smoothing)
    ipo:     (delta_w / |y_w| - delta_l / |y_l| - 1 / (2 beta))^2                   (length-averaged log-ratios)
Rewards are beta times the log-ratios. The loss of a step is the mean over its pairs (all micro-batches,
all ranks). Several dpo_loss_type with dpo_loss_weights (TRL's loss_type list and loss_weights): the weighted sum of
each type's mean loss (unset weights: 1 each).

`dpo_use_weighting: true` (TRL's `use_weighting`, WPO, https://huggingface.co/papers/2406.11827 eq. 2) multiplies
each pair's loss by w(y_w) w(y_l), w(y) = exp(mean over y's completion tokens of log pi(t) - log sum_v pi(v)^2),
computed without gradient from the policy's own forward.
"""

from __future__ import annotations

import torch.nn.functional as F

import torch

from trainer.objectives.base import sequence_counts, sequence_logps
from trainer.objectives.pairs import PAIR_METRICS, PairObjective


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             label_smoothing: float = 0.0, ipo: bool = False, tokens=None):
    """Per-pair losses, chosen rewards, rejected rewards. `tokens` (IPO): the (chosen, rejected) token counts its
    log-ratios are averaged over."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if ipo:
        chosen_tokens, rejected_tokens = tokens
        delta = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_logratios - rejected_logratios
        losses = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * delta) * label_smoothing)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


class DPO(PairObjective):
    needs_reference = True
    reference_names = ("chosen", "rejected")
    metric_names = ("loss", *PAIR_METRICS, "tokens")

    @classmethod
    def describe(cls, cfg) -> str:
        line = super().describe(cfg)
        if cfg.dpo_loss_weights or len(cfg.dpo_loss_type or []) > 1:
            types = cfg.dpo_loss_type
            weights = cfg.dpo_loss_weights or [1.0] * len(types)
            line = line[:-1] + "; loss " + " + ".join(f"{w:g} x {t}" for t, w in zip(types, weights)) + ")"
        return line[:-1] + "; each pair's loss weighted by WPO's weights, dpo_use_weighting)" if cfg.dpo_use_weighting else line

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        types = cfg.dpo_loss_type or ["ipo" if cfg.objective == "ipo" else "sigmoid"]
        return cls(collator, cfg.sample_packing, cfg.beta, cfg.dpo_label_smoothing, ipo=cfg.objective == "ipo",
                   weighting=bool(cfg.dpo_use_weighting),
                   mix=list(zip(types, cfg.dpo_loss_weights or [1.0] * len(types))))

    def __init__(self, collator, packed: bool, beta: float, label_smoothing: float = 0.0, ipo: bool = False,
                 weighting: bool = False, mix: list[tuple[str, float]] | None = None):
        super().__init__(collator, packed)
        self.name = "ipo" if ipo else "dpo"
        self.beta, self.label_smoothing, self.ipo, self.weighting = beta, label_smoothing, ipo, weighting
        self.mix = mix or [("ipo" if ipo else "sigmoid", 1.0)]  # (loss type, weight)

    def loss(self, model, batch, totals):
        if self.weighting:
            chosen, rejected, n_chosen, n_rejected, weights = self.weighted_pair_logps(model, batch)
        else:
            chosen, rejected, n_chosen, n_rejected, _, _ = self.pair_logps(model, batch)
            weights = 1.0
        ref = batch["ref"].to(chosen.dtype)
        loss = 0.0
        for kind, weight in self.mix:
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                chosen, rejected, ref[:, 0], ref[:, 1], self.beta, self.label_smoothing, kind == "ipo",
                (n_chosen, n_rejected))
            loss = loss + weight * (losses * weights).sum() / max(totals["pairs"], 1)
        return loss, self.pair_metrics(loss, chosen_rewards, rejected_rewards, chosen, rejected, batch)

    @staticmethod
    def weighted_pair_logps(model, batch):
        """Policy log-prob sums of (chosen, rejected), their token counts, and each pair's WPO weight."""
        logps, aligned = sequence_logps(model, batch, with_wpo=True)
        completion, _ = sequence_counts(batch)
        c, r = batch["chosen_index"], batch["rejected_index"]
        return logps[c], logps[r], completion[c], completion[r], torch.exp(aligned[c]) * torch.exp(aligned[r])
