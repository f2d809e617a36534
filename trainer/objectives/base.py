"""The seam between the one training loop and what is trained: an Objective.

An objective says how micro-batches are built (rows -> tensors) and how the loss is computed; the loop
(trainer.train) owns everything else: accumulation, checkpoints, exact resume, timeouts, evaluation
cadence, metrics. Per optimizer step the loop

1. calls step_stats(model, batch) on every micro-batch and sums the result over micro-batches and ranks
   (ONE all-reduce of a fixed-size vector): the step's normalisers (target tokens, pairs, examples) and
   any step-level estimate (KTO's KL);
2. calls loss(model, batch, totals) per micro-batch and backpropagates it. The loss is already divided by
   the step's global totals, so micro-batch size, accumulation, packing and the number of processes do not
   change what is trained;
3. sums the metric vectors over micro-batches and ranks (one more fixed-size all-reduce) and asks
   report(sums, totals) for the logged values.

No collective ever depends on a rank's data: shapes are fixed by the objective's names.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trainer.batch.labels import IGNORE
from trainer.data.prepare import prepare
from trainer.objectives.loss import MODEL_INPUTS


class Objective:
    name = "objective"
    stat_names: tuple[str, ...] = ()  # summed over the step's micro-batches and ranks before the loss
    metric_names: tuple[str, ...] = ()  # summed after the step, turned into logged values by report()
    progress_names: tuple[str, ...] = ()  # shown beside loss and lr on the progress bar
    generates = False  # GRPO: expand() generates each step's micro-batches
    needs_reference = False  # reference log-probs are precomputed once (trainer.objectives.reference)
    stats_need_model = False  # step_stats runs forwards (KTO's KL), so its batch must be on the device
    reference_names: tuple[str, ...] = ()  # one column per reference value of an example

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum) -> Objective:
        """The objective a config asks for (trainer.objectives.objective_class picks the class)."""
        raise NotImplementedError

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank: int = 0, log=print):
        """The data hook: the rows this objective trains on, prepared once (trainer/data/prepare.py caches them,
        rank 0 prepares, the others wait). SFT's prompt formats unless the objective builds its own rows."""
        return prepare(cfg, tokenizer, rank, log)

    @classmethod
    def capacity(cls, cfg, packing: bool) -> int | None:
        """Tokens per packed row for the sampler (None: one example per row)."""
        return cfg.sequence_len if packing else None

    def loader_batch(self, micro_batch_size: int, ga: int) -> tuple[int, int]:
        """(rows per loader batch, loader batches per optimizer step); GRPO draws one batch of prompts per step."""
        return micro_batch_size, ga

    def before_training(self, model, *, tokenizer, dtype, rank: int, timeout: float, output_dir, say) -> None:
        """Called once by the loop before the first step and before a checkpoint loads, so the model is the
        starting one (EBFT's feature network, GRPO's reference and tokenizer)."""

    def expand(self, model, loader_batches: list, ga: int, world: bool) -> list:
        """The step's ga micro-batches from its loader batches (GRPO generates them here)."""
        return loader_batches

    def lengths(self, dataset) -> np.ndarray:
        return np.asarray(dataset["length"])

    def rows(self, dataset, reference: np.ndarray | None = None):
        raise NotImplementedError

    def collate(self, rows: list[list[dict]]) -> dict:
        raise NotImplementedError

    def step_stats(self, model, batch: dict) -> list[float]:
        raise NotImplementedError

    def loss(self, model, batch: dict, totals: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss normalised by the step's global totals, metric sums as a float64 vector of metric_names)."""
        raise NotImplementedError

    def report(self, sums: dict[str, float], totals: dict[str, float]) -> dict:
        raise NotImplementedError

    def reference(self, model, batch: dict) -> torch.Tensor:
        """[examples of the batch in row order, len(reference_names)] reference values (no grad)."""
        raise NotImplementedError

    def metrics(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)


class ExampleRows(torch.utils.data.Dataset):
    """Index a tokenized dataset by rows (lists of example indices); attach each example's reference values."""

    def __init__(self, dataset, columns: list[str], reference: np.ndarray | None = None):
        self.dataset = dataset.select_columns(columns)
        self.reference = reference

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, row: list[int]) -> list[dict]:
        out = []
        for i in row:
            example = self.dataset[i]
            if self.reference is not None:
                example["ref"] = self.reference[i].tolist()
            out.append(example)
        return out


def frozen_copy(model, dtype=None):
    """The starting model, frozen, for objectives that compare against it: None for a peft model, whose starting
    model is the base with the adapter disabled (no copy); else a deep copy in eval mode (cast to dtype if given)."""
    import copy

    if hasattr(model, "disable_adapter"):
        return None
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    return frozen if dtype is None else frozen.to(dtype)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def sequence_counts(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: completion (target) tokens, and all predicted tokens (every token after the first)."""
    seq, n = batch["sequence_ids"], int(batch["n_sequences"])
    nxt = seq[:, 1:]
    inside = (nxt >= 0) & (nxt == seq[:, :-1])
    completion = inside & (batch["labels"][:, 1:] != IGNORE)
    count = lambda mask: torch.zeros(n, dtype=torch.float32, device=seq.device).index_add_(  # noqa: E731
        0, nxt[mask], torch.ones(int(mask.sum()), device=seq.device))
    return count(completion), count(inside)


def sequence_logps(model, batch: dict, with_all: bool = False):
    """Sum of the log-probs of each sequence's completion tokens (and, with_all, of all its tokens after the first).

    One forward over however the sequences are laid out (one per row, or packed several to a row with a
    block-diagonal mask): the sums are gathered by sequence id, so the layout does not change them.
    """
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    logits = model(**inputs, use_cache=False).logits
    ids, seq, n = batch["input_ids"][:, 1:], batch["sequence_ids"], int(batch["n_sequences"])
    nxt = seq[:, 1:]
    token_logps = -F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids.flatten(), reduction="none").view_as(ids)
    inside = (nxt >= 0) & (nxt == seq[:, :-1])
    completion = inside & (batch["labels"][:, 1:] != IGNORE)

    def total(mask):
        return torch.zeros(n, dtype=token_logps.dtype, device=ids.device).index_add(0, nxt[mask], token_logps[mask])

    return (total(completion), total(inside)) if with_all else total(completion)
