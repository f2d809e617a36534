"""Training and evaluation keys: their rules and notes."""

from __future__ import annotations

from trainer.errors import ConfigError


def eval_table_notes(cfg) -> list[str]:
    """eval_table_size without a tracker that takes tables (the config refuses it with one)."""
    if cfg.eval_table_size:  # (with a tracker the config refuses it)
        return ["eval_table_size: ignored (Axolotl logs prediction tables only to wandb, mlflow or comet, and none "
                "is configured)"]
    return []


def one_process_only(cfg, processes: int) -> None:
    """Features that run in one process here: refused when more are launched, before anything loads."""
    if processes <= 1:
        return
    if cfg.lisa_n_layers:
        raise ConfigError("lisa_n_layers: runs in one process here (DDP reduces a gradient for every parameter it "
                          "was built with, so frozen layers would still be decayed and moved)")
    if cfg.relora:
        raise ConfigError("relora: runs in one process here (each rank would re-draw its own LoRA at a restart)")
