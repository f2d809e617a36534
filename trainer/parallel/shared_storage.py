"""Several machines in one run: are dataset_prepared_path and output_dir on storage every node sees?

Under torchrun with more than one node (WORLD_SIZE above LOCAL_WORLD_SIZE), rank 0 prepares the dataset cache and
the other ranks wait for it in dataset_prepared_path; every rank writes its part of a checkpoint into output_dir.
On a node that does not share those directories the cache never appears, and a rank would wait
dataset_prepare_timeout (30 min) before it fails. So at start, within seconds:

1. rank 0 writes a marker file named by a random token into both directories;
2. the token goes to every rank in one broadcast (which also orders the write before the look);
3. the first process of every other node looks for the marker in its own view of each directory (for up to
   LOOK_S seconds: a network filesystem may show a new name a moment later);
4. what they saw is summed over all ranks in one all-reduce of a fixed-size vector; rank 0 removes the markers.

Then, in one line: both shared (nothing changes); a node-local dataset_prepared_path is prepared by every node's
first process (each node its own copy of the same cache), except where ranks exchange files through it
(DPO/IPO/KTO reference log-probs: refused); a node-local output_dir keeps final/ and metrics.jsonl on the first
node, and is refused where checkpoints are saved (every rank writes into the checkpoint directory rank 0 made).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.errors import ConfigError
from trainer.parallel.collective import phase, reduce_sum

LOOK_S = 3.0
MARKER = ".envtool-shared-{token:016x}"


def layout() -> tuple[int, int]:
    """(nodes, processes per node) from torchrun's environment; (1, WORLD_SIZE) when it runs on one node."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "0") or 0) or max(1, world // max(local, 1))
    return nodes, local


@dataclass
class Storage:
    nodes: int = 1
    prepared_shared: bool = True
    output_shared: bool = True

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def describe(self, cfg) -> str:
        if self.prepared_shared and self.output_shared:
            return (f"{self.nodes} nodes: dataset_prepared_path and output_dir are on storage every node sees "
                    "(checked): rank 0 prepares the dataset once")
        parts = []
        if not self.prepared_shared:
            parts.append(f"dataset_prepared_path {cfg.dataset_prepared_path} is not on storage every node sees: "
                         "each node prepares the dataset itself")
        else:
            parts.append("dataset_prepared_path is shared: rank 0 prepares the dataset once")
        if not self.output_shared:
            parts.append(f"output_dir {cfg.output_dir} is not shared: final/ and metrics.jsonl are written on the "
                         "first node (node rank 0) only")
        else:
            parts.append("output_dir is shared")
        return f"{self.nodes} nodes: " + "; ".join(parts)

    def refusal(self, cfg, needs_reference: bool) -> str | None:
        """Why this layout cannot run this config, or None."""
        fix = "put it on storage every node mounts (NFS, a shared volume)"
        if not self.prepared_shared and needs_reference:
            return (f"{self.nodes} nodes: dataset_prepared_path {cfg.dataset_prepared_path} is not on storage every "
                    f"node sees, and rl: {cfg.rl} exchanges the reference log-probs of every rank through it: {fix}")
        saves = [k for k in ("save_steps", "saves_per_epoch") if getattr(cfg, k, None)]
        if not self.output_shared and saves:
            return (f"{self.nodes} nodes: output_dir {cfg.output_dir} is not on storage every node sees, and every "
                    f"rank writes into the checkpoints rank 0 starts there ({saves[0]}: {getattr(cfg, saves[0])}): "
                    f"{fix}, or save no checkpoints (drop {' and '.join(saves)})")
        return None


def check(cfg, rank: int, local_rank: int, device, timeout_s: float) -> Storage:
    """Storage() on one node (no collective); on several, what every node sees (see the module's docstring)."""
    nodes, _ = layout()
    if nodes <= 1 or not (dist.is_available() and dist.is_initialized()):
        return Storage()
    directories = [Path(cfg.dataset_prepared_path), Path(cfg.output_dir)]
    token = torch.zeros(1, dtype=torch.int64, device=device)
    written: list[Path] = []
    try:
        if rank == 0:
            value = secrets.randbits(62)
            for directory in directories:
                directory.mkdir(parents=True, exist_ok=True)
                marker = directory / MARKER.format(token=value)
                marker.write_text(f"{value}\n")
                written.append(marker)
            token[0] = value
        with phase("the shared-storage check (token)", rank, timeout_s):
            dist.broadcast(token, src=0)
        name = MARKER.format(token=int(token[0]))
        missing = torch.zeros(len(directories), dtype=torch.float64, device=device)
        if local_rank == 0 and rank != 0:  # the first process of each other node looks
            deadline = time.monotonic() + LOOK_S
            while True:
                seen = [(directory / name).is_file() for directory in directories]
                if all(seen) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            missing = torch.tensor([0.0 if s else 1.0 for s in seen], dtype=torch.float64, device=device)
        missing = reduce_sum(missing, "the shared-storage check (what each node saw)", rank, timeout_s)
    finally:
        for marker in written:
            marker.unlink(missing_ok=True)
    return Storage(nodes, prepared_shared=float(missing[0]) == 0, output_shared=float(missing[1]) == 0)
