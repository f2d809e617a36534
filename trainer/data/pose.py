"""PoSE (use_pose): each training row keeps its tokens but gets position ids with random gaps, so a model trained on
sequence_len tokens sees positions up to pose_max_context_len (Positional Skip-wisE training), as Axolotl's
add_pose_position_ids (utils/trainer.py) does it, written here from what it does:

- the row is cut before each token of pose_split_on_token_ids, or else into pose_num_chunks (default 2) equal chunks
  (length // chunks each, the rest in the last); a first cut before position 2 is dropped, the row's end closes the
  last piece;
- the first piece keeps positions 0, 1, ...; before each later piece a skip is drawn uniformly from 0 to the skips
  left (pose_max_context_len - the row's length, spent as they are drawn), and every later position is shifted by
  the skips so far. The last position is at most pose_max_context_len - 1.

The draws: Axolotl draws them from Python's global random state inside datasets' map (one worker's state per
process), which no second run repeats; here each row's draws come from random.Random seeded by (seed, row index),
so a run and its resume draw the same. Only packed SFT data gets them, as in Axolotl (whose PoSE map sits in the
preparation of packed data: sample_packing, not streamed); validation rows where they are packed too
(eval_sample_packing, default sample_packing). The collator (trainer/batch/collate.py) uses a row's position_ids where it has them.
"""

from __future__ import annotations

import random


def positions(input_ids: list[int], max_context_len: int, split_on: list[int] | None, chunks: int,
              rng: random.Random) -> list[int]:
    n = len(input_ids)
    skips_left = max_context_len - n
    if split_on:
        wanted = set(split_on)
        cuts = [i for i, t in enumerate(input_ids) if t in wanted]
    else:
        size = n // chunks
        cuts = [i * size for i in range(1, chunks)]
    cuts.append(n)
    if cuts[0] < 2:
        cuts = cuts[1:]
    out: list[int] = []
    start, shift = 0, 0
    for cut in cuts:
        skip = rng.randint(0, skips_left) if start != 0 and skips_left else 0
        skips_left -= skip
        shift += skip
        out.extend(range(start + shift, cut + shift))
        start = cut
    return out


def apply(cfg, data):
    """`data` (trainer.data.prepare.Prepared) with a position_ids column on its training rows (and validation rows
    where they are packed)."""
    from dataclasses import replace  # start-up: only runs with use_pose

    def add(dataset, salt: int):
        def one(row, index):
            rng = random.Random(f"{cfg.seed}-{salt}-{index}")
            return {"position_ids": positions(row["input_ids"], cfg.pose_max_context_len,
                                              cfg.pose_split_on_token_ids, cfg.pose_num_chunks or 2, rng)}
        return dataset.map(one, with_indices=True, desc="PoSE position ids")

    train = add(data.train, 0)
    validation = data.validation
    if validation is not None and cfg.packing_for_eval:
        validation = add(validation, 1)
    return replace(data, train=train, validation=validation)
