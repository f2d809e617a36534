"""optimizer: muon (Axolotl's MuonOptimizerFactory split, built from torch.optim.Muon and torch.optim.AdamW)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import train_losses, train_then_resume
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError


def tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def loss_of(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return model(input_ids=ids, labels=ids).loss


def test_muon_steps_as_torchs_muon_and_adamw_on_axolotls_split():
    """The oracle: torch.optim.Muon (Moonlight's lr adjustment) on the hidden matrices and torch.optim.AdamW
    (Axolotl's default betas 0.95, 0.95) on embeddings and LM head, stepped separately; norms untouched."""
    from trainer.optim.muon import build

    cfg, _ = parse_config({"base_model": "m", "datasets": [{"path": "x.jsonl", "type": "alpaca"}],
                           "optimizer": "muon", "learning_rate": 0.02, "weight_decay": 0.01})
    ours, ref = tiny_model(), tiny_model()
    opt = build(cfg, ours)
    hidden = [p for n, p in ref.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    outer = [ref.model.embed_tokens.weight, ref.lm_head.weight]
    ref_opts = [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(outer, lr=0.02, weight_decay=0.01, betas=(0.95, 0.95), eps=1e-8)]
    norm_before = ours.model.norm.weight.clone()
    for step in range(3):
        for model, opts in ((ours, [opt]), (ref, ref_opts)):
            loss_of(model, step).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(ours.model.norm.weight, norm_before)  # as Axolotl's factory: 1-D parameters left out


def test_adam_betas_are_used_when_set():
    from trainer.optim.muon import build

    cfg, _ = parse_config({"base_model": "m", "datasets": [{"path": "x.jsonl", "type": "alpaca"}],
                           "optimizer": "muon", "adam_beta1": 0.8, "adam_beta2": 0.9})
    opt = build(cfg, tiny_model())
    assert [g.get("betas") for g in opt.param_groups if "betas" in g] == [(0.8, 0.9)]


def test_muon_trains_and_resumes_exactly(make_config, tmp_path):
    full, _ = train_then_resume(main, make_config, tmp_path, checkpoint=2, optimizer="muon", learning_rate=0.02,
                                weight_decay=0.01, max_steps=4, save_steps=2, lr_scheduler="cosine", warmup_steps=1)
    losses = train_losses(full)
    assert losses[4] < losses[1]


def test_torchs_averaged_momentum_gives_axolotls_step():
    """Axolotl's Muon keeps buf = m*buf + g and orthogonalises g + m*buf; torch's keeps the average
    buf = m*buf + (1-m)*g and orthogonalises (1-m)*g + m*buf, which is (1-m) x Axolotl's. Newton-Schulz divides
    by the norm first, so both steps are the same (up to bf16 rounding of the scaled input)."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(24, 16, generator=g) for _ in range(4)]
    m, axolotl_buf, torch_buf = 0.95, torch.zeros(24, 16), torch.zeros(24, 16)
    for grad in grads:
        axolotl_buf = m * axolotl_buf + grad
        torch_buf = torch_buf.lerp(grad, 1 - m)
        ns = [_zeropower_via_newtonschulz(u, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7).float()
              for u in (grad + m * axolotl_buf, grad.lerp(torch_buf, m))]
        assert torch.allclose(ns[0], ns[1], atol=2e-2), (ns[0] - ns[1]).abs().max()


def test_muon_refuses_flattened_parameters():
    base = {"base_model": "m", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "optimizer": "muon"}
    with pytest.raises(ConfigError, match="muon with deepspeed"):
        parse_config({**base, "deepspeed": "deepspeed_configs/zero2.json"})
    with pytest.raises(ConfigError, match="muon with FSDP1"):
        parse_config({**base, "fsdp": ["full_shard", "auto_wrap"]})
    assert parse_config({**base, "fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}})[0].optimizer == "muon"
