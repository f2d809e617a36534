"""lr_quadratic_warmup: the logged learning rates follow Axolotl's cosine schedule with quadratic warmup."""

from __future__ import annotations

import math

import pytest

from tests.trainer.helpers import read_metrics, train_then_resume
from trainer.cli import main
from trainer.config import parse_config


def axolotl_lambda(step, warmup, total):  # axolotl/utils/schedulers.py, num_cycles 0.5
    if step < warmup:
        return (float(step) / float(max(1, warmup))) ** 2
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * progress)))


def test_quadratic_warmup_learning_rates(make_config, tmp_path):
    config = make_config(lr_scheduler="cosine", lr_quadratic_warmup=True, warmup_steps=4, max_steps=10,
                         learning_rate=1e-3)
    assert main(["train", str(config)]) == 0
    lrs = [r["lr"] for r in read_metrics(tmp_path / "out") if "lr" in r]
    assert lrs == pytest.approx([1e-3 * axolotl_lambda(s, 4, 10) for s in range(10)], rel=1e-9)
    assert lrs[1] == pytest.approx(1e-3 / 16)  # quadratic, not linear (1e-3 / 4)


def test_quadratic_warmup_resumes(make_config, tmp_path):
    train_then_resume(main, make_config, tmp_path, checkpoint=2, lr_scheduler="cosine", lr_quadratic_warmup=True,
                      warmup_steps=3, max_steps=5, save_steps=2)


def test_notes():
    base = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], "lr_quadratic_warmup": True}
    assert any("no effect" in n for n in parse_config({**base, "lr_scheduler": "linear"})[1])
    assert any("not applied" in n for n in parse_config({**base, "cosine_min_lr_ratio": 0.1})[1])
