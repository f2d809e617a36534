"""ReLoRA (relora, jagged_restart_*, relora_prune_*): at each restart the LoRA update moves into the base
weights and LoRA starts again, without changing what the model computes; the optimizer state of LoRA is
pruned; the learning rate follows Axolotl's jagged restarts; runs resume exactly across restarts (LoRA and
QLoRA), and the final model is the full merged model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import read_metrics, train_then_resume
from trainer.cli import main
from trainer.config import load_config, parse_config
from trainer.errors import ConfigError

RELORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True, relora=True, relora_prune_ratio=0.5,
              jagged_restart_steps=2, jagged_restart_warmup_steps=1, jagged_restart_anneal_steps=False,
              learning_rate=1e-2)


def build(make_config, **extra):
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model
    from trainer.model.relora import ReLoRA
    from trainer.optim.optimizers import make_optimizer
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(**{**RELORA, **extra}))
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), load_tokenizer(cfg))
    optimizer = make_optimizer(cfg, model)
    return cfg, model, optimizer, ReLoRA(cfg, model, torch.float32, log=lambda *_: None)


def one_step(model, optimizer):
    ids = torch.arange(3, 40).reshape(1, -1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return ids


def test_restart_merges_resets_and_keeps_the_function(make_config):
    cfg, model, optimizer, relora = build(make_config)
    for _ in range(3):
        ids = one_step(model, optimizer)
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    key, layer = next(iter(relora.layers.items()))
    base_before = layer.get_base_layer().weight.detach().clone()
    a, b = layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone()
    assert b.abs().sum() > 0  # LoRA has learned something to merge
    relora.restart(optimizer, step=2)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.allclose(before, after, atol=1e-5)  # the function is unchanged ...
    base_after = layer.get_base_layer().weight.detach()
    assert torch.allclose(base_after, base_before + layer.scaling["default"] * b @ a, atol=1e-6)  # ... the base moved
    assert torch.count_nonzero(layer.lora_B["default"].weight) == 0  # LoRA starts again: B zero, A re-drawn
    assert not torch.equal(layer.lora_A["default"].weight, a)
    for p in relora.lora_params:  # half of each Adam moment zeroed (relora_prune_ratio 0.5, by magnitude)
        for k in ("exp_avg", "exp_avg_sq"):
            share = float((optimizer.state[p][k] == 0).float().mean())
            assert 0.45 <= share <= 0.6


def test_8bit_optimizer_state_is_pruned_by_value(make_config):
    import bitsandbytes.functional as F

    cfg, model, optimizer, relora = build(make_config, optimizer="adamw_bnb_8bit", lora_r=64, relora_prune_ratio=None)
    for _ in range(2):  # (A's gradient is zero while B is)
        one_step(model, optimizer)

    def pruned(p):  # 8-bit codes have no exact zero: a pruned value becomes the code nearest zero
        s = optimizer.state[p]
        m = F.dequantize_blockwise(s["state1"], absmax=s["absmax1"], code=s["qmap1"], blocksize=256).abs()
        return float((m <= 1e-3 * m.max()).float().mean())

    big = [p for p in relora.lora_params if optimizer.state[p]["state1"].dtype == torch.uint8]
    assert big  # 64 x 64 LoRA matrices: 8-bit blockwise state
    assert all(pruned(p) < 0.5 for p in big)
    relora.restart(optimizer, step=2)
    for p in big:  # relora_prune_ratio 0.9 (the default): the values, not the 8-bit codes, are zeroed
        assert 0.85 <= pruned(p) <= 0.95


def axolotl_jagged(step, inner, every, warmup, anneal, min_scale=0.001):
    """axolotl.utils.schedulers.JaggedLRRestartScheduler.get_lr's scale, times the inner schedule."""
    if step < every - anneal:
        scale = 1
    else:
        p = step % every
        if p < warmup:
            t = min(1.0, p / warmup)
        elif p > every - anneal:
            t = min(1.0, (every - p) / anneal)
        else:
            t = 1
        scale = t * (1 - min_scale) + min_scale
    return inner * scale


def test_training_run_restarts_and_ends_with_the_full_model(make_config, tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    config = make_config(output_dir=str(out), max_steps=6, save_steps=1, lr_scheduler="cosine",
                         **{**RELORA, "jagged_restart_steps": 3, "jagged_restart_warmup_steps": 2})
    assert main(["train", str(config)]) == 0
    lrs = [r["lr"] for r in read_metrics(out) if "lr" in r]
    cosine = [0.5 * (1 + math.cos(math.pi * s / 6)) * 1e-2 for s in range(6)]
    assert lrs == pytest.approx([axolotl_jagged(s, cosine[s], 3, 2, 1) for s in range(6)], rel=1e-9)
    # the base of checkpoint-3 is the original; the restart at the start of step 4 moves it (checkpoint-4)
    original = load_file(str(tiny_llama / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    bases = {s: load_file(str(out / f"checkpoint-{s}" / "relora" / "base.safetensors"))[key] for s in (3, 4, 6)}
    assert torch.equal(bases[3], original[key]) and not torch.equal(bases[4], original[key])
    assert torch.equal(bases[4], bases[6])  # no restart at 5 or 6
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["relora_restarts"] == 1
    # final/ is a full model: the merged base plus the last LoRA
    assert not (out / "final" / "adapter_config.json").exists()
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    adapter = load_file(str(out / "checkpoint-6" / "adapter_model.safetensors"))
    a = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.allclose(final.state_dict()[key], bases[6] + 2.0 * b @ a, atol=1e-6)


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_relora_resumes_exactly_across_restarts(make_config, tmp_path, quantized):
    extra = {"adapter": "qlora", "load_in_4bit": True} if quantized else {}
    full, resumed = train_then_resume(main, make_config, tmp_path, checkpoint=2, max_steps=5, save_steps=2,
                                      **{**RELORA, **extra})
    a, b = [load_file(str(d / "final" / "model.safetensors")) for d in (full, resumed)]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qlora_restart_requantizes_the_merged_weights(make_config):
    import bitsandbytes as bnb

    cfg, model, optimizer, relora = build(make_config, adapter="qlora", load_in_4bit=True)
    for _ in range(2):
        one_step(model, optimizer)
    key, layer = next(iter(relora.layers.items()))
    packed = layer.get_base_layer().weight.detach().clone()
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    merged = relora.master[key] + layer.scaling["default"] * b @ a
    relora.restart(optimizer, step=2)
    weight = layer.get_base_layer().weight
    assert isinstance(weight, bnb.nn.Params4bit) and not torch.equal(weight.detach(), packed)
    assert torch.allclose(relora.master[key], merged, atol=1e-6)  # full-precision master holds the merge
    dequantized = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    q, state = bnb.functional.quantize_4bit(merged, blocksize=weight.blocksize, quant_type=weight.quant_type,
                                            compress_statistics=weight.compress_statistics)
    assert torch.allclose(dequantized, bnb.functional.dequantize_4bit(q, state))  # the 4-bit base quantizes the merge


BASE = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}]}


@pytest.mark.parametrize("extra, message", [
    ({"relora": True, "adapter": "lora"}, "needs jagged_restart_steps"),
    ({"relora": True, "jagged_restart_steps": 5}, "needs adapter: lora"),
    ({"relora": True, "jagged_restart_steps": 5, "adapter": "lora", "fsdp_version": 2}, "not with DeepSpeed or FSDP"),
    ({"relora": True, "jagged_restart_steps": 5, "adapter": "lora", "optimizer": "adafactor"}, "not supported with ReLoRA"),
    ({"relora": True, "jagged_restart_steps": 5, "adapter": "lora", "hub_model_id": "me/x"}, "not with early_stopping"),
])
def test_relora_refusals(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, **extra})


def test_a_run_shaped_like_axolotls_relora_example(make_config, tmp_path):
    """examples/llama-2/relora.yml's keys (QLoRA, adamw_bnb_8bit, packing, checkpointing), restarts every 2 steps."""
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), load_in_4bit=True, adapter="qlora", lora_r=8, lora_alpha=16,
                         lora_dropout=0.05, lora_target_linear=True, relora=True, relora_prune_ratio=0.9,
                         relora_cpu_offload=False, jagged_restart_steps=2, jagged_restart_warmup_steps=1,
                         jagged_restart_anneal_steps=False, optimizer="adamw_bnb_8bit", lr_scheduler="cosine",
                         learning_rate=2e-4, gradient_checkpointing=True, sample_packing=True, warmup_ratio=0.1,
                         val_set_size=0.05, max_steps=5, save_steps=5)
    assert main(["train", str(config)]) == 0
    assert json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["relora_restarts"] == 2
    assert (out / "final" / "config.json").exists() and not (out / "final" / "adapter_config.json").exists()


@pytest.mark.parametrize("method, ratio, expected", [("magnitude", 0.9, 0.9), ("random", 0.3, 0.3), ("reset", None, 0.999)])
def test_prune_methods(make_config, method, ratio, expected):
    cfg, model, optimizer, relora = build(make_config, relora_prune_method=method, relora_prune_ratio=ratio, lora_r=32)
    for _ in range(2):
        one_step(model, optimizer)
    big = [p for p in relora.lora_params if optimizer.state[p]["exp_avg"].count_nonzero() == p.numel()]
    assert big
    kept = {id(p): optimizer.state[p]["exp_avg"].clone() for p in big}
    relora.restart(optimizer, step=2)
    for p in big:
        m = optimizer.state[p]["exp_avg"]
        assert float((m == 0).float().mean()) == pytest.approx(expected, abs=0.03)
        survivors = m != 0
        assert torch.equal(m[survivors], kept[id(p)][survivors])  # what is kept is kept as it was
        if method == "magnitude":  # the largest survive
            assert m.abs().max() == kept[id(p)].abs().max()
