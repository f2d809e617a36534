"""Reward models on two processes (torchrun, gloo on CPU), under a hard timeout: an evaluation and a checkpoint
mid-run, and the same losses, evaluations and accuracies as one process accumulating 2 micro-batches. The
Bradley-Terry case also runs under DeepSpeed ZeRO-1, as Axolotl's examples/qwen3/reward-model.yaml does."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import assert_same_training, read_metrics, write_jsonl
from tests.trainer.parallel.test_distributed import torchrun
from tests.trainer.objectives.test_reward_model import bt_rows, step_rows
from trainer.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("kind,deepspeed", [("reward", None), ("prm", None),
                                            ("reward", "deepspeed_configs/zero1.json")])
def test_two_processes_match_one_process_accumulating_two(kind, deepspeed, make_config, tmp_path):
    if kind == "reward":
        extra = dict(reward_model=True, chat_template="chatml", center_rewards_coefficient=0.01,
                     datasets=[{"path": str(write_jsonl(tmp_path / "bt.jsonl", bt_rows(30, seed=2))),
                                "type": "bradley_terry.chat_template"}])
    else:
        extra = dict(process_reward_model=True,
                     datasets=[{"path": str(write_jsonl(tmp_path / "steps.jsonl", step_rows(30, seed=2))),
                                "type": "stepwise_supervised"}])
    common = dict(sequence_len=128, val_set_size=0.3, micro_batch_size=1, max_steps=3, eval_steps=2, save_steps=2,
                  learning_rate=5e-3, ddp_timeout=60, dataset_prepare_timeout=60, **extra)
    two = tmp_path / "two"
    config = make_config("two.yml", output_dir=str(two), gradient_accumulation_steps=1,
                         **common, **({"deepspeed": deepspeed} if deepspeed else {}))
    result = torchrun("-m", "trainer", "train", str(config), timeout=240)  # a hang fails the test
    assert result.returncode == 0, result.stderr[-3000:]
    if deepspeed:
        assert "sharding: DEEPSPEED" in result.stderr
    assert (two / "checkpoint-2").is_dir() and [r["step"] for r in read_metrics(two) if "eval_loss" in r] == [2, 3]

    one = tmp_path / "one"
    assert main(["train", str(make_config("one.yml", output_dir=str(one), gradient_accumulation_steps=2,
                                          **common))]) == 0
    assert_same_training(one, two)
    metric = "margin" if kind == "reward" else "accuracy"
    assert [r[metric] for r in read_metrics(two) if "loss" in r] == pytest.approx(
        [r[metric] for r in read_metrics(one) if "loss" in r], rel=1e-4, abs=1e-6)
    assert [r["eval_accuracy"] for r in read_metrics(two) if "eval_loss" in r] == pytest.approx(
        [r["eval_accuracy"] for r in read_metrics(one) if "eval_loss" in r])
