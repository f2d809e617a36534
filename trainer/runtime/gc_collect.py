"""gc_collect_steps (Axolotl's key since v0.17): Python's garbage collector, then the accelerator's cache emptied,
every N optimizer steps and around evaluations and saves, as Axolotl's GCCallback (axolotl/utils/callbacks, 0.19)
does it:

    at the start                  once (Axolotl: train begin and step 0)
    after a step (before what     an evaluation follows: now, and again at the start of the second step after it
    follows it)                   (Axolotl's next_gc_on_begin_step); else every N steps (N > 0; -1: only at
                                  evaluations and saves); else a save follows, or the last step with saves on
    at an epoch's end             not here: the loop's hooks have no such point (a collection every N steps or at
                                  a save still runs)

Each collection is accelerate's clear_device_cache(garbage_collection=True): gc.collect(), then the device's
empty_cache (CUDA, XPU, MPS ...; nothing more on the CPU), as Axolotl's gc.collect() + torch.cuda.empty_cache().
Memory only: the weights, the data and the schedule are the same with it or without it.

Added as one feature of the feature list (trainer/config/features.py): this module, and its entry there, which
declares the key.
"""

from __future__ import annotations

from trainer.hooks import Hook


class CollectEvery(Hook):
    def __init__(self, training, every: int):
        self.training = training  # its eval_every, save_every and total_steps, set once the data is counted
        self.every = every
        self.next = -1  # the step whose start collects again (after an evaluation)
        self.collected: list[int] = []  # the steps after which it collected (start: 0)

    def collect(self, step: int) -> None:
        # heavy: accelerate (and torch) load only when a collection runs; validate reads this module without them
        from accelerate.utils.memory import clear_device_cache

        clear_device_cache(garbage_collection=True)
        self.collected.append(step)

    def start(self, state: dict, checkpoint) -> None:
        self.collect(state.get("step", 0))

    def before_step(self, step: int) -> None:
        if step == self.next:
            self.collect(step)

    def after_step(self, step: int) -> None:
        t = self.training
        if t.eval_every and step % t.eval_every == 0 and step < t.total_steps:  # an evaluation follows
            self.collect(step)
            self.next = step + 1
        elif self.every > 0 and step % self.every == 0:
            self.collect(step)
        elif t.save_every and (step % t.save_every == 0 or step >= t.total_steps):  # a save follows, or the end
            self.collect(step)


def hook(training) -> Hook | None:
    every = training.cfg.gc_collect_steps
    return CollectEvery(training, every) if every else None


def line(cfg) -> str | None:
    every = cfg.gc_collect_steps
    if not every:
        return None
    when = f"every {every} steps and " if every > 0 else ""
    return f"memory: Python's garbage collected {when}before each evaluation and save (gc_collect_steps)"
