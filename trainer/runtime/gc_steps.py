"""gc_collect_steps (Axolotl's key): Python's garbage collector and the accelerator's cached-memory release every
N optimizer steps, for runs whose memory grows between collections (reference cycles holding tensors)."""

from __future__ import annotations

import gc

from trainer.hooks import Hook


class CollectEvery(Hook):
    def __init__(self, steps: int):
        self.steps = steps
        self.collections = 0

    def after_step(self, step: int) -> None:
        if step % self.steps:
            return
        gc.collect()
        import torch  # (here: the module is read by validate, which need not import torch)

        for backend in (torch.cuda, getattr(torch, "xpu", None), getattr(torch, "mps", None)):
            if backend is not None and backend.is_available():
                backend.empty_cache()
        self.collections += 1


def hook(cfg) -> Hook | None:
    return CollectEvery(cfg.gc_collect_steps) if cfg.gc_collect_steps else None


def line(cfg) -> str | None:
    return f"memory: gc.collect() and the accelerator's cache emptied every {cfg.gc_collect_steps} steps" \
        if cfg.gc_collect_steps else None
