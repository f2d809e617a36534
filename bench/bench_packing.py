"""Packing efficiency and time for 1M sequence lengths from a long-tailed distribution.

Baselines are measured in the same run, so the printed ratios do not depend on the machine:
  - padding: random batches padded to their longest sequence (what training without packing pays for)
  - next-fit: packing in arrival order, starting a new bin whenever the next sequence does not fit
  - argsort: numpy sorting the same lengths once (a yardstick for the packer's time)

    python bench/bench_packing.py [--n 1000000] [--capacity 4096] [--batch 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.batch.packing import efficiency, pack  # noqa: E402


def long_tailed_lengths(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Chat/instruction SFT data: most samples a few hundred tokens, a long tail up to the context size
    (log-normal, median capacity/16, sigma 1.0, clipped to [16, capacity])."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(capacity / 16), 1.0, n), 16, capacity).astype(np.int64)


def padded_efficiency(lengths: np.ndarray, batch: int, seed: int = 0) -> float:
    order = np.random.default_rng(seed).permutation(lengths.size)
    usable = lengths.size // batch * batch
    batches = lengths[order[:usable]].reshape(-1, batch)
    return float(batches.sum() / (batches.max(axis=1).sum() * batch))


def next_fit_bins(lengths: np.ndarray, capacity: int) -> int:
    bins, room = 0, 0
    for n in lengths.tolist():
        if n > room:
            bins, room = bins + 1, capacity
        room -= n
    return bins


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8, help="sequences per padded batch (baseline)")
    args = parser.parse_args()

    lengths = long_tailed_lengths(args.n, args.capacity)
    order = np.random.default_rng(1).permutation(lengths.size)
    bins, pack_s = timed(pack, lengths, args.capacity, order)
    _, sort_s = timed(np.argsort, -lengths)
    nf_bins, nf_s = timed(next_fit_bins, lengths[order], args.capacity)

    packed = efficiency(lengths, bins, args.capacity)
    next_fit = lengths.sum() / (nf_bins * args.capacity)
    padded = padded_efficiency(lengths, args.batch)
    print(f"lengths: {args.n:,} log-normal, median {int(np.median(lengths))}, mean {lengths.mean():.0f}, "
          f"p99 {int(np.percentile(lengths, 99))}, capacity {args.capacity}")
    print(f"multipack (best-fit decreasing): {len(bins):,} bins, efficiency {packed:.4%}, {pack_s:.2f} s")
    print(f"baseline padding, batches of {args.batch}: efficiency {padded:.4%}")
    print(f"baseline next-fit in order: {nf_bins:,} bins, efficiency {next_fit:.4%}, {nf_s:.2f} s")
    print(f"ratio efficiency multipack / padding:  {packed / padded:.2f}x")
    print(f"ratio efficiency multipack / next-fit: {packed / next_fit:.3f}x")
    print(f"ratio time multipack / numpy argsort:  {pack_s / sort_s:.1f}x")


if __name__ == "__main__":
    main()
