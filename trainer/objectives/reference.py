"""Reference log-probs, computed once before training and cached beside the tokenized data. No reference
model is ever kept: the reference is the model as loaded, before any step (with LoRA, the base with the
adapter disabled -- which is also right when a run resumes with a trained adapter).

Each rank computes its share of the examples (the evaluation sampler's split: ranks may differ by a batch)
with NO collective of its own: it writes its shard atomically, then waits for the other ranks' shard files,
with the data-preparation timeout, naming the ranks it is still waiting for. So neither uneven lengths nor
a slow rank can turn this into a collective that times out with a backend stack trace.

With sharded weights (FSDP, DeepSpeed ZeRO-3) every forward pass is itself a collective (the shards are
gathered), so there the ranks first agree, in one all-reduce, on the busiest rank's batch count, and the
others run as many filler forwards (one example, its values discarded) -- as the evaluation does.

Cache: <dataset cache>/reference-<key>/<split>.npy, the key hashing the model (config and weight files'
names, sizes and mtimes), the precision, the attention backend, the adapter and quantization settings and
the objective's kind. A repeated or resumed run reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainer.batch.sampler import EVALUATION, MultipackBatchSampler
from trainer.errors import TrainerError
from trainer.hooks import Run
from trainer.objectives import capacity
from trainer.objectives.base import Objective, to_device
from trainer.parallel.collective import phase

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".pt")


def model_identity(source: str) -> str:
    """What the weights are: file names, sizes and mtimes of a local directory (or of the hub snapshot)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        try:
            # heavy: transformers loads only when this runs
            from transformers.utils import cached_file

            path = Path(cached_file(source, "config.json")).parent  # .../snapshots/<commit>/
        except Exception:  # not downloadable here: the name is all we know
            return source
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return json.dumps([str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


def reference_key(cfg, runtime, objective: Objective) -> str:
    relevant = {
        "model": model_identity(cfg.base_model),
        "precision": runtime.precision,
        "attention": runtime.attention,
        "adapter": cfg.adapter,
        "quantization": [getattr(cfg, k, None) for k in ("load_in_4bit", "load_in_8bit")],
        "bitnet": getattr(cfg, "use_onebitllms", False),
        "reference": objective.reference_names,
        "kind": "kto" if objective.name == "kto" else "pairs",
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _is_peft(model) -> bool:
    try:
        # heavy: peft loads only when this runs
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _busiest(count: int, device, rank: int, timeout_s: float) -> int:
    """The most batches any rank has (one all-reduce: every rank calls it)."""
    most = torch.tensor([count], device=device)
    with phase("reference log-probs (counting batches)", rank, timeout_s):
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _shard(objective, model, dataset, batch_size: int, capacity, run: Run, autocast) -> np.ndarray:
    """[rows, 1 + k]: example index, then its reference values (run.rank's share of run.world). run.sharded: every
    forward is a collective, so every rank runs as many as the busiest rank (the extra ones on one example, not
    kept); they time out after cfg.dataset_prepare_timeout."""
    device, rank, world, sharded = run.device, run.rank, run.world, run.sharded
    timeout_s = run.cfg.dataset_prepare_timeout
    sampler = MultipackBatchSampler(objective.lengths(dataset), batch_size, capacity, EVALUATION, rank=rank,
                                    world_size=world)
    rows = objective.rows(dataset)
    out = [np.zeros((0, 1 + len(objective.reference_names)))]
    batches = list(sampler)
    steps = _busiest(len(batches), device, rank, timeout_s) if sharded and world > 1 else len(batches)
    for i in range(steps):
        if i >= len(batches):  # takes part in the shards' all-gathers; its values are not kept
            with autocast():
                objective.reference(model, to_device(objective.collate([rows[[0]]]), device))
            continue
        batch_rows = batches[i]
        batch = to_device(objective.collate([rows[r] for r in batch_rows]), device)
        with autocast():
            values = objective.reference(model, batch).double().cpu().numpy()
        index = np.array([e for row in batch_rows for e in row], dtype=np.float64)[:, None]
        out.append(np.concatenate([index, values], axis=1))
    return np.concatenate(out)


def _wait_for(paths: dict[int, Path], rank: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while missing := [r for r, p in paths.items() if not p.exists()]:
        if time.monotonic() > deadline:
            raise TrainerError(f"rank {rank} waited {timeout_s:g}s for the reference log-probs of rank(s) "
                               f"{', '.join(map(str, missing))}; see their logs, or raise dataset_prepare_timeout")
        time.sleep(0.2)


def reference_logps(objective: Objective, model, data, runtime, run: Run, autocast=None) -> dict[str, np.ndarray]:
    """{"train": [n, k], "validation": [m, k]} reference values per example, from the cache or computed now, this
    rank's share (run.rank of run.world) computed here. run.sharded: the weights are sharded (FSDP, ZeRO-3): every
    rank must call this (it runs collectives)."""
    cfg, rank, world, sharded, log = run.cfg, run.rank, run.world, run.sharded, run.say
    root = Path(data.path) / f"reference-{reference_key(cfg, runtime, objective)}"
    splits = {"train": data.train, "validation": data.validation}
    out, todo = {}, []
    for split, dataset in splits.items():
        if dataset is None:
            continue
        final = root / f"{split}.npy"
        if final.exists():
            out[split] = np.load(final)
        else:
            todo.append((split, dataset))
    if not todo:
        log(f"reusing the reference log-probs in {root}")
        return out
    root.mkdir(parents=True, exist_ok=True)
    log(f"computing reference log-probs once, into {root}")
    was_training = model.training
    model.eval()
    adapter_off = model.disable_adapter() if _is_peft(model) else nullcontext()  # LoRA: the base is the reference
    batch_size = cfg.eval_batch_size or cfg.micro_batch_size

    bins = capacity(cfg, cfg.packing_for_eval)
    layout = f"of-{world}-b{batch_size}-c{bins or 0}"  # which examples each rank's shard holds
    with torch.no_grad(), adapter_off:
        for split, dataset in todo:
            shard = root / f"{split}.shard-{rank}-{layout}.npy"
            # a shard from an interrupted run is complete (atomic) and still right; sharded, every rank
            # computes again (its forwards are collectives the other ranks take part in)
            if sharded or not shard.exists():
                _save_atomic(shard, _shard(objective, model, dataset, batch_size, bins, run,
                                           autocast or nullcontext))
    model.train(was_training)
    for split, dataset in todo:
        shards = {r: root / f"{split}.shard-{r}-{layout}.npy" for r in range(world)}
        _wait_for(shards, rank, cfg.dataset_prepare_timeout)
        merged = np.concatenate([np.load(p) for p in shards.values()])
        values = np.full((len(dataset), len(objective.reference_names)), np.nan, dtype=np.float32)
        values[merged[:, 0].astype(np.int64)] = merged[:, 1:]
        if np.isnan(values).any():
            raise TrainerError(f"reference log-probs in {root} do not cover every {split} example; delete the directory")
        if rank == 0:
            _save_atomic(root / f"{split}.npy", values)
        out[split] = values
    return out
