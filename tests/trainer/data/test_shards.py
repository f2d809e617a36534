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
    # Axolotl's pretraining stream never reads shards (it streams the whole dataset): ignored, and said so
    _, notes = parse_config({**BASE, "max_steps": 5,
                             "pretraining_dataset": [{"path": "org/text", "type": "pretrain", "shards": 4}]})
    assert any(n.startswith("ignored: pretraining_dataset.0.shards") for n in notes), notes


def test_a_shard_of_a_streamed_dataset_is_refused():
    with pytest.raises(ConfigError, match=r"datasets.0.shards: one shard of a streamed dataset \(streaming: true\) is "
                                          "not implemented"):
        parse_config({**BASE, "streaming": True, "max_steps": 5,
                      "datasets": [{"path": "org/data", "type": "alpaca", "shards": 4}]})


def test_dataset_shard_num_and_idx_shard_the_prepared_rows_as_axolotl():
    """dataset_shard_num / dataset_shard_idx: Axolotl's _apply_dataset_sharding (utils/data/sft.py) shards the
    prepared rows, `dataset.shard(num_shards, index)`, before the validation split; a lone one, an index past the
    shards, or rl: are refused (Axolotl trains on all the rows there)."""
    import datasets

    from trainer.data.prepare import filter_and_split

    rows = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(20)], "labels": [[i, i] for i in range(20)],
                                       "too_long": [False] * 20, "length": [2] * 20, "targets": [1] * 20})
    cfg, _ = parse_config({**BASE, "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "dataset_shard_num": 3,
                           "dataset_shard_idx": 2, "seed": 5})
    data, _, stats = filter_and_split(cfg, rows)
    want = rows.remove_columns(["too_long"]).shuffle(seed=5).shard(num_shards=3, index=2)  # Axolotl's two calls
    assert data["input_ids"][:] == want["input_ids"][:] and stats["dataset_shard"] == "2 of 3"
    for extra, message in (({"dataset_shard_num": 3}, "go together"), ({"dataset_shard_idx": 0}, "go together"),
                           ({"dataset_shard_num": 3, "dataset_shard_idx": 3}, "names no shard of 3"),
                           ({"dataset_shard_num": 3, "dataset_shard_idx": 1, "rl": "dpo"}, "shards prepared SFT rows")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**BASE, "datasets": [{"path": "d.jsonl", "type": "alpaca"}], **extra})


@pytest.mark.slow
def test_dataset_shard_trains_through_the_cli(tmp_path, tiny_llama):
    import yaml

    from tests.trainer.helpers import run_cli

    data = write_jsonl(tmp_path / "rows.jsonl", [{"text": f"row {i} of the data"} for i in range(24)])
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(data), "type": "completion"}],
        "dataset_shard_num": 4, "dataset_shard_idx": 1, "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"), "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2,
        "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
