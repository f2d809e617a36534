"""SimPO: reference-free, length-normalised, with a target margin; plus CPO's NLL term (cpo_alpha).

As TRL's CPOTrainer with loss_type "simpo" (trl/experimental/cpo) defines it, log-probs averaged over
completion tokens:
    logits = (lp_w - lp_l) - gamma / beta
    loss   = -(1 - eps) log sigmoid(beta logits) - eps log sigmoid(-beta logits)  +  cpo_alpha * NLL(chosen)
The NLL is the mean over the step's chosen completion tokens (CPO's labels mask the prompt).
"""

from __future__ import annotations

import torch.nn.functional as F

from trainer.objectives.pairs import PAIR_METRICS, PairObjective


def simpo_loss(chosen_avg_logps, rejected_avg_logps, beta: float, gamma: float, label_smoothing: float = 0.0):
    logits = (chosen_avg_logps - rejected_avg_logps) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return losses, beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()


class SimPO(PairObjective):
    name = "simpo"
    metric_names = ("loss", *PAIR_METRICS, "nll_loss", "tokens")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(collator, cfg.sample_packing, cfg.beta, cfg.simpo_gamma, cfg.cpo_alpha, cfg.dpo_label_smoothing)

    def __init__(self, collator, packed: bool, beta: float, gamma: float, cpo_alpha: float, label_smoothing: float = 0.0):
        super().__init__(collator, packed)
        self.beta, self.gamma, self.cpo_alpha, self.label_smoothing = beta, gamma, cpo_alpha, label_smoothing

    def loss(self, model, batch, totals):
        chosen, rejected, n_chosen, n_rejected, _, _ = self.pair_logps(model, batch)
        pairs = max(totals["pairs"], 1)
        avg_chosen, avg_rejected = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        losses, chosen_rewards, rejected_rewards = simpo_loss(avg_chosen, avg_rejected, self.beta, self.gamma,
                                                              self.label_smoothing)
        nll = -chosen.sum() / max(totals["chosen_tokens"], 1)
        loss = losses.sum() / pairs + (self.cpo_alpha * nll if self.cpo_alpha else 0.0)
        return loss, self.pair_metrics(loss, chosen_rewards, rejected_rewards, avg_chosen, avg_rejected, batch,
                                       nll)

    def report(self, sums, totals):
        row = super().report(sums, totals)
        row["nll_loss"] = sums["nll_loss"]  # each micro-batch's share is already divided by the step's tokens
        return row
