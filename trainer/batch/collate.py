"""Turn micro-batches of rows (lists of tokenized examples) into model inputs.

Packed or not, every row is a concatenation of examples ("segments"). Isolation between segments
depends on the attention backend (see trainer.batch.attention): flash-attn gets one flattened row with
position_ids that restart per segment; flex_attention keeps its rows and gets position_ids alone; sdpa
and eager get a block-diagonal causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.batch.attention import FLASH_BACKENDS, block_causal_mask, needs_mask
from trainer.batch.labels import IGNORE


@dataclass
class Collator:
    pad_token_id: int
    attention: str
    pad_to: int | None = None  # pad every row to this length (pad_to_sequence_len)
    pad_multiple: int = 1  # round row length up to a multiple (8 helps tensor cores on GPU)
    sequence_ids: bool = False  # also return which sequence (0, 1, ... over all rows; -1 = padding) each token is
    positions_only: bool = False  # no 4D mask (context parallelism builds its own from position_ids)


    def __call__(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        if self.attention in FLASH_BACKENDS:
            rows = [[example for row in rows for example in row]]  # one row; cu_seqlens come from position_ids
        ids, labels, positions, segments = [], [], [], []
        for row in rows:
            r_ids, r_labels, r_pos, r_seg = [], [], [], []
            for k, example in enumerate(row):
                n = len(example["input_ids"])
                r_ids += example["input_ids"]
                # The first token of a segment is never a target: the token before it belongs to another example.
                r_labels += [IGNORE] + list(example["labels"][1:])
                r_pos += example.get("position_ids") or range(n)  # PoSE's skipped positions, else 0..n-1
                r_seg += [k] * n
            ids.append(r_ids), labels.append(r_labels), positions.append(r_pos), segments.append(r_seg)

        width = max(len(r) for r in ids)
        if self.pad_to and self.attention not in FLASH_BACKENDS:
            width = max(width, self.pad_to)
        width = -(-width // self.pad_multiple) * self.pad_multiple
        for r_ids, r_labels, r_pos, r_seg in zip(ids, labels, positions, segments):
            pad = width - len(r_ids)
            r_ids += [self.pad_token_id] * pad
            r_labels += [IGNORE] * pad
            r_pos += range(pad)
            r_seg += [-1] * pad  # padding is a segment of its own, so no query row is fully masked

        batch = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": torch.tensor(positions, dtype=torch.long),
            "num_tokens": torch.tensor(sum(len(r) for r in segments) - sum(r.count(-1) for r in segments)),
        }
        if needs_mask(self.attention) and not self.positions_only:  # else position_ids alone (flash: flattened; flex: per row)
            batch["attention_mask"] = block_causal_mask(torch.tensor(segments), self.attention)
        if self.sequence_ids:  # per-sequence sums (preference objectives) need to know whose token is whose
            ids, offset = [], 0
            for r_seg in segments:
                ids.append([offset + k if k >= 0 else -1 for k in r_seg])
                offset += max(r_seg) + 1 if r_seg and max(r_seg) >= 0 else 0
            batch["sequence_ids"] = torch.tensor(ids, dtype=torch.long)
        return batch


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that contribute to the loss (labels shift by one; label 0 of a row is never a target)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


class Rows(torch.utils.data.Dataset):
    """Index a tokenized dataset by rows (lists of example indices), for DataLoader(batch_sampler=...)."""

    def __init__(self, dataset):
        # position_ids: PoSE's (trainer/data/pose.py), where the rows carry them
        self.dataset = dataset.select_columns([c for c in ("input_ids", "labels", "position_ids")
                                               if c in dataset.column_names])

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, row: list[int]) -> list[dict]:
        return [self.dataset[i] for i in row]
