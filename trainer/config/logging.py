"""Where metrics and the final model go besides output_dir (trainer/outputs/loggers.py, trainer/outputs/hub.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator


class LoggingKeys(BaseModel):
    # loggers (besides output_dir/metrics.jsonl)
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = None
    wandb_run_id: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_watch: str | None = None
    wandb_log_model: str | None = None
    use_wandb: bool | None = None
    use_tensorboard: bool = False
    use_mlflow: bool = False
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None
    loss_watchdog_threshold: float | None = Field(None, gt=0)  # stop when the loss stays above this ...
    loss_watchdog_patience: int = Field(3, ge=1)  # ... for this many steps in a row
    hub_model_id: str | None = None  # push the final model or adapter to the hub at the end
    hub_strategy: str | None = None
    hub_revision: str | None = None  # the branch of hub_model_id pushed to (created if missing); unset: main

    @field_validator("wandb_project", "wandb_entity", "wandb_name", "wandb_run_id", "wandb_watch", "wandb_log_model",
                     "mlflow_experiment_name", "mlflow_run_name", mode="before")
    @classmethod
    def _as_text(cls, value):
        """YAML reads `wandb_name: 3.1` as a number and `wandb_watch: false` as a boolean; both are the text
        written (transformers reads WANDB_WATCH / WANDB_LOG_MODEL "false" as off)."""
        if isinstance(value, bool):
            return str(value).lower()
        return str(value) if isinstance(value, int | float) else value
