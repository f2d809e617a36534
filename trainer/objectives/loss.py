"""The loss is a sum over target tokens; callers divide by the number of target tokens of the whole
optimizer step (all micro-batches, all ranks), so micro-batch size, gradient accumulation, packing and
the number of processes do not change what is trained.

The sum is computed without the whole logits tensor wherever the model allows it and that is cheaper or saves memory
(trainer/objectives/chunked_loss.py: the head applied to the target tokens a chunk at a time); elsewhere over the
full logits, with the same result."""

from __future__ import annotations

import torch

from trainer.objectives import chunked_loss

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    slot = chunked_loss.decide(model, inputs)
    if slot is not None:  # both paths run here: this step's by cost (or the config's chunked_cross_entropy)
        targets = int((batch["labels"][:, 1:] != chunked_loss.IGNORE).sum())
        if chunked_loss.choose(slot, batch["input_ids"].numel(), targets).path == "full":
            slot = None
    if slot is None:
        total = chunked_loss.full_loss_sum(model, inputs, batch["labels"])
    else:
        hidden, head, seen = chunked_loss.forward_hidden(model, *slot, inputs)
        total = chunked_loss.loss_sum_from_hidden(hidden, head, seen, batch["labels"])
    return with_router_aux(model, total, batch["labels"])


def with_router_aux(model, total: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A mixture of experts run with output_router_logits (its config, or Axolotl's model_config, as Axolotl's Mixtral
    examples set it): the router's load-balancing loss added as transformers adds it to the model's loss,
    router_aux_loss_coef x aux per token of the micro-batch's mean; here each target token carries it, so the step's
    loss is its mean cross-entropy plus the coefficient times the aux losses weighted by the micro-batches' share of
    the step's target tokens (the HF Trainer averages them per micro-batch; one micro-batch: the same number)."""
    aux = chunked_loss.take_router_aux()
    if aux is None:
        return total
    config = chunked_loss._inner(model).config
    coef = getattr(config, "router_aux_loss_coef", None)
    if not coef:
        return total
    targets = (labels[:, 1:] != chunked_loss.IGNORE).sum()
    return total + coef * aux.to(total.dtype) * targets
