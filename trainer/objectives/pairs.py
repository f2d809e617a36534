"""What the pair objectives (DPO, IPO, ORPO, SimPO) share: batches of (chosen, rejected) pairs.

Unpacked, a micro-batch of B pairs is 2B rows (each sequence its own row, as TRL's concatenated forward).
Packed (sample_packing), each row is a bin of whole pairs up to 2 x sequence_len tokens, every sequence a
segment of its own behind the same block-diagonal mask as SFT; log-probs are summed per sequence id, so
packing changes the layout, never the numbers.
"""

from __future__ import annotations

import torch

from trainer.batch.collate import Collator
from trainer.data.prepare import prepare
from trainer.objectives.base import ExampleRows, Objective, sequence_counts, sequence_logps

PAIR_COLUMNS = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


class PairObjective(Objective):
    stat_names = ("pairs", "chosen_tokens")
    progress_names = ("rewards/margins", "rewards/accuracies")

    @classmethod
    def describe(cls, cfg) -> str:
        reference = ("reference log-probs computed once before training and cached" if cfg.objective in ("dpo", "ipo", "kto")
                     else "reference-free")
        return f"{cfg.objective} (beta {cfg.beta:g}; {reference})"

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Preference pairs (trainer/objectives/preference_data.py); DPO, IPO, ORPO and SimPO share their tokens."""
        # heavy: torch loads only when this runs
        from trainer.objectives.preference_data import build_preference

        return prepare(cfg, tokenizer, rank, log, builder=build_preference, kind={"kind": "pairs"})

    @classmethod
    def capacity(cls, cfg, packing: bool) -> int | None:
        """A packed row holds whole pairs: up to 2 x sequence_len tokens (both of a pair's sequences)."""
        return cfg.sequence_len * 2 if packing else None

    def __init__(self, collator: Collator, packed: bool):
        self.collator = Collator(collator.pad_token_id, collator.attention, collator.pad_to, collator.pad_multiple,
                                 sequence_ids=True)
        self.packed = packed

    def rows(self, dataset, reference=None):
        return ExampleRows(dataset, PAIR_COLUMNS, reference)

    def collate(self, rows):
        layout, chosen, rejected, refs = [], [], [], []
        k = 0  # sequence id, in the order the collator numbers them (rows, then segments)
        for row in rows:
            sequences = []
            for pair in row:
                for side, where in (("chosen", chosen), ("rejected", rejected)):
                    where.append(k)
                    k += 1
                    sequences.append({"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"]})
                if "ref" in pair:
                    refs.append(pair["ref"])
            if self.packed:
                layout.append(sequences)
            else:
                layout.extend([s] for s in sequences)
        batch = self.collator(layout)
        batch["n_sequences"] = torch.tensor(len(chosen) + len(rejected))
        batch["chosen_index"], batch["rejected_index"] = torch.tensor(chosen), torch.tensor(rejected)
        if refs:
            batch["ref"] = torch.tensor(refs, dtype=torch.float32)
        return batch

    def step_stats(self, model, batch):
        completion, _ = sequence_counts(batch)
        return [float(len(batch["chosen_index"])), float(completion[batch["chosen_index"]].sum())]

    @torch.no_grad()
    def reference(self, model, batch):
        logps = sequence_logps(model, batch)
        return torch.stack([logps[batch["chosen_index"]], logps[batch["rejected_index"]]], dim=1)

    def pair_logps(self, model, batch, with_all: bool = False):
        """Policy log-prob sums of (chosen, rejected) completions, their token counts, and (with_all) the
        chosen sequences' log-prob sum over all tokens (ORPO's NLL with train_on_inputs)."""
        completion, inside = sequence_counts(batch)
        if with_all:
            logps, all_logps = sequence_logps(model, batch, with_all=True)
        else:
            logps, all_logps = sequence_logps(model, batch), None
        c, r = batch["chosen_index"], batch["rejected_index"]
        return logps[c], logps[r], completion[c], completion[r], (all_logps[c] if with_all else None), inside[c]

    @staticmethod
    def pair_metrics(loss, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, batch, *extra):
        """The metric vector in PAIR_METRICS order: loss, sums over the pairs, then extras, then tokens."""
        return vector(loss, chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).sum(),
                      (chosen_rewards - rejected_rewards).sum(), chosen_logps.sum(), rejected_logps.sum(), *extra,
                      batch["num_tokens"])

    def report(self, sums, totals):
        pairs = max(totals["pairs"], 1)
        row = {"loss": sums["loss"], **{k: sums[k] / pairs for k in PAIR_METRICS}}
        row.update({k: sums[k] / pairs for k in self.metric_names if k not in row and k != "tokens"})
        row["tokens"], row["pairs"] = int(sums["tokens"]), int(totals["pairs"])
        return row

    def describe_eval(self, result: dict) -> str:
        return (f"eval_loss {result['eval_loss']:.4f}, eval_rewards/accuracies "
                f"{result.get('eval_rewards/accuracies', float('nan')):.3f}")


def vector(*values) -> torch.Tensor:
    """Detached float64 vector of scalars (tensors or numbers), on the first tensor's device."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), "cpu")
    return torch.stack([torch.as_tensor(v, device=device).detach().double().reshape(()) for v in values])
