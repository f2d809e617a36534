"""Training order options from Axolotl's configs, used by trainer.batch.sampler.

- group_by_length: the HF Trainer's LengthGroupedSampler order (what Axolotl's `group_by_length` selects
  when sample_packing is off): transformers' own `get_length_grouped_indices`, seeded per epoch.
- sample_packing_sequentially: Axolotl's next-fit packer (`allocate_sequentially`): examples go into the
  current bin in the given order, and a new bin starts when the next one does not fit. With
  curriculum_sampling (the dataset's own order) the packed rows follow the dataset from first to last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it is used: validate and `envtool train` read configs without it
    import numpy as np


def length_grouped(lengths: np.ndarray, group_size: int, seed: int) -> np.ndarray:
    """Indices such that each run of `group_size` consecutive ones has similar lengths (the longest first)."""
    # heavy: numpy and torch load only when this runs
    import numpy as np
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator().manual_seed(seed)
    return np.asarray(get_length_grouped_indices(np.asarray(lengths).tolist(), group_size, generator=generator),
                      dtype=np.int64)


def pack_sequentially(lengths: np.ndarray, capacity: int, order: np.ndarray) -> list[list[int]]:
    """Next-fit packing of `order` into rows of at most `capacity` tokens, keeping the order."""
    rows: list[list[int]] = []
    current: list[int] = []
    room = capacity
    for i in order:
        size = int(lengths[i])
        if size > capacity:
            raise ValueError(f"length {size} exceeds the capacity {capacity}")
        if size > room and current:
            rows.append(current)
            current, room = [], capacity
        current.append(int(i))
        room -= size
    if current:
        rows.append(current)
    return rows
