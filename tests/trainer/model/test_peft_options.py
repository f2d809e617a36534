"""Axolotl's lora_*/peft_* keys that are peft's own LoraConfig fields (loaders/adapter.py _build_lora_config_kwargs and
_build_peft_lora_config: rank_pattern, alpha_pattern, layers_to_transform, layers_pattern, layer_replication,
init_lora_weights, trainable_token_indices, ensure_weight_tying; get_peft_model's autocast_adapter_dtype): the adapter
add_lora builds is the one peft builds from the same LoraConfig."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import parse_config
from trainer.errors import ConfigError
from trainer.model.load import add_lora

TARGETS = ["q_proj", "v_proj"]


def _base(tiny_llama, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=dtype)


def _ours(tiny_llama, **keys):
    cfg, _ = parse_config({"base_model": str(tiny_llama), "learning_rate": 1e-4, "adapter": "lora",
                           "lora_target_modules": TARGETS, "datasets": [{"path": "d.jsonl", "type": "alpaca"}], **keys})
    return add_lora(cfg, _base(tiny_llama, torch.bfloat16 if keys.get("bf16") else torch.float32))


def _shapes(model) -> dict:
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("keys, peft_kwargs", [
    ({"lora_rank_pattern": {"q_proj": 4}, "lora_alpha_pattern": {"v_proj": 4}},
     {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 4}}),
    ({"peft_layers_to_transform": [1], "peft_layers_pattern": ["layers"]},
     {"layers_to_transform": [1], "layers_pattern": ["layers"]}),
    ({"peft_layer_replication": [[0, 2], [1, 2]]}, {"layer_replication": [(0, 2), (1, 2)]}),
    ({"peft_trainable_token_indices": [1, 2]}, {"trainable_token_indices": [1, 2]}),
    ({"peft_init_lora_weights": "olora"}, {"init_lora_weights": "olora"}),
])
def test_the_adapter_is_the_one_peft_builds_from_the_same_fields(tiny_llama, keys, peft_kwargs):
    from peft import LoraConfig, get_peft_model

    ours = _ours(tiny_llama, **keys)
    theirs = get_peft_model(_base(tiny_llama), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                          task_type="CAUSAL_LM", **peft_kwargs))
    assert _shapes(ours) == _shapes(theirs)
    if "init_lora_weights" in peft_kwargs:  # the same initialisation, deterministic for OLoRA
        for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.allclose(a.float(), b.float(), atol=1e-5), n


def test_autocast_adapter_dtype_false_keeps_the_base_dtype_and_a_bad_init_is_one_line(tiny_llama):
    assert {d for _, d in _shapes(_ours(tiny_llama, bf16=True)).values()} == {torch.float32}
    kept = _ours(tiny_llama, bf16=True, peft_autocast_adapter_dtype=False)
    assert {d for _, d in _shapes(kept).values()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="peft_init_lora_weights: Unknown initialization"):
        _ours(tiny_llama, peft_init_lora_weights="nonsense")
    with pytest.raises(ConfigError, match="peft_init_lora_weights: 'pissa' conflicts with peft.loftq_config"):
        parse_config({"base_model": "m", "learning_rate": 1e-4, "adapter": "lora", "peft_init_lora_weights": "pissa",
                      "peft": {"loftq_config": {"loftq_bits": 4}}, "datasets": [{"path": "d.jsonl", "type": "alpaca"}]})


@pytest.mark.slow
def test_peft_options_train_through_the_cli(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"Add {i} and {i}.", "output": f"{2 * i}"}
                                              for i in range(8)])
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(data), "type": "alpaca"}], "adapter": "lora",
        "lora_target_modules": TARGETS, "lora_rank_pattern": {"q_proj": 4}, "lora_alpha_pattern": {"q_proj": 8},
        "peft_layer_replication": [[0, 2], [1, 2]], "peft_init_lora_weights": "gaussian",
        "peft_trainable_token_indices": [1, 2], "peft_ensure_weight_tying": False,
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 512, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = __import__("json").loads(next((tmp_path / "out").rglob("adapter_config.json")).read_text())
    assert saved["rank_pattern"] == {"q_proj": 4} and saved["layer_replication"] == [[0, 2], [1, 2]]
