"""Which examples go into which micro-batch on which rank: computed locally, no collectives.

Every rank builds the same global list of batches from the same lengths and the same seed (a seeded
shuffle, then the packer), and takes every world_size-th batch. So every rank knows, without asking the
others, how many batches everyone has. (Axolotl's multi-GPU hang after evaluation came from a broadcast
inside its sampler's __len__: a collective that only some ranks reached.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.batch.packing import pack

Batch = list[list[int]]  # a micro-batch: rows, each row a list of example indices packed together


@dataclass(frozen=True)
class Order:
    """How MultipackBatchSampler orders and cuts an epoch (its docstring says what each does): the seed, a shuffle
    or the data's order, length grouping (over `group_size` rows), next-fit packing, and dropping the remainder."""

    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    group_by_length: bool = False
    group_size: int | None = None
    sequential_packing: bool = False


EVALUATION = Order(shuffle=False, drop_last=False)  # every example once, in the data's order


class MultipackBatchSampler:
    """Yields micro-batches of `batch_size` rows. With `capacity` each row is a bin of packed examples
    of at most `capacity` tokens; without it each row is one example (padded by the collator).

    Order (training): `shuffle` (a seeded permutation per epoch), `group_by_length` (the HF Trainer's
    length-grouped order: mega-batches of a shuffled order, each sorted longest first; with `group_size` the
    number of rows an optimizer step takes), or the dataset's own order (shuffle=False: evaluation, and
    Axolotl's curriculum_sampling). `sequential_packing` packs next-fit in that order (Axolotl's
    sample_packing_sequentially) instead of best-fit decreasing, so packed rows keep the order too.

    drop_last=True (training): every rank gets exactly len(self) batches; the global remainder that
    cannot be split evenly is dropped. drop_last=False (evaluation): every batch is used once, so ranks
    may differ by one batch — evaluation has no per-batch collectives, so that is safe.
    """

    def __init__(self, lengths, batch_size: int, capacity: int | None, order: Order = Order(), rank: int = 0,
                 world_size: int = 1):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.capacity = capacity
        self.seed = order.seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = order.shuffle
        self.drop_last = order.drop_last
        self.group_by_length = order.group_by_length and order.shuffle and capacity is None  # packing decides batches
        self.group_size = order.group_size or batch_size
        self.sequential_packing = order.sequential_packing
        self.epoch = 0
        self.skip = 0  # batches of this epoch already consumed (set when resuming)
        self._cache: tuple[int, list[Batch]] | None = None

    def global_batches(self, epoch: int) -> list[Batch]:
        """All micro-batches of an epoch, for all ranks, in order. Memoised per epoch."""
        if self._cache and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.lengths.size) if self.shuffle else np.arange(self.lengths.size)
        if self.group_by_length:
            # start-up: trainer.batch.ordering imported only when this runs
            from trainer.batch.ordering import length_grouped

            order = length_grouped(self.lengths, self.group_size, int(rng.integers(2**62)))
        if self.capacity is None:
            rows = [[int(i)] for i in order]
        elif self.sequential_packing:
            from trainer.batch.ordering import pack_sequentially

            rows = pack_sequentially(self.lengths, self.capacity, order)
        else:
            bins = pack(self.lengths, self.capacity, order)
            if self.shuffle:
                bins = [bins[i] for i in rng.permutation(len(bins))]
            rows = [b.tolist() for b in bins]
        batches = [rows[i:i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        self._cache = (epoch, batches)
        return batches

    def rank_batches(self, epoch: int) -> list[Batch]:
        batches = self.global_batches(epoch)
        if self.drop_last:
            batches = batches[: len(batches) // self.world_size * self.world_size]
        return batches[self.rank::self.world_size]

    def __len__(self) -> int:
        # Packing only depends on the multiset of lengths, so every epoch has the same number of batches.
        return len(self.rank_batches(self.epoch))

    def __iter__(self):
        # not a generator: the resume offset is used up as soon as iteration starts
        batches = self.rank_batches(self.epoch)[self.skip:]
        self.skip = 0
        return iter(batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self, consumed: int) -> dict:
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.skip = state["consumed"]
