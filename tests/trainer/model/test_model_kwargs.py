"""model_kwargs (Axolotl's overrides_of_model_kwargs): extra from_pretrained arguments, as Axolotl's ModelLoader
starts its model_kwargs from them and then sets its own (dtype, attention, quantization, revision, ...) over them
(loaders/model.py)."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import parse_config


def test_model_kwargs_reach_from_pretrained_and_the_loaders_own_win(tiny_llama):
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, notes = parse_config({"base_model": str(tiny_llama), "learning_rate": 1e-4,
                               "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                               "overrides_of_model_kwargs": {"use_cache": False, "dtype": "float16"}})
    assert cfg.model_kwargs == {"use_cache": False, "dtype": "float16"} and notes
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), load_tokenizer(cfg))
    assert model.config.use_cache is False  # passed on
    assert model.dtype == torch.float32  # the loader's own dtype for this run (CPU: fp32), as Axolotl's wins


@pytest.mark.slow
def test_model_kwargs_train_through_the_cli(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} of the data"} for i in range(8)])
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(data), "type": "completion"}],
        "model_kwargs": {"use_cache": False, "low_cpu_mem_usage": True},
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
