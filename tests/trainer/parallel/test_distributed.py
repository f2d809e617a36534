"""Several processes (torchrun, gloo on CPU): no hangs, and the same training as one process."""

from __future__ import annotations

import textwrap

import pytest

from tests.trainer.helpers import alpaca_rows, assert_same_training, read_metrics, torchrun, write_jsonl
from trainer.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_processes_with_uneven_lengths_evaluate_and_checkpoint_midway(make_config, tmp_path):
    data = write_jsonl(tmp_path / "uneven.jsonl", alpaca_rows(80, seed=3, long_every=4))  # 1 in 4 rows ~3x longer
    common = dict(datasets=[{"path": str(data), "type": "alpaca"}], sequence_len=400, sample_packing=True,
                  val_set_size=0.2, micro_batch_size=1, max_steps=5, eval_steps=2, save_steps=2,
                  lr_scheduler="cosine", warmup_steps=1)
    two = tmp_path / "two-procs"
    result = torchrun("-m", "trainer", "train", str(make_config("two.yml", output_dir=str(two),
                                                                     gradient_accumulation_steps=1, **common)),
                      timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(two)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 5]
    assert {p.name for p in (two / "checkpoint-2").iterdir()} >= {"rng_state_0.pt", "rng_state_1.pt", "optimizer.pt"}
    assert (two / "final" / "model.safetensors").exists()

    # One process accumulating 2 micro-batches sees the same examples per step as two processes with one
    # each, and the loss is averaged over all target tokens of the step on all ranks: same training.
    one = tmp_path / "one-proc"
    assert main(["train", str(make_config("one.yml", output_dir=str(one), gradient_accumulation_steps=2, **common))]) == 0
    assert_same_training(one, two)


def test_collective_timeout_names_rank_and_phase(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from datetime import timedelta
        import torch, torch.distributed as dist
        from trainer.parallel.collective import reduce_sum
        from trainer.errors import TrainingError
        dist.init_process_group("gloo", timeout=timedelta(seconds=2))
        if dist.get_rank() == 0:
            try:
                reduce_sum(torch.ones(1), "evaluation (summing eval loss)", 0, 2)
            except TrainingError as err:
                print(err, flush=True)
                sys.exit(3)
        else:
            time.sleep(6)  # never joins: stuck elsewhere
    """))
    result = torchrun(str(script), timeout=120)
    assert "rank 0: a collective timed out after 2s during evaluation (summing eval loss)" in result.stdout, (
        result.stdout + result.stderr[-2000:])
