"""Long runs, through the commands a user types: a stop signal saves one checkpoint at one step on every rank and
the same command continues exactly; a damaged newest checkpoint is skipped; a checkpoint resumes on another number
of processes with the same global batch; one training per output_dir; an output_dir that refuses writes is one line.

The reference for "exactly" is an uninterrupted run with the same global batch (one process accumulating 2
micro-batches trains the same steps as two processes with one each: tests/trainer/parallel/test_distributed.py).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import REPO, read_metrics, run_cli, torchrun_train, train_losses
from trainer.cli import main

ENVTOOL = Path(sys.executable).parent / "envtool"


def _env(tmp_path: Path) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")}
    environment.update(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                       TOKENIZERS_PARALLELISM="false")
    return environment


def _signal_after(proc: subprocess.Popen, out: Path, rows: int, sig: int, timeout: float = 240) -> None:
    """Send `sig` to `proc` once output_dir/metrics.jsonl has `rows` rows (the run is mid-training)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached its first steps"
        time.sleep(0.05)
    proc.send_signal(sig)


def _trainer_processes(config: Path) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(config).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _close(a: dict[int, float], b: dict[int, float], steps) -> None:
    for step in steps:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_envtool_train_or_torchrun_stops_both_ranks_at_one_step_and_the_same_command_continues(
        make_config, tmp_path, capsys):
    steps = 36  # 48 rows: 24 steps an epoch on 2 processes, so the run crosses an epoch
    common = dict(micro_batch_size=1, max_steps=steps, save_steps=4)
    reference = tmp_path / "reference"  # uninterrupted, one process accumulating 2 micro-batches: the same steps
    assert main(["train", str(make_config("reference.yml", output_dir=str(reference), gradient_accumulation_steps=2,
                                          **common))]) == 0
    expected = train_losses(reference)
    out = tmp_path / "out"
    config = make_config("run.yml", output_dir=str(out), gradient_accumulation_steps=1, **common)
    command = [str(ENVTOOL), "train", str(config), "--gpu", "cpu", "--nproc", "2"]

    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(tmp_path))
    _signal_after(proc, out, rows=5, sig=signal.SIGTERM)  # checkpoint-4 is saved
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 138, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped after step ") and last.endswith(
        "(SIGTERM): saved " + last.split(": saved ")[1]), stderr[-3000:]
    step = int(last.split()[3])
    assert 4 <= step < steps and f"saved {out / f'checkpoint-{step}'}; run the same command again" in last
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    assert not _trainer_processes(config)  # envtool, torchrun and both ranks are gone: nothing orphaned
    # both ranks stopped after the same step: one checkpoint of that step holding each rank's state, verified
    saved = out / f"checkpoint-{step}"
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["step"] == step and state["world_size"] == 2 and state["global_batch"] == 2
    manifest = json.loads((saved / "manifest.json").read_text())["files"]
    assert {"rng_state_0.pt", "rng_state_1.pt", "optimizer.pt", "model.safetensors", "trainer_state.json"} <= set(manifest)
    assert json.loads((out / "stopped.json").read_text())["step"] == step
    _close(expected, train_losses(out), range(1, step + 1))

    # torchrun alone, signalled itself: the same command resumes from that checkpoint; torchrun forwards SIGTERM
    # to both ranks, which stop after one step with a checkpoint (torchrun then exits 1 with its own report)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", "-m", "trainer", "train", str(config)], stderr=subprocess.PIPE, text=True,
                                env=_env(tmp_path), cwd=REPO)
    _signal_after(torchrun, out, rows=step + 3, sig=signal.SIGTERM)
    _, stderr = torchrun.communicate(timeout=240)
    assert f"resumed from {saved} at step {step}" in stderr, stderr[-3000:]
    stops = [line for line in stderr.splitlines() if line.startswith("stopped after step ")]
    assert stops and len({line.split()[3] for line in stops}) == 1, stderr[-3000:]  # every rank: one step
    first, step = step, int(stops[0].split()[3])
    assert step >= first + 3 and json.loads((out / "stopped.json").read_text())["step"] == step
    assert not _trainer_processes(config)
    saved = out / f"checkpoint-{step}"

    damaged = tmp_path / "damaged"  # the same stopped run, its newest checkpoint overwritten inside the weights
    shutil.copytree(out, damaged)
    weights = damaged / f"checkpoint-{step}" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\x7f" * 64
    weights.write_bytes(bytes(data))

    # envtool's command again: continues from the stop's checkpoint, exactly, and logs every step once
    again = subprocess.run(command, capture_output=True, text=True, env=_env(tmp_path), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"continuing from {saved}" in again.stderr and f"resumed from {saved} at step {step}" in again.stderr
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, steps + 1))
    _close(expected, train_losses(out), range(1, steps + 1))
    assert not (out / "stopped.json").exists() and (out / "final" / "model.safetensors").exists()

    # the damaged copy on ONE process: the damaged checkpoint is named and skipped, the previous one resumes with
    # the accumulation doubled to keep the global batch of 2, and the run still matches the uninterrupted one
    previous = max(int(p.name.split("-")[1]) for p in damaged.glob("checkpoint-*") if p.name != f"checkpoint-{step}")
    capsys.readouterr()
    assert main(["train", str(make_config("one.yml", output_dir=str(damaged), gradient_accumulation_steps=1,
                                          **common))]) == 0  # python -m trainer train, in this process
    err = capsys.readouterr().err
    assert (f"note: skipping {damaged / f'checkpoint-{step}'}: the bytes of model.safetensors changed since it was "
            "written (its sha256 does not match the manifest)") in err
    assert "on 1 it continues with gradient_accumulation_steps 2 (the config says 1)" in err
    assert f"resumed from {damaged / f'checkpoint-{previous}'} at step {previous}" in err
    assert [r["step"] for r in read_metrics(damaged) if "loss" in r] == list(range(1, steps + 1))  # cut back, then appended
    _close(expected, train_losses(damaged), range(1, steps + 1))


@pytest.mark.slow
def test_ctrl_c_saves_once_a_second_run_is_refused_and_a_planted_pickle_never_runs(make_config, tmp_path, capsys):
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), micro_batch_size=1, max_steps=5000)
    env = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "trainer", "train", str(config)], stderr=subprocess.PIPE,
                             text=True, env=env, cwd=REPO)
    try:
        _signal_after(first, out, rows=2, sig=0)  # (signal 0: only wait) training now
        second = run_cli("train", str(config))
        assert first.poll() is None, "the first run ended before the second one was refused"
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: output_dir {out} is in use by another training (pid {first.pid} on {os.uname().nodename}); "
            "wait for it to end, or give this run another output_dir")
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, stderr[-3000:]
    assert "SIGINT: stopping after this step with a checkpoint (Ctrl-C again stops at once, without one)" in stderr
    last = stderr.strip().splitlines()[-1]
    step = int(last.split()[3])
    assert last == (f"stopped after step {step} of 5000 (SIGINT): saved {out / f'checkpoint-{step}'}; run the same "
                    "command again to continue from it (exit code 130)")
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{step}"]  # one save
    assert [r["step"] for r in read_metrics(out)] == list(range(1, step + 1))

    # a checkpoint whose RNG file pickles a command (its manifest rewritten to match, as a forger would): the
    # same command again refuses to load it, and the command never runs
    from trainer.outputs.checkpoint import write_manifest

    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    saved = out / f"checkpoint-{step}"
    torch.save({"python": Planted()}, saved / "rng_state_0.pt")
    write_manifest(saved)
    capsys.readouterr()
    assert main(["train", str(config)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {saved / 'rng_state_0.pt'} holds more than tensors and plain values (") and \
        last.endswith("envtool does not load it (it could run code): resume from a checkpoint envtool wrote, or "
                      "start without resume_from_checkpoint"), last
    assert not marker.exists()


@pytest.mark.slow
def test_an_output_dir_that_refuses_writes_is_one_line_before_training(make_config, tmp_path):
    """The kernel refuses writes past RLIMIT_FSIZE (EFBIG), as a full disk refuses them (ENOSPC): found by the
    probe at the start, one line, exit 1, nothing left behind."""
    out = tmp_path / "out"
    config = make_config(output_dir=str(out))
    env = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

    result = subprocess.run([sys.executable, "-m", "trainer", "train", str(config)], capture_output=True, text=True,
                            env=env, cwd=REPO, preexec_fn=small_files, timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: output_dir {out} does not take writes: File too large; checkpoints, metrics and the final model go "
        "there (free space, or choose another output_dir)")
    assert sorted(p.name for p in out.iterdir()) == [".envtool-train.lock"]


@pytest.mark.slow
@pytest.mark.distributed
def test_an_fsdp2_checkpoint_of_two_processes_resumes_on_one_with_the_same_global_batch(make_config, tmp_path, capsys):
    """FSDP2 saves the full optimizer state (gathered from the shards); one process loads it unsharded, with the
    accumulation doubled, and trains the same steps as the two-process run did."""
    fsdp2 = {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                                "fsdp_state_dict_type": "FULL_STATE_DICT",
                                                "fsdp_reshard_after_forward": True}}
    common = dict(micro_batch_size=1, gradient_accumulation_steps=1, max_steps=6, **fsdp2)
    two = tmp_path / "two"
    result = torchrun_train(make_config("two.yml", output_dir=str(two), save_steps=3, **common))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharding: FSDP" in result.stderr
    one = tmp_path / "one"
    one.mkdir()
    shutil.copytree(two / "checkpoint-3", one / "checkpoint-3")
    capsys.readouterr()
    assert main(["train", str(make_config("one.yml", output_dir=str(one), auto_resume_from_checkpoints=True,
                                          **common))]) == 0
    err = capsys.readouterr().err
    assert "on 1 it continues with gradient_accumulation_steps 2 (the config says 1)" in err
    assert f"resumed from {one / 'checkpoint-3'} at step 3" in err
    _close(train_losses(two), train_losses(one), range(4, 7))
    assert sorted(train_losses(one)) == [4, 5, 6]


def test_a_global_batch_that_cannot_be_kept_names_the_settings_that_can():
    from trainer.config.global_batch import accumulation_for
    from trainer.errors import ConfigError

    assert accumulation_for(16, 2, 4) == 2 and accumulation_for(16, 2, 1) == 8
    with pytest.raises(ConfigError) as refused:
        accumulation_for(16, 2, 3, why="checkpoint-24 was trained with a global batch of 16 rows")
    assert str(refused.value) == (
        "checkpoint-24 was trained with a global batch of 16 rows cannot be kept with micro_batch_size 2 on 3 "
        "process(es) (16 is not a multiple of 6); use 2 process(es) (gradient_accumulation_steps 4) or 4 "
        "process(es) (gradient_accumulation_steps 2)")
    with pytest.raises(ConfigError) as refused:
        accumulation_for(12, 4, 2)
    assert str(refused.value).endswith("(12 is not a multiple of 8); use 1 process(es) (gradient_accumulation_steps 3) "
                                       "or 3 process(es) (gradient_accumulation_steps 1) or micro_batch_size 3 on 2 "
                                       "(gradient_accumulation_steps 2)")
