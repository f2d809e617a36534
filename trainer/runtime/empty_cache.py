"""torch_empty_cache_steps (Axolotl's key, transformers' TrainingArguments.torch_empty_cache_steps): the
accelerator's cached memory released every N optimizer steps (Python's garbage collector first), lowering peak
memory at some speed, as transformers' Trainer does with accelerate's `clear_device_cache`.

Added as one feature of trainer/features.py: this module, and one entry on FEATURES (plus the key in the config's
schema and its decision in matrices/axolotl_keys.toml)."""

from __future__ import annotations

from trainer.hooks import Hook


class EmptyCacheEvery(Hook):
    def __init__(self, steps: int):
        self.steps = steps
        self.emptied = 0

    def after_step(self, step: int) -> None:
        if step % self.steps:
            return
        # heavy: accelerate loads only when this runs
        from accelerate.utils.memory import clear_device_cache  # (here: validate reads this module without torch)

        clear_device_cache(garbage_collection=True)
        self.emptied += 1


def hook(run) -> Hook | None:
    steps = run.cfg.torch_empty_cache_steps
    return EmptyCacheEvery(steps) if steps else None


def line(cfg) -> str | None:
    steps = cfg.torch_empty_cache_steps
    return f"memory: the accelerator's cache emptied every {steps} steps (torch_empty_cache_steps)" if steps else None
