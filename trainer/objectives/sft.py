"""Supervised fine-tuning: cross-entropy summed over target tokens, divided by the step's target tokens."""

from __future__ import annotations

import torch

from trainer.batch.collate import Collator, Rows, count_targets
from trainer.objectives.base import Objective
from trainer.objectives.evaluate import evaluate


class SFT(Objective):
    name = "sft"
    stat_names = ("target_tokens",)
    metric_names = ("loss_sum", "tokens")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        if cfg.use_eaft:  # entropy-weighted token losses (trainer/objectives/eaft.py), in evaluation too
            # heavy: torch loads only when this runs
            from trainer.objectives.eaft import EaftLossSum

            eaft = EaftLossSum(cfg.eaft_alpha, cfg.eaft_k)
            return cls(collator, eaft, eval_loss_sum=eaft)
        return cls(collator, token_loss_sum)

    def __init__(self, collator: Collator, token_loss_sum, eval_loss_sum=None):
        self.collator = collator
        self.token_loss_sum = token_loss_sum  # passed in by the loop (tests replace it there)
        self.eval_loss_sum = eval_loss_sum  # evaluation's token loss sum, when not plain cross-entropy (use_eaft)

    def rows(self, dataset, reference=None):
        return Rows(dataset)

    def collate(self, rows):
        return self.collator(rows)

    def step_stats(self, model, batch):
        return [count_targets(batch)]

    def loss(self, model, batch, totals):
        loss_sum = self.token_loss_sum(model, batch)
        loss = loss_sum / max(totals["target_tokens"], 1)
        return loss, torch.stack([loss_sum.detach().double().cpu(), torch.tensor(float(batch["num_tokens"]), dtype=torch.float64)])

    def report(self, sums, totals):
        return {"loss": sums["loss_sum"] / max(totals["target_tokens"], 1), "tokens": int(sums["tokens"]),
                "target_tokens": int(totals["target_tokens"])}

    def score(self, model, dataset, where, reference=None) -> dict:
        """Mean token loss over the split (trainer/objectives/evaluate.py)."""
        return evaluate(model, dataset, self.collator, where.batch_size, where.capacity, where.run,
                        **({"loss_sum": self.eval_loss_sum} if self.eval_loss_sum else {}))

    def describe_eval(self, result: dict) -> str:
        return f"eval_loss {result['eval_loss']:.4f} over {result['eval_tokens']} tokens"
