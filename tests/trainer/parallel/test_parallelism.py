"""Axolotl's N-D parallelism sizes (trainer/parallel/mesh.py): dp_shard_size (FSDP over that many ranks) and
dp_replicate_size (HSDP: replicas x shards, accelerate's ParallelismConfig on a 2-D device mesh).

The multi-process runs use torchrun on CPU over gloo (127.0.0.1) under a hard timeout, and train the same
steps as plain DDP: every step covers the same four micro-batches (DDP: 2 processes x accumulation 2; FSDP
with dp_shard_size 2: the same; HSDP 2 x 2: 4 processes x accumulation 1), so the losses agree to rel 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer.helpers import read_metrics, torchrun_train, train_losses
from tests.trainer.parallel.test_fsdp_deepspeed import FSDP2, common
from trainer.config import parse_config
from trainer.config.parallel import Mesh, mesh_for
from trainer.errors import ConfigError

BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}


def cfg(**keys):
    return parse_config({**BASE, **keys})[0]


# --- the sizes: Axolotl's fill rules, checked against the number of processes ---------------------------

@pytest.mark.parametrize("keys, world, fsdp, expected", [
    ({"dp_shard_size": 2}, 2, True, Mesh(1, 2)),
    ({"dp_shard_size": 2}, 4, True, Mesh(2, 2)),  # ranks left over replicate (Axolotl fills dp_replicate)
    ({"dp_shard_size": 2, "dp_replicate_size": 2}, 4, True, Mesh(2, 2)),
    ({"dp_replicate_size": 2}, 8, True, Mesh(2, 4)),  # the rest shard
    ({"dp_shard_size": 1, "dp_replicate_size": 1}, 4, True, Mesh(1, 4)),  # falcon-e: 1 = what is left
    ({"dp_replicate_size": 2}, 2, False, Mesh(2, 1)),  # no FSDP: plain DDP over all ranks
    ({"dp_shard_size": 16}, 32, True, Mesh(2, 16)),  # gpt-oss-120b on 2 x 16 GPUs
    ({"tensor_parallel_size": 2}, 2, False, Mesh(1, 1, 2)),  # tensor parallel alone
    ({"tensor_parallel_size": 2}, 8, True, Mesh(1, 4, 2)),  # FSDP takes the ranks TP leaves
    ({"dp_shard_size": 4, "dp_replicate_size": 2, "tensor_parallel_size": 2}, 16, True, Mesh(2, 4, 2)),  # hsdp-tp
])
def test_sizes_fill_the_world_as_axolotl_does(keys, world, fsdp, expected):
    assert mesh_for(cfg(**keys, **(FSDP2 if fsdp else {})), world, fsdp) == expected


@pytest.mark.parametrize("keys, world, message", [
    ({"dp_shard_size": 4}, 2, "dp_shard_size 4 needs a multiple of 4 processes, but this run has 2"),
    ({"dp_shard_size": 2}, 3, "dp_shard_size 2 needs a multiple of 2 processes, but this run has 3"),
    ({"dp_shard_size": 2, "dp_replicate_size": 2}, 8, "dp_shard_size 2 x dp_replicate_size 2 = 4 processes, "
                                                      "but this run has 8"),
    ({"dp_replicate_size": 3}, 4, "dp_replicate_size 3 needs a multiple of 3 processes, but this run has 4"),
    ({"tensor_parallel_size": 2, "fsdp_version": None, "fsdp_config": None}, 4,
     "tensor_parallel_size 2 = 2 processes, but this run has 4"),  # no FSDP for the ranks TP leaves
    ({"tensor_parallel_size": 4}, 6, "tensor_parallel_size 4 needs a multiple of 4 processes, but this run has 6"),
])
def test_sizes_that_do_not_fit_the_world_are_one_clear_line(keys, world, message):
    keys = {**FSDP2, **keys}
    keys = {k: v for k, v in keys.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as err:
        mesh_for(cfg(**keys), world, fsdp="fsdp_version" in keys)
    assert "\n" not in str(err.value)


def test_no_size_keys_no_mesh():
    assert mesh_for(cfg(**FSDP2), 2, True) is None


@pytest.mark.parametrize("keys, message", [
    ({"tensor_parallel_size": 2, "adapter": "lora"}, "tensor_parallel_size: 2 with adapter: lora (LoRA on tensor-"),
    ({"tensor_parallel_size": 2, "deepspeed": "ds.json"}, "tensor_parallel_size: 2 with deepspeed (Axolotl's DeepSpeed AutoTP"),
    ({"tensor_parallel_size": 2, "rl": "dpo", "datasets": [{"path": "d.jsonl", "type": "chatml.intel"}]},
     "tensor_parallel_size: 2 with rl: dpo (the reference pass"),
    ({"dp_shard_size": 2}, "dp_shard_size: 2 shards the model with FSDP, so it needs fsdp_version: 2"),
    ({"dp_shard_size": 2, "dp_replicate_size": 2, "fsdp": ["full_shard", "auto_wrap"]},
     "dp_replicate_size: 2 with FSDP (HSDP) needs fsdp_version: 2"),
])
def test_refusals_name_the_key_and_the_reason(keys, message):
    with pytest.raises(ConfigError) as err:
        cfg(**keys)
    assert message in str(err.value)


def test_sizes_of_one_mean_none():
    """Axolotl's falcon-e configs spell out every size as 1."""
    config, notes = parse_config({**BASE, **FSDP2, "dp_shard_size": 1, "dp_replicate_size": 1,
                                  "tensor_parallel_size": 1, "context_parallel_size": 1})
    assert config.tensor_parallel_size == 1 and any("sizes of 1 mean none" in n for n in notes)


# --- real runs: torchrun, gloo, tiny llama --------------------------------------------------------------

def run(tmp: Path, tiny_llama: Path, name: str, nproc: int, extra: dict, expect_ok: bool = True, **overrides):
    import yaml

    out = tmp / name
    config = {**common(tmp, tiny_llama), "max_steps": 4, "output_dir": str(out), **extra, **overrides}
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump(config))
    result = torchrun_train(path, nproc=nproc, timeout=240)
    if expect_ok:
        assert result.returncode == 0, result.stderr[-4000:]
    return out, result


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("ddp")
    return run(tmp, tiny_llama, "ddp", 2, {"gradient_accumulation_steps": 2})[0]


def assert_same_as(out: Path, reference: Path) -> None:
    losses, expected = train_losses(out), train_losses(reference)
    assert losses.keys() == expected.keys() == {1, 2, 3, 4}
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), step
    evals = lambda o: [r["eval_loss"] for r in read_metrics(o) if "eval_loss" in r]  # noqa: E731
    assert evals(out) == pytest.approx(evals(reference), rel=1e-5) and len(evals(out)) == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_dp_shard_size_shards_over_two_processes_and_matches_ddp(tmp_path, tiny_llama, ddp_reference):
    out, result = run(tmp_path, tiny_llama, "shard", 2, {**FSDP2, "dp_shard_size": 2, "gradient_accumulation_steps": 2})
    assert "parallelism: FSDP over 2 processes; mesh dim0=2, placements Shard(dim=0)" in result.stderr
    assert_same_as(out, ddp_reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_falcon_e_sizes_of_one_and_sync_each_batch_shard_over_all_processes(tmp_path, tiny_llama, ddp_reference):
    """Axolotl's falcon-e configs: every size spelled as 1 (FSDP then shards over all ranks, as in Axolotl) and
    accelerator_config's sync_each_batch (gradients reduce-scattered after every micro-batch, not once per step)."""
    falcon = {**FSDP2, "dp_shard_size": 1, "dp_replicate_size": 1, "tensor_parallel_size": 1,
              "context_parallel_size": 1, "gradient_accumulation_steps": 2,
              "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}}
    out, result = run(tmp_path, tiny_llama, "falcon", 2, falcon)
    assert "parallelism: FSDP over 2 processes; mesh dim0=2, placements Shard(dim=0)" in result.stderr
    assert_same_as(out, ddp_reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_replicates_two_sharded_copies_matches_ddp_and_resumes(tmp_path, tiny_llama, ddp_reference):
    hsdp = {**FSDP2, "dp_shard_size": 2, "dp_replicate_size": 2}
    out, result = run(tmp_path, tiny_llama, "hsdp", 4, hsdp)
    # the parameters really live on a 2-D mesh: replicated across dp_replicate, sharded across dp_shard
    assert ("parallelism: HSDP: 2 replicas x 2-way FSDP shards (4 processes); mesh dp_replicate=2 x "
            "dp_shard_cp=2, placements Replicate(), Shard(dim=0)") in result.stderr
    assert_same_as(out, ddp_reference)
    assert (out / "final" / "model.safetensors").exists()

    resumed = tmp_path / "hsdp-resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    again, result = run(tmp_path, tiny_llama, "hsdp-resumed", 4, hsdp, auto_resume_from_checkpoints=True)
    assert "resumed from" in result.stderr
    full, after = train_losses(out), train_losses(again)
    assert sorted(after) == [3, 4] and all(after[s] == pytest.approx(full[s], rel=1e-6) for s in after)


@pytest.mark.distributed
@pytest.mark.slow
def test_sizes_that_do_not_fit_the_launch_stop_every_rank_before_work(tmp_path, tiny_llama):
    _, result = run(tmp_path, tiny_llama, "misfit", 2, {**FSDP2, "dp_shard_size": 4}, expect_ok=False)
    assert result.returncode != 0
    message = ("dp_shard_size 4 needs a multiple of 4 processes, but this run has 2 (WORLD_SIZE): launch that many "
               "processes (torchrun --nproc-per-node, times the nodes) or change the sizes")
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    # each rank stops on its own; torchrun may end the other before it prints
    assert lines and set(lines) <= {f"error (rank 1): {message}", f"error: {message}"}
    assert "exitcode  : 2" in result.stderr  # bad config (torchrun itself then prints its own summary)
    assert 'trainer/train.py", line' not in result.stderr  # no traceback from the workers
    assert not (tmp_path / "misfit").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_alone_matches_ddp_counts_once_and_resumes(tmp_path, tiny_llama, ddp_reference):
    """2-way TP (the tiny llama's tp_plan, transformers' DistributedConfig, DTensor over gloo): both ranks run
    the same 4 micro-batches per step (accumulation 4) that DDP's two ranks split, and count them once."""
    tp = {"tensor_parallel_size": 2, "gradient_accumulation_steps": 4}
    out, result = run(tmp_path, tiny_llama, "tp", 2, tp)
    assert "parallelism: 2-way tensor parallel x no data parallelism (2 processes); mesh tp=2" in result.stderr
    assert_same_as(out, ddp_reference)
    counts = lambda o, k: [r[k] for r in read_metrics(o) if k in r]  # noqa: E731
    for key in ("tokens", "target_tokens", "eval_tokens"):  # not doubled by the two ranks of the TP group
        assert counts(out, key) == counts(ddp_reference, key), key

    resumed = tmp_path / "tp-resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    again, result = run(tmp_path, tiny_llama, "tp-resumed", 2, tp, auto_resume_from_checkpoints=True)
    assert "resumed from" in result.stderr
    full, after = train_losses(out), train_losses(again)
    assert sorted(after) == [3, 4] and all(after[s] == pytest.approx(full[s], rel=1e-6) for s in after)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_with_fsdp_on_four_processes_matches_ddp(tmp_path, tiny_llama, ddp_reference):
    """2-D: FSDP2 over 2 data ranks x 2-way TP (Axolotl's distributed-parallel examples, scaled down)."""
    out, result = run(tmp_path, tiny_llama, "tp-fsdp", 4, {**FSDP2, "tensor_parallel_size": 2,
                                                           "gradient_accumulation_steps": 2})
    assert "parallelism: 2-way tensor parallel x 2-way FSDP shards (4 processes); mesh fsdp=2 x tp=2" in result.stderr
    assert_same_as(out, ddp_reference)
    from safetensors.torch import load_file

    final, ref = load_file(out / "final" / "model.safetensors"), load_file(ddp_reference / "final" / "model.safetensors")
    assert final.keys() == ref.keys() and all((final[k] - ref[k]).abs().max() < 1e-4 for k in ref)
