"""EAFT, entropy-aware focal training (Axolotl's `use_eaft`, `eaft_alpha`, `eaft_k`).

Axolotl's loss (src/axolotl/monkeypatch/loss/eaft.py at 067b021c8b87, passed to the HF Trainer as
compute_loss_func by src/axolotl/core/builders/causal.py): each target token's cross-entropy is multiplied by
H^alpha, where H is the entropy of the softmax over the token's top-k logits (computed without gradient,
with log(p + 1e-10)). The HF Trainer gives that function num_items_in_batch, the target tokens of the whole
optimizer step (all micro-batches; with average_tokens_across_devices, all ranks), and it returns
sum(weighted) / num_items_in_batch. That is this trainer's normalisation already: the weighted token losses
are summed here and the loop divides by the step's target tokens on all ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.batch.labels import IGNORE
from trainer.objectives.loss import MODEL_INPUTS


def entropy_weights(logits: torch.Tensor, alpha: float, k: int) -> torch.Tensor:
    """[tokens, vocab] logits -> [tokens] weights H_topk ** alpha (no gradient)."""
    with torch.no_grad():
        top = torch.topk(logits.float(), k=min(k, logits.shape[-1]), dim=-1).values
        probs = F.softmax(top, dim=-1)
        entropy = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)
        return torch.pow(entropy, alpha)


def weighted_loss_sum(logits: torch.Tensor, labels: torch.Tensor, alpha: float, k: int) -> torch.Tensor:
    """Sum over target tokens of H^alpha * cross-entropy; logits [b, s, v] and labels [b, s] unshifted."""
    flat_logits = logits[:, :-1].flatten(0, 1)
    flat_labels = labels[:, 1:].flatten()
    keep = flat_labels != IGNORE
    chosen = flat_logits[keep]
    losses = F.cross_entropy(chosen.float(), flat_labels[keep], reduction="none")
    return (losses * entropy_weights(chosen, alpha, k)).sum()


class EaftLossSum:
    """The loop's token_loss_sum with EAFT's weights: (model, batch) -> summed weighted loss."""

    def __init__(self, alpha: float, k: int):
        self.alpha, self.k = alpha, k

    def __call__(self, model, batch: dict) -> torch.Tensor:
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        logits = model(**inputs, use_cache=False).logits
        return weighted_loss_sum(logits, batch["labels"], self.alpha, self.k)
