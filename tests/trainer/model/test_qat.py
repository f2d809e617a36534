"""Quantization-aware training (qat:), Axolotl's schedule keys (cosine_constant_lr_ratio, eta_min),
save_only_model checkpoints, and the hardware floors of qat's dtypes and fp8 (matrices/packages.toml).

A tiny llama trains a few steps on CPU with torchao's real fake quantization: the test inspects the model the
trainer built (torchao's module types and configs) and checks what a user would notice -- the losses differ
from the same run without qat, fake_quant_after_n_steps trains exactly as without qat until its step, the
final model is a plain HF model, checkpoints resume exactly.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.oracle import require_extra

require_extra("torchao", "qat")  # before the imports that need it: skipped here without it, fails under CI

from tests.trainer.helpers import example_full_then_resumed, read_metrics, run_cli, train_losses, train_then_resume
from trainer.cli import main

INT8_INT4 = {"activation_dtype": "int8", "weight_dtype": "int4", "group_size": 32}
EXAMPLE = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "llama-3__3b-qat-fsdp2.yaml"


@pytest.fixture
def captured(monkeypatch):
    """What the trainer's QAT preparation built (trainer.model.qat.prepare wrapped, not replaced): the model, and its
    modules right after preparation (training ends by converting them back to plain layers)."""
    from trainer.model import qat

    seen, real = [], qat.prepare

    def prepare(model, config):
        count = real(model, config)
        seen.append((model, dict(model.named_modules())))
        return count

    monkeypatch.setattr(qat, "prepare", prepare)
    return seen


def linears(modules: dict) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in modules.items() if isinstance(m, torch.nn.Linear)}


def test_int8_int4_qat_fake_quantizes_every_linear_and_changes_training(make_config, tmp_path, captured):
    from torchao.quantization.qat import FakeQuantizedLinear
    from torchao.quantization.qat.fake_quantizer import Int4WeightFakeQuantizer, IntxFakeQuantizer

    plain, qat = tmp_path / "plain", tmp_path / "qat"
    assert main(["train", str(make_config("plain.yml", output_dir=str(plain)))]) == 0
    assert main(["train", str(make_config("qat.yml", output_dir=str(qat), qat=INT8_INT4))]) == 0
    model, modules = captured[0]
    layers = linears(modules)
    assert len(layers) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head (as Axolotl's quantize_)
    for name, layer in layers.items():
        assert isinstance(layer, FakeQuantizedLinear), name
        assert isinstance(layer.weight_fake_quantizer, Int4WeightFakeQuantizer)
        assert layer.weight_fake_quantizer.config.group_size == 32
        assert isinstance(layer.activation_fake_quantizer, IntxFakeQuantizer)
        assert layer.activation_fake_quantizer.config.dtype == torch.int8
    a, b = train_losses(plain), train_losses(qat)
    assert a.keys() == b.keys()
    assert all(math.isfinite(v) for v in b.values())
    assert all(a[s] != pytest.approx(b[s], rel=1e-6) for s in a)  # step 1 too: the forward pass is quantized
    # the final model is a plain HF model (layers converted back), its weights the trained ones
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(qat / "final")
    assert all(type(m) is torch.nn.Linear for m in linears(dict(final.named_modules())).values())
    assert all(type(m) is torch.nn.Linear for m in linears(dict(model.named_modules())).values())  # converted
    trained = model.state_dict()
    for key, value in final.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0)


MXFP4 = {"activation_dtype": "mxfp4", "weight_dtype": "mxfp4", "group_size": 32}


@pytest.mark.slow
def test_mxfp4_trains_under_bf16_autocast_with_checkpointing(make_config, tmp_path, captured):
    """As Axolotl's 3b-qat-mxfp4 example: bf16 (fp32 master weights under autocast here), gradient checkpointing.
    torchao's MX linear asserts its output has its input's dtype, which autocast breaks; the trainer runs it in
    the weights' precision (trainer.model.qat._master_precision_forward)."""
    out = tmp_path / "out"
    cfg = make_config(output_dir=str(out), max_steps=2, bf16=True, gradient_checkpointing=True, qat=MXFP4)
    result = run_cli("train", str(cfg))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "precision bf16" in result.stderr and "qat: 15 layers fake-quantized" in result.stderr
    losses = train_losses(out)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())


@pytest.mark.parametrize("qat, types", [
    (MXFP4, ("MXFakeQuantizedLinear",)),
    ({"activation_dtype": "fp8", "weight_dtype": "float8"}, ("FakeQuantizedLinear", "Float8FakeQuantizer")),
    ({"activation_dtype": "float8_e4m3fn", "weight_dtype": "int4", "group_size": 32},
     ("FakeQuantizedLinear", "Int4WeightFakeQuantizer", "Float8FakeQuantizer")),
    ({"weight_dtype": "int4", "group_size": 32, "quantize_embedding": True},
     ("FakeQuantizedLinear", "Int4WeightFakeQuantizer", "FakeQuantizedEmbedding")),
], ids=["mxfp4", "fp8-fp8", "fp8-int4", "int4-weight-only+embedding"])
def test_each_cpu_dtype_trains_with_torchao_fake_quantization(qat, types, make_config, tmp_path, captured):
    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), max_steps=2, qat=qat))]) == 0
    modules = captured[0][1]
    names = {type(m).__name__ for m in modules.values()}
    assert set(types) <= names
    assert "Linear" not in names  # no linear layer left un-quantized
    assert all(math.isfinite(v) for v in train_losses(out).values())
    if qat.get("quantize_embedding"):
        assert sum(type(m).__name__ == "FakeQuantizedEmbedding" for m in modules.values()) == 1


def test_fake_quant_after_n_steps_trains_as_without_qat_until_then(make_config, tmp_path):
    """Axolotl's QATCallback: fake quantization off from step 0, on from step N (here 2: steps 1-2 plain)."""
    plain, late = tmp_path / "plain", tmp_path / "late"
    assert main(["train", str(make_config("plain.yml", output_dir=str(plain)))]) == 0
    assert main(["train", str(make_config("late.yml", output_dir=str(late),
                                          qat={**INT8_INT4, "fake_quant_after_n_steps": 2}))]) == 0
    a, b = train_losses(plain), train_losses(late)
    assert [b[1], b[2]] == [a[1], a[2]]  # the same math, bit for bit
    assert b[3] != pytest.approx(a[3], rel=1e-6)


def test_qat_checkpoint_resumes_exactly_across_the_fake_quant_switch(make_config, tmp_path):
    """Resumed at step 2 with fake quantization switching on at step 3: the resumed run takes the same steps."""
    from trainer.cli import main as cli_main

    train_then_resume(cli_main, make_config, tmp_path, checkpoint=2, save_steps=2,
                      qat={**INT8_INT4, "fake_quant_after_n_steps": 3})


# ------------------------------------------------------------------------------------------- schedules
def axolotl_decay_constant(step, warmup, total, constant_ratio, min_ratio):
    """Axolotl's _get_cosine_schedule_with_warmup_decay_constant_lr_lambda (src/axolotl/utils/schedulers.py at
    067b021), written out from its source: linear warmup; cosine (half a cycle) from 1 to min_ratio between the
    warmup and int(total * constant_ratio) steps; min_ratio after."""
    if step < warmup:
        return step / max(1, warmup)
    end = int(total * constant_ratio)
    progress = (min(step, end) - warmup) / max(1, end - warmup)
    return max(0, (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))) + min_ratio


def test_cosine_constant_lr_ratio_follows_axolotls_schedule(make_config, tmp_path):
    out = tmp_path / "out"
    cfg = make_config(output_dir=str(out), max_steps=10, lr_scheduler="cosine", warmup_steps=2,
                      cosine_min_lr_ratio=0.2, cosine_constant_lr_ratio=0.6)
    assert main(["train", str(cfg)]) == 0
    lrs = [r["lr"] for r in read_metrics(out) if "lr" in r]
    expected = [1e-3 * axolotl_decay_constant(s, 2, 10, 0.6, 0.2) for s in range(10)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert lrs[6:] == pytest.approx([2e-4] * 4)  # flat at the floor from 60% of the steps
    assert lrs[3] == pytest.approx(1e-3 * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.25))))  # by hand


def test_zero_constant_ratio_with_min_ratio_one_is_transformers_cosine_with_min_lr(make_config, tmp_path):
    """Axolotl's 3b-qat examples: cosine_constant_lr_ratio: 0 is 'not set' (Axolotl tests it for truth), so the
    schedule is cosine with a floor of 1.0 x learning_rate: warmup, then constant. Oracle: transformers."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), max_steps=6, lr_scheduler="cosine", warmup_steps=2,
                                          cosine_min_lr_ratio=1.0, cosine_constant_lr_ratio=0))]) == 0
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    oracle = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 2, 6, min_lr_rate=1.0)
    expected = []
    for _ in range(6):
        expected.append(oracle.get_last_lr()[0])
        optimizer.step()
        oracle.step()
    assert [r["lr"] for r in read_metrics(out) if "lr" in r] == pytest.approx(expected)
    assert expected == pytest.approx([0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3])


@pytest.mark.slow
def test_schedule_keys_in_validate(make_config, tmp_path):
    result = run_cli("validate", str(make_config(eta_min=7e-7, lr_scheduler="linear", cosine_constant_lr_ratio=0.5,
                                                 cosine_min_lr_ratio=0.1)), "--gpu", "cpu")
    assert result.returncode == 0, result.stderr
    assert "ignored: eta_min (" in result.stdout  # not a key of Axolotl's schema: dropped there too
    assert "cosine_constant_lr_ratio: no effect with lr_scheduler: linear" in result.stdout


# --------------------------------------------------------------------------------------- save_only_model
@pytest.mark.slow
def test_save_only_model_checkpoints_hold_no_optimizer_and_resume_restarts_it(make_config, tmp_path):
    common = dict(max_steps=4, save_steps=2, save_only_model=True, lr_scheduler="cosine", warmup_steps=1)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert main(["train", str(make_config("full.yml", output_dir=str(full), **common))]) == 0
    files = sorted(p.name for p in (full / "checkpoint-2").iterdir())
    assert "model.safetensors" in files and "trainer_state.json" in files
    assert not [f for f in files if f.startswith(("optimizer", "scheduler", "rng_state", "scaler"))]
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    result = run_cli("train", str(make_config("resumed.yml", output_dir=str(resumed),
                                              auto_resume_from_checkpoints=True, **common)))
    assert result.returncode == 0, result.stderr
    assert "saved with save_only_model" in result.stderr and "optimizer restarts" in result.stderr
    a, b = read_metrics(full), read_metrics(resumed)
    a, b = {r["step"]: r for r in a if "loss" in r}, {r["step"]: r for r in b if "loss" in r}
    assert sorted(b) == [3, 4]
    assert b[3]["loss"] == a[3]["loss"]  # same weights, same data: the step's forward pass is the same
    assert [b[s]["lr"] for s in (3, 4)] == pytest.approx([a[s]["lr"] for s in (3, 4)])  # the schedule continues
    assert b[4]["loss"] != pytest.approx(a[4]["loss"], rel=1e-6)  # ... but step 3 ran on a fresh AdamW


def test_a_full_checkpoint_still_resumes_exactly_with_save_only_model_off(make_config, tmp_path):
    train_then_resume(main, make_config, tmp_path, checkpoint=2, save_steps=2, lr_scheduler="cosine",
                      cosine_min_lr_ratio=0.5, cosine_constant_lr_ratio=0.5)


# ----------------------------------------------------------------------------------- validate and floors
@pytest.mark.slow
def test_qat_and_fp8_floors_come_from_the_matrices(make_config):
    # nvfp4: emulated below sm_100, torchao's FP4 GEMM on it (tests/trainer/model/test_nvfp4.py)
    fp8 = make_config("fp8.yml", fp8=True, fp8_enable_fsdp_float8_all_gather=True)
    a100 = run_cli("validate", str(fp8), "--gpu", "a100")
    assert a100.returncode == 2 and "fp8: float8 training" in a100.stderr and "needs sm_89+" in a100.stderr
    assert "A100" in a100.stderr and "source: torchao" in a100.stderr
    cpu = run_cli("validate", str(fp8), "--gpu", "cpu")
    assert cpu.returncode == 2 and "cannot run on the CPU" in cpu.stderr
    h100 = run_cli("validate", str(fp8), "--gpu", "h100")
    assert h100.returncode == 2 and "does not implement float8 training" in h100.stderr
    mx = run_cli("validate", str(make_config("mx.yml", qat={"weight_dtype": "mxfp4", "activation_dtype": "mxfp4"})),
                 "--gpu", "t4")
    assert mx.returncode == 0 and "qat (activations mxfp4, weights mxfp4): torchao fake quantization" in mx.stdout


@pytest.mark.slow
@pytest.mark.parametrize("qat, extra, message", [
    ({"weight_dtype": "int8"}, {}, "activation_dtype None with weight_dtype int8 has no torchao QAT scheme"),
    ({"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 32}, {}, "set group_size: 16"),
    ({"weight_dtype": "nvfp4", "group_size": 16}, {}, "no weight-only NVFP4 QAT"),
    ({"weight_dtype": "mxfp4", "fake_quant_after_n_steps": 3}, {}, "cannot switch fake quantization off"),
    (INT8_INT4, {"adapter": "lora"}, "qat with adapter"),
    (INT8_INT4, {"adapter": "qlora", "load_in_4bit": True}, "qat and load_in_4bit cannot be used together"),
    (INT8_INT4, {"deepspeed": "deepspeed_configs/zero2.json"}, "qat with deepspeed is not supported"),
])
def test_bad_qat_configs_are_one_line_errors(qat, extra, message, make_config):
    result = run_cli("validate", str(make_config(qat=qat, **extra)), "--gpu", "cpu")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error:")


@pytest.mark.slow
def test_a_misspelt_qat_key_is_named_with_the_key_it_resembles(make_config):
    result = run_cli("validate", str(make_config(qat={"weight_dtype": "int4", "group_sizes": 3})), "--gpu", "cpu")
    assert result.returncode == 2, result.stderr  # group_size is not set: ignoring group_sizes would train another
    assert "'qat.group_sizes' is not a key; did you mean 'qat.group_size'?" in result.stderr


@pytest.mark.slow
def test_a_layer_the_group_size_does_not_tile_is_a_config_error(make_config):
    result = run_cli("train", str(make_config(qat={"weight_dtype": "int4", "group_size": 48})))
    assert result.returncode == 2 and "qat: torchao cannot fake-quantize this model" in result.stderr, result.stderr


# ------------------------------------------------------------------ Axolotl's example, as Axolotl wrote it
@pytest.mark.distributed
@pytest.mark.slow
def test_axolotls_qat_fsdp2_example_trains_and_resumes_with_only_model_and_data_swapped(tmp_path, tiny_llama):
    """examples/llama-3/3b-qat-fsdp2.yaml (qat int8/int4, FSDP2, cosine_constant_lr_ratio, save_only_model, liger
    off on CPU) on 2 processes; then its save_only_model checkpoint resumes (fresh optimizer, same step 3 loss)."""
    runs, stderr = example_full_then_resumed(yaml.safe_load(EXAMPLE.read_text()), tiny_llama, tmp_path)
    assert all("qat: 15 layers fake-quantized" in t and "sharding: FSDP" in t for t in stderr.values())
    assert not (tmp_path / "full" / "checkpoint-2" / "optimizer.pt").exists()
    assert sorted(runs["resumed"]) == [3, 4] and runs["resumed"][3] == pytest.approx(runs["full"][3], rel=1e-6)
