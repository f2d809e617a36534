"""Multipack packer and the distributed sampler: correct, efficient, deterministic, collective-free."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from trainer.batch.packing import efficiency, pack
from trainer.batch.sampler import MultipackBatchSampler, Order


def long_tailed(n: int, cap: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(cap / 8), 1.0, n).astype(int), 1, cap)


def check_bins(lengths, bins, cap):
    flat = np.concatenate(bins)
    assert sorted(flat.tolist()) == list(range(len(lengths))), "every item exactly once"
    assert max(int(lengths[b].sum()) for b in bins) <= cap


@pytest.mark.parametrize("cap", [256, 2048])
def test_packs_every_item_once_within_capacity_at_99_percent(cap):
    lengths = long_tailed(50_000, cap)
    bins = pack(lengths, cap)
    check_bins(lengths, bins, cap)
    assert efficiency(lengths, bins, cap) >= 0.99


def test_small_and_edge_cases():
    assert pack(np.array([], dtype=int), 10) == []
    bins = pack(np.array([10, 10, 10]), 10)  # exactly full bins
    assert sorted(len(b) for b in bins) == [1, 1, 1]
    lengths = np.array([6, 5, 4, 3, 2, 1])
    bins = pack(lengths, 7)
    check_bins(lengths, bins, 7)
    assert len(bins) == 3  # 21 tokens in bins of 7: optimal
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 7\]"):
        pack(np.array([8]), 7)


def test_order_changes_composition_not_efficiency():
    lengths = long_tailed(5000, 512)
    a = pack(lengths, 512, np.random.default_rng(1).permutation(5000))
    b = pack(lengths, 512, np.random.default_rng(2).permutation(5000))
    assert len(a) == len(b)
    assert {tuple(sorted(x.tolist())) for x in a} != {tuple(sorted(x.tolist())) for x in b}


@pytest.fixture
def no_collectives(monkeypatch):
    """Any torch.distributed collective during sampling fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the sampler must not call a collective")

    for name in ("broadcast", "all_reduce", "all_gather", "all_gather_object", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, name, forbidden)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("packing", [True, False])
def test_every_rank_gets_the_same_number_of_batches(world, packing, no_collectives):
    lengths = np.concatenate([np.full(37, 3), np.full(11, 250), long_tailed(101, 256, seed=world)])
    samplers = [MultipackBatchSampler(lengths, 2, 256 if packing else None, Order(seed=5), rank=r, world_size=world)
                for r in range(world)]
    for epoch in range(2):
        seen = []
        for s in samplers:
            s.set_epoch(epoch)
            batches = list(s)
            assert len(batches) == len(s) == len(samplers[0])
            seen += [i for batch in batches for row in batch for i in row]
        assert len(seen) == len(set(seen)), "ranks never share an example"
        assert len(seen) >= len(lengths) - world * 2 * (256 if packing else 1)  # only a remainder is dropped


def test_epochs_reshuffle_and_the_seed_reproduces():
    lengths = long_tailed(300, 128)
    s = MultipackBatchSampler(lengths, 2, 128, Order(seed=3))
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    assert first != second and len(first) == len(second)
    assert list(MultipackBatchSampler(lengths, 2, 128, Order(seed=3))) == first


def test_eval_sampler_uses_every_example_once(no_collectives):
    lengths = long_tailed(101, 128)
    seen = []
    for r in range(3):
        s = MultipackBatchSampler(lengths, 2, 128, Order(shuffle=False, drop_last=False), rank=r, world_size=3)
        seen += [i for batch in s for row in batch for i in row]
    assert sorted(seen) == list(range(101))


def test_resume_continues_where_it_stopped():
    lengths = long_tailed(200, 128)
    full = list(MultipackBatchSampler(lengths, 2, 128, Order(seed=9), rank=1, world_size=2))
    resumed = MultipackBatchSampler(lengths, 2, 128, Order(seed=9), rank=1, world_size=2)
    resumed.load_state_dict({"epoch": 0, "consumed": 3})
    assert list(resumed) == full[3:]
    assert list(resumed) == full  # the skip applies to one pass only
