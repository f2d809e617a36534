"""The few collectives the trainer makes, each inside a named phase.

A collective that times out (ddp_timeout seconds) becomes a TrainingError that names the rank and the
phase, instead of a hang or a backend stack trace. No collective lives in a sampler or a data loader.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from trainer.errors import TrainingError

TIMEOUT_WORDS = ("timed out", "timeout", "time out")


@contextmanager
def phase(name: str, rank: int, timeout_s: float):
    try:
        yield
    except (RuntimeError, dist.DistError) as err:  # DistBackendError is a RuntimeError subclass
        if any(w in str(err).lower() for w in TIMEOUT_WORDS):
            raise TrainingError(
                f"rank {rank}: a collective timed out after {timeout_s:g}s during {name}; another rank "
                "stopped or is stuck there (see its log), or raise ddp_timeout") from err
        raise


def reduce_sum(values: torch.Tensor, name: str, rank: int, timeout_s: float) -> torch.Tensor:
    """Sum a tensor over all ranks (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with phase(name, rank, timeout_s):
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(name: str, rank: int, timeout_s: float) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with phase(name, rank, timeout_s):
            dist.barrier()
