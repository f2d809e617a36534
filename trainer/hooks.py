"""How a feature takes part in the training loop without a branch in it: a Hook.

trainer/train.py asks each feature module for its hook (`hook(cfg, ...)` returns None when the config does not
use the feature) and calls every hook at these points of every run, in the order they were made:

    start(state, checkpoint)       the weights are the starting ones (a resumed checkpoint's, if any)
    before_step(step)              `step` steps done; the next one is about to draw its batches
    forward()                      a context each micro-batch's forward, loss and backward run in (activation
                                   offloading's save_on_cpu)
    after_step(step)               the optimizer has stepped; `step` steps done
    after_evaluation(step, result) an evaluation's result; True stops training after this step
    on_save(step)                  what the checkpoint written at `step` keeps for the hook (Saved)
    end(step)                      training is over (after the last evaluation), before the final model is gathered
    save_final(model, directory, tokenizer)   the final model's last change before it is written; True when the
                                   hook wrote the model itself

A hook overrides only what it needs. The loop's own work (accumulation, clipping, logging, evaluation and save
cadence) stays in the loop; everything a feature adds to it lives with the feature: QAT's fake-quant schedule
(trainer/model/qat.py), LISA (trainer/optim/lisa.py), ReLoRA (trainer/model/relora.py), sparsity's masks
(trainer/model/sparsity.py), diffusion's samples (trainer/objectives/diffusion_steps.py), early stopping
(trainer/outputs/early_stopping.py). Lives at the bottom of the house (it imports nothing) so every wing can
implement it.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class Run:
    """Where and how this process trains: what hooks, objectives' evaluation and reference passes and the
    checkpoint writer read instead of loose rank/world/device/timeout arguments (trainer.train builds it once;
    `python -m trainer evaluate` and tests build a one-process one with `Run(cfg, device)`)."""

    cfg: Any  # the validated config
    device: Any = "cpu"  # torch device (or its name)
    rank: int = 0  # this process among all of them
    world: int = 1
    data_rank: int = 0  # this process's share of the data (ranks of one tensor/context-parallel group share one)
    data_world: int = 1
    timeout_s: float = 1800.0  # collectives' timeout (ddp_timeout)
    output_dir: Path | None = None
    sharded: bool = False  # the weights are sharded (FSDP, ZeRO-3): every forward is a collective
    say: Callable[[str], None] = print  # the one way to print (rank 0 only, in a distributed run)

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass
class Saved:
    """What a hook adds to a checkpoint."""

    state: dict = field(default_factory=dict)  # merged into the checkpoint's trainer state (trainer_state.json)
    tensors: dict[str, dict] = field(default_factory=dict)  # extra safetensors files: {path in it: tensors}
    keep: str | None = None  # a checkpoint save_total_limit must not delete


class Hook:
    def start(self, state: dict, checkpoint: Path | None) -> None:
        """`state`: the resumed checkpoint's trainer state ({} for a fresh run); `checkpoint`: its directory."""

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def forward(self):
        """A context manager around a micro-batch's forward, loss and backward (None: nothing)."""
        return None

    def after_evaluation(self, step: int, result: dict) -> bool:
        return False

    def on_save(self, step: int) -> Saved | None:
        return None

    def end(self, step: int) -> None:
        pass

    def save_final(self, model, directory: Path, tokenizer) -> bool:
        return False


class Hooks:
    """The run's hooks, called in order."""

    def __init__(self, hooks):
        self.hooks = [h for h in hooks if h is not None]

    def start(self, state: dict, checkpoint: Path | None) -> None:
        for h in self.hooks:
            h.start(state, checkpoint)

    def before_step(self, step: int) -> None:
        for h in self.hooks:
            h.before_step(step)

    def after_step(self, step: int) -> None:
        for h in self.hooks:
            h.after_step(step)

    def forward(self):
        stack = ExitStack()
        for h in self.hooks:
            context = h.forward()
            if context is not None:
                stack.enter_context(context)
        return stack

    def after_evaluation(self, step: int, result: dict) -> bool:
        return any([h.after_evaluation(step, result) for h in self.hooks])  # (a list: every hook sees it)

    def on_save(self, step: int) -> Saved:
        saved = Saved()
        for h in self.hooks:
            part = h.on_save(step)
            if part is not None:
                saved.state.update(part.state)
                saved.tensors.update(part.tensors)
                saved.keep = saved.keep or part.keep
        return saved

    def end(self, step: int) -> None:
        for h in self.hooks:
            h.end(step)

    def save_final(self, model, directory: Path, tokenizer) -> bool:
        return any([h.save_final(model, directory, tokenizer) for h in self.hooks])
