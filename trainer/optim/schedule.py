"""The learning-rate schedule, chosen as Axolotl's SchedulerMixin.create_scheduler chooses it
(src/axolotl/core/trainers/mixins/scheduler.py at 067b021):

- lr_scheduler: cosine with cosine_min_lr_ratio AND cosine_constant_lr_ratio both non-zero: Axolotl's
  get_cosine_schedule_with_warmup_decay_constant -- linear warmup, then cosine from learning_rate down to
  cosine_min_lr_ratio x learning_rate, reached at cosine_constant_lr_ratio x the total steps, flat after.
- cosine with cosine_min_lr_ratio non-zero: cosine decaying to that floor (transformers' cosine_with_min_lr,
  the same formula as Axolotl's get_cosine_schedule_with_min_lr).
- otherwise transformers' get_scheduler for the named schedule (constant: constant_with_warmup); linear, cosine,
  cosine_with_min_lr and constant_with_warmup are its own formulas built here (`warmup_schedule`), as importing
  get_scheduler imports peft and bitsandbytes.

Axolotl tests the ratios for truth, so 0 means "not set" (its 3b-qat examples set cosine_constant_lr_ratio: 0
with cosine_min_lr_ratio: 1.0: warmup, then a constant learning rate), and it uses them only with cosine.

lr_quadratic_warmup (with cosine), checked first as Axolotl does: the warmup rises as (step / warmup)^2, then
the usual half-cosine to zero (get_cosine_schedule_with_quadratic_warmup); cosine_min_lr_ratio is then not
applied (a note says so).

one_cycle: torch's OneCycleLR peaking at learning_rate over the run, pct_start the warmup's share and a cosine
anneal unless lr_scheduler_kwargs say otherwise (its other arguments, e.g. div_factor, come from there too).
rex: the Reflected Exponential schedule (arXiv 2107.04197) as Axolotl's RexLR computes it: linear warmup, then
the factor m + (1 - m) * z / (0.1 + 0.9 z) with z the share of post-warmup steps left, m = cosine_min_lr_ratio (0
when unset). lr_scheduler_kwargs go to transformers' get_scheduler (its scheduler_specific_kwargs) and to
OneCycleLR, as Axolotl passes them; Axolotl's own cosine variants and rex take none (a note says so).

jagged_restart_steps (ReLoRA's restarts; also on its own) wraps whichever schedule was chosen: Axolotl's
JaggedLRRestartScheduler scales it by a factor that, from the first restart on, rises linearly from
min_lr_scale (cosine_min_lr_ratio, else 0.001) to 1 over jagged_restart_warmup_steps (default 10) after each
restart and falls over jagged_restart_anneal_steps (default 1) before the next one.
"""

from __future__ import annotations

import math
from functools import partial


def decay_constant_factor(step: int, *, warmup: int, total: int, constant_ratio: float, min_ratio: float,
                          num_cycles: float = 0.5) -> float:
    """The learning-rate multiplier of Axolotl's _get_cosine_schedule_with_warmup_decay_constant_lr_lambda
    (src/axolotl/utils/schedulers.py at 067b021; "Continual Pre-Training of LLMs", arXiv 2308.04014)."""
    if step < warmup:
        return step / max(1, warmup)
    decay_end = int(total * constant_ratio)
    progress = (min(step, decay_end) - warmup) / max(1, decay_end - warmup)
    return max(0.0, (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))) + min_ratio


def quadratic_warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step / max(1, warmup)) ** 2
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def jagged_scale(step: int, every: int, warmup: int, anneal: int, min_scale: float) -> float:
    if step < every - anneal:
        return 1.0
    progress = step % every
    if progress < warmup:
        t = min(1.0, progress / warmup)
    elif progress > every - anneal:
        t = min(1.0, (every - progress) / anneal)
    else:
        t = 1.0
    return t * (1 - min_scale) + min_scale


def rex_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The multiplier of learning_rate at LambdaLR step `step` (Axolotl's RexLR.get_lr at its last_step = step + 1:
    RexLR starts counting one step later; src/axolotl/utils/schedulers.py, checked against it in
    tests/trainer/optim/test_schedules.py)."""
    step += 1
    if 1 <= step <= warmup:
        return step / warmup
    after, remaining = step - warmup, total - warmup
    if after >= remaining or after == -1 or remaining <= 0:
        return min_ratio
    z = (remaining - after % remaining) / remaining
    return min_ratio + (1.0 - min_ratio) * (z / (0.1 + 0.9 * z))


def warmup_steps(cfg, total_steps: int) -> int:
    """warmup_steps (a float below 1 is a fraction of the steps, as transformers v5's TrainingArguments reads
    the value Axolotl passes it), else warmup_ratio of the steps, rounded up."""
    given = cfg.warmup_steps
    if given is not None and given >= 1:
        return int(given)
    return math.ceil((given if given is not None else cfg.warmup_ratio or 0) * total_steps)


def make_scheduler(cfg, optimizer, warmup: int, total_steps: int):
    """The schedule Axolotl builds for cfg, with jagged restarts around it when jagged_restart_steps is set."""
    return jagged(cfg, _schedule(cfg, optimizer, warmup, total_steps))


def _schedule(cfg, optimizer, warmup: int, total_steps: int):
    from torch.optim.lr_scheduler import LambdaLR  # heavy: torch loads only when training

    kwargs = dict(cfg.lr_scheduler_kwargs or {})
    if cfg.lr_scheduler == "one_cycle":
        from torch.optim.lr_scheduler import OneCycleLR

        from trainer.config.training import one_cycle_args

        return OneCycleLR(optimizer, **one_cycle_args(cfg, warmup, total_steps))
    if cfg.lr_scheduler == "rex":
        return LambdaLR(optimizer, partial(rex_factor, warmup=warmup, total=total_steps,
                                           min_ratio=cfg.cosine_min_lr_ratio or 0.0))
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler == "cosine":
        return LambdaLR(optimizer, partial(quadratic_warmup_cosine, warmup=warmup, total=total_steps))
    if cfg.lr_scheduler == "cosine" and cfg.cosine_min_lr_ratio and cfg.cosine_constant_lr_ratio:
        return LambdaLR(optimizer, partial(decay_constant_factor, warmup=warmup, total=total_steps,
                                           constant_ratio=cfg.cosine_constant_lr_ratio,
                                           min_ratio=cfg.cosine_min_lr_ratio))
    if cfg.lr_scheduler == "cosine" and cfg.cosine_min_lr_ratio:  # Axolotl's get_cosine_schedule_with_min_lr: no kwargs
        kwargs = {}
    schedule = "constant_with_warmup" if cfg.lr_scheduler == "constant" else cfg.lr_scheduler
    extra = {}
    if cfg.cosine_min_lr_ratio is not None and schedule == "cosine":  # Axolotl's floor for the cosine decay
        schedule, extra = "cosine_with_min_lr", {"min_lr_rate": cfg.cosine_min_lr_ratio}
    own = warmup_schedule(schedule, optimizer, warmup, total_steps, {**extra, **kwargs})
    if own is not None:
        return own
    from transformers import get_scheduler  # heavy: imports peft and bitsandbytes (transformers.trainer_utils)

    return get_scheduler(schedule, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs={**extra, **kwargs})


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _cosine_with_min_lr(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5,
                        min_lr_rate: float = 0.0) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


# transformers' get_scheduler names built here (its lambdas, in transformers/optimization.py, as LambdaLR over a
# partial), with the scheduler_specific_kwargs each reads; tests/trainer/optim/test_schedule_choices.py checks them
# against get_scheduler step for step. Anything else goes to get_scheduler itself.
WARMUP_SCHEDULES = {"linear": (_linear, ()), "cosine": (_cosine, ("num_cycles",)),
                    "cosine_with_min_lr": (_cosine_with_min_lr, ("num_cycles", "min_lr_rate"))}


def warmup_schedule(name: str, optimizer, warmup: int, total_steps: int, kwargs: dict):
    """transformers' get_scheduler(name, ...) for linear, cosine, cosine_with_min_lr (from min_lr_rate) and
    constant_with_warmup, built without importing transformers.optimization, which imports peft and bitsandbytes
    (about 1.5 s of every run's start); None for any other schedule, or kwargs these do not take."""
    from torch.optim.lr_scheduler import LambdaLR  # heavy: torch loads only when training

    if type(optimizer).__module__.startswith("transformers"):  # its layer-wise optimizers: get_scheduler's own path
        return None
    if name == "constant_with_warmup":  # (get_scheduler passes it no scheduler_specific_kwargs)
        return LambdaLR(optimizer, partial(_constant_with_warmup, num_warmup_steps=warmup))
    factor, takes = WARMUP_SCHEDULES.get(name, (None, ()))
    if factor is None or not set(kwargs) <= set(takes):
        return None
    if name == "cosine_with_min_lr" and "min_lr_rate" not in kwargs:  # (get_scheduler's ValueError names it)
        return None
    return LambdaLR(optimizer, partial(factor, num_warmup_steps=warmup, num_training_steps=total_steps, **kwargs))


def jagged(cfg, scheduler):
    """Wrap a LambdaLR schedule with jagged restarts (jagged_restart_steps), else return it."""
    if not cfg.jagged_restart_steps:
        return scheduler
    # heavy: torch loads only when this runs
    from torch.optim.lr_scheduler import LambdaLR

    scale = dict(every=cfg.jagged_restart_steps, warmup=cfg.jagged_restart_warmup_steps or 10,
                 anneal=cfg.jagged_restart_anneal_steps or 1, min_scale=cfg.cosine_min_lr_ratio or 0.001)
    inner = scheduler.lr_lambdas
    optimizer = scheduler.optimizer
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):  # start over from the base rates
        group["lr"] = base
    return LambdaLR(optimizer, [lambda s, f=f: f(s) * jagged_scale(s, **scale) for f in inner])
