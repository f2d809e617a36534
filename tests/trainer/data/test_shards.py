"""`shards` / `shards_idx` of a dataset entry: the one shard Axolotl trains on (utils/data/sft.py: the rows shuffled by
cfg.seed, then `.shard(num_shards=shards, index=shards_idx or 0)`), for datasets and test_datasets; a shard index past
the shards is refused before anything is loaded; a streamed pretraining_dataset's shard is refused (not implemented)."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import write_jsonl
from trainer.config import DatasetConfig, parse_config
from trainer.data.prepare import load_raw
from trainer.errors import ConfigError

BASE = {"base_model": "org/model", "learning_rate": 2e-4}


def test_a_shard_is_the_rows_axolotl_trains_on(tmp_path):
    import datasets

    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": f"row {i}"} for i in range(23)])
    whole = datasets.load_dataset("json", data_files=str(path), split="train")
    for shards, idx, seed in ((4, None, 42), (4, 3, 42), (10, 2, 7)):
        ds = DatasetConfig(path=str(path), type="completion", shards=shards, shards_idx=idx)
        got = load_raw(ds, seed)["text"]
        # Axolotl's own two calls, on the same rows (its load_dataset_with_config)
        assert got == whole.shuffle(seed=seed).shard(num_shards=shards, index=idx or 0)["text"]
        assert len(got) in (23 // shards, 23 // shards + 1) and set(got) < set(whole["text"])
    assert load_raw(DatasetConfig(path=str(path), type="completion"), 42)["text"] == whole["text"]  # no shards: all


def test_shards_are_read_from_a_config_and_a_wrong_one_is_refused_early():
    cfg, _ = parse_config({**BASE, "datasets": [{"path": "org/data", "type": "alpaca", "shards": 10}],
                           "test_datasets": [{"path": "org/data", "split": "test", "shards": 10, "shards_idx": 9,
                                              "type": "alpaca"}]})
    assert (cfg.datasets[0].shards, cfg.test_datasets[0].shards_idx) == (10, 9)
    with pytest.raises(ConfigError, match="shards_idx: 10 names no shard of 10 shards"):
        parse_config({**BASE, "datasets": [{"path": "org/data", "type": "alpaca", "shards": 10, "shards_idx": 10}]})
    with pytest.raises(ConfigError, match="one shard of a streamed pretraining dataset is not implemented"):
        parse_config({**BASE, "pretraining_dataset": [{"path": "org/text", "type": "pretrain", "shards": 4}]})


def test_a_shard_of_a_streamed_dataset_is_refused():
    with pytest.raises(ConfigError, match=r"datasets.0.shards: one shard of a streamed dataset \(streaming: true\) is "
                                          "not implemented"):
        parse_config({**BASE, "streaming": True, "max_steps": 5,
                      "datasets": [{"path": "org/data", "type": "alpaca", "shards": 4}]})
