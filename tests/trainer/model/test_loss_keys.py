"""The keys that ask Axolotl for a fused loss (cut_cross_entropy, its plugin, liger's loss kernels) are served by the
trainer's chunked cross-entropy on every GPU and on CPU, and validate says so; `cut_cross_entropy: false` beside the
plugin keeps it off, as in Axolotl."""

from __future__ import annotations

import pytest

from trainer.config import parse_config
from trainer.model import kernels
from trainer.runtime.hardware import gpu_from_name

CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "learning_rate": 1e-4}


@pytest.mark.parametrize("keys, asked", [
    ({"plugins": [CCE]}, ["cut_cross_entropy"]),
    ({"plugins": [CCE], "cut_cross_entropy": False}, []),
    ({"cut_cross_entropy": True}, ["cut_cross_entropy"]),
    ({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_fused_linear_cross_entropy": True},
     ["liger_fused_linear_cross_entropy"]),
])
@pytest.mark.parametrize("gpu", ["cpu", "t4", "v100", "h100"])
def test_a_fused_loss_key_is_served_by_the_chunked_loss_everywhere(keys, asked, gpu):
    cfg, _ = parse_config({**BASE, **keys})
    _, notes = kernels.plan_notes(cfg, gpu_from_name(gpu), None)
    served = [n for n in notes if "served by the trainer's own chunked cross-entropy" in n]
    assert [n.split(":")[0] for n in served] == ([", ".join(asked)] if asked else [])
