"""QLoRA and 8-bit LoRA really train on CPU (bitsandbytes' CPU backend) and resume exactly; validate explains
the hardware floors, which it reads from matrices/packages.toml [[feature]] rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import run_cli, train_losses, train_then_resume
from trainer.cli import main

pytestmark = pytest.mark.slow

# The shape of Axolotl's examples/llama-3/qlora-1b.yml (tiny model, local data, few steps).
QLORA = dict(adapter="qlora", load_in_4bit=True, lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_target_linear=True,
             optimizer="adamw_bnb_8bit", gradient_checkpointing=True, sample_packing=True,
             lr_scheduler="cosine", warmup_steps=1, learning_rate=2e-3)


def test_qlora_trains_4bit_layers_on_cpu_and_resumes_exactly(make_config, tmp_path):
    import bitsandbytes as bnb
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    common = dict(max_steps=5, save_steps=2, **QLORA)
    full, resumed = train_then_resume(main, make_config, tmp_path, **common)
    a = train_losses(full)
    assert a[5] < a[1]  # it learns
    wa = load_file(full / "final" / "adapter_model.safetensors")
    wb = load_file(resumed / "final" / "adapter_model.safetensors")
    assert wa and all("lora_" in k for k in wa) and all(torch.equal(wa[k], wb[k]) for k in wa)

    # what was trained on: LoRA on bitsandbytes 4-bit (NF4) linear layers
    cfg, _ = load_config(tmp_path / "resumed.yml")
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), AutoTokenizer.from_pretrained(cfg.base_model))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit) and q_proj.base_layer.weight.quant_type == "nf4"
    assert not q_proj.base_layer.weight.requires_grad and q_proj.lora_A["default"].weight.requires_grad


def test_evaluate_uses_the_quantized_base_the_adapter_trained_on(make_config, tmp_path, capsys):
    import json

    from tests.trainer.helpers import read_metrics

    out = tmp_path / "out"
    config = make_config(output_dir=str(out), max_steps=2, val_set_size=0.25, **QLORA)
    assert main(["train", str(config)]) == 0
    last = [r for r in read_metrics(out) if "eval_loss" in r][-1]
    capsys.readouterr()
    assert main(["evaluate", str(config), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)


def test_an_evaluation_does_not_break_the_4bit_backward(make_config):
    """bitsandbytes repacks 4-bit weights for CPU inference on the first eval-mode forward (AVX512-BF16 CPUs);
    the gradients of a training step after an evaluation must equal those before it."""
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(**{**QLORA, "lora_dropout": 0.0}))  # no dropout: the same gradient twice
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), tokenizer)
    batch = tokenizer(["the quick brown fox jumps over the lazy dog"], return_tensors="pt")

    def lora_grads():
        model.zero_grad()
        model(**batch, labels=batch["input_ids"]).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.train()
    before = lora_grads()
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    after = lora_grads()
    first = next(n for n in before if "layers.0." in n and "lora_B" in n)  # the bottom layer: needs every backward
    assert before[first].abs().sum() > 0
    assert all(torch.allclose(before[n], after[n]) for n in before), [n for n in before
                                                                    if not torch.allclose(before[n], after[n])][:3]


def test_8bit_lora_trains_int8_layers(make_config, tmp_path):
    import bitsandbytes as bnb
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    out = tmp_path / "out"
    config = make_config(output_dir=str(out), adapter="lora", load_in_8bit=True, lora_r=4,
                         lora_target_modules=["q_proj", "v_proj"], optimizer="adamw_8bit", max_steps=3,
                         learning_rate=5e-3)
    assert main(["train", str(config)]) == 0
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3] and all(v == v for v in losses.values())
    cfg, _ = load_config(config)
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), AutoTokenizer.from_pretrained(cfg.base_model))
    assert isinstance(model.base_model.model.model.layers[0].self_attn.v_proj.base_layer, bnb.nn.Linear8bitLt)


@pytest.mark.parametrize("gpu, key, ok", [
    ("t4", "load_in_4bit", True), ("t4", "load_in_8bit", True), ("p100", "load_in_4bit", True),
    ("v100", "load_in_8bit", False), ("sm_52", "load_in_4bit", False), ("cpu", "load_in_4bit", True),
])
def test_validate_explains_the_bitsandbytes_floors(make_config, gpu, key, ok):
    config = make_config(adapter="qlora" if key == "load_in_4bit" else "lora", **{key: True})
    result = run_cli("validate", str(config), "--gpu", gpu)
    if ok:
        assert result.returncode == 0, result.stderr
        assert f"  - {key}: bitsandbytes" in result.stdout
    else:
        assert result.returncode == 2 and "Traceback" not in result.stderr
        floor = "sm_75" if key == "load_in_8bit" else "sm_60"
        assert f"error: {key}: bitsandbytes" in result.stderr and f"needs {floor}+" in result.stderr
        if key == "load_in_8bit":  # 4-bit has a lower floor: say so
            assert "use load_in_4bit: true instead" in result.stderr


def test_floors_come_from_the_matrices(make_config, tmp_path):
    """Raising bnb_4bit's min_cc in a copy of matrices/ changes what validate says: no floor lives in Python."""
    from trainer.facts import matrix_dir

    copy = tmp_path / "matrices"
    shutil.copytree(matrix_dir(), copy)
    text = (copy / "packages.toml").read_text()
    start = text.index('name = "bnb_4bit"')
    text = text[:start] + text[start:].replace('min_cc = "6.0"', 'min_cc = "8.0"', 1)
    (copy / "packages.toml").write_text(text)
    config = make_config(adapter="qlora", load_in_4bit=True)
    result = run_cli("validate", str(config), "--gpu", "t4", env={"ENVTOOL_MATRIX_DIR": str(copy)})
    assert result.returncode == 2 and "needs sm_80+" in result.stderr


def test_quantized_loading_needs_an_adapter(make_config):
    result = run_cli("validate", str(make_config(load_in_4bit=True)), "--gpu", "t4")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: load_in_4bit/load_in_8bit need an adapter (lora or qlora): quantized "
                                     "weights cannot be trained directly")
    result = run_cli("validate", str(make_config(adapter="qlora")), "--gpu", "t4")
    assert result.returncode == 2 and "adapter: qlora needs load_in_4bit: true" in result.stderr


def test_t4_example_config_validates(tmp_path):
    example = Path(__file__).resolve().parents[3] / "examples" / "t4-qlora.yml"
    result = run_cli("validate", str(example), "--gpu", "t4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "adapter:    qlora on 4-bit (NF4) base weights" in out and "optimizer:  paged_adamw_8bit (bitsandbytes)" in out
    assert "bf16: auto -> fp16" in out
