"""Shared fixtures: tiny models and tokenizers built locally, small datasets, config files, CLI runner."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.trainer.helpers import alpaca_rows, write_jsonl  # noqa: E402
from trainer.model.tiny import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), family="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """A mixture-of-experts model (transformers' MixtralConfig: 4 experts, 2 per token), built locally."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), family="mixtral", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """A mixture-of-experts model (transformers' Qwen3MoeConfig: 4 experts, 2 per token), built locally."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), family="qwen3_moe", seed=0)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> Path:
    """A vision-language model (LLaVA: CLIP tower, projector, llama) with its processor, built locally."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llava"), family="llava", seed=0)


@pytest.fixture(scope="session")
def tiny_gemma3_vision(tmp_path_factory) -> Path:
    """A Gemma 3 vision-language model (SigLIP tower, Gemma 3 language tower) with its processor, built locally."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3-vision"), family="gemma3_vision", seed=0)


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(48))


@pytest.fixture
def make_config(tmp_path, tiny_llama, alpaca_file):
    """Write a config YAML (tiny model, alpaca data, outputs under tmp_path) with overrides; return its path."""

    def make(name: str = "config.yml", **overrides) -> Path:
        cfg = {
            "base_model": str(tiny_llama),
            "datasets": [{"path": str(alpaca_file), "type": "alpaca"}],
            "dataset_prepared_path": str(tmp_path / "prepared"),
            "output_dir": str(tmp_path / "out"),
            "sequence_len": 256,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "max_steps": 4,
            "learning_rate": 1e-3,
            "lr_scheduler": "constant",
            "attn_implementation": "sdpa",
            "seed": 1,
        }
        for key, value in overrides.items():  # None removes a key
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    return make


@pytest.fixture(autouse=True)
def _no_plan_from_the_environment(monkeypatch):
    monkeypatch.delenv("ENVTOOL_PLAN", raising=False)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each in-process training run gets a fresh accelerate state (torchrun processes start fresh anyway)."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state()
    PartialState._reset_state()
