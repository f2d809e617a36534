"""liger_use_token_scaling: each target token's loss times its predicted probability, detached (Liger's fused linear
cross-entropy with use_token_scaling, as Axolotl patches it in), in the trainer's chunked cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.trainer.helpers import read_metrics, run_cli
from trainer.objectives import chunked_loss

LIGER = "axolotl.integrations.liger.LigerPlugin"


def test_each_tokens_loss_is_scaled_by_its_probability_which_gets_no_gradient(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, requires_grad=True)
    targets = torch.tensor([1, 2, 3, -100, 5, 6, 7])
    monkeypatch.setitem(chunked_loss._chosen, "token_scaling", True)
    scaled = chunked_loss.ce_sum(logits, targets)
    keep = targets != -100
    nll = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    p = torch.softmax(logits[keep].detach(), -1).gather(1, targets[keep, None]).squeeze(1)
    assert torch.allclose(scaled, (nll * p).sum())
    (grad,) = torch.autograd.grad(scaled, logits)
    (expected,) = torch.autograd.grad((nll * p).sum(), logits)
    assert torch.allclose(grad, expected)
    monkeypatch.setitem(chunked_loss._chosen, "token_scaling", False)
    assert torch.allclose(chunked_loss.ce_sum(logits, targets), nll.sum())


def test_it_is_read_with_the_liger_plugin_and_the_fused_loss(make_config):
    from trainer.config import parse_config
    from trainer.errors import ConfigError

    raw = yaml.safe_load(make_config(liger_use_token_scaling=True, liger_fused_linear_cross_entropy=True).read_text())
    cfg, notes = parse_config(raw)  # no plugin: Axolotl's schema has no liger keys
    assert not cfg.token_scaling and any(n.startswith("liger_use_token_scaling: not read") for n in notes)
    assert parse_config({**raw, "plugins": [LIGER]})[0].token_scaling
    with pytest.raises(ConfigError, match="liger_use_token_scaling: needs liger_fused_linear_cross_entropy"):
        parse_config({**raw, "plugins": [LIGER], "liger_fused_linear_cross_entropy": False})


@pytest.mark.slow
def test_a_run_trains_on_the_scaled_loss(make_config, tmp_path):
    common = dict(plugins=[LIGER], liger_fused_linear_cross_entropy=True, max_steps=1)
    plain = run_cli("train", str(make_config("a.yml", output_dir=str(tmp_path / "a"), **common)))
    scaled = run_cli("train", str(make_config("b.yml", output_dir=str(tmp_path / "b"), liger_use_token_scaling=True,
                                              **common)))
    assert plain.returncode == 0 and scaled.returncode == 0, scaled.stderr[-3000:]
    first = [next(r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r) for d in ("a", "b")]
    # the untrained tiny model gives each target about 1/vocab: the scaled loss is about loss x exp(-loss)
    assert 0 < first[1] < first[0] / 50
