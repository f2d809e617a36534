"""Mixture-of-experts models trained as a user runs them: `envtool train CONFIG --gpu cpu` on tiny Mixtral and
Qwen3-MoE models (transformers' own config classes) with quantize_moe_experts, the loss finite and going down, and
the saved adapter loaded again by `python -m trainer evaluate` onto a base whose experts are quantized the same way
(the evaluation loss the run logged, to float rounding); `envtool train --dry-run` naming the experts' cost; and LoRA
on the fused expert tensors (lora_target_parameters) merged by `merge-lora` into the checkpoint's own unfused expert
tensors, its logits peft's (base + adapter)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import alpaca_rows, read_metrics, run_cli, train_losses, write_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENVTOOL = Path(sys.executable).parent / "envtool"


def envtool(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    return subprocess.run([str(ENVTOOL), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def config(tmp_path: Path, model: Path, **keys) -> Path:
    cfg = {"base_model": str(model),
           "datasets": [{"path": str(write_jsonl(tmp_path / "rows.jsonl", alpaca_rows(40))), "type": "alpaca"}],
           "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
           "adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True, "lora_r": 8, "lora_alpha": 16,
           "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "sequence_len": 128,
           "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 8, "learning_rate": 5e-3,
           "lr_scheduler": "constant", "val_set_size": 0.2, "bf16": True, "seed": 1, "attn_implementation": "sdpa",
           **keys}
    path = tmp_path / "moe.yml"
    path.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}, sort_keys=False))
    return path


@pytest.mark.parametrize("family,keys", [
    ("mixtral", {}),  # QLoRA: NF4 experts
    ("qwen3_moe", {"adapter": "lora", "load_in_4bit": None, "load_in_8bit": True}),  # 8-bit LoRA: int8 experts
    # LoRA on them, in fp32: in bf16 evaluate's loss differs from the logged one by ~1e-5 relative with expert LoRA
    # whether the experts are quantized or not (measured: peft's bf16 fold of the factors), above this test's 1e-5
    ("mixtral", {"lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 "lora_dropout": 0.0, "bf16": None})], ids=["mixtral-nf4", "qwen3_moe-int8", "mixtral-nf4-expert-lora"])
def test_envtool_trains_a_moe_with_experts_quantized_on_load(tmp_path, request, family, keys):
    path = config(tmp_path, request.getfixturevalue(f"tiny_{family}"), **keys)
    out = envtool("train", str(path), "--gpu", "cpu", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = train_losses(tmp_path / "out")
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1] - 0.1  # it learns
    logged = [r["eval_loss"] for r in read_metrics(tmp_path / "out") if "eval_loss" in r][-1]

    evaluated = run_cli("evaluate", str(path), "--json")  # loads out/final onto a base quantized the same way
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["model"] == str(tmp_path / "out" / "final")
    assert result["eval_loss"] == pytest.approx(logged, rel=1e-5)


def test_the_dry_run_names_what_unquantized_experts_cost(tmp_path, tiny_mixtral):
    plain = config(tmp_path, tiny_mixtral, quantize_moe_experts=None)
    out = envtool("train", str(plain), "--gpu", "a100-80gb", "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if "MoE experts:" in x]
    assert len(lines) == 1 and "stay unquantized" in lines[0] and "0.4 MB in bf16" in lines[0], out.stdout


@pytest.mark.parametrize("family,quantized", [("mixtral", False), ("qwen3_moe", False), ("mixtral", True)],
                         ids=["mixtral", "qwen3_moe", "mixtral-trained-on-nf4-experts"])
def test_merge_lora_folds_expert_lora_into_the_unfused_checkpoint(tmp_path, request, family, quantized):
    """Trained on quantized experts (Axolotl's Gemma 4 / GLM recipes), the adapter merges onto the checkpoint's own
    unquantized experts, as Axolotl's merge-lora does."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = request.getfixturevalue(f"tiny_{family}")
    quantization = {"adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True} if quantized else \
        {"adapter": "lora", "load_in_4bit": None, "quantize_moe_experts": None}
    path = config(tmp_path, base, **quantization, bf16=None,
                  lora_target_modules=["q_proj", "v_proj"], lora_dropout=0.0, max_steps=3, val_set_size=0,
                  lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    for command in ("train", "merge-lora"):
        out = run_cli(command, str(path))
        assert out.returncode == 0, out.stderr[-3000:]
    merged = tmp_path / "out" / "merged"
    names = [safe_open(d / "model.safetensors", "pt").keys() for d in (base, merged)]
    assert names[0] == names[1] and any(".experts.0." in n for n in names[1])  # per-expert tensors, as saved

    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    oracle = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(tmp_path / "out" / "final")).eval()
    with torch.no_grad():
        expected = oracle(input_ids=ids).logits
        with oracle.disable_adapter():
            before = oracle(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    wrapped = [n for n, _ in oracle.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(wrapped) == 4  # 2 layers x (gate_up_proj, down_proj): the experts were adapted
    assert (expected - before).abs().max() > 1e-3  # the adapter changes the model, so the comparison can fail
    assert (got - expected).abs().max() <= 1e-5

    exported = run_cli("export", str(path), "--format", "gguf", "--outtype", "f32")  # llama.cpp's file of it
    gguf_file = tmp_path / "out" / "out-f32.gguf"
    if family == "qwen3_moe":  # transformers' Qwen3-MoE default does not normalize the top-k weights; llama.cpp does
        assert exported.returncode == 2 and not gguf_file.exists()
        assert exported.stderr.strip().splitlines()[-1].startswith("error: export: this Qwen3-MoE does not normalize")
        return
    assert exported.returncode == 0, exported.stderr[-3000:]
    import gguf
    from safetensors.torch import load_file

    weights = load_file(str(merged / "model.safetensors"))
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}
    for layer in range(2):  # each layer's experts stacked per projection, as llama.cpp's converter stacks them
        for gguf_name, proj in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
            stacked = torch.stack([weights[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}.weight"]
                                   for e in range(4)])
            assert torch.equal(torch.from_numpy(tensors[f"blk.{layer}.{gguf_name}.weight"].data.copy()), stacked)
        router = weights[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        assert torch.equal(torch.from_numpy(tensors[f"blk.{layer}.ffn_gate_inp.weight"].data.copy()), router)


def test_lora_on_quantized_experts_resumes_exactly(tmp_path, tiny_mixtral):
    """Stopped at checkpoint-2 and resumed, a QLoRA with LoRA on its NF4 experts takes the uninterrupted run's steps 3
    and 4 (the adapter's expert tensors load back onto the quantized experts: the same peft nesting)."""
    import shutil

    keys = {"lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "lora_dropout": 0.0,
            "max_steps": 4, "save_steps": 2, "val_set_size": 0, "bf16": None}
    full = config(tmp_path, tiny_mixtral, **keys)
    out = run_cli("train", str(full))
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "out" / "checkpoint-2", resumed_dir / "checkpoint-2")
    raw = yaml.safe_load(full.read_text())
    raw.update(output_dir=str(resumed_dir), resume_from_checkpoint=str(resumed_dir / "checkpoint-2"))
    again = tmp_path / "again.yml"
    again.write_text(yaml.safe_dump(raw))
    out = run_cli("train", str(again))
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = train_losses(tmp_path / "out"), train_losses(resumed_dir)
    assert sorted(got) == [3, 4]
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in got), (want, got)
