"""shuffle_before_merging_datasets, as Axolotl's merge_datasets (utils/data/shared.py): with more than one dataset,
each is shuffled by the seed before they are concatenated; one dataset, or the key unset, is left in order (and
shuffle_merged_datasets shuffles the whole afterwards, as before)."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import parse_config
from trainer.data.prepare import merged

BASE = {"base_model": "m", "learning_rate": 1e-4, "seed": 7,
        "datasets": [{"path": "a.jsonl", "type": "completion"}, {"path": "b.jsonl", "type": "completion"}]}


def test_each_dataset_is_shuffled_by_the_seed_before_merging():
    import datasets

    a = datasets.Dataset.from_dict({"text": [f"a{i}" for i in range(20)]})
    b = datasets.Dataset.from_dict({"text": [f"b{i}" for i in range(13)]})
    cfg, _ = parse_config({**BASE, "shuffle_before_merging_datasets": True})
    # Axolotl's own calls on the same rows
    want = datasets.concatenate_datasets([a.shuffle(seed=7), b.shuffle(seed=7)])
    assert list(merged(cfg, [a, b])["text"]) == list(want["text"])
    assert list(merged(cfg, [a])["text"]) == list(a["text"])  # one dataset: merge_datasets returns it as it is
    plain, _ = parse_config(BASE)
    assert list(merged(plain, [a, b])["text"]) == list(a["text"]) + list(b["text"])
    assert list(want["text"]) != list(a["text"]) + list(b["text"])


@pytest.mark.slow
def test_shuffle_before_merging_trains_through_the_cli(tmp_path, tiny_llama):
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", [{"text": f"{n} row {i} of the data"} for i in range(8)])
             for n in ("a", "b")]
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(p), "type": "completion"} for p in paths],
        "shuffle_before_merging_datasets": True, "shuffle_merged_datasets": False,
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
