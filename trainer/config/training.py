"""Training and evaluation keys: their rules and notes."""

from __future__ import annotations


def eval_table_notes(cfg) -> list[str]:
    """eval_table_size without a tracker that takes tables (the config refuses it with one)."""
    if cfg.eval_table_size:  # (with a tracker the config refuses it)
        return ["eval_table_size: ignored (Axolotl logs prediction tables only to wandb, mlflow or comet, and none "
                "is configured)"]
    return []
