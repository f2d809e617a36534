"""PoSE (use_pose, trainer/data/pose.py): packed SFT rows train with Axolotl's position skips (add_pose_position_ids:
pieces cut by tokens or into chunks, random skips before every piece but the first, up to pose_max_context_len)."""

from __future__ import annotations

import random

import pytest
import yaml

from tests.trainer.helpers import read_metrics, run_cli
from trainer.data.pose import positions


def _pieces(pos: list[int]) -> list[list[int]]:
    out = [[pos[0]]]
    for a, b in zip(pos, pos[1:]):
        out[-1].append(b) if b == a + 1 else out.append([b])
    return out


def test_positions_skip_between_pieces_and_stay_within_the_context():
    ids = list(range(100, 160))  # 60 tokens
    for seed in range(50):
        pos = positions(ids, 1000, None, 3, random.Random(seed))
        assert len(pos) == 60 and pos[:20] == list(range(20))  # the first piece keeps 0, 1, ...
        assert all(b > a for a, b in zip(pos, pos[1:])) and pos[-1] <= 999
        assert len(_pieces(pos)) <= 3  # skips only where a piece starts (a skip of 0 joins two pieces)
    assert any(positions(ids, 1000, None, 3, random.Random(s))[-1] > 500 for s in range(50))  # they reach far
    # cut before each split token; a cut before position 2 is dropped
    split = [7, 1, 2, 7, 3, 4, 5, 7, 6]
    pos = positions(split, 100, [7], 2, random.Random(0))
    assert pos[:3] == [0, 1, 2] and [len(p) for p in _pieces(pos)] in ([3, 4, 2], [3, 6], [7, 2], [9])
    assert positions(split, 9, [7], 2, random.Random(0)) == list(range(9))  # no room: no skips


def test_without_sample_packing_use_pose_is_named_as_not_read(make_config):
    from trainer.config import parse_config
    from trainer.errors import ConfigError

    raw = yaml.safe_load(make_config(use_pose=True, pose_max_context_len=4096).read_text())
    cfg, notes = parse_config(raw)
    assert not cfg.pose and any(n.startswith("use_pose: not read") for n in notes)
    assert parse_config({**raw, "sample_packing": True})[0].pose
    with pytest.raises(ConfigError, match="use_pose: needs pose_max_context_len"):
        parse_config({**raw, "sample_packing": True, "pose_max_context_len": None})
    with pytest.raises(ConfigError, match=r"pose_max_context_len: 100 is below sequence_len \(256\)"):
        parse_config({**raw, "sample_packing": True, "pose_max_context_len": 100})


@pytest.mark.slow
def test_packed_rows_train_with_skipped_positions(make_config, tmp_path):
    """The same packed run with and without PoSE: the positions reach the model (another first loss), and the run
    says so."""
    common = dict(sample_packing=True, max_steps=1, micro_batch_size=1)
    plain = run_cli("train", str(make_config("plain.yml", output_dir=str(tmp_path / "plain"), **common)))
    pose = run_cli("train", str(make_config("pose.yml", output_dir=str(tmp_path / "pose"), use_pose=True,
                                            pose_max_context_len=8192, **common)))
    assert plain.returncode == 0 and pose.returncode == 0, pose.stderr[-3000:]
    assert "PoSE: position ids skip up to pose_max_context_len 8192" in pose.stderr
    first = [next(r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r) for d in ("plain", "pose")]
    assert abs(first[0] - first[1]) > 1e-6  # (the tiny model's positions move its loss a little)


def test_the_collator_gives_the_model_a_rows_own_positions():
    from datasets import Dataset

    from trainer.batch.collate import Collator, Rows

    data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10]], "labels": [[5, 6, 7, 8], [9, 10]],
                              "position_ids": [[0, 1, 500, 501], [0, 1]]})
    for attention in ("sdpa", "flash_attention_2"):
        batch = Collator(0, attention)([Rows(data)[[0, 1]]])  # one packed row of both
        assert batch["position_ids"].flatten().tolist()[:6] == [0, 1, 500, 501, 0, 1]
    plain = Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[5, 6, 7]]})
    assert Collator(0, "sdpa")([Rows(plain)[[0]]])["position_ids"].tolist() == [[0, 1, 2]]
