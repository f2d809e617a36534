"""Training end to end on CPU: what is trained, resuming, checkpoints, failures, outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainer.outputs.checkpoint as checkpoint_mod
import trainer.parallel.accelerator as accelerator_mod
import trainer.train as train_mod
from tests.trainer.helpers import read_metrics, run_cli, train_losses
from trainer.cli import main


def train(config: Path) -> int:
    return main(["train", str(config)])


def test_micro_batch_size_and_accumulation_do_not_change_what_is_trained(make_config, tmp_path):
    """4x1, 2x2 and 1x4 see the same examples per step; with the loss averaged over every target token
    of the step (not per micro-batch) they take the same steps."""
    losses = {}
    for mbs, ga in [(4, 1), (2, 2), (1, 4)]:
        out = tmp_path / f"out-{mbs}x{ga}"
        assert train(make_config(f"{mbs}x{ga}.yml", micro_batch_size=mbs, gradient_accumulation_steps=ga,
                                 output_dir=str(out), max_steps=3)) == 0
        losses[(mbs, ga)] = train_losses(out)
    reference = losses[(4, 1)]
    assert len(reference) == 3
    for key, got in losses.items():
        assert got.keys() == reference.keys()
        for step in reference:
            assert got[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (key, step)


def test_packing_does_not_change_the_gradient(tiny_llama, tmp_path, make_config):
    """The same examples, packed into rows or one per micro-batch, give the same gradient."""
    from transformers import AutoModelForCausalLM

    from trainer.batch.collate import Collator, count_targets
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer, prepare
    from trainer.objectives.loss import token_loss_sum

    cfg, _ = load_config(make_config())
    data = prepare(cfg, load_tokenizer(cfg))
    examples = [data.train[i] for i in range(6)]
    collate = Collator(pad_token_id=0, attention="sdpa")
    layouts = {
        "one per micro-batch": [collate([[e]]) for e in examples],
        "padded batch of 6": [collate([[e] for e in examples])],
        "packed 3+3": [collate([examples[:3], examples[3:]])],
        "packed, 2 micro-batches": [collate([examples[:4]]), collate([examples[4:]])],
    }
    grads = {}
    for name, micro_batches in layouts.items():
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
        n_targets = sum(count_targets(b) for b in micro_batches)
        for batch in micro_batches:
            (token_loss_sum(model, batch) / n_targets).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    reference = grads["one per micro-batch"]
    for name, g in grads.items():
        assert torch.allclose(g, reference, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("adapter", [None, "lora"])
def test_resumed_run_continues_exactly(make_config, tmp_path, adapter):
    extra = {"adapter": "lora", "lora_r": 4, "lora_dropout": 0.2} if adapter else {}  # dropout: RNG state matters
    common = dict(max_steps=7, save_steps=3, sample_packing=True, gradient_accumulation_steps=2,
                  lr_scheduler="cosine", warmup_steps=2, **extra)
    full_out, resumed_out = tmp_path / "full", tmp_path / "resumed"
    assert train(make_config("full.yml", output_dir=str(full_out), **common)) == 0
    resumed_out.mkdir()
    shutil.copytree(full_out / "checkpoint-3", resumed_out / "checkpoint-3")  # what an interrupted run leaves
    assert train(make_config("resumed.yml", output_dir=str(resumed_out), auto_resume_from_checkpoints=True, **common)) == 0

    full, resumed = train_losses(full_out), train_losses(resumed_out)
    assert sorted(resumed) == [4, 5, 6, 7]
    assert [resumed[s] for s in range(4, 8)] == [full[s] for s in range(4, 8)]  # exactly, on CPU
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    a, b = load_file(full_out / "final" / weights), load_file(resumed_out / "final" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_is_complete_or_absent(make_config, tmp_path, monkeypatch, capsys):
    real_save = torch.save

    def crash_on_optimizer(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_mod.torch, "save", crash_on_optimizer)
    out = tmp_path / "out"
    assert train(make_config(output_dir=str(out), save_steps=2)) == 1
    assert "disk full" in capsys.readouterr().err
    # nothing half-written stays: the partial directory is removed with the failure
    assert not list(out.glob("checkpoint-*")) and not (out / ".tmp-checkpoint-2").exists()
    assert checkpoint_mod.list_checkpoints(out) == []
    monkeypatch.undo()
    # a later run with auto-resume ignores the partial directory and starts from scratch
    assert train(make_config("again.yml", output_dir=str(out), save_steps=2, auto_resume_from_checkpoints=True)) == 0
    assert [p.name for p in checkpoint_mod.list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert sorted(train_losses(out)) == [1, 2, 3, 4]  # the new run's log replaced the failed run's
    ckpt = out / "checkpoint-4"
    assert {"optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json", "model.safetensors"} <= {
        p.name for p in ckpt.iterdir()}
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["sampler"]["consumed"] >= 4


def test_nan_loss_stops_with_the_step(make_config, monkeypatch, capsys):
    real = train_mod.token_loss_sum
    calls = []

    def nan_on_third(model, batch):
        calls.append(1)
        loss = real(model, batch)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(train_mod, "token_loss_sum", nan_on_third)
    assert train(make_config(max_steps=5)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: loss is nan at step 3;")


def test_gradient_checkpointing_trains_the_same(make_config, tmp_path):
    plain, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    assert train(make_config("a.yml", output_dir=str(plain), max_steps=2)) == 0
    assert train(make_config("b.yml", output_dir=str(ckpt), max_steps=2, gradient_checkpointing=True)) == 0
    a, b = train_losses(plain), train_losses(ckpt)
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a)


def test_lora_trains_only_the_adapter_and_evaluate_agrees(make_config, tmp_path, capsys):
    out = tmp_path / "lora"
    config = make_config(output_dir=str(out), adapter="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"],
                         val_set_size=0.25, max_steps=3, learning_rate=0.01)
    assert train(config) == 0
    final = out / "final"
    assert (final / "adapter_config.json").exists() and not (final / "model.safetensors").exists()
    saved = load_file(final / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    last_eval = [r for r in read_metrics(out) if "eval_loss" in r][-1]
    capsys.readouterr()
    assert main(["evaluate", str(config), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_loss"] == pytest.approx(last_eval["eval_loss"], rel=1e-5)
    assert result["eval_tokens"] == last_eval["eval_tokens"] and result["model"] == str(final)


def test_eval_loss_is_the_same_with_and_without_eval_packing(make_config, tmp_path, capsys):
    out = tmp_path / "out"
    assert train(make_config(output_dir=str(out), val_set_size=0.25, max_steps=2)) == 0
    results = {}
    for packing in (True, False):
        capsys.readouterr()
        config = make_config(f"eval-{packing}.yml", output_dir=str(out), val_set_size=0.25,
                             eval_sample_packing=packing, eval_batch_size=3)
        assert main(["evaluate", str(config), "--json"]) == 0
        results[packing] = json.loads(capsys.readouterr().out)
    assert results[True]["eval_tokens"] == results[False]["eval_tokens"] > 0
    assert results[True]["eval_loss"] == pytest.approx(results[False]["eval_loss"], rel=1e-5)


def test_metrics_jsonl_and_final_model(make_config, tmp_path):
    out = tmp_path / "out"
    assert train(make_config(output_dir=str(out), max_steps=4, val_set_size=0.25, eval_steps=2, logging_steps=1)) == 0
    rows = read_metrics(out)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "epoch"} <= steps[0].keys()
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 0 for r in steps)
    assert [r["step"] for r in evals] == [2, 4]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "final")
    AutoTokenizer.from_pretrained(out / "final")


def test_not_enough_data_is_bad_input(make_config, capsys):
    assert train(make_config(micro_batch_size=40, gradient_accumulation_steps=4)) == 2
    assert "fewer than gradient_accumulation_steps=4" in capsys.readouterr().err


def test_resume_from_a_checkpoint_at_the_end_of_an_epoch(make_config, tmp_path):
    """The sampler's resume offset must not leak into the next epoch."""
    from trainer.batch.sampler import MultipackBatchSampler
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer, prepare

    cfg, _ = load_config(make_config())
    n_batches = len(MultipackBatchSampler(prepare(cfg, load_tokenizer(cfg)).train["length"], 2, None))
    common = dict(max_steps=n_batches + 2, save_steps=n_batches)  # one checkpoint, exactly at the epoch's end
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert train(make_config("full.yml", output_dir=str(full), **common)) == 0
    resumed.mkdir()
    shutil.copytree(full / f"checkpoint-{n_batches}", resumed / f"checkpoint-{n_batches}")
    assert train(make_config("resumed.yml", output_dir=str(resumed),
                             resume_from_checkpoint=str(resumed / f"checkpoint-{n_batches}"), **common)) == 0
    a, b = train_losses(full), train_losses(resumed)
    assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(b)] and len(b) == 2


def test_deepspeed_key_is_passed_through_or_refused_clearly(make_config, tmp_path, capsys, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    real = accelerator_mod.importlib.util.find_spec
    monkeypatch.setattr(accelerator_mod.importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
    code = train(make_config(deepspeed=str(ds)))
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and "deepspeed: the deepspeed package is not installed" in err
    assert train(make_config("missing.yml", deepspeed=str(tmp_path / "nope.json"))) == 2
    assert "deepspeed: not found" in capsys.readouterr().err


def test_evaluate_needs_a_validation_split(make_config, capsys):
    assert main(["evaluate", str(make_config())]) == 2
    assert "set val_set_size" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_packed_training_is_the_same_on_sdpa_and_eager(family, make_config, tmp_path, request):
    losses = {}
    for attention in ("sdpa", "eager"):
        out = tmp_path / attention
        assert train(make_config(f"{attention}.yml", base_model=str(request.getfixturevalue(family)),
                                 attn_implementation=attention, sample_packing=True, output_dir=str(out),
                                 max_steps=3)) == 0
        losses[attention] = train_losses(out)
    assert losses["sdpa"].keys() == losses["eager"].keys()
    assert all(losses["eager"][s] == pytest.approx(losses["sdpa"][s], rel=1e-5) for s in losses["sdpa"])


def test_mixed_prompt_formats_and_added_tokens_train(make_config, tmp_path):
    chat = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w} <extra>"}]}
            for w in ("cats", "dogs", "sun", "fox") * 4]
    text = [{"text": f"the quick {w} fox"} for w in ("red", "blue", "green", "white") * 4]
    segments = [{"segments": [{"text": "Q: two plus two?", "label": False}, {"text": f" A: {w}", "label": True}]}
                for w in ("four", "4", "four!", "IV") * 4]
    paths = {}
    for name, rows in (("chat", chat), ("text", text), ("segments", segments)):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), sample_packing=True, max_steps=3, tokens=["<extra>"],
                         special_tokens={"pad_token": "<pad>"},
                         datasets=[{"path": str(paths["chat"]), "type": "chat_template"},
                                   {"path": str(paths["text"]), "type": "completion"},
                                   {"path": str(paths["segments"]), "type": "input_output"}])
    assert train(config) == 0
    assert len(train_losses(out)) == 3
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert "<extra>" in tokenizer.get_vocab()
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)  # embeddings were resized


@pytest.mark.slow
def test_bf16_autocast_runs_on_cpu_close_to_fp32(make_config, tmp_path):
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    assert train(make_config("a.yml", output_dir=str(fp32), max_steps=2)) == 0
    result = run_cli("train", str(make_config("b.yml", output_dir=str(bf16), max_steps=2, bf16=True)))
    assert result.returncode == 0, result.stderr[-2000:]  # its own process: accelerate's precision is per process
    a, b = train_losses(fp32), train_losses(bf16)
    assert all(b[s] == pytest.approx(a[s], rel=2e-2) and b[s] != a[s] for s in a)  # autocast really ran


def test_train_reads_the_plan(make_config, tmp_path, monkeypatch, capsys):
    from tests.trainer.runtime.test_hardware import plan_for

    cpu_plan = tmp_path / "cpu-plan.json"
    cpu_plan.write_text(json.dumps(plan_for("cpu", None, "sdpa", "fp32")))
    monkeypatch.setenv("ENVTOOL_PLAN", str(cpu_plan))
    assert train(make_config(max_steps=1, attn_implementation=None)) == 0
    assert "attention: sdpa (chosen by the plan)" in capsys.readouterr().err
    t4_plan = tmp_path / "t4-plan.json"
    t4_plan.write_text(json.dumps(plan_for("Tesla T4", "7.5", "sdpa", "fp16")))
    monkeypatch.setenv("ENVTOOL_PLAN", str(t4_plan))
    assert train(make_config(max_steps=1)) == 1
    assert "the plan is for Tesla T4 (sm_75, turing) but torch sees no CUDA device here" in capsys.readouterr().err


def test_a_full_disk_at_the_final_save_names_the_folder_and_how_to_continue(make_config, tmp_path, monkeypatch,
                                                                             capsys):
    """ENOSPC while the final model is written (issue 44 item 7): one line naming output_dir/final and the config
    keys that continue from the newest checkpoint, exit 1, and no .tmp-final left to keep the disk full."""
    import errno

    from transformers import PreTrainedTokenizerBase

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", no_space)
    out = tmp_path / "out"
    assert train(make_config(output_dir=str(out), save_steps=2)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: cannot write the final model to {out / 'final'}: No space left on device; free space, then "
                   f"continue from {out / 'checkpoint-4'}: run again with auto_resume_from_checkpoints: true (or "
                   f"resume_from_checkpoint: {out / 'checkpoint-4'})")
    assert not (out / ".tmp-final").exists() and not (out / "final").exists()


def test_resuming_onto_rewritten_data_is_refused_naming_the_checkpoint(make_config, alpaca_file, tmp_path, capsys):
    """The same config over a dataset file rewritten since the checkpoint (issue 44 item 6): the data position would
    continue into other rows. Refused in one line (exit 2) naming the checkpoint; the unchanged file resumes."""
    from tests.trainer.helpers import alpaca_rows, write_jsonl

    out = tmp_path / "out"
    assert train(make_config(output_dir=str(out), max_steps=2, save_steps=2)) == 0
    capsys.readouterr()
    original = alpaca_file.read_text()
    write_jsonl(alpaca_file, list(reversed(alpaca_rows(48))))
    again = make_config("again.yml", output_dir=str(out), max_steps=4, save_steps=2, auto_resume_from_checkpoints=True)
    assert train(again) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: {out / 'checkpoint-2'} was trained on other data than this run reads")
    assert "restore that data, or start a new run (a new output_dir)" in line
    alpaca_file.write_text(original)
    assert train(again) == 0 and (out / "checkpoint-4").is_dir()


def test_raising_max_steps_on_a_resume_continues_at_the_new_schedules_rate(make_config, tmp_path, capsys):
    """A finished 4-step cosine run resumed with max_steps 8 (issue 44 item 6): its step 5 trained at learning rate 0,
    the old schedule's end, before the new one took over. Now step 5 is at the rate the 8-step schedule gives it, as
    a fresh 8-step run has at step 5, and a note says so."""
    common = {"lr_scheduler": "cosine", "warmup_steps": 1, "save_steps": 4}
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert train(make_config(output_dir=str(out), max_steps=4, **common)) == 0
    assert train(make_config("more.yml", output_dir=str(out), max_steps=8, auto_resume_from_checkpoints=True,
                             **common)) == 0
    assert "note: the learning rate continues on this run's schedule" in capsys.readouterr().err
    assert train(make_config("fresh.yml", output_dir=str(fresh), max_steps=8, **common)) == 0
    rates = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    want = {r["step"]: r["lr"] for r in read_metrics(fresh) if "lr" in r}
    assert rates[5] > 0 and [rates[s] for s in range(5, 9)] == pytest.approx([want[s] for s in range(5, 9)])
