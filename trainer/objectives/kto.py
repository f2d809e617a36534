"""KTO: unpaired desirable/undesirable examples, against precomputed reference log-probs.

As TRL's KTOTrainer (trl/trainer/kto_trainer.py, loss_type "kto") defines it:
    r   = log pi(y|x) - log ref(y|x)                     summed over completion tokens
    KL  = max(0, mean over mismatched pairs (x, y') of log pi(y'|x) - log ref(y'|x))    (no gradient)
    desirable:   w_d * (1 - sigmoid(beta (r - KL)))
    undesirable: w_u * (1 - sigmoid(beta (KL - r)))
The KL estimate and the loss's mean are over the whole step (all micro-batches, all ranks): the KL
forwards run first (step_stats) and their sums are all-reduced with the step's counts in one vector.
The mismatched pairs are fixed when the data is prepared (trainer.objectives.preference_data.add_kl_pairs).
"""

from __future__ import annotations

import torch

from trainer.batch.collate import Collator
from trainer.data.prepare import prepare
from trainer.objectives.base import ExampleRows, Objective, sequence_logps
from trainer.objectives.pairs import vector

KTO_COLUMNS = ["input_ids", "labels", "label", "kl_input_ids", "kl_labels"]


def kto_loss(logps, ref_logps, labels, kl, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    """Per-example weighted losses and rewards (beta * log-ratio)."""
    logratios = logps - ref_logps
    desirable = 1 - torch.sigmoid(beta * (logratios - kl))
    undesirable = 1 - torch.sigmoid(beta * (kl - logratios))
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses, beta * logratios.detach()


class KTO(Objective):
    name = "kto"
    needs_reference = True
    stats_need_model = True
    reference_names = ("completion", "kl")
    stat_names = ("examples", "desirable", "undesirable", "kl_sum", "kl_count")
    metric_names = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "tokens")
    progress_names = ("rewards/margins", "kl")

    @classmethod
    def describe(cls, cfg) -> str:
        reference = ("reference log-probs computed once before training and cached" if cfg.objective in ("dpo", "ipo", "kto")
                     else "reference-free")
        return f"{cfg.objective} (beta {cfg.beta:g}; {reference})"

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(collator, cfg.sample_packing, cfg.beta, cfg.kto_desirable_weight, cfg.kto_undesirable_weight)

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Desirable/undesirable examples with their mismatched KL pairs (trainer/objectives/preference_data.py)."""
        # heavy: torch loads only when this runs
        from trainer.objectives.preference_data import build_preference

        return prepare(cfg, tokenizer, rank, log, builder=build_preference, kind={"kind": "kto"})

    def __init__(self, collator: Collator, packed: bool, beta: float, desirable_weight: float, undesirable_weight: float):
        self.collator = Collator(collator.pad_token_id, collator.attention, collator.pad_to, collator.pad_multiple,
                                 sequence_ids=True)
        self.packed = packed
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight

    def rows(self, dataset, reference=None):
        return ExampleRows(dataset, KTO_COLUMNS, reference)

    def _layout(self, rows, prefix: str):
        seqs = [[{"input_ids": e[f"{prefix}input_ids"], "labels": e[f"{prefix}labels"]} for e in row] for row in rows]
        return seqs if self.packed else [[s] for row in seqs for s in row]

    def collate(self, rows):
        examples = [e for row in rows for e in row]
        batch = self.collator(self._layout(rows, ""))
        kl = self.collator(self._layout(rows, "kl_"))
        batch.update({f"kl_{k}": v for k, v in kl.items()})
        batch["n_sequences"] = batch["kl_n_sequences"] = torch.tensor(len(examples))
        batch["label"] = torch.tensor([bool(e["label"]) for e in examples])
        if "ref" in examples[0]:
            batch["ref"] = torch.tensor([e["ref"] for e in examples], dtype=torch.float32)
        return batch

    @staticmethod
    def kl_batch(batch):
        return {k[3:]: v for k, v in batch.items() if k.startswith("kl_")}

    def step_stats(self, model, batch):
        labels = batch["label"]
        with torch.no_grad():  # the KL estimate carries no gradient (TRL detaches it too)
            kl_logps = sequence_logps(model, self.kl_batch(batch))
        kl_sum = float((kl_logps - batch["ref"][:, 1].to(kl_logps.dtype)).sum())
        return [float(len(labels)), float(labels.sum()), float((~labels).sum()), kl_sum, float(len(labels))]

    @staticmethod
    def kl(totals) -> float:
        return max(totals["kl_sum"] / max(totals["kl_count"], 1), 0.0)

    def loss(self, model, batch, totals):
        logps = sequence_logps(model, batch)
        labels = batch["label"]
        losses, rewards = kto_loss(logps, batch["ref"][:, 0].to(logps.dtype), labels, self.kl(totals), self.beta,
                                   self.desirable_weight, self.undesirable_weight)
        loss = losses.sum() / max(totals["examples"], 1)
        zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
        return loss, vector(loss, torch.where(labels, rewards, zero).sum(), torch.where(~labels, rewards, zero).sum(),
                            torch.where(labels, logps.detach(), zero).sum(), torch.where(~labels, logps.detach(), zero).sum(),
                            batch["num_tokens"])

    def report(self, sums, totals):
        row = {"loss": sums["loss"], "kl": self.kl(totals)}
        for side, count in (("chosen", totals["desirable"]), ("rejected", totals["undesirable"])):
            if count:  # as TRL: only when the step has examples of that kind
                row[f"rewards/{side}"] = sums[f"rewards/{side}"] / count
                row[f"logps/{side}"] = sums[f"logps/{side}"] / count
        if totals["desirable"] and totals["undesirable"]:
            row["rewards/margins"] = row["rewards/chosen"] - row["rewards/rejected"]
        row["tokens"], row["examples"] = int(sums["tokens"]), int(totals["examples"])
        return row

    @torch.no_grad()
    def reference(self, model, batch):
        return torch.stack([sequence_logps(model, batch), sequence_logps(model, self.kl_batch(batch))], dim=1)

    def describe_eval(self, result: dict) -> str:
        return f"eval_loss {result['eval_loss']:.4f}, eval_kl {result['eval_kl']:.4f}"
