"""The loss is a sum over target tokens; callers divide by the number of target tokens of the whole
optimizer step (all micro-batches, all ranks), so micro-batch size, gradient accumulation, packing and
the number of processes do not change what is trained."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.batch.labels import IGNORE

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")
