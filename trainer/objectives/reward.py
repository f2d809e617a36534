"""Bradley-Terry reward model (reward_model: true), as TRL's RewardTrainer.compute_loss defines it:

    r = the sequence-classification head's score of a sequence (its last non-pad token)
    loss = mean over pairs of -log sigmoid(r_chosen - r_rejected)
           + center_rewards_coefficient * mean over pairs of (r_chosen + r_rejected)^2

A micro-batch of B pairs is 2B rows, chosen sequences first, right-padded with a 2-D attention mask (TRL's
DataCollatorForPreference layout), so the head pools each sequence exactly as the saved model will at
inference. The step's loss is the mean over all its pairs (all micro-batches, all ranks).
Metrics, under TRL's names: accuracy (r_chosen > r_rejected), margin, mean_reward; plus rewards/chosen and
rewards/rejected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.batch.collate import Collator
from trainer.config.rl import num_labels
from trainer.data.prepare import prepare
from trainer.objectives.base import ExampleRows, Objective
from trainer.objectives.pairs import vector
from trainer.objectives.reward_data import build_reward, reward_kind

COLUMNS = ["chosen_input_ids", "rejected_input_ids"]


def reward_loss(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor, center: float | None) -> torch.Tensor:
    """Per-pair losses (their mean is TRL's loss)."""
    losses = -F.logsigmoid(rewards_chosen - rewards_rejected)
    if center is not None:
        losses = losses + center * (rewards_chosen + rewards_rejected) ** 2
    return losses


class Reward(Objective):
    name = "reward"
    stat_names = ("pairs",)
    metric_names = ("loss", "correct", "margin", "rewards/chosen", "rewards/rejected", "tokens")
    progress_names = ("accuracy", "margin")

    @classmethod
    def describe(cls, cfg) -> str:
        return (f"{cfg.objective} ({'sequence' if cfg.objective == 'reward' else 'token'} classification, "
                f"num_labels {num_labels(cfg)})")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(collator, cfg.center_rewards_coefficient)

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Chosen/rejected answers, tokenized (trainer/objectives/reward_data.py)."""
        return prepare(cfg, tokenizer, rank, log, builder=build_reward, kind=reward_kind(cfg))

    @classmethod
    def capacity(cls, cfg, packing: bool) -> int | None:
        return None  # the head scores one sequence per row: never packed

    def __init__(self, collator: Collator, center_rewards_coefficient: float | None = None):
        self.pad_token_id, self.pad_to, self.pad_multiple = collator.pad_token_id, collator.pad_to, collator.pad_multiple
        self.center = center_rewards_coefficient

    def rows(self, dataset, reference=None):
        return ExampleRows(dataset, COLUMNS)

    def collate(self, rows):
        pairs = [pair for row in rows for pair in row]
        sequences = [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
        width = max(len(s) for s in sequences)
        if self.pad_to:
            width = max(width, self.pad_to)
        width = -(-width // self.pad_multiple) * self.pad_multiple
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        return {"input_ids": ids, "attention_mask": mask, "num_tokens": mask.sum(), "n_pairs": torch.tensor(len(pairs))}

    def step_stats(self, model, batch):
        return [float(batch["n_pairs"])]

    def rewards(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return torch.chunk(scores.squeeze(-1).float(), 2)

    def loss(self, model, batch, totals):
        chosen, rejected = self.rewards(model, batch)
        loss = reward_loss(chosen, rejected, self.center).sum() / max(totals["pairs"], 1)
        return loss, vector(loss, (chosen > rejected).sum(), (chosen - rejected).sum(), chosen.sum(), rejected.sum(),
                            batch["num_tokens"])

    def report(self, sums, totals):
        pairs = max(totals["pairs"], 1)
        chosen, rejected = sums["rewards/chosen"] / pairs, sums["rewards/rejected"] / pairs
        return {"loss": sums["loss"], "accuracy": sums["correct"] / pairs, "margin": sums["margin"] / pairs,
                "mean_reward": (chosen + rejected) / 2, "rewards/chosen": chosen, "rewards/rejected": rejected,
                "tokens": int(sums["tokens"]), "pairs": int(totals["pairs"])}

    def describe_eval(self, result: dict) -> str:
        return f"eval_loss {result['eval_loss']:.4f}, eval_accuracy {result['eval_accuracy']:.3f}"
