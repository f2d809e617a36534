"""ORPO: the chosen answer's NLL plus an odds-ratio term; no reference model at all.

As TRL's ORPOTrainer (trl/experimental/orpo) defines it, with log-probs averaged over completion tokens:
    log_odds = (lp_w - lp_l) - (log(1 - exp(lp_w)) - log(1 - exp(lp_l)))
    loss     = NLL(chosen) - beta * mean(log sigmoid(log_odds))            beta = orpo_alpha
The NLL is the mean over the step's chosen completion tokens; with train_on_inputs: true it covers the
prompt tokens too, which is what TRL (and so Axolotl) does. Rewards are beta times the averaged log-probs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.objectives.base import sequence_counts
from trainer.objectives.pairs import PAIR_METRICS, PairObjective


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_loss(chosen_avg_logps, rejected_avg_logps, beta: float):
    """Per-pair beta * log sigmoid(log odds ratio) (to be SUBTRACTED from the NLL), the log odds, rewards."""
    chosen_avg_logps, rejected_avg_logps = chosen_avg_logps.float(), rejected_avg_logps.float()
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (log1mexp(chosen_avg_logps) - log1mexp(rejected_avg_logps))
    ratio = F.logsigmoid(log_odds)
    return beta * ratio, log_odds, beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()


class ORPO(PairObjective):
    name = "orpo"
    metric_names = ("loss", *PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen", "tokens")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(collator, cfg.sample_packing, cfg.beta, nll_on_prompt=cfg.train_on_inputs)

    def __init__(self, collator, packed: bool, beta: float, nll_on_prompt: bool = False):
        super().__init__(collator, packed)
        self.beta, self.nll_on_prompt = beta, nll_on_prompt
        if nll_on_prompt:
            self.stat_names = ("pairs", "chosen_tokens", "chosen_all_tokens")

    def step_stats(self, model, batch):
        stats = super().step_stats(model, batch)
        if self.nll_on_prompt:
            stats.append(float(sequence_counts(batch)[1][batch["chosen_index"]].sum()))
        return stats

    def loss(self, model, batch, totals):
        chosen, rejected, n_chosen, n_rejected, chosen_all, _ = self.pair_logps(model, batch, self.nll_on_prompt)
        pairs = max(totals["pairs"], 1)
        if self.nll_on_prompt:
            nll = -chosen_all.sum() / max(totals["chosen_all_tokens"], 1)
        else:
            nll = -chosen.sum() / max(totals["chosen_tokens"], 1)
        avg_chosen, avg_rejected = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        ratio, log_odds, chosen_rewards, rejected_rewards = odds_ratio_loss(avg_chosen, avg_rejected, self.beta)
        loss = nll - ratio.sum() / pairs
        return loss, self.pair_metrics(loss, chosen_rewards, rejected_rewards, avg_chosen, avg_rejected, batch,
                                       nll, F.logsigmoid(log_odds).sum(), log_odds.sum())  # (beta may be 0)

    def report(self, sums, totals):
        row = super().report(sums, totals)
        row["nll_loss"] = sums["nll_loss"]  # each micro-batch's share is already divided by the step's tokens
        return row
