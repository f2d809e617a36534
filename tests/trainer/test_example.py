"""The tiny CPU example, run exactly as the README tells a user to."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.trainer.helpers import REPO, read_metrics, run_cli


@pytest.mark.slow
def test_tiny_cpu_example_trains_and_learns(tmp_path):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    steps = [
        ("make-tiny-model", "outputs/tiny-model"),
        ("validate", "examples/tiny-cpu.yml"),
        ("train", "examples/tiny-cpu.yml"),
        ("evaluate", "examples/tiny-cpu.yml", "--json"),
    ]
    results = [run_cli(*args, cwd=tmp_path, timeout=300) for args in steps]
    for args, result in zip(steps, results):
        assert result.returncode == 0, (args, result.stderr[-2000:])
    assert "bf16: auto -> fp32" in results[1].stdout
    rows = read_metrics(tmp_path / "outputs/tiny-cpu")
    losses = [r["loss"] for r in rows if "loss" in r]
    evaluation = json.loads(results[3].stdout)
    assert evaluation["eval_tokens"] > 0
    assert evaluation["eval_loss"] < 0.6 * losses[0]  # it learned: well below the untrained loss
    assert (tmp_path / "outputs/tiny-cpu/final/model.safetensors").exists()
