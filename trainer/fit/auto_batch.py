"""`micro_batch_size: auto` (and Axolotl's `auto_find_batch_size: true`): the micro-batch the GPU holds.

The step's batch per process is kept: `micro_batch_size x gradient_accumulation_steps` as written (`auto` counts as
1, so `gradient_accumulation_steps` is then the batch per step). The loss is normalised per token over the whole
step, so any split of it trains the same; only memory and speed change.

1. **Pick** (at the run's start, before the model loads): the largest micro-batch dividing the step's batch whose
   estimated peak fits the GPU's memory (trainer/fit/memory.py, the estimate `envtool fit` prints); the whole
   step's batch on the CPU (no GPU memory to estimate); 1 where the model's shape is unknown. A resumed run keeps
   the split its checkpoints were written with (the data position counts micro-batches).
2. **Back off** (trainer/train.py): an out-of-memory error before the run's first optimizer step halves the
   micro-batch (the largest divisor of the step's batch at most half of it) and doubles the accumulation, then
   starts the step again with fresh batches. One process only: with several, one rank's error would leave the
   others waiting in a collective, so there the error stops the run with the split to set.
3. **Record**: `output_dir/micro_batch.json` (written atomically) holds the split, how it was chosen and each
   back-off.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FILE = "micro_batch.json"


@dataclass
class Choice:
    micro_batch_size: int
    gradient_accumulation_steps: int
    chosen_by: str  # a sentence: the estimate on which GPU, the CPU, the resumed run's record
    backoffs: list[dict] = field(default_factory=list)  # {"micro_batch_size": tried, "error": first line}

    @property
    def batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps


def choose(cfg, runtime, world: int, resuming: bool) -> Choice | None:
    """The split for this run (None without auto_find_batch_size). Sets cfg's micro_batch_size and
    gradient_accumulation_steps to it."""
    if not cfg.auto_find_batch_size:
        return None
    batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    recorded = Path(cfg.output_dir) / FILE
    choice = None
    if resuming and recorded.is_file():
        data = json.loads(recorded.read_text())
        if data.get("micro_batch_size", 0) * data.get("gradient_accumulation_steps", 0) == batch:
            choice = Choice(data["micro_batch_size"], data["gradient_accumulation_steps"],
                            f"as recorded in {recorded} (the run resumes)", data.get("backoffs", []))
    if choice is None and runtime.gpu.memory_gb is None:
        choice = Choice(batch, 1, f"the whole step's batch: no GPU memory to estimate on {runtime.gpu.describe()}")
    if choice is None:
        # start-up: trainer.fit.memory_model imported only when this runs
        from trainer.fit import memory, memory_model

        gpu = memory.Gpu(runtime.gpu.name, runtime.gpu.memory_gb, world)
        try:
            found = memory.report(cfg, runtime, gpu)
        except memory_model.ModelConfigError as err:
            found = memory.Report(memory.unknown(gpu, str(err)), cfg.base_model, reason=str(err))
        if found.estimate is None:
            choice = Choice(1, batch, f"1: the memory estimate is unknown ({found.reason})")
        else:
            m = found.estimate.setup.micro_batch
            choice = Choice(m, batch // m, f"the largest that fits {gpu.name} ({gpu.memory_gb:g} GB) at the estimate "
                            f"({memory.one_line(found)})")
    apply(cfg, choice)
    return choice


def apply(cfg, choice: Choice) -> None:
    cfg.micro_batch_size = choice.micro_batch_size
    cfg.gradient_accumulation_steps = choice.gradient_accumulation_steps


def back_off(choice: Choice, error: BaseException) -> Choice | None:
    """The next smaller split after an out-of-memory error at `choice` (None at a micro-batch of 1)."""
    m = choice.micro_batch_size
    smaller = [d for d in range(1, m // 2 + 1) if choice.batch % d == 0]
    if not smaller:
        return None
    first = (str(error).splitlines() or [type(error).__name__])[0][:300]
    new = max(smaller)
    return Choice(new, choice.batch // new, choice.chosen_by,
                  [*choice.backoffs, {"micro_batch_size": m, "error": first}])


def describe(choice: Choice) -> str:
    text = (f"micro_batch_size auto: {choice.micro_batch_size} x gradient_accumulation_steps "
            f"{choice.gradient_accumulation_steps} ({choice.chosen_by})")
    if choice.backoffs:
        text += "; backed off from " + ", ".join(str(b["micro_batch_size"]) for b in choice.backoffs)
    return text


def record(output_dir: Path, choice: Choice) -> Path:
    """output_dir/micro_batch.json, atomically."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**asdict(choice), "batch_per_step": choice.batch}, indent=2) + "\n")
    tmp.replace(path)
    return path
