"""Learning rates per parameter group, as Axolotl's OptimizerMixin sets them (core/trainers/mixins/optimizer.py):
LoRA+ (loraplus_lr_ratio, loraplus_lr_embedding) through peft's create_loraplus_optimizer; embedding_lr,
embedding_lr_scale and lr_groups by its create_optimizer_grouped_parameters."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import parse_config
from trainer.errors import ConfigError
from trainer.optim.optimizers import make_optimizer

BASE = {"learning_rate": 1e-3, "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "optimizer": "adamw_torch"}


def _model(tiny_llama, lora: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def _lrs(optimizer, model) -> dict[str, float]:
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    return {n: lr_of[id(p)] for n, p in model.named_parameters() if p.requires_grad}


def test_loraplus_is_pefts_optimizer(tiny_llama):
    from peft.optimizers import create_loraplus_optimizer

    cfg, _ = parse_config({**BASE, "base_model": str(tiny_llama), "adapter": "lora", "loraplus_lr_ratio": 16})
    model = _model(tiny_llama, lora=True)
    ours = _lrs(make_optimizer(cfg, model), model)
    theirs = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16,
                                       loraplus_lr_embedding=1e-6, betas=(0.9, 0.999), eps=1e-8)
    assert ours == _lrs(theirs, model)
    assert all(lr == pytest.approx(16e-3) for n, lr in ours.items() if "lora_B" in n)
    assert {lr for n, lr in ours.items() if "lora_A" in n} == {1e-3}


def test_embedding_lr_and_lr_groups_are_axolotls_groups(tiny_llama):
    cfg, _ = parse_config({**BASE, "base_model": str(tiny_llama), "embedding_lr_scale": 0.5, "embedding_lr": 7.0,
                           "lr_groups": [{"name": "attn", "modules": ["self_attn"], "lr": 1e-4}]})
    model = _model(tiny_llama, lora=False)
    lrs = _lrs(make_optimizer(cfg, model), model)
    for name, lr in lrs.items():  # the scale wins over embedding_lr, as in Axolotl
        want = (5e-4 if "embed_tokens" in name or "lm_head" in name
                else 1e-4 if "self_attn" in name and name.endswith("weight") else 1e-3)
        assert lr == pytest.approx(want), name
    # 0 is unset (Axolotl's `if self.args.embedding_lr_scale`): the embeddings at embedding_lr
    cfg, _ = parse_config({**BASE, "base_model": str(tiny_llama), "embedding_lr_scale": 0, "embedding_lr": 2e-3})
    assert _lrs(make_optimizer(cfg, model), model)["model.embed_tokens.weight"] == 2e-3
    with pytest.raises(ConfigError, match="loraplus_lr_ratio conflicts with embedding_lr"):
        parse_config({**BASE, "base_model": "m", "loraplus_lr_ratio": 4, "embedding_lr": 1e-4})


@pytest.mark.slow
@pytest.mark.parametrize("keys", [{"adapter": "lora", "lora_target_modules": ["q_proj", "v_proj"],
                                   "loraplus_lr_ratio": 16, "loraplus_lr_embedding": 1e-5},
                                  {"embedding_lr_scale": 0.1, "lr_groups": [{"name": "mlp", "modules": ["mlp"],
                                                                             "lr": 1e-4}]}])
def test_group_learning_rates_train_through_the_cli(tmp_path, tiny_llama, keys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} of the data"} for i in range(8)])
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(data), "type": "completion"}], **keys,
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
