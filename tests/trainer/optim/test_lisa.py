"""LISA (lisa_n_layers, lisa_step_interval, lisa_layers_attribute): per step only the drawn layers move."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import train_then_resume
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError
from trainer.model.tiny import build_model, build_tokenizer

LAYERS = 4


@pytest.fixture(scope="module")
def four_layer_llama(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-4")
    tokenizer = build_tokenizer()
    build_model(tokenizer, "llama", seed=0, layers=LAYERS).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def moved_layers(before: dict, after: dict) -> set[int]:
    return {int(k.split(".")[2]) for k in before if k.startswith("model.layers.") and not torch.equal(before[k], after[k])}


LISA = dict(lisa_n_layers=2, lisa_step_interval=3, lisa_layers_attribute="model.layers", max_steps=7, save_steps=1,
            weight_decay=0.1)


def test_lisa_moves_only_the_drawn_layers_and_redraws_each_interval(make_config, four_layer_llama, tmp_path):
    from trainer.optim.lisa import Lisa

    out = tmp_path / "out"
    assert main(["train", str(make_config(base_model=str(four_layer_llama), output_dir=str(out), **LISA)) ]) == 0
    cfg, _ = parse_config({"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], "seed": 1, **LISA})
    from transformers import AutoModelForCausalLM

    lisa = Lisa(cfg, AutoModelForCausalLM.from_pretrained(four_layer_llama), log=lambda *_: None)
    start = weights(four_layer_llama)
    ckpts = [start] + [weights(out / f"checkpoint-{s}") for s in range(1, 8)]
    sets = []
    for step in range(7):  # step `step` (0-based) turns checkpoint step into step+1
        moved = moved_layers(ckpts[step], ckpts[step + 1])
        assert moved == set(lisa.active(step)), step  # exactly the drawn layers moved: n of them
        assert len(moved) == 2
        # what LISA does not freeze keeps training
        assert not torch.equal(ckpts[step]["lm_head.weight"], ckpts[step + 1]["lm_head.weight"])
        sets.append(frozenset(moved))
    # Axolotl's schedule: draws at step 0, 1, then every 3 steps (3, 6): 1-2 and 3-5 share their layers
    assert sets[1] == sets[2] and sets[3] == sets[4] == sets[5]
    assert len({sets[0], sets[1], sets[3], sets[6]}) > 1  # the draws differ (seeded, so this does not flake)


def test_lisa_resumes_with_the_same_layers(make_config, four_layer_llama, tmp_path):
    common = {**LISA, "max_steps": 6, "save_steps": 2, "base_model": str(four_layer_llama)}
    full, resumed = train_then_resume(main, make_config, tmp_path, checkpoint=2, **common)
    a, b = weights(full / "final"), weights(resumed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, message", [
    ({"lisa_step_interval": None}, "go together"),
    ({"adapter": "lora"}, "full fine-tune"),
    ({"fsdp_version": 2}, "DeepSpeed or FSDP"),
])
def test_lisa_refusals(extra, message):
    raw = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], **LISA, **extra}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_lisa_bad_attribute_is_one_line(make_config, four_layer_llama, capsys):
    config = make_config(base_model=str(four_layer_llama), **{**LISA, "lisa_layers_attribute": "model.blocks"})
    assert main(["train", str(config)]) == 2
    assert "lisa_layers_attribute" in capsys.readouterr().err


def test_a_run_shaped_like_axolotls_lisa_example(make_config, four_layer_llama, tmp_path):
    """examples/llama-2/lisa.yml's keys (full fine-tune, adamw_bnb_8bit, packing, checkpointing)."""
    out = tmp_path / "out"
    config = make_config(base_model=str(four_layer_llama), output_dir=str(out), lisa_n_layers=2, lisa_step_interval=2,
                         lisa_layers_attribute="model.layers", optimizer="adamw_bnb_8bit", lr_scheduler="cosine",
                         learning_rate=5e-3, gradient_checkpointing=True, sample_packing=True, warmup_ratio=0.1,
                         weight_decay=0.1, val_set_size=0.05, max_steps=3, save_steps=1)
    assert main(["train", str(config)]) == 0
    before, after = weights(out / "checkpoint-2"), weights(out / "checkpoint-3")
    assert len(moved_layers(before, after)) == 2
