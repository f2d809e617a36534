"""Learning-rate schedules from Axolotl beyond transformers' get_scheduler.

lr_quadratic_warmup (with lr_scheduler: cosine): the warmup rises as (step / warmup)^2 instead of linearly,
then the usual half-cosine to zero: Axolotl's get_cosine_schedule_with_quadratic_warmup. Axolotl uses it in
place of cosine_min_lr_ratio when both are set (with a warning); so does this, with a note.
"""

from __future__ import annotations

import math


def quadratic_warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step / max(1, warmup)) ** 2
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build(cfg, optimizer, warmup: int, total: int):
    """The schedule for cfg, or None when transformers' get_scheduler builds it."""
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler == "cosine":
        from functools import partial

        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, partial(quadratic_warmup_cosine, warmup=warmup, total=total))
    return None


def notes(cfg) -> list[str]:
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler != "cosine":
        return [f"lr_quadratic_warmup: no effect with lr_scheduler: {cfg.lr_scheduler} (Axolotl applies it to cosine only)"]
    if cfg.lr_quadratic_warmup and cfg.cosine_min_lr_ratio is not None:
        return ["cosine_min_lr_ratio: not applied with lr_quadratic_warmup (as in Axolotl: the quadratic-warmup "
                "cosine decays to zero)"]
    return []
