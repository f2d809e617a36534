"""The loss is a sum over target tokens; callers divide by the number of target tokens of the whole
optimizer step (all micro-batches, all ranks), so micro-batch size, gradient accumulation, packing and
the number of processes do not change what is trained.

The sum is computed without the whole logits tensor wherever the model allows it (trainer/objectives/chunked_loss.py:
the head applied to the target tokens a chunk at a time); elsewhere over the full logits, with the same result."""

from __future__ import annotations

import torch

from trainer.objectives import chunked_loss

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    slot = chunked_loss.decide(model, inputs)
    if slot is None:
        return chunked_loss.full_loss_sum(model, inputs, batch["labels"])
    hidden, head, seen = chunked_loss.forward_hidden(model, *slot, inputs)
    return chunked_loss.loss_sum_from_hidden(hidden, head, seen, batch["labels"])
