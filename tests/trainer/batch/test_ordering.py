"""Training order keys: group_by_length (HF's length-grouped batches), curriculum_sampling (the data's own
order), sample_packing_sequentially (next-fit packing that keeps the order)."""

from __future__ import annotations

import numpy as np
import pytest

import trainer.train as train_mod
from tests.trainer.helpers import alpaca_rows, train_then_resume, write_jsonl
from trainer.batch.ordering import pack_sequentially
from trainer.batch.sampler import MultipackBatchSampler, Order
from trainer.cli import main
from trainer.config import parse_config


def padding_share(lengths, batches) -> float:
    slots = sum(max(lengths[i] for row in b for i in row) * len(b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for row in b for i in row) / slots


def test_group_by_length_batches_similar_lengths():
    lengths = np.random.default_rng(0).integers(1, 500, size=400)
    grouped = MultipackBatchSampler(lengths, 4, None, Order(seed=3, group_by_length=True, group_size=8))
    shuffled = MultipackBatchSampler(lengths, 4, None, Order(seed=3))
    epochs = []
    for epoch in (0, 1):
        grouped.set_epoch(epoch)
        batches = list(grouped)
        flat = [i for b in batches for row in b for i in row]
        assert sorted(flat) == list(range(400))  # every example once per epoch
        assert lengths[batches[0][0][0]] == lengths.max()  # the longest batch first (an OOM shows at once)
        epochs.append(flat)
        assert padding_share(lengths, batches) < 0.1 < padding_share(lengths, list(shuffled))
    assert epochs[0] != epochs[1]  # still shuffled between epochs


def test_group_by_length_is_off_with_packing():
    lengths = np.arange(1, 101)
    packed = MultipackBatchSampler(lengths, 2, 256, Order(seed=1, group_by_length=True))
    assert list(packed) == list(MultipackBatchSampler(lengths, 2, 256, Order(seed=1)))
    cfg, notes = parse_config({"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}],
                               "group_by_length": True, "sample_packing": True})
    assert any("group_by_length: no effect with sample_packing" in n for n in notes)


def test_sequential_packing_keeps_order_and_is_next_fit():
    lengths = np.random.default_rng(1).integers(1, 90, size=200)
    sampler = MultipackBatchSampler(lengths, 2, 128, Order(shuffle=False, sequential_packing=True, drop_last=False))
    rows = [row for batch in sampler for row in batch]
    assert [i for row in rows for i in row] == list(range(200))  # the data's order, first to last
    for row, following in zip(rows, rows[1:]):
        assert lengths[row].sum() <= 128
        assert lengths[row].sum() + lengths[following[0]] > 128  # next-fit: the next example did not fit
    assert pack_sequentially(np.array([5, 5, 5]), 10, np.array([2, 0, 1])) == [[2, 0], [1]]


@pytest.fixture
def record_batches(monkeypatch):
    seen = []

    class Recording(MultipackBatchSampler):
        def __iter__(self):
            batches = list(super().__iter__())
            seen.extend(batches)
            return iter(batches)

    monkeypatch.setattr(train_mod, "MultipackBatchSampler", Recording)
    return seen


def test_curriculum_sampling_trains_the_rows_in_file_order(make_config, tmp_path, record_batches):
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer, prepare

    rows = alpaca_rows(24)
    data = write_jsonl(tmp_path / "ordered.jsonl", rows)
    config = make_config(datasets=[{"path": str(data), "type": "alpaca"}], curriculum_sampling=True,
                         sample_packing=True, sample_packing_sequentially=True, max_steps=3, num_epochs=1)
    assert main(["train", str(config)]) == 0
    cfg, _ = load_config(config)
    train = prepare(cfg, load_tokenizer(cfg)).train
    tokenizer = load_tokenizer(cfg)
    # the prepared rows are the file's rows, in the file's order ...
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in train["input_ids"]]
    assert all(r["output"].split()[-1] in text for r, text in zip(rows, decoded))
    # ... and the loop trained them first to last, packed in that order
    trained = [i for batch in record_batches for row in batch for i in row]
    assert trained == list(range(len(trained))) and len(trained) >= 6


def test_shuffled_order_differs(make_config, tmp_path, record_batches):
    assert main(["train", str(make_config(max_steps=3))]) == 0
    trained = [i for batch in record_batches for row in batch for i in row]
    assert trained != sorted(trained)  # the default still shuffles: the test above can fail


@pytest.mark.parametrize("keys", [
    {"group_by_length": True, "gradient_accumulation_steps": 2},
    {"curriculum_sampling": True, "sample_packing": True, "sample_packing_sequentially": True},
], ids=["group_by_length", "curriculum+sequential"])
def test_ordered_runs_resume_exactly(make_config, tmp_path, keys):
    train_then_resume(main, make_config, tmp_path, checkpoint=2, max_steps=4, save_steps=2, num_epochs=1, **keys)


def test_sample_packing_sequentially_example_validates():
    """Axolotl's examples/llama-3/lora-1b-sample-packing-sequentially.yml, with its stray test_value key."""
    raw = {"base_model": "meta-llama/Llama-3.2-1B", "datasets": [{"path": "mhenrichsen/alpaca_2k_test", "type": "alpaca"}] * 2,
           "test_value": True, "sample_packing": True, "sample_packing_sequentially": True, "curriculum_sampling": True}
    _, notes = parse_config(raw)
    assert any(n.startswith("ignored: ") and "test_value" in n for n in notes)  # named in the one note line
    assert any("merged datasets are shuffled once" in n for n in notes)


def test_group_by_length_across_ranks():
    lengths = np.random.default_rng(4).integers(1, 300, size=200)
    ranks = [MultipackBatchSampler(lengths, 2, None, Order(seed=1, group_by_length=True, group_size=4), rank=r,
                                   world_size=2)
             for r in range(2)]
    batches = [list(s) for s in ranks]
    assert len(batches[0]) == len(batches[1])  # the same number of steps everywhere
    flat = sorted(i for per_rank in batches for b in per_rank for row in b for i in row)
    assert flat == list(range(200))
    assert all(padding_share(lengths, per_rank) < 0.1 for per_rank in batches)
