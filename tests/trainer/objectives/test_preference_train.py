"""Preference training end to end on CPU: every method trains and logs TRL's metric names; the reference
log-probs are computed once and reused; accumulation, packing and resuming do not change what is trained;
no reference model is ever held in memory."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import load_file

import trainer.objectives.reference as reference_mod
from tests.trainer.helpers import REPO, read_metrics, train_losses
from tests.trainer.pref_helpers import kto_rows, pair_rows, write_jsonl
from trainer.cli import main

PAIR_METRICS = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"}


@pytest.fixture
def pairs_file(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", pair_rows(40, seed=2))


@pytest.fixture
def kto_file(tmp_path):
    return write_jsonl(tmp_path / "kto.jsonl", kto_rows(40, seed=3))


@pytest.fixture
def pref_config(make_config, pairs_file, kto_file):
    def make(name="pref.yml", rl="dpo", **overrides):
        ds = ({"path": str(kto_file), "type": "chatml.prompt_pairs"} if rl == "kto"
              else {"path": str(pairs_file), "type": "chat_template.default"})
        return make_config(name, rl=rl, datasets=[ds], sequence_len=96, learning_rate=5e-3, **overrides)

    return make


def train(config) -> int:
    return main(["train", str(config)])


@pytest.mark.parametrize("rl", ["dpo", "ipo", "orpo", "simpo", "kto"])
def test_each_method_trains_evaluates_and_logs_trls_metric_names(rl, pref_config, tmp_path, capsys):
    out = tmp_path / rl
    assert train(pref_config(rl=rl, output_dir=str(out), max_steps=3, val_set_size=0.2, eval_steps=2)) == 0
    rows = read_metrics(out)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["step"] for r in evals] == [2, 3]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in steps)
    names = {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"} if rl == "kto" else PAIR_METRICS
    assert names <= set().union(*steps) and {f"eval_{n}" for n in names if n != "kl"} <= set().union(*evals)
    if rl in ("dpo", "ipo", "kto"):  # step 1: the policy is the reference, so every reward is 0
        assert steps[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
        first = {"dpo": math.log(2), "ipo": (1 / (2 * 0.1)) ** 2, "kto": 0.5}[rl]  # log 2; (1/2beta)^2; 1 - sigmoid(0)
        assert steps[0]["loss"] == pytest.approx(first, rel=1e-5)
    err = capsys.readouterr().err
    assert "rewards/margins=" in err or "kl=" in err  # the progress line shows them
    assert (out / "final" / "model.safetensors").exists()


def test_the_reference_is_computed_once_and_reused(pref_config, tmp_path, monkeypatch, capsys):
    calls = []
    real = reference_mod._shard
    monkeypatch.setattr(reference_mod, "_shard", lambda *a, **k: calls.append(1) or real(*a, **k))
    first, second = tmp_path / "first", tmp_path / "second"
    assert train(pref_config("a.yml", output_dir=str(first), max_steps=2, val_set_size=0.2)) == 0
    assert len(calls) == 2  # train and validation
    assert "computing reference log-probs once" in capsys.readouterr().err
    assert train(pref_config("b.yml", output_dir=str(second), max_steps=2, val_set_size=0.2)) == 0
    assert len(calls) == 2 and "reusing the reference log-probs" in capsys.readouterr().err
    assert train_losses(first) == train_losses(second)
    # ORPO and SimPO need none; another model needs its own
    assert train(pref_config("c.yml", rl="orpo", output_dir=str(tmp_path / "orpo"), max_steps=1)) == 0
    assert len(calls) == 2


@pytest.mark.parametrize("rl", ["dpo", "kto"])
def test_accumulation_and_micro_batch_size_do_not_change_what_is_trained(rl, pref_config, tmp_path):
    """Pairs (or KTO examples, with the KL estimate) are averaged over the whole step, not per micro-batch."""
    losses = {}
    for mbs, ga in [(4, 1), (2, 2), (1, 4)]:
        out = tmp_path / f"{mbs}x{ga}"
        assert train(pref_config(f"{mbs}x{ga}.yml", rl=rl, output_dir=str(out), micro_batch_size=mbs,
                                 gradient_accumulation_steps=ga, max_steps=3)) == 0
        losses[(mbs, ga)] = train_losses(out)
    for key, got in losses.items():
        assert got == pytest.approx(losses[(4, 1)], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("rl,adapter", [("dpo", "lora"), ("kto", None)])
def test_resumed_run_continues_exactly_even_without_the_reference_cache(rl, adapter, pref_config, tmp_path):
    """The reference is computed before a checkpoint's weights load, with LoRA from the base with the adapter
    disabled: deleting the cache before resuming still gives the same reference, so the same losses."""
    extra = {"adapter": "lora", "lora_r": 4, "lora_dropout": 0.2} if adapter else {}
    common = dict(rl=rl, max_steps=6, save_steps=3, gradient_accumulation_steps=2, lr_scheduler="cosine",
                  warmup_steps=1, sample_packing=True, **extra)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert train(pref_config("full.yml", output_dir=str(full), **common)) == 0
    for ref in (tmp_path / "prepared").glob("*/reference-*"):
        shutil.rmtree(ref)
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    assert train(pref_config("resumed.yml", output_dir=str(resumed), auto_resume_from_checkpoints=True, **common)) == 0
    a, b = train_losses(full), train_losses(resumed)
    assert sorted(b) == [4, 5, 6] and [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    x, y = load_file(full / "final" / weights), load_file(resumed / "final" / weights)
    assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("rl", ["dpo", "orpo", "kto"])
def test_packed_and_unpacked_batches_give_the_same_loss_and_gradient(rl, pref_config, tiny_llama):
    from transformers import AutoModelForCausalLM

    from trainer import objectives
    from trainer.batch.collate import Collator
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer
    from trainer.objectives import prepare

    cfg, _ = load_config(pref_config(rl=rl))
    data = prepare(cfg, load_tokenizer(cfg))
    results = {}
    ref = torch.rand(len(data.train), 2).numpy() * -20  # stands in for the reference log-probs
    for packed in (False, True):
        cfg.sample_packing = packed
        objective = objectives.build(cfg, Collator(0, "sdpa"), None)
        rows = objective.rows(data.train, ref if objective.needs_reference else None)
        examples = [rows[[i]][0] for i in range(6)]
        micro_batches = [objective.collate([examples[:4]]), objective.collate([examples[4:]])] if packed else \
            [objective.collate([[e] for e in examples])]
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
        stats = torch.tensor([objective.step_stats(model, b) for b in micro_batches], dtype=torch.float64).sum(0)
        totals = dict(zip(objective.stat_names, stats.tolist()))
        loss = sum(objective.loss(model, b, totals)[0] for b in micro_batches)
        loss.backward()
        results[packed] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    assert torch.allclose(results[True][1], results[False][1], atol=1e-6, rtol=1e-4)


MEASURE = textwrap.dedent("""
    import json, resource, sys
    from trainer.cli import main
    code = main(["train", sys.argv[1]])
    print(json.dumps({"code": code, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")


def peak_rss_kb(config) -> int:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(config)], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["code"] == 0
    return out["peak_kb"]


@pytest.mark.slow
def test_full_fine_tune_dpo_peaks_at_sft_memory_not_a_second_model(make_config, tmp_path, pairs_file):
    """Peak RSS of full fine-tune DPO vs SFT on the same ~10M-parameter model (40 MB of fp32 weights) and the
    same sequences (SFT trains on chosen and rejected as separate examples, 2 per micro-batch = 1 pair).
    Tolerance 15 MiB (allocator noise, the reference numbers). Measured: SFT 746.9 MiB, DPO 747.2 MiB; the
    same DPO run holding a deep copy of the model as its reference peaked at 775.2 MiB (+28 MiB), so a
    reference copy fails this test."""
    from trainer.model.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = tmp_path / "model"
    build_model(tokenizer, hidden_size=512, layers=4).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    weights_kb = (model_dir / "model.safetensors").stat().st_size // 1024
    rows = pair_rows(40, seed=2)
    sft_rows = [{"messages": r["messages"] + [side]} for r in rows for side in (r["chosen"], r["rejected"])]
    sft_file = write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    common = dict(base_model=str(model_dir), max_steps=3, sequence_len=96, learning_rate=1e-4, optimizer="adamw_torch")
    sft = make_config("sft.yml", output_dir=str(tmp_path / "sft"), micro_batch_size=2, shuffle_merged_datasets=False,
                      datasets=[{"path": str(sft_file), "type": "chat_template"}], **common)
    dpo = make_config("dpo.yml", output_dir=str(tmp_path / "dpo"), micro_batch_size=1, rl="dpo",
                      datasets=[{"path": str(pairs_file), "type": "chat_template.default"}], **common)
    sft_kb, dpo_kb = peak_rss_kb(sft), peak_rss_kb(dpo)
    print(f"peak RSS: SFT {sft_kb / 1024:.1f} MiB, DPO {dpo_kb / 1024:.1f} MiB, weights {weights_kb / 1024:.1f} MiB")
    assert weights_kb > 35 * 1024
    assert dpo_kb - sft_kb < 15 * 1024, (sft_kb, dpo_kb)


@pytest.mark.parametrize("rl,adapter", [("dpo", "lora"), ("kto", None), ("orpo", None)])
def test_evaluate_command_agrees_with_the_last_evaluation_of_training(rl, adapter, pref_config, tmp_path, capsys):
    extra = {"adapter": "lora", "lora_r": 4} if adapter else {}
    config = pref_config(rl=rl, output_dir=str(tmp_path / "out"), max_steps=2, val_set_size=0.2, **extra)
    assert train(config) == 0
    last = [r for r in read_metrics(tmp_path / "out") if "eval_loss" in r][-1]
    capsys.readouterr()
    assert main(["evaluate", str(config), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert result["eval_rewards/chosen"] == pytest.approx(last["eval_rewards/chosen"], rel=1e-4, abs=1e-6)


def test_with_lora_the_reference_is_the_base_with_the_adapter_disabled(pref_config, tiny_llama, tmp_path):
    import numpy as np
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer import objectives
    from trainer.batch.collate import Collator
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer
    from trainer.objectives import prepare
    from trainer.hooks import Run
    from trainer.objectives.reference import reference_logps
    from trainer.runtime.hardware import adapt, detect

    cfg, _ = load_config(pref_config(adapter="lora"))
    runtime = adapt(cfg, *detect("cpu", None))
    data = prepare(cfg, load_tokenizer(cfg))
    objective = objectives.build(cfg, Collator(0, "sdpa"), None)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    expected = reference_logps(objective, base, data, runtime, Run(cfg, say=lambda *_: None))["train"]
    shutil.rmtree(next(data.path.glob("reference-*")))
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa"),
                             LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))  # a non-zero adapter
    got = reference_logps(objective, trained, data, runtime, Run(cfg, say=lambda *_: None))["train"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    batch = objective.collate([[objective.rows(data.train)[[0]][0]]])
    with torch.no_grad():
        assert not torch.allclose(objective.reference(trained, batch), torch.tensor(expected[:1]), atol=1e-3)


def test_a_rank_waiting_for_anothers_reference_share_stops_with_a_clear_error(pref_config, tiny_llama):
    """No collective: a rank whose peer never writes its share times out naming it (one line, exit 1)."""
    from transformers import AutoModelForCausalLM

    from trainer import objectives
    from trainer.batch.collate import Collator
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer
    from trainer.errors import TrainerError
    from trainer.objectives import prepare
    from trainer.hooks import Run
    from trainer.objectives.reference import reference_logps
    from trainer.runtime.hardware import adapt, detect

    cfg, _ = load_config(pref_config(dataset_prepare_timeout=1))
    data = prepare(cfg, load_tokenizer(cfg))
    objective = objectives.build(cfg, Collator(0, "sdpa"), None)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    with pytest.raises(TrainerError, match=r"rank 0 waited 1s for the reference log-probs of rank\(s\) 1;") as err:
        reference_logps(objective, model, data, adapt(cfg, *detect("cpu", None)),
                        Run(cfg, rank=0, world=2, say=lambda *_: None))
    assert err.value.exit_code == 1


@pytest.mark.slow
def test_tiny_cpu_dpo_example_trains_and_learns(tmp_path):
    from tests.trainer.helpers import run_cli

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    steps = [("make-tiny-model", "outputs/tiny-model"), ("validate", "examples/tiny-cpu-dpo.yml"),
             ("train", "examples/tiny-cpu-dpo.yml"), ("evaluate", "examples/tiny-cpu-dpo.yml", "--json")]
    results = [run_cli(*args, cwd=tmp_path, timeout=300) for args in steps]
    for args, result in zip(steps, results):
        assert result.returncode == 0, (args, result.stderr[-2000:])
    assert "objective:  dpo (beta 0.1; reference log-probs computed once" in results[1].stdout
    evaluation = json.loads(results[3].stdout)
    assert evaluation["eval_loss"] < 0.8 * math.log(2)  # it learned to prefer the right answers on held-out pairs
    assert evaluation["eval_rewards/accuracies"] >= 0.75 and evaluation["eval_rewards/margins"] > 0


@pytest.mark.parametrize("rl", ["dpo", "kto"])
def test_gradient_checkpointing_trains_the_same(rl, pref_config, tmp_path):
    """Including KTO's no-grad KL forwards and the reference precompute, which run with checkpointing enabled."""
    plain, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    assert train(pref_config("a.yml", rl=rl, output_dir=str(plain), max_steps=3)) == 0
    assert train(pref_config("b.yml", rl=rl, output_dir=str(ckpt), max_steps=3, gradient_checkpointing=True)) == 0
    a, b = train_losses(plain), train_losses(ckpt)
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a)


@pytest.mark.parametrize("rl", ["dpo", "kto"])
def test_dpo_use_weighting_through_the_command(rl, pref_config, tmp_path, capsys):
    """`dpo_use_weighting: true` (Axolotl passes it to TRL's DPOConfig.use_weighting): validate says so, and the first
    step's loss is no longer log 2 (the policy is the reference, so every pair's loss is log 2 times its WPO weight;
    the weights themselves are checked against TRL in test_objectives_losses.py). With KTO it has no effect, as in
    Axolotl, and a note says so."""
    config = pref_config(rl=rl, output_dir=str(tmp_path / "out"), max_steps=2, dpo_use_weighting=True)
    assert main(["validate", str(config)]) == 0
    said = capsys.readouterr()
    if rl == "kto":
        assert "dpo_use_weighting: no effect with kto" in said.out + said.err
        return
    assert "weighted by WPO's weights, dpo_use_weighting" in said.out + said.err
    assert train(config) == 0
    first = train_losses(tmp_path / "out")[1]
    assert math.isfinite(first) and first != pytest.approx(math.log(2), rel=1e-4)


@pytest.mark.slow
def test_several_dpo_loss_types_train_as_their_weighted_sum(pref_config, tmp_path, capsys):
    """dpo_loss_type [sigmoid, ipo] with dpo_loss_weights [0.5, 2] (TRL's loss_type list and loss_weights, as Axolotl
    passes them): the step's loss is 0.5 x sigmoid + 2 x ipo. At step 1 the policy is the reference (every log-ratio 0):
    0.5 log 2 + 2 (1 / (2 beta))^2."""
    from tests.trainer.helpers import run_cli

    out = tmp_path / "mix"
    config = pref_config(output_dir=str(out), max_steps=2, rl_beta=0.1, dpo_loss_type=["sigmoid", "ipo"],
                         dpo_loss_weights=[0.5, 2.0])
    shown = run_cli("validate", str(config), "--gpu", "cpu")
    assert "objective:  dpo (beta 0.1; reference log-probs computed once before training and cached; loss 0.5 x " \
           "sigmoid + 2 x ipo)" in shown.stdout, shown.stdout + shown.stderr
    assert train(config) == 0
    first = next(r for r in read_metrics(out) if "loss" in r)
    assert first["loss"] == pytest.approx(0.5 * math.log(2) + 2 * (1 / (2 * 0.1)) ** 2, rel=1e-4)


def test_dpo_loss_weights_need_one_weight_per_loss_type(make_config):
    from trainer.config import parse_config
    from trainer.errors import ConfigError
    import yaml

    raw = yaml.safe_load(make_config(rl="dpo", dpo_loss_type=["sigmoid", "ipo"], dpo_loss_weights=[1.0]).read_text())
    with pytest.raises(ConfigError, match=r"dpo_loss_weights: \[1.0\] needs one weight per dpo_loss_type"):
        parse_config(raw)
    with pytest.raises(ConfigError, match=r"dpo_loss_weights: \[1.0\] needs one weight per dpo_loss_type \(unset\)"):
        parse_config({**raw, "dpo_loss_type": None})


@pytest.mark.slow
def test_orpo_alpha_0_trains_the_chosen_answers_nll_only(pref_config, tmp_path):
    """Axolotl passes orpo_alpha as ORPO's beta (`is not None`: 0 is 0), so TRL's ORPO loss is the chosen answers' NLL
    alone: the logged loss is the logged nll_loss."""
    out = tmp_path / "orpo0"
    assert train(pref_config(rl="orpo", output_dir=str(out), max_steps=2, orpo_alpha=0)) == 0
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert steps and all(r["loss"] == pytest.approx(r["nll_loss"], rel=1e-6) for r in steps)
    assert all(r["rewards/chosen"] == 0 for r in steps)


def test_orpo_alpha_0_as_another_methods_beta_is_refused(make_config):
    from trainer.config import parse_config
    from trainer.errors import ConfigError

    raw = yaml.safe_load(make_config(rl="dpo", orpo_alpha=0).read_text())
    with pytest.raises(ConfigError, match="orpo_alpha: 0 is the beta of rl: dpo"):
        parse_config(raw)
    assert parse_config({**raw, "rl_beta": 0.2})[0].beta == 0.2
