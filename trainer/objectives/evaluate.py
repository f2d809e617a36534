"""Evaluation: mean loss over every target token of the validation split.

Each rank evaluates its share of the batches with no per-batch collective (ranks may hold one batch
more or less), then a single all-reduce sums loss and token counts. The result does not depend on
packing, batch size or the number of processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.batch.collate import Collator, Rows, count_targets
from trainer.batch.sampler import EVALUATION, MultipackBatchSampler
from trainer.hooks import Run
from trainer.objectives.loss import token_loss_sum
from trainer.parallel.collective import phase
from trainer.parallel.collective import reduce_sum


@torch.no_grad()
def evaluate(model, dataset, collator: Collator, batch_size: int, capacity: int | None, run: Run,
             loss_sum=token_loss_sum) -> dict:
    """Mean token loss over this rank's share (run.data_rank of run.data_world) of the split.
    loss_sum: the summed token loss (EAFT's weighted one with use_eaft). run.sharded: the weights are sharded (FSDP,
    DeepSpeed ZeRO-3), so every forward pass is a collective and all
    ranks must run as many as the busiest rank: the others run extra forward passes whose loss is discarded."""
    device, rank, world_size, timeout_s, sharded = run.device, run.data_rank, run.data_world, run.timeout_s, run.sharded
    sampler = MultipackBatchSampler(dataset["length"], batch_size, capacity, EVALUATION, rank=rank,
                                    world_size=world_size)
    rows = Rows(dataset)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    batches = list(sampler)
    steps = len(batches)
    if sharded and world_size > 1:  # agree on the count first: every forward below is a collective

        most = torch.tensor([steps], device=device)
        with phase("evaluation (counting batches)", rank, timeout_s):
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        steps = int(most.item())
    for i in range(steps):
        if i < len(batches):
            batch = {k: v.to(device) for k, v in collator([rows[r] for r in batches[i]]).items()}
            totals[0] += loss_sum(model, batch).double()
            totals[1] += count_targets(batch)
        else:  # takes part in the shards' all-gathers; its loss is not counted
            loss_sum(model, {k: v.to(device) for k, v in collator([rows[[0]]]).items()})
    reduce_sum(totals, "evaluation (summing eval loss)", rank, timeout_s)
    model.train(was_training)
    loss_sum, tokens = totals.tolist()
    return {"eval_loss": loss_sum / tokens if tokens else float("nan"), "eval_tokens": int(tokens)}
