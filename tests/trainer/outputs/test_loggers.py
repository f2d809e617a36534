"""Trackers (wandb offline, TensorBoard event files, MLflow local store), the loss watchdog, hub_model_id's
early check. Nothing here reaches the network: wandb runs offline, the Hub endpoint is a closed local port."""

from __future__ import annotations

import json
import socket

import pytest

from tests.trainer.helpers import read_metrics, run_cli, train_losses
from trainer.cli import main

pytestmark = pytest.mark.slow


def test_wandb_offline_tensorboard_and_mlflow_record_the_run(make_config, tmp_path, monkeypatch):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: wandb has no credentials, so it logs offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), max_steps=3, val_set_size=0.25, eval_steps=2,
                         wandb_project="envtool-test", wandb_name="tiny", use_tensorboard=True, use_mlflow=True,
                         mlflow_experiment_name="tiny-exp")
    assert main(["train", str(config)]) == 0
    losses = train_losses(out)

    # wandb: one offline run (what `wandb sync` uploads); its .wandb log holds every logged loss as wandb
    # records it (the JSON of the value) and the run's config
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record,) = runs[0].glob("run-*.wandb")
    data = record.read_bytes()
    assert b"train/loss" in data and b"eval/loss" in data and b"envtool-test" in data
    assert all(json.dumps(v).encode() in data for v in losses.values())

    # tensorboard: real event files with every logged loss
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("train/loss")] == [
        (s, round(v, 5)) for s, v in sorted(losses.items())]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 3]

    # mlflow: a local file store with the experiment, run and metric history
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tiny-exp")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == sorted(losses)
    assert [m.value for m in history] == pytest.approx([losses[s] for s in sorted(losses)])
    assert run.data.params["learning_rate"] == "0.001"


def test_loss_watchdog_stops_a_diverging_run_naming_the_step(make_config, tmp_path, capsys):
    out = tmp_path / "out"
    # a learning rate this high makes the tiny model's loss explode within a few steps
    config = make_config(output_dir=str(out), max_steps=12, learning_rate=5.0, optimizer="sgd",
                         max_grad_norm=0, loss_watchdog_threshold=8.0, loss_watchdog_patience=2)
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    rows = [r for r in read_metrics(out) if "loss" in r]
    last = rows[-1]["step"]
    assert last < 12 and rows[-1]["loss"] > 8.0 and rows[-2]["loss"] > 8.0
    assert err.startswith(f"error: loss watchdog: loss ") and f"at step {last} has been above " \
        f"loss_watchdog_threshold 8 for 2 logged steps in a row (steps {last - 1}-{last}); stopped" in err
    assert not (out / "final").exists()


def test_watchdog_patience_needs_consecutive_steps():
    from trainer.errors import TrainingError
    from trainer.outputs.loggers import Watchdog

    dog = Watchdog(2.0, 3)
    for step, loss in enumerate([3, 3, 1, 3, 3], start=1):  # never three in a row
        dog.check(loss, step)
    with pytest.raises(TrainingError, match=r"at step 6 .* \(steps 4-6\)"):
        dog.check(3, 6)


def test_hub_model_id_fails_before_training_without_the_hub(make_config, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), hub_model_id="someone/tiny")
    result = run_cli("train", str(config), env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_TOKEN": "hf_fake",
                                                "HF_HUB_OFFLINE": "0"}, timeout=120)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: hub_model_id: cannot reach the Hugging Face Hub to push someone/tiny at the end")
    assert not (out / "metrics.jsonl").exists()  # stopped before any training step
    result = run_cli("train", str(config), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "HF_HUB_OFFLINE is set" in result.stderr


def test_missing_tracker_package_is_named_before_training(make_config, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), wandb_project="p"))]) == 2
    assert "wandb not installed: the config logs to wandb" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()


def test_a_tracker_that_cannot_start_is_named_with_its_key(make_config, tmp_path, monkeypatch, capsys):
    """Installed but broken (issue 44 item 7): tensorboard's writer failing at import (a protobuf too new for it) was a
    bare ImportError naming no tracker; now one line naming the key that asked for it, exit 1."""
    import torch.utils.tensorboard as tensorboard

    def broken(*args, **kwargs):
        raise ImportError("cannot import name 'builder' from 'google.protobuf.internal'")

    monkeypatch.setattr(tensorboard, "SummaryWriter", broken)
    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), use_tensorboard=True))]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: use_tensorboard: true: tensorboard could not start (ImportError: cannot import name 'builder' from "
        "'google.protobuf.internal'); fix its install or settings, or remove the key")
