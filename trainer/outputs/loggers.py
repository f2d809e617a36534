"""Where metrics go: output_dir/metrics.jsonl (MetricsLog), Weights & Biases, TensorBoard, MLflow; and the loss watchdog.

- wandb_project (or use_wandb): a wandb run in output_dir/wandb. wandb_mode online/offline/disabled as given;
  unset, it is online when wandb has credentials (WANDB_API_KEY or a `wandb login`) and offline otherwise, so
  a machine with no network or key still records the run (`wandb sync` uploads it later).
- use_tensorboard: event files in output_dir/runs (the HF Trainer's place), through torch.utils.tensorboard.
- use_mlflow: an MLflow run; mlflow_tracking_uri unset means a local file store in output_dir/mlruns.
- loss_watchdog_threshold / loss_watchdog_patience: stop a run whose loss stays above the threshold for
  `patience` logged steps in a row, with a TrainingError naming the step (exit code 1).

Only rank 0 logs. A missing package is a ConfigError naming it, raised before training starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from trainer.errors import ConfigError, TrainingError

PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def wanted(cfg) -> list[str]:
    names = []
    if cfg.use_wandb or (cfg.wandb_project and cfg.use_wandb is not False):
        names.append("wandb")
    if cfg.use_tensorboard:
        names.append("tensorboard")
    if cfg.use_mlflow or cfg.mlflow_tracking_uri or cfg.mlflow_experiment_name:
        names.append("mlflow")
    return names


def asked_by(cfg, name: str) -> str:
    """The config key that turns tracker `name` on, as the user wrote it ("wandb_project: demo")."""
    if name == "wandb":
        return "use_wandb: true" if cfg.use_wandb else f"wandb_project: {cfg.wandb_project}"
    if name == "tensorboard":
        return "use_tensorboard: true"
    key = next(k for k in ("use_mlflow", "mlflow_tracking_uri", "mlflow_experiment_name") if getattr(cfg, k))
    return f"{key}: {str(getattr(cfg, key)).lower() if key == 'use_mlflow' else getattr(cfg, key)}"


def check(cfg) -> None:
    """Before any work: every tracker asked for is installed."""
    missing = [PACKAGES[n] for n in wanted(cfg) if importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not installed: the config logs to {', '.join(missing)} "
                          "(install envtool's `trackers` extra, or remove the keys)")


def _numbers(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def _prefixed(row: dict) -> dict:
    return {(k if k.startswith("eval_") else f"train/{k}").replace("eval_", "eval/", 1): v for k, v in _numbers(row).items()}


class MetricsLog:
    """output_dir/metrics.jsonl, one JSON object per line, written by rank 0.

    A new run replaces an old log. A resumed run (`resumed_at`: the checkpoint's step) first cuts the log back to
    that step -- the rows of steps trained after the checkpoint, which the resumed run trains again, are dropped
    (atomically: the cut log replaces the old one whole) -- then appends, so every step is in it once."""

    def __init__(self, path: Path, enabled: bool, fresh: bool, resumed_at: int | None = None):
        self.path, self.enabled = path, enabled
        if enabled and fresh:
            path.write_text("")
        elif enabled and resumed_at is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut by a kill mid-write
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resumed_at:
                    kept.append(line + "\n")
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)

    def write(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


class Trackers:
    """metrics.jsonl plus the configured trackers; write(row) sends one row everywhere."""

    def __init__(self, metrics, cfg, output_dir: Path, enabled: bool, resumed: bool, log):
        self.metrics, self.backends = metrics, []
        self.watchdog = Watchdog(cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience)
        if not enabled:
            return
        config = cfg.model_dump(mode="json")
        for name in wanted(cfg):
            try:
                self.backends.append(getattr(self, f"_open_{name}")(cfg, Path(output_dir), config, resumed, log))
            except Exception as err:  # a tracker that cannot import or start (a broken install, a bad URI): named
                first = (str(err).strip().splitlines() or [""])[0][:200]
                raise TrainingError(f"{asked_by(cfg, name)}: {name} could not start ({type(err).__name__}"
                                    f"{': ' + first if first else ''}); fix its install or settings, or remove the "
                                    "key") from None

    @staticmethod
    def _open_wandb(cfg, output_dir, config, resumed, log):
        # optional: wandb is imported only where it is used
        import wandb

        mode = cfg.wandb_mode or os.environ.get("WANDB_MODE")
        if mode is None:
            has_key = bool(os.environ.get("WANDB_API_KEY")) or Path("~/.netrc").expanduser().is_file()
            mode = "online" if has_key else "offline"
            if mode == "offline":
                log("note: wandb: no credentials (WANDB_API_KEY or `wandb login`): logging offline; "
                    f"upload later with `wandb sync {output_dir / 'wandb'}`")
        (output_dir / "wandb").mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=cfg.wandb_project or "envtool", entity=cfg.wandb_entity, name=cfg.wandb_name,
                         id=cfg.wandb_run_id, resume="allow" if resumed or cfg.wandb_run_id else None,
                         dir=str(output_dir), mode=mode, config=config)
        return ("wandb", run)

    @staticmethod
    def _open_tensorboard(cfg, output_dir, config, resumed, log):
        # heavy: torch loads only when this runs
        from torch.utils.tensorboard import SummaryWriter

        return ("tensorboard", SummaryWriter(log_dir=str(output_dir / "runs")))

    @staticmethod
    def _open_mlflow(cfg, output_dir, config, resumed, log):
        uri = cfg.mlflow_tracking_uri or (output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local store mlflow 3 keeps for files
        # optional: mlflow is imported only where it is used
        import mlflow

        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(cfg.mlflow_experiment_name or "envtool")
        run = mlflow.start_run(run_name=cfg.mlflow_run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items() if not isinstance(v, (list, dict))})
        return ("mlflow", run)

    def write(self, row: dict) -> None:
        self.metrics.write(row)
        step = int(row["step"])
        for name, handle in self.backends:
            values = _prefixed(row)
            if name == "wandb":
                handle.log(values, step=step)
            elif name == "tensorboard":
                for key, value in values.items():
                    handle.add_scalar(key, value, step)
                handle.flush()
            elif name == "mlflow":
                # optional: mlflow is imported only where it is used
                import mlflow

                mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()}, step=step)
        if "loss" in row:
            self.watchdog.check(row["loss"], step)

    def close(self) -> None:
        for name, handle in self.backends:
            if name == "wandb":
                handle.finish()
            elif name == "tensorboard":
                handle.close()
            elif name == "mlflow":
                # optional: mlflow is imported only where it is used
                import mlflow

                mlflow.end_run()
        self.backends = []


class Watchdog:
    """Axolotl's loss watchdog: stop when the loss is above the threshold for `patience` logged steps in a row."""

    def __init__(self, threshold: float | None, patience: int):
        self.threshold, self.patience, self.bad = threshold, patience, []

    def check(self, loss: float, step: int) -> None:
        if self.threshold is None:
            return
        self.bad = self.bad + [step] if loss > self.threshold else []
        if len(self.bad) >= self.patience:
            raise TrainingError(
                f"loss watchdog: loss {loss:.4g} at step {step} has been above loss_watchdog_threshold "
                f"{self.threshold:g} for {len(self.bad)} logged steps in a row (steps {self.bad[0]}-{step}); stopped. "
                "Lower learning_rate or check the data")
