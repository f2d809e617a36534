"""A stop signal during the final evaluation or save (issue 33, item 1), through the commands a user types.

The emitted sbatch sends SIGUSR1 five minutes before the time limit; Kubernetes and spot reclaims send SIGTERM. Once
the last step is done the stop handler stays installed until final/ is complete: the evaluation and save finish,
the run exits 0. A kill before final/ is complete (the scheduler's SIGKILL after its grace period) leaves the newest
checkpoint named in stopped.json, and the same command resumes from it and completes the run.

The moment is made deterministic by ENVTOOL_PAUSE_AT (trainer/runtime/stop.py): the real run waits at that point of
its real code path until a signal arrives (the signal is what the test sends), then goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.helpers import REPO

ENVTOOL = Path(sys.executable).parent / "envtool"


def _env(tmp_path: Path, **extra: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU", "ENVTOOL_PAUSE_AT")}
    environment.update(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                       TOKENIZERS_PARALLELISM="false", **extra)
    return environment


def _start_paused(command: list[str], tmp_path: Path, point: str) -> tuple[subprocess.Popen, list[str]]:
    """Start the run and read its output until it says it is paused at `point` (it waits there for a signal)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=_env(tmp_path, ENVTOOL_PAUSE_AT=point))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"paused at {point}" in line:
            return proc, lines
    proc.wait()
    raise AssertionError("the run never reached " + point + ":\n" + "".join(lines)[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("point, sig", [("final-eval", signal.SIGTERM), ("final-save", signal.SIGUSR1)])
def test_a_signal_during_the_final_evaluation_or_save_finishes_it_and_exits_0(make_config, tmp_path, point, sig):
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), max_steps=4, save_steps=2, val_set_size=0.1)
    proc, lines = _start_paused([sys.executable, "-m", "trainer", "train", str(config)], tmp_path, point)
    # while it waits, stopped.json names the newest checkpoint: a kill now would be resumed by the same command
    assert json.loads((out / "stopped.json").read_text())["checkpoint"] == str(out / "checkpoint-4")
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=240)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    assert f"{sig.name}: the final evaluation and save are under way: finishing them first" in output
    assert (f"note: {sig.name} arrived during the final evaluation or save: finished them first; the run is "
            "complete") in output
    assert "Traceback" not in output
    final = out / "final"
    assert (final / "adapter_model.safetensors").exists() or (final / "model.safetensors").exists()
    assert (final / "tokenizer_config.json").exists() and not (out / ".tmp-final").exists()
    assert not (out / "stopped.json").exists()  # complete: a rerun is not a resume
    if point == "final-eval":  # the evaluation ran to its end after the signal
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert any(row.get("step") == 4 and "eval_loss" in row for row in rows), rows


@pytest.mark.slow
def test_a_kill_during_the_final_save_is_completed_by_the_same_envtool_train_command(make_config, tmp_path):
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), max_steps=4, save_steps=2, val_set_size=0.1)
    command = [str(ENVTOOL), "train", str(config), "--gpu", "cpu"]
    proc, lines = _start_paused(command, tmp_path, "final-save")
    # the scheduler's SIGKILL after its grace period: to every process of the run (envtool's and the trainer's)
    for pid in _children(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=60)
    assert not (out / "final").exists() and (out / ".tmp-final").is_dir()  # the save was cut short
    assert json.loads((out / "stopped.json").read_text())["checkpoint"] == str(out / "checkpoint-4")

    again = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=_env(tmp_path), timeout=300)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert (f"the previous run on {out} ended during the final evaluation and save: continuing from "
            f"{out / 'checkpoint-4'}") in output
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in output and "Traceback" not in output
    final = out / "final"
    assert (final / "adapter_model.safetensors").exists() or (final / "model.safetensors").exists()
    assert not (out / "stopped.json").exists() and not (out / ".tmp-final").exists()


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc), deepest last."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(stat.parent.name))
                frontier.append(int(stat.parent.name))
    return found
