"""What the memory options save or cost in the estimate (trainer/fit/memory.py option_effects), and `envtool fit`'s
suggestion of one when it is the cheapest change that fits: the suggestion's keys written into the config, read
again by the trainer's reader and estimated again, fit. Llama 3.1 8B QLoRA's published config.json, counted
analytically (no torch build: fast)."""

from __future__ import annotations

import json

import pytest

from tests.support.hub import published_config
from trainer.config import parse_config
from trainer.fit import memory, memory_model
from trainer.runtime.hardware import adapt, gpu_from_name

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama8b")
    (d / "config.json").write_text(json.dumps(published_config(MODEL)))
    return d


def raw(model_dir, **keys) -> dict:
    return {"base_model": str(model_dir), "datasets": [{"path": "data.jsonl", "type": "alpaca"}], "learning_rate": 2e-5,
            "adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True, "micro_batch_size": 1,
            "sample_packing": True, "bf16": True, **keys}


def estimate(model_dir, memory_gb: float, gpu: str = "a100-80gb", **keys) -> memory.Estimate:
    cfg, _ = parse_config(raw(model_dir, **keys))
    rt = adapt(cfg, gpu_from_name(gpu))
    shape = memory_model.model_shape(str(model_dir), exact=False)
    return memory.estimate(shape, memory.setup_from(cfg, rt, 1), memory.Gpu(gpu, memory_gb, 1))


def effect(est, key) -> dict:
    return next(o for o in est.options if o["key"] == key)


def test_each_option_moves_its_own_term(model_dir):
    est = estimate(model_dir, 80, sequence_len=65536, gradient_checkpointing=True)
    ckpt, offload, sac, tiled, loss = (effect(est, k) for k in ("gradient_checkpointing", "activation_offloading",
                                                                "selective_checkpointing", "tiled_mlp", "chunked loss"))
    assert ckpt["on"] and ckpt["gb"] < ckpt["other_gb"]  # checkpointing keeps each layer's input only
    assert not offload["on"] and offload["other_gb"] < offload["gb"] and "in host memory instead" in offload["text"]
    assert not sac["on"] and sac["other_gb"] > sac["gb"]  # keeping attention's output costs memory
    assert not tiled["on"] and tiled["other_gb"] < tiled["gb"]  # 2 slices of 65536 tokens: half an MLP rebuilt
    assert loss["on"] and loss["term"] == "logits" and loss["gb"] < loss["other_gb"] / 10
    # and with the options on, the same numbers the other way round
    on = estimate(model_dir, 80, sequence_len=65536, gradient_checkpointing=True, activation_offloading=True,
                  tiled_mlp=True)
    assert effect(on, "activation_offloading")["gb"] == pytest.approx(offload["other_gb"], rel=0.25)
    assert on.host > 0 and on.breakdown()["activations"] < est.breakdown()["activations"]


def test_on_the_cpu_offloading_changes_nothing(model_dir):
    cfg, _ = parse_config(raw(model_dir, sequence_len=4096, gradient_checkpointing=True, activation_offloading=True))
    rt = adapt(cfg, gpu_from_name("cpu"))
    assert memory.setup_from(cfg, rt, 1).offload is False


@pytest.mark.parametrize("kind", ["gradient_checkpointing", "tiled_mlp", "activation_offloading"])
def test_the_first_suggestion_applied_fits(model_dir, kind):
    """A GPU sized between the option's peak and the next cheaper change's: the option is the first suggestion,
    and written into the config it fits at the peak it promised."""
    keys = {"sequence_len": 65536, "gradient_checkpointing": kind != "gradient_checkpointing"}
    base = estimate(model_dir, 1000, **keys)
    with_it = {"gradient_checkpointing": {"gradient_checkpointing": True}, "tiled_mlp": {"tiled_mlp": True},
               "activation_offloading": {"activation_offloading": True}}[kind]
    target = estimate(model_dir, 1000, **{**keys, **with_it}).peak / memory.GB
    cheaper = {"gradient_checkpointing": [], "tiled_mlp": [], "activation_offloading": [{"tiled_mlp": True}]}[kind]
    floor = max([estimate(model_dir, 1000, **{**keys, **c}).high / memory.GB for c in cheaper], default=0)
    size = (max(target, floor) + base.peak / memory.GB) / 2 if not cheaper else (target + floor) / 2
    if kind == "activation_offloading":
        assert target < floor  # offloading fits where tiling does not
    found = estimate(model_dir, size, **keys)
    first = next(s for s in found.suggestions if not s["kind"].startswith("max_"))
    assert first["kind"] == kind and first["peak_gb"] <= size
    applied = estimate(model_dir, size, **{**keys, **first["change"]})
    assert applied.fits and applied.peak / memory.GB == pytest.approx(first["peak_gb"], abs=0.01)
