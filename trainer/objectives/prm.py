"""Process reward model (process_reward_model: true): token classification of each step's last token.

TRL's PRMTrainer (trl/experimental/prm, removed by TRL 1.16; Axolotl still trains with it) trains with the
plain Trainer loss of AutoModelForTokenClassification: cross-entropy over num_labels classes on the tokens
whose label is not -100 (a step's last token, its separator), averaged over those tokens. Here the sum over a
step's labelled tokens is divided by the step's labelled tokens on all micro-batches and ranks, so
accumulation, packing and processes do not change what is trained. Labels are not shifted: token t is
classified from the prefix up to and including t. Metric: accuracy (argmax == label over labelled tokens),
TRL's compute_accuracy for PRMs.
"""

from __future__ import annotations

import torch.nn.functional as F

from trainer.batch.collate import Collator, Rows
from trainer.batch.labels import IGNORE
from trainer.config.rl import num_labels
from trainer.data.prepare import prepare
from trainer.objectives.base import Objective
from trainer.objectives.loss import MODEL_INPUTS
from trainer.objectives.pairs import vector
from trainer.objectives.reward_data import build_reward, reward_kind


class PRM(Objective):
    name = "prm"
    stat_names = ("target_tokens",)
    metric_names = ("loss_sum", "correct", "tokens")
    progress_names = ("accuracy",)

    @classmethod
    def describe(cls, cfg) -> str:
        return (f"{cfg.objective} ({'sequence' if cfg.objective == 'reward' else 'token'} classification, "
                f"num_labels {num_labels(cfg)})")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(collator)

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Stepwise rows, a label on each step's last token (trainer/objectives/reward_data.py)."""
        return prepare(cfg, tokenizer, rank, log, builder=build_reward, kind=reward_kind(cfg))

    def __init__(self, collator: Collator):
        self.collator = collator

    def rows(self, dataset, reference=None):
        return Rows(dataset)

    def collate(self, rows):
        return self.collator(rows)

    def step_stats(self, model, batch):
        return [float((batch["labels"] != IGNORE).sum())]

    def loss(self, model, batch, totals):
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        logits = model(**inputs, use_cache=False).logits
        labels = batch["labels"]
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        labelled = labels != IGNORE
        correct = (logits.argmax(-1)[labelled] == labels[labelled]).sum()
        return loss_sum / max(totals["target_tokens"], 1), vector(loss_sum, correct, batch["num_tokens"])

    def report(self, sums, totals):
        n = max(totals["target_tokens"], 1)
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "tokens": int(sums["tokens"]),
                "target_tokens": int(totals["target_tokens"])}

    def describe_eval(self, result: dict) -> str:
        return f"eval_loss {result['eval_loss']:.4f}, eval_accuracy {result['eval_accuracy']:.3f}"
