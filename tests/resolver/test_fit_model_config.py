"""`envtool fit` on a model whose config.json no model can have (issue 33, item 5): a size that is a string, NaN, a
float, 0, negative or absurdly large is one line naming the file and the key (exit 2), never a traceback, never
"fits" for a model that cannot exist, never a hang. Generated from the published config.json samples
(bench/data/model_configs.toml), read through the estimate's own reader as `envtool fit` reads a model directory."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hub import CONFIGS, published_config
from trainer.fit import memory_model

from .conftest import ENVTOOL

REPO = Path(__file__).resolve().parents[2]
MODELS = sorted(__import__("tomllib").loads(CONFIGS.read_text())["models"])
CORE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "intermediate_size", "max_position_embeddings")
NOT_WHOLE = st.one_of(st.integers(1, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True)
                      .filter(lambda f: not f.is_integer()), st.sampled_from([64.0, 2e9, float("nan"), True, [64],
                                                                              {"a": 1}, ""]))


def _shape(config: dict):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        try:
            return memory_model.model_shape(tmp, exact=False), str(Path(tmp) / "config.json")
        except memory_model.ModelConfigError as err:
            return err, str(Path(tmp) / "config.json")


@given(st.sampled_from(MODELS), st.sampled_from(CORE), NOT_WHOLE)
@settings(max_examples=60, deadline=timedelta(seconds=1))
def test_a_size_that_is_not_a_whole_number_is_refused_naming_file_and_key(model, key, value):
    config = {**published_config(model), key: value}
    found, file = _shape(config)
    assert isinstance(found, memory_model.ModelConfigError) and found.bad_input
    assert str(found).startswith(f"{file}: {key} is ") and "\n" not in str(found)


@given(st.sampled_from(MODELS), st.dictionaries(st.sampled_from(CORE), st.integers(-10, 10**9) | st.just(10**8),
                                                min_size=1, max_size=3))
@settings(max_examples=80, deadline=timedelta(seconds=1))
def test_whole_number_sizes_give_a_real_model_or_one_line_naming_file_and_key(model, sizes):
    """The oracle: what is counted has parameters, layers and heads; what is refused names a key the test changed
    (or the head arithmetic the change broke); nothing else escapes, and nothing takes long (10^8 layers hung)."""
    found, file = _shape({**published_config(model), **sizes})
    if isinstance(found, memory_model.ModelConfigError):
        assert found.bad_input and str(found).startswith(f"{file}: ")
        assert any(k in str(found) for k in sizes), found
        return
    assert found.params > 0 and found.num_layers >= 1 and found.hidden_size >= 1 and found.vocab_size >= 1
    assert all(layer.heads >= 1 and layer.q_dim >= 1 and layer.kv_dim >= 1 for layer in found.layers)
    assert math.isfinite(found.params)


def test_overridden_sizes_are_named_as_the_training_config_s():
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(published_config(MODELS[0])))
        with pytest.raises(memory_model.ModelConfigError, match=r"^model_config_overrides: vocab_size is -1: no "):
            memory_model.model_shape(tmp, overrides={"vocab_size": -1}, exact=False)


COMMANDS = {  # the three paths that read a model's config.json before training: they must agree (exit 2, one line)
    "fit": ([str(ENVTOOL), "fit", "tiny-cpu.yml", "--gpu", "a100-80gb"], "envtool: error: "),
    "train --dry-run": ([str(ENVTOOL), "train", "tiny-cpu.yml", "--gpu", "a100-80gb", "--dry-run"], "envtool: error: "),
    "validate": ([str(ENVTOOL.parent / "python"), "-m", "trainer", "validate", "tiny-cpu.yml", "--gpu", "a100-80gb"],
                 "error: "),
}


@pytest.mark.slow  # each command reads the training config with the trainer's reader: ~10 s of CPU
@pytest.mark.parametrize("command", list(COMMANDS))
def test_envtool_fit_on_a_config_json_with_a_string_size_is_one_line_exit_2(tmp_path, command):
    shutil.copytree(REPO / "examples" / "data", tmp_path / "examples" / "data")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**published_config("Qwen/Qwen2.5-0.5B"), "hidden_size": "896"}))
    config = (REPO / "examples" / "tiny-cpu.yml").read_text().replace("base_model: outputs/tiny-model",
                                                                      f"base_model: {model}")
    (tmp_path / "tiny-cpu.yml").write_text(config)
    argv, prefix = COMMANDS[command]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f'{prefix}{model / "config.json"}: hidden_size is "896": a '
                                                      "model's sizes are whole numbers")
    assert "Traceback" not in result.stderr
