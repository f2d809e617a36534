"""Learning-rate schedules from Axolotl beyond transformers' get_scheduler.

lr_quadratic_warmup (with lr_scheduler: cosine): the warmup rises as (step / warmup)^2 instead of linearly,
then the usual half-cosine to zero: Axolotl's get_cosine_schedule_with_quadratic_warmup. Axolotl uses it in
place of cosine_min_lr_ratio when both are set (with a warning); so does this, with a note.

jagged_restart_steps (ReLoRA's restarts; also on its own): Axolotl's JaggedLRRestartScheduler scales the
schedule by a factor that, from the first restart on, rises linearly from min_lr_scale (cosine_min_lr_ratio,
else 0.001) to 1 over jagged_restart_warmup_steps (default 10) after each restart and falls over
jagged_restart_anneal_steps (default 1) before the next one.
"""

from __future__ import annotations

import math


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


def build(cfg, optimizer, warmup: int, total: int):
    """The schedule for cfg, or None when transformers' get_scheduler builds it."""
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler == "cosine":
        from functools import partial

        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, partial(quadratic_warmup_cosine, warmup=warmup, total=total))
    return None


def jagged(cfg, scheduler):
    """Wrap a LambdaLR schedule with jagged restarts (jagged_restart_steps), else return it."""
    if not cfg.jagged_restart_steps:
        return scheduler
    from torch.optim.lr_scheduler import LambdaLR

    scale = dict(every=cfg.jagged_restart_steps, warmup=cfg.jagged_restart_warmup_steps or 10,
                 anneal=cfg.jagged_restart_anneal_steps or 1, min_scale=cfg.cosine_min_lr_ratio or 0.001)
    inner = scheduler.lr_lambdas
    optimizer = scheduler.optimizer
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):  # start over from the base rates
        group["lr"] = base
    return LambdaLR(optimizer, [lambda s, f=f: f(s) * jagged_scale(s, **scale) for f in inner])


def notes(cfg) -> list[str]:
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler != "cosine":
        return [f"lr_quadratic_warmup: no effect with lr_scheduler: {cfg.lr_scheduler} (Axolotl applies it to cosine only)"]
    if cfg.lr_quadratic_warmup and cfg.cosine_min_lr_ratio is not None:
        return ["cosine_min_lr_ratio: not applied with lr_quadratic_warmup (as in Axolotl: the quadratic-warmup "
                "cosine decays to zero)"]
    return []
