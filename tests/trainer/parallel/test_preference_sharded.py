"""Preference training with weights sharded in every forward (FSDP2, DeepSpeed ZeRO-3) on two processes (torchrun,
gloo on CPU): the reference pass before training, KTO's KL forwards, an evaluation and a checkpoint mid-run, with
uneven example counts per rank, under a hard timeout -- the same losses as DDP, and an exact resume.

The hang this guards against: every forward is a collective (the shards are gathered), so a reference pass or an
evaluation in which one rank has a batch more than the other would wait forever.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.helpers import read_metrics, torchrun, train_losses
from tests.trainer.pref_helpers import kto_rows, pair_rows, write_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DS_ZERO3 = Path(__file__).parents[1] / "fixtures" / "deepspeed_configs" / "zero3.json"  # Axolotl's zero3.json, verbatim
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                            "fsdp_state_dict_type": "FULL_STATE_DICT",
                                            "fsdp_reshard_after_forward": True}}


def trained_adapter(base: Path, out: Path) -> Path:
    """A LoRA adapter whose B matrices are not zero (peft's init_lora_weights=False), so it changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("rl,adapter", [("dpo", None), ("kto", None), ("dpo", "lora")])
def test_fsdp2_and_zero3_match_ddp_evaluate_checkpoint_and_resume(rl, adapter, make_config, tmp_path, tiny_llama):
    """With LoRA (continuing a trained adapter, lora_model_dir) the reference is the base with the adapter
    disabled, on the sharded model: the first step's rewards are then not zero, and the same as DDP's."""
    # 44 rows: 35 train and 9 held out, so each rank's reference pass and evaluation is a batch off the other's
    if rl == "kto":  # packed, with KL forwards in every step
        dataset = {"path": str(write_jsonl(tmp_path / "kto.jsonl", kto_rows(44, seed=4, long_every=4))),
                   "type": "chatml.prompt_pairs"}
    else:  # 1 pair in 4 has a ~10x longer chosen answer
        dataset = {"path": str(write_jsonl(tmp_path / "pairs.jsonl", pair_rows(44, seed=4, long_every=4))),
                   "type": "chat_template.default"}
    common = dict(rl=rl, datasets=[dataset], sequence_len=160, val_set_size=0.2, micro_batch_size=1, max_steps=3,
                  gradient_accumulation_steps=2, eval_steps=2, save_steps=2, lr_scheduler="cosine", warmup_steps=0,
                  learning_rate=5e-3, ddp_timeout=60, dataset_prepare_timeout=60, sample_packing=rl == "kto")
    if adapter:
        common.update(adapter=adapter, lora_model_dir=str(trained_adapter(tiny_llama, tmp_path / "adapter")))

    def run(name: str, prepared: str, **extra) -> tuple[Path, str]:
        out = tmp_path / name
        config = make_config(f"{name}.yml", output_dir=str(out), dataset_prepared_path=str(tmp_path / prepared),
                             **common, **extra)
        result = torchrun("-m", "trainer", "train", str(config), timeout=240)  # a hang fails the test
        assert result.returncode == 0, result.stderr[-3000:]
        return out, result.stderr

    ddp, _ = run("ddp", "prepared-ddp")
    reference, ref_evals = train_losses(ddp), [r["eval_loss"] for r in read_metrics(ddp) if "eval_loss" in r]
    assert reference.keys() == {1, 2, 3} and len(ref_evals) == 2
    if adapter:  # the policy starts with the adapter on, the reference without it
        assert abs(next(r for r in read_metrics(ddp) if "loss" in r)["rewards/chosen"]) > 1e-4
    for backend, extra, kind in (("fsdp2", FSDP2, "FSDP"), ("zero3", {"deepspeed": str(DS_ZERO3)}, "DEEPSPEED")):
        out, log = run(backend, f"prepared-{backend}", **extra)
        assert f"sharding: {kind}" in log and "computing reference log-probs once" in log
        # the reference pass really was uneven: one rank's share of the train examples is one more
        shards = sorted((tmp_path / f"prepared-{backend}").rglob("train.shard-*.npy"))
        assert sorted(len(np.load(p)) for p in shards) == [17, 18], shards
        losses = train_losses(out)
        assert losses.keys() == reference.keys()
        for step in reference:
            assert losses[step] == pytest.approx(reference[step], rel=1e-5), (backend, step)
        assert [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r] == pytest.approx(ref_evals, rel=1e-5)
        metric = "kl" if rl == "kto" else "rewards/margins"
        logged = lambda o: [r[metric] for r in read_metrics(o) if "loss" in r]  # noqa: E731
        assert logged(out) == pytest.approx(logged(ddp), rel=1e-4, abs=1e-6)
        weights = "adapter_model.safetensors" if adapter else "model.safetensors"
        assert (out / "checkpoint-2").is_dir() and (out / "final" / weights).exists()

        resumed = tmp_path / f"{backend}-resumed"  # from the mid-run checkpoint: the last step again, exactly
        resumed.mkdir()
        shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
        again, log = run(f"{backend}-resumed", f"prepared-{backend}", auto_resume_from_checkpoints=True, **extra)
        assert "resumed from" in log and "reusing the reference log-probs" in log
        after = train_losses(again)
        assert sorted(after) == [3] and after[3] == pytest.approx(losses[3], rel=1e-6), backend
