"""early_stopping_patience: the run stops at the evaluation transformers' EarlyStoppingCallback would stop
at, ends with the best checkpoint's weights (load_best_model_at_end, as Axolotl sets it), and resumes exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import read_metrics, train_losses, train_then_resume
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError

# a learning rate high enough that the tiny model's eval_loss goes up and down within 10 steps
RUN = dict(val_set_size=8, eval_steps=1, save_steps=2, max_steps=10, learning_rate=3e-2)


def hf_stop_step(evals: list[tuple[int, float]], patience: int) -> int | None:
    """Feed the evaluations to transformers' EarlyStoppingCallback, keeping best_metric as the Trainer does."""
    from transformers import EarlyStoppingCallback, TrainerControl

    callback = EarlyStoppingCallback(early_stopping_patience=patience)
    args = SimpleNamespace(metric_for_best_model="eval_loss", greater_is_better=False)
    state, control = SimpleNamespace(best_metric=None), TrainerControl()
    for step, loss in evals:
        callback.on_evaluate(args, state, control, metrics={"eval_loss": loss})
        if state.best_metric is None or loss < state.best_metric:  # Trainer._determine_best_metric
            state.best_metric = loss
        if control.should_training_stop:
            return step
    return None


def weights(path):
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.slow
def test_stops_where_transformers_would_and_keeps_the_best_checkpoint(make_config, tmp_path):
    plain, stopping = tmp_path / "plain", tmp_path / "stopping"
    assert main(["train", str(make_config("a.yml", output_dir=str(plain), **RUN))]) == 0
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(plain) if "eval_loss" in r]
    expected = hf_stop_step(evals, patience=2)
    assert expected is not None and expected < 10  # the run above does get worse twice in a row

    assert main(["train", str(make_config("b.yml", output_dir=str(stopping), early_stopping_patience=2, **RUN))]) == 0
    losses = train_losses(stopping)
    assert max(losses) == expected  # no step after the stopping evaluation
    assert [l for s, l in sorted(losses.items())] == [train_losses(plain)[s] for s in sorted(losses)]
    # the final model is the checkpoint with the lowest eval_loss among the checkpointed steps
    saved = {s: loss for s, loss in evals if s <= expected and s % 2 == 0}
    best = min(saved, key=saved.get)
    final, chosen = weights(stopping / "final"), weights(stopping / f"checkpoint-{best}")
    assert final.keys() == chosen.keys() and all(torch.equal(final[k], chosen[k]) for k in final)
    if best != expected:
        last = weights(stopping / f"checkpoint-{expected}")
        assert not all(torch.equal(final[k], last[k]) for k in final)


def test_save_total_limit_keeps_the_best_checkpoint(make_config, tmp_path):
    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), early_stopping_patience=2, save_total_limit=1,
                                          **RUN))]) == 0
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    last = max(train_losses(out))
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r}
    best = min((s for s in evals if s % 2 == 0), key=evals.get)
    assert kept == sorted({f"checkpoint-{best}", f"checkpoint-{last}"})
    final = weights(out / "final")
    chosen = weights(out / f"checkpoint-{best}")
    assert all(torch.equal(final[k], chosen[k]) for k in final)


@pytest.mark.slow  # 10 steps with 10 evaluations: 5-10 s
def test_load_best_model_at_end_alone_trains_every_step_and_ends_with_the_best_checkpoint(make_config, tmp_path,
                                                                                          capsys):
    """Axolotl passes load_best_model_at_end to transformers' Trainer, which ends with the checkpoint of the lowest
    eval_loss, without stopping early; before, this was refused unless early_stopping_patience was set."""
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), load_best_model_at_end=True, **RUN)
    assert main(["validate", str(config)]) == 0
    assert "load_best_model_at_end" not in capsys.readouterr().err  # read, not ignored nor refused
    assert main(["train", str(config)]) == 0
    assert max(train_losses(out)) == 10  # no early stop
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r}
    best = min((s for s in evals if s % 2 == 0), key=lambda s: (evals[s], s))
    assert evals[10] > evals[best]  # (this run's last evaluation is not its best: the choice is seen)
    final, chosen = weights(out / "final"), weights(out / f"checkpoint-{best}")
    assert all(torch.equal(final[k], chosen[k]) for k in final)


def test_early_stopping_resumes_to_the_same_stop(make_config, tmp_path):
    full, resumed = train_then_resume(main, make_config, tmp_path, checkpoint=4, early_stopping_patience=2, **RUN)
    assert max(train_losses(full)) < 10  # it did stop early, in both
    a, b = weights(full / "final"), weights(resumed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, message", [
    ({"eval_steps": 2, "save_steps": 3}, "eval_steps dividing save_steps"),
    ({"val_set_size": None}, "validation split"),
])
@pytest.mark.parametrize("key", [{"early_stopping_patience": 3}, {"load_best_model_at_end": True}])
def test_early_stopping_refusals(extra, message, key):
    raw = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], **key, **RUN, **extra}
    with pytest.raises(ConfigError, match=f"{next(iter(key))} needs .*{message}"):
        parse_config({k: v for k, v in raw.items() if v is not None})
