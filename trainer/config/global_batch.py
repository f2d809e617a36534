"""The global batch: micro_batch_size x data-parallel processes x gradient_accumulation_steps rows per optimizer step.

What a step trains on, and so what the loss curve means, depends only on the global batch: the sampler builds one
global list of micro-batches and a step takes the next `global batch` rows of it, whichever process holds which
(trainer/batch/sampler.py). So a run can move to another number of processes, or another micro-batch size, and
train the same steps, as long as the accumulation is rescaled to keep the product. This is the one place that
rescales it: resuming a checkpoint on another number of processes (trainer/train.py `keep_global_batch`) calls
`accumulation_for`. No torch here.
"""

from __future__ import annotations

from trainer.errors import ConfigError


def global_batch(micro_batch_size: int, processes: int, accumulation: int) -> int:
    return micro_batch_size * processes * accumulation


def accumulation_for(rows: int, micro_batch_size: int, processes: int, *, why: str = "") -> int:
    """gradient_accumulation_steps that makes `rows` rows per step from `micro_batch_size` rows on each of
    `processes` data-parallel processes. Raises ConfigError, one line naming the nearest settings that work, when
    `rows` is not a multiple of micro_batch_size x processes. `why`: what asks for the global batch (the start of
    the message, e.g. "checkpoint-40 was trained with a global batch of 12 (...)")."""
    per_step = micro_batch_size * processes
    if rows % per_step == 0:
        return rows // per_step
    raise ConfigError(f"{why or f'a global batch of {rows} rows'} cannot be kept with micro_batch_size "
                      f"{micro_batch_size} on {processes} process(es) ({rows} is not a multiple of {per_step}); "
                      + nearest(rows, micro_batch_size, processes))


def nearest(rows: int, micro_batch_size: int, processes: int) -> str:
    """The closest settings that keep `rows` per step: another number of processes with this micro_batch_size,
    or another micro_batch_size on these processes."""
    options = []
    counts = [p for p in range(1, rows + 1) if rows % (micro_batch_size * p) == 0]
    below = [p for p in counts if p < processes]
    above = [p for p in counts if p > processes]
    for p in ([below[-1]] if below else []) + ([above[0]] if above else []):
        options.append(f"{p} process(es) (gradient_accumulation_steps {rows // (micro_batch_size * p)})")
    sizes = [m for m in range(1, rows + 1) if rows % (m * processes) == 0]
    if sizes:
        m = min(sizes, key=lambda m: (abs(m - micro_batch_size), m))
        options.append(f"micro_batch_size {m} on {processes} (gradient_accumulation_steps {rows // (m * processes)})")
    if not options:
        return "no setting on this many processes keeps it"
    return "use " + " or ".join(options)
