"""Two dataset sources Axolotl reads that need no prompt format: `type: _synthetic` (its benchmark data,
prompt_strategies/_synthetic.py: numpy's default_rng(seed).integers(min_input_id, max_input_id, (length,
sequence_length)), every token trained) and a folder datasets' save_to_disk wrote, or an .arrow file (ds_type: arrow),
as its _load_from_local_path loads them (load_from_disk first for a folder, load_dataset("arrow") for a file)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from tests.trainer.helpers import run_cli
from trainer.config import DatasetConfig, parse_config
from trainer.data.prepare import load_raw, synthetic_rows
from trainer.errors import ConfigError, DataError
from trainer.model.tiny import build_tokenizer


def test_synthetic_rows_are_axolotls_draw():
    cfg, _ = parse_config({"base_model": "m", "learning_rate": 1e-4, "sequence_len": 64,
                           "datasets": [{"path": "synthetic", "type": "_synthetic", "length": 5, "seed": 3}]})
    tok = build_tokenizer()
    rows = synthetic_rows(cfg.datasets[0], cfg, tok)
    want = np.random.default_rng(3).integers(low=100, high=tok.vocab_size, size=(5, 64)).tolist()  # Axolotl's call
    assert rows["input_ids"] == want and rows["labels"] == want
    other = cfg.datasets[0].model_copy(update={"sequence_length": 8, "min_input_id": 5, "max_input_id": 9})
    assert all(len(r) == 8 and all(5 <= t < 9 for t in r) for r in synthetic_rows(other, cfg, tok)["input_ids"])
    with pytest.raises(DataError, match="max_input_id 5 must be above min_input_id 5"):
        synthetic_rows(other.model_copy(update={"max_input_id": 5}), cfg, tok)
    with pytest.raises(ConfigError, match=r"datasets.0.*length: only with type: _synthetic"):
        parse_config({"base_model": "m", "learning_rate": 1e-4,
                      "datasets": [{"path": "d.jsonl", "type": "alpaca", "length": 5}]})


def test_a_saved_dataset_and_an_arrow_file_load_as_axolotl_loads_them(tmp_path):
    import datasets

    rows = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(6)]})
    rows.save_to_disk(str(tmp_path / "saved"))
    assert list(load_raw(DatasetConfig(path=str(tmp_path / "saved"), type="completion"))["text"]) == list(rows["text"])
    datasets.DatasetDict({"train": rows, "test": rows.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    test = load_raw(DatasetConfig(path=str(tmp_path / "dict"), type="completion", split="test"))
    assert list(test["text"]) == ["row 0", "row 1"]
    with pytest.raises(DataError, match="has no split 'validation'"):
        load_raw(DatasetConfig(path=str(tmp_path / "dict"), type="completion", split="validation"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for ds in (DatasetConfig(path=str(arrow), type="completion"),  # by its extension
               DatasetConfig(data_files=str(arrow), ds_type="arrow", type="completion")):
        assert list(load_raw(ds)["text"]) == list(rows["text"])


@pytest.mark.slow
def test_synthetic_and_saved_pretokenized_data_train_through_the_cli(tmp_path, tiny_llama):
    import datasets

    datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]] * 6}).save_to_disk(str(tmp_path / "tokens"))
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama),
        "datasets": [{"path": "synthetic", "type": "_synthetic", "length": 8, "sequence_length": 32, "seed": 1},
                     {"path": str(tmp_path / "tokens")}],
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
