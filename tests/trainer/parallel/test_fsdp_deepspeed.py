"""FSDP2 and DeepSpeed ZeRO-2/ZeRO-3 with 2 processes (torchrun, gloo on 127.0.0.1): long-tailed lengths with
packing, an evaluation and a checkpoint mid-run, under a hard timeout; they resume, and reach DDP's losses.

The hang this guards against: with sharded weights every forward pass is a collective, so an evaluation in
which one rank has a batch more than the other (multipack's uneven split) waits forever. Tolerance against DDP:
rel 1e-5 — the same fp32 math, only the order of the gradient reductions differs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.trainer.helpers import alpaca_rows, read_metrics, torchrun_train, train_losses, write_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DS_CONFIGS = Path(__file__).parents[1] / "fixtures" / "deepspeed_configs"  # Axolotl's zero2.json / zero3.json, verbatim
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                            "fsdp_state_dict_type": "FULL_STATE_DICT",
                                            "fsdp_reshard_after_forward": True}}
BACKENDS = {
    "fsdp2": FSDP2,
    # Axolotl's older spelling: the fsdp: list, unprefixed keys, FSDP1 (which runs as FSDP2 on CPU, with a note)
    "fsdp_legacy_list": {"fsdp": ["full_shard", "auto_wrap"],
                         "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                         "state_dict_type": "FULL_STATE_DICT"}},
    "zero3": {"deepspeed": str(DS_CONFIGS / "zero3.json")},
    "zero2": {"deepspeed": str(DS_CONFIGS / "zero2.json")},
}
EXPECTED_TYPE = {"fsdp2": "FSDP", "fsdp_legacy_list": "FSDP", "zero3": "DEEPSPEED", "zero2": "DEEPSPEED"}


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, tiny_llama):
    """The same run under plain DDP (2 processes): the losses every sharded backend must reach."""
    tmp = tmp_path_factory.mktemp("ddp")
    return run_config(tmp, tiny_llama, "ddp", {})


def common(tmp: Path, tiny_llama: Path) -> dict:
    data = tmp / "uneven.jsonl"
    if not data.exists():
        write_jsonl(data, alpaca_rows(80, seed=3, long_every=4))  # 1 in 4 rows ~3x longer: uneven packs
    return dict(base_model=str(tiny_llama), datasets=[{"path": str(data), "type": "alpaca"}],
                dataset_prepared_path=str(tmp / "prepared"), sequence_len=400, sample_packing=True,
                val_set_size=0.2, micro_batch_size=1, max_steps=5, eval_steps=2, save_steps=2,
                learning_rate=1e-3, lr_scheduler="cosine", warmup_steps=1, seed=1, attn_implementation="sdpa",
                ddp_timeout=60)


def run_config(tmp: Path, tiny_llama: Path, name: str, extra: dict, **overrides) -> tuple[Path, subprocess.CompletedProcess]:
    import yaml

    out = tmp / name
    cfg = {**common(tmp, tiny_llama), "output_dir": str(out), **extra, **overrides}
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    result = torchrun_train(path)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


def resume_run(tmp: Path, tiny_llama: Path, name: str, extra: dict) -> tuple[Path, subprocess.CompletedProcess]:
    """Run `name` again as `name`-resumed, starting from a copy of its checkpoint-2."""
    resumed = tmp / f"{name}-resumed"
    resumed.mkdir()
    shutil.copytree(tmp / name / "checkpoint-2", resumed / "checkpoint-2")
    return run_config(tmp, tiny_llama, f"{name}-resumed", extra, auto_resume_from_checkpoints=True)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sharded_training_evaluates_checkpoints_resumes_and_matches_ddp(backend, tmp_path, tiny_llama, ddp_reference):
    ddp_out, _ = ddp_reference
    out, result = run_config(tmp_path, tiny_llama, backend, BACKENDS[backend])
    assert f"sharding: {EXPECTED_TYPE[backend]}" in result.stderr  # the backend really ran
    if backend == "fsdp_legacy_list":
        assert "fsdp_version: 1 runs as FSDP2 on CPU" in result.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 5]
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "model.safetensors").exists()

    losses, reference = train_losses(out), train_losses(ddp_out)
    assert losses.keys() == reference.keys() == {1, 2, 3, 4, 5}
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], rel=1e-5), (backend, step)
    evals = lambda o: [r["eval_loss"] for r in read_metrics(o) if "eval_loss" in r]  # noqa: E731
    assert evals(out) == pytest.approx(evals(ddp_out), rel=1e-5)

    from safetensors.torch import load_file

    final, ref = load_file(out / "final" / "model.safetensors"), load_file(ddp_out / "final" / "model.safetensors")
    assert final.keys() == ref.keys()
    assert all((final[k] - ref[k]).abs().max() < 1e-4 for k in ref)  # the full weights, gathered from the shards

    if backend in ("fsdp2", "zero3", "zero2"):  # resume from the mid-run checkpoint: the same steps again
        again, result = resume_run(tmp_path, tiny_llama, backend, BACKENDS[backend])
        assert "resumed from" in result.stderr
        after = train_losses(again)
        assert sorted(after) == [3, 4, 5]
        for step in after:
            assert after[step] == pytest.approx(losses[step], rel=1e-6), (backend, step)


def test_qlora_under_fsdp2_resumes_exactly(tmp_path, tiny_llama):
    """Axolotl's qlora-fsdp examples: 4-bit base, LoRA, FSDP2; the adapter's names in a checkpoint lack the
    adapter name, so resuming must map them back (or the adapter silently restarts from scratch)."""
    qlora = {**FSDP2, "adapter": "qlora", "load_in_4bit": True, "lora_r": 4, "lora_target_linear": True}
    out, result = run_config(tmp_path, tiny_llama, "fsdp-qlora", qlora)
    assert "sharding: FSDP" in result.stderr and (out / "final" / "adapter_model.safetensors").exists()
    again, _ = resume_run(tmp_path, tiny_llama, "fsdp-qlora", qlora)
    full, after = train_losses(out), train_losses(again)
    assert sorted(after) == [3, 4, 5]
    assert all(after[s] == pytest.approx(full[s], rel=1e-6) for s in after), (full, after)


def test_lora_under_zero3_resumes_exactly(tmp_path, tiny_llama):
    """LoRA under ZeRO-3 with gradient accumulation: resuming from the mid-run checkpoint repeats the same steps.
    DeepSpeed records its parameter-fetch trace on the first micro-batch after the checkpoint loads and checks
    the next against it; peft's layer reads lora_A.weight outside lora_A, so unless the trainer declares it,
    the two micro-batches fetch differently and the resume dies ("tracing error at step N")."""
    lora = {**BACKENDS["zero3"], "adapter": "lora", "lora_r": 4, "lora_target_linear": True, "max_steps": 4,
            "gradient_accumulation_steps": 2}
    out, result = run_config(tmp_path, tiny_llama, "zero3-lora", lora)
    assert "sharding: DEEPSPEED" in result.stderr and (out / "final" / "adapter_model.safetensors").exists()
    again, _ = resume_run(tmp_path, tiny_llama, "zero3-lora", lora)
    full, after = train_losses(out), train_losses(again)
    assert sorted(after) == [3, 4]
    assert all(after[s] == pytest.approx(full[s], rel=1e-6) for s in after), (full, after)


def test_one_process_without_a_launcher_trains_under_deepspeed_as_without_it(tmp_path, tiny_llama):
    """`python -m trainer train` (as `envtool train` starts one device's run) with `deepspeed:` and no torchrun:
    the run makes the one-process group a launcher would (it stopped with "Default process group has not been
    initialized" before) and reaches the losses of the same run without DeepSpeed."""
    import yaml

    from tests.trainer.helpers import run_cli

    from trainer.cli import main

    paths = {}
    # ZeRO-1 as Axolotl ships it (the bundled copy): no optimizer offload, so no cpu_adam build (minutes) in CI
    for name, extra in (("plain", {}), ("zero1", {"deepspeed": "deepspeed_configs/zero1.json"})):
        cfg = {**common(tmp_path, tiny_llama), "output_dir": str(tmp_path / name), "val_set_size": 0, "max_steps": 3,
               **extra}
        cfg.pop("eval_steps")
        paths[name] = tmp_path / f"{name}.yml"
        paths[name].write_text(yaml.safe_dump(cfg))
    assert main(["train", str(paths["plain"])]) == 0  # the reference, in this process
    result = run_cli("train", str(paths["zero1"]), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharding: DEEPSPEED" in result.stderr
    plain, zero1 = train_losses(tmp_path / "plain"), train_losses(tmp_path / "zero1")
    assert plain.keys() == zero1.keys() == {1, 2, 3}
    assert all(zero1[s] == pytest.approx(plain[s], rel=1e-5) for s in plain), (plain, zero1)
