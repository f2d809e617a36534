"""The trainer's house: the config reader runs without the training stack, and every part of trainer/ sits in a
layer of the import-linter contract (pyproject.toml [tool.importlinter]; `lint-imports` in .ci/run checks it)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from tests.trainer.helpers import REPO, run_cli

HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate")
CONFIGS = sorted([*(REPO / "tests/trainer/fixtures/axolotl_examples").glob("*.y*ml"), *(REPO / "examples").glob("*.yml")])

# Every config judged by trainer.setup.start on a GPU named like `envtool train --gpu t4` names it; the verdicts
# (effective attention and precision, or the refusal) printed as JSON.
JUDGE = """
import json, sys
for name in sys.argv[2].split(","):
    if name:
        sys.modules[name] = None  # `import torch` now raises ImportError, as in an environment without it
import trainer.config
from trainer.errors import TrainerError
from trainer.setup import start

verdicts = {}
for path in json.loads(sys.argv[1]):
    try:
        cfg, notes, runtime = start(path, gpu="t4")
        verdicts[path] = f"ok {runtime.attention} {runtime.precision} ({len(runtime.changes)} changes, {len(notes)} notes)"
    except TrainerError as err:
        verdicts[path] = f"refused ({type(err).__name__}): {err}"
print(json.dumps({"verdicts": verdicts, "loaded": sorted(n for n in sys.argv[2].split(",") if sys.modules.get(n))}))
"""


def judge(blocked: tuple[str, ...]) -> dict:
    result = subprocess.run([sys.executable, "-c", JUDGE, json.dumps([str(p) for p in CONFIGS]), ",".join(blocked)],
                            capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr  # an ImportError of a blocked module would end here
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_config_reader_judges_every_config_without_the_training_stack():
    """trainer.config and trainer.setup.start(path, gpu=...) are what `envtool train` reads a config with, in an
    environment that may have no torch, transformers, peft, datasets or accelerate: with those blocked, every
    Axolotl example and every example of ours gets the same verdict as with them installed."""
    without = judge(HEAVY)
    with_stack = judge(())
    assert without["verdicts"] == with_stack["verdicts"]
    assert with_stack["loaded"] == []  # not even imported where they are installed
    ok = [v for v in without["verdicts"].values() if v.startswith("ok")]
    assert len(ok) >= 20, without["verdicts"]  # most examples run on a T4 (fp16, sdpa); the rest are refused in one line
    assert any("fp16" in v for v in ok)


def test_every_part_of_trainer_sits_in_a_layer_of_the_contract():
    """A new wing or top-level module must be placed in the architecture, or lint-imports would not check it."""
    contract = next(c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                    if c["id"] == "trainer-layers")
    named = {m.strip() for layer in contract["layers"] for m in layer.replace(":", "|").split("|")}
    parts = {f"trainer.{p.stem if p.suffix == '.py' else p.name}" for p in (REPO / "trainer").iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").is_file()}
    assert parts - named == set()
    assert named - parts == set()


@pytest.mark.slow
@pytest.mark.parametrize("feature, message", [
    ({"lisa_n_layers": 1, "lisa_step_interval": 2}, "lisa_n_layers: runs in one process here"),
    ({"adapter": "lora", "lora_target_linear": True, "relora": True, "jagged_restart_steps": 2},
     "relora: runs in one process here"),
])
def test_one_process_features_are_refused_before_anything_loads(make_config, tmp_path, feature, message):
    """Launched as one of two processes (torchrun's WORLD_SIZE), LISA and ReLoRA are refused by the run's start:
    one line, exit 2, before the data is prepared or the model loads (no process group is ever joined, so this
    process would otherwise wait for a second one that does not exist)."""
    config = make_config(dataset_prepared_path=str(tmp_path / "prepared"), output_dir=str(tmp_path / "out"), **feature)
    result = run_cli("train", str(config), env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message} (")
    assert "training on" not in result.stderr
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "out").exists()
