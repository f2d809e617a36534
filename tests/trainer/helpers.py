"""Helpers shared by the trainer tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = ("the quick brown fox jumps over the lazy dog while cats sleep and dogs play fetch in the sun "
         "paris rome berlin water boils two plus four nine").split()


def alpaca_rows(n: int, seed: int = 0, long_every: int = 0) -> list[dict]:
    """Alpaca rows with varied lengths; every `long_every`-th row is very long (skewed lengths)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = 60 if long_every and i % long_every == 0 else rng.randint(1, 12)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        rows.append({"instruction": f"Repeat {i % 7}.", "input": "" if i % 3 else "some input", "output": text})
    return rows


COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def image_chat_rows(directory: Path, n: int) -> list[dict]:
    """n conversations in Axolotl's multimodal chat format, each about one solid-colour PNG written to `directory`
    (sizes vary, so the processor resizes): the user asks, the assistant names the colour."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = list(COLOURS)[i % len(COLOURS)]
        Image.new("RGB", (30 + 3 * i, 28 + i), COLOURS[name]).save(directory / f"img{i}.png")
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": f"img{i}.png"},
                                         {"type": "text", "text": "What colour is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"It is {name}."}]}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_group(cmd: list[str], env: dict, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output, text) in a process group of its own, all of which is killed at the timeout:
    torchrun's workers, DeepSpeed's op builds and DataLoader workers die with it instead of living on as orphans that
    hold CPU and build locks for the tests after (subprocess.run kills only the process it started)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            # torchrun's workers run in sessions of their own: the group kill misses them, and an orphan holding the
            # pipes would keep communicate() waiting for good. Every descendant is found first, then all killed.
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                out, err = "", "(the output could not be read: a process outside the group still holds it)"
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from expired
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children before their parents' siblings; [] elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(entry.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    """Run `python -m trainer ...` in a subprocess, as a user would."""
    base = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
    full_env = {**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return run_group([sys.executable, "-m", "trainer", *args], full_env, cwd or REPO, timeout)


def torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """torchrun --standalone with nproc processes (gloo on CPU, 127.0.0.1): a hang fails the test
    (subprocess.run raises TimeoutExpired)."""
    env = {**{k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"},
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return run_group(cmd, env, REPO, timeout)


def torchrun_train(config: Path, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """`python -m trainer train CONFIG` under torchrun."""
    return torchrun("-m", "trainer", "train", str(config), nproc=nproc, timeout=timeout)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}


def train_then_resume(main, make_config, tmp_path: Path, checkpoint: int = 2, **common) -> tuple[Path, Path]:
    """Train a run to the end, then train a second run that resumes from the first's checkpoint-N; assert the
    resumed run takes exactly the uninterrupted run's later steps (same losses), and return both output dirs."""
    import shutil

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert main(["train", str(make_config("full.yml", output_dir=str(full), **common))]) == 0
    resumed.mkdir()
    shutil.copytree(full / f"checkpoint-{checkpoint}", resumed / f"checkpoint-{checkpoint}")
    assert main(["train", str(make_config("resumed.yml", output_dir=str(resumed),
                                          auto_resume_from_checkpoints=True, **common))]) == 0
    a, b = train_losses(full), train_losses(resumed)
    later = [s for s in sorted(a) if s > checkpoint]
    assert sorted(b) == later and [b[s] for s in later] == [a[s] for s in later]
    return full, resumed


def assert_same_training(one: Path, two: Path, rel: float = 1e-5) -> None:
    """Two output dirs trained the same: the same steps with the same losses and evaluation losses (e.g. one
    process accumulating 2 micro-batches against two processes with one each)."""
    import pytest

    single, double = train_losses(one), train_losses(two)
    assert single.keys() == double.keys()
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=rel), step
    evals = [[r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r] for out in (one, two)]
    assert evals[1] == pytest.approx(evals[0], rel=rel)


def example_full_then_resumed(example: dict, base_model: Path, tmp_path: Path, rows: int = 40,
                              timeout: int = 300) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """An Axolotl example as written, with only the model and data swapped (a tiny alpaca set), 4 steps and a
    checkpoint at step 2, on 2 processes; then again resuming that checkpoint. ({"full"|"resumed": losses by
    step}, {"full"|"resumed": the run's stderr}); each run is asserted to succeed."""
    import shutil

    import yaml

    data = write_jsonl(tmp_path / "data.jsonl", [{"instruction": f"Say {i}.", "input": "", "output": "word " * (i % 9 + 1)}
                                                  for i in range(rows)])
    cfg = {**example, "base_model": str(base_model), "datasets": [{"path": str(data), "type": "alpaca"}],
           "sequence_len": 128, "micro_batch_size": 2, "dataset_prepared_path": str(tmp_path / "prepared"),
           "max_steps": 4, "save_steps": 2, "learning_rate": 1e-3}
    cfg.pop("saves_per_epoch", None)
    losses, stderr = {}, {}
    for name, extra in (("full", {}), ("resumed", {"auto_resume_from_checkpoints": True})):
        out = tmp_path / name
        if extra:
            out.mkdir()
            shutil.copytree(tmp_path / "full" / "checkpoint-2", out / "checkpoint-2")
        path = tmp_path / f"{name}.yml"
        path.write_text(yaml.safe_dump({**cfg, "output_dir": str(out), **extra}))
        result = torchrun_train(path, timeout=timeout)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name], stderr[name] = train_losses(out), result.stderr
    return losses, stderr
