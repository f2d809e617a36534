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

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.batch.labels import IGNORE
from trainer.batch.sampler import EVALUATION, MultipackBatchSampler
from trainer.data.prepare import prepare
from trainer.hooks import Run
from trainer.objectives import chunked_loss
from trainer.objectives.loss import MODEL_INPUTS
from trainer.parallel.collective import phase
from trainer.parallel.collective import reduce_sum


@dataclass(frozen=True)
class Scoring:
    """How a split is scored: batches of batch_size rows (packed up to capacity tokens; None: one example a row),
    this rank's share of world (run.data_rank of run.data_world), collectives timing out after run.timeout_s.
    sharded: the weights are sharded (FSDP, ZeRO-3), so every forward is a collective and every rank runs as many
    as the busiest one. device, rank, world, timeout_s, sharded: read from `run`."""

    batch_size: int
    capacity: int | None
    run: Run

    device = property(lambda self: self.run.device)
    rank = property(lambda self: self.run.data_rank)
    world = property(lambda self: self.run.data_world)
    timeout_s = property(lambda self: self.run.timeout_s)
    sharded = property(lambda self: self.run.sharded)


class Objective:
    name = "objective"
    stat_names: tuple[str, ...] = ()  # summed over the step's micro-batches and ranks before the loss
    metric_names: tuple[str, ...] = ()  # summed after the step, turned into logged values by report()
    progress_names: tuple[str, ...] = ()  # shown beside loss and lr on the progress bar
    needs_reference = False  # reference log-probs are precomputed once (trainer.objectives.reference)
    stats_need_model = False  # step_stats runs forwards (KTO's KL), so its batch must be on the device
    reference_names: tuple[str, ...] = ()  # one column per reference value of an example
    # set by the loop before each step: a callable giving the next step's loader batches (None: no next step in this
    # epoch), for an objective that prepares a step ahead (GRPO's async_prefetch); peeking takes nothing
    upcoming = None

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
    def check_services(cls, cfg) -> None:
        """Called by `train` before the data and the model load: a service the objective needs (GRPO's vLLM server)
        answers, or one error line now. Nothing by default."""

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

    @classmethod
    def describe(cls, cfg) -> str | None:
        """One line for validate about what `cfg` trains with this objective; None: nothing to add."""
        return None

    def evaluate(self, model, dataset, batch_size: int, capacity: int | None, run: Run,
                 reference: np.ndarray | None = None) -> dict:
        """The objective's loss and metrics over a split (eval_* keys; `reference`: the split's reference values).
        The one signature the loop and `python -m trainer evaluate` call; objectives differ in score()."""
        return self.score(model, dataset, Scoring(batch_size, capacity, run),
                          reference)

    def score(self, model, dataset, where: Scoring, reference: np.ndarray | None = None) -> dict:
        """The split as ONE step (pairs, KTO, reward models); SFT, diffusion and GRPO score their own way."""
        return evaluate_as_step(self, model, dataset, reference, where)

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
    if hasattr(model, "disable_adapter"):
        return None
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    return frozen if dtype is None else frozen.to(dtype)


@torch.no_grad()
def evaluate_as_step(objective: Objective, model, dataset, reference, where: Scoring) -> dict:
    """The objective's loss and metrics over a whole split, as ONE step: each rank its share of the batches
    with no per-batch collective, then two fixed-size all-reduces (totals, then metric sums).
    Sharded weights (FSDP, ZeRO-3) make every forward a collective: ranks first agree on the busiest rank's batch
    count and the others run filler forwards whose numbers are discarded."""
    device, rank, world, timeout_s = where.device, where.rank, where.world, where.timeout_s
    sampler = MultipackBatchSampler(objective.lengths(dataset), where.batch_size, where.capacity, EVALUATION,
                                    rank=rank, world_size=world)
    rows = objective.rows(dataset, reference)
    was_training = model.training
    model.eval()
    batches = [to_device(objective.collate([rows[r] for r in b]), device) for b in sampler]
    fillers = []
    if where.sharded and world > 1:
        most = torch.tensor([len(batches)], device=device)
        with phase("evaluation (counting batches)", rank, timeout_s):
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        filler = to_device(objective.collate([rows[[0]]]), device)  # a row is a list of example indices
        fillers = [filler] * (int(most.item()) - len(batches))
    stats = torch.zeros(len(objective.stat_names), dtype=torch.float64, device=device)
    for batch in batches:
        stats += torch.tensor(objective.step_stats(model, batch), dtype=torch.float64, device=device)
    for batch in fillers:  # takes part in the shards' all-gathers; not counted
        objective.step_stats(model, batch)
    reduce_sum(stats, "evaluation (summing eval totals)", rank, timeout_s)
    totals = dict(zip(objective.stat_names, stats.tolist()))
    sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
    for batch in batches:
        sums += objective.loss(model, batch, totals)[1].to(device)
    for batch in fillers:
        objective.loss(model, batch, totals)
    reduce_sum(sums, "evaluation (summing eval metrics)", rank, timeout_s)
    model.train(was_training)
    report = objective.report(dict(zip(objective.metric_names, sums.tolist())), totals)
    return {f"eval_{k}": v for k, v in report.items()}


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


def sequence_logps(model, batch: dict, with_all: bool = False, with_wpo: bool = False):
    """Sum of the log-probs of each sequence's completion tokens (and, with_all, of all its tokens after the first;
    with_wpo, WPO's per-sequence mean of log p(token) - log sum_v p_v^2 over its completion tokens, without gradient,
    as TRL's DPOTrainer computes its `use_weighting` weights).

    One forward over however the sequences are laid out (one per row, or packed several to a row with a
    block-diagonal mask): the sums are gathered by sequence id, so the layout does not change them.
    """
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    ids, seq, n = batch["input_ids"][:, 1:], batch["sequence_ids"], int(batch["n_sequences"])
    nxt = seq[:, 1:]
    inside = (nxt >= 0) & (nxt == seq[:, :-1])
    completion = inside & (batch["labels"][:, 1:] != IGNORE)
    slot = chunked_loss.decide(model, inputs)
    if slot is not None:  # both paths run here: this step's by cost (or the config's chunked_cross_entropy)
        scored = int((inside if with_all else completion).sum())
        if chunked_loss.choose(slot, batch["input_ids"].numel(), scored).path == "full":
            slot = None
    sum_sq = None
    if slot is not None:  # the head over the counted positions only, a chunk at a time (the logits never whole)
        hidden, head, seen = chunked_loss.forward_hidden(model, *slot, inputs)
        token_logps = chunked_loss.token_logps_from_hidden(hidden, head, seen, batch["input_ids"],
                                                           inside if with_all else completion)
        if with_wpo:
            sum_sq = chunked_loss.token_log_sum_sq_from_hidden(hidden, head, seen, completion)
    else:
        logits = model(**inputs, use_cache=False).logits
        token_logps = -F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids.flatten(),
                                       reduction="none").view_as(ids)
        if with_wpo:
            with torch.no_grad():
                sum_sq = chunked_loss.log_sum_sq_probs(logits[:, :-1])

    def total(mask, values=token_logps):
        return torch.zeros(n, dtype=values.dtype, device=ids.device).index_add(0, nxt[mask], values[mask])

    logps = (total(completion), total(inside)) if with_all else total(completion)
    if not with_wpo:
        return logps
    aligned = total(completion, token_logps.detach() - sum_sq)
    counts = total(completion, torch.ones_like(token_logps)).clamp(min=1)
    return logps, aligned / counts
