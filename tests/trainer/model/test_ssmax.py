"""scaling_softmax (trainer/model/ssmax.py): Scalable-Softmax attention, Axolotl's flex_attention score_mod
score x (s log n + b), and the same formula in plain torch where flex does not train (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from tests.trainer.helpers import read_metrics, run_cli
from trainer.model import ssmax


def _inputs(seed=0, heads=4, kv_heads=2, n=6, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g)
    k = torch.randn(1, kv_heads, n, d, generator=g)
    v = torch.randn(1, kv_heads, n, d, generator=g)
    return q, k, v


def _by_hand(q, k, v, s, b, positions):
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = torch.clamp(torch.tensor(positions, dtype=torch.float) + 1, min=2.0)
    scores = scores * (s * torch.log(n) + b).view(1, 1, -1, 1)
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def test_the_plain_torch_ssmax_is_the_formula():
    q, k, v = _inputs()
    module = torch.nn.Module()
    positions = [0, 1, 2, 0, 1, 2]  # two packed sequences: n restarts
    out, _ = ssmax.math_forward(0.43, 0.1)(module, q, k, v, None, position_ids=torch.tensor([positions]))
    assert torch.allclose(out, _by_hand(q, k, v, 0.43, 0.1, positions), atol=1e-5)
    plain, _ = ssmax.math_forward(0.43, 0.0)(module, q, k, v, None)  # no position_ids: the query's index
    assert torch.allclose(plain, _by_hand(q, k, v, 0.43, 0.0, list(range(6))), atol=1e-5)


def test_flex_attentions_score_mod_computes_the_same(monkeypatch):
    """The GPU path (flex_attention with the score_mod), run here eagerly on CPU's forward: the same numbers."""
    from torch.nn.attention import flex_attention as flex
    from transformers.integrations import flex_attention as hf_flex

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex.flex_attention(q, k, v, **kw))
    q, k, v = _inputs(1)
    block = flex.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 6, 6, device="cpu")
    module = torch.nn.Module()
    positions = torch.tensor([[0, 1, 2, 3, 4, 5]])
    out, _ = ssmax.flex_forward(0.43, 0.1)(module, q, k, v, block, position_ids=positions)
    assert torch.allclose(out, _by_hand(q, k, v, 0.43, 0.1, positions[0].tolist()), atol=1e-4)


def test_it_needs_flex_attention_as_in_axolotl(make_config):
    from trainer.config import parse_config
    from trainer.errors import ConfigError

    raw = yaml.safe_load(make_config(scaling_softmax=True).read_text())
    with pytest.raises(ConfigError, match="scaling_softmax: needs attn_implementation: flex_attention"):
        parse_config(raw)
    cfg, notes = parse_config({**raw, "attn_implementation": "flex_attention", "scaling_softmax_factor": 0})
    assert cfg.scaling_softmax and cfg.scaling_softmax_factor is None  # 0: Axolotl's `or 0.43`
    assert any(n.startswith("scaling_softmax_factor: 0 read as unset") for n in notes)


@pytest.mark.slow
def test_a_cpu_run_trains_with_ssmax(make_config, tmp_path):
    common = dict(attn_implementation="flex_attention", max_steps=1, sample_packing=True)
    plain = run_cli("train", str(make_config("a.yml", output_dir=str(tmp_path / "a"), **common)))
    scaled = run_cli("train", str(make_config("b.yml", output_dir=str(tmp_path / "b"), scaling_softmax=True,
                                              scaling_softmax_factor=0.5, **common)))
    assert plain.returncode == 0 and scaled.returncode == 0, scaled.stderr[-3000:]
    assert "scaling_softmax: attention scores x (0.5 log n + 0) (SSMax), by plain torch in place of sdpa" in scaled.stderr
    first = [next(r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r) for d in ("a", "b")]
    assert abs(first[0] - first[1]) > 1e-5  # (the tiny model's attention moves its first loss a little)
