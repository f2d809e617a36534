"""The attention backends of matrices/attention.toml beyond flash/sdpa/eager: torch's flex_attention and the Hub
kernel kernels-community/vllm-flash-attn3 (Axolotl's llama-4 flex and gpt-oss examples). The config accepts
exactly the table's names; each backend is kept where its row says it runs and falls back elsewhere; packed
sequences stay apart under flex; and the facts behind the rows are checked against torch where they can be."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.batch.test_attention import examples
from trainer import facts
from trainer.batch.collate import Collator
from trainer.config import Attention, parse_config
from trainer.errors import ConfigError
from trainer.objectives.loss import MODEL_INPUTS
from trainer.runtime.hardware import adapt, gpu_from_name

CONFIG = {"base_model": "tiny", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
HUB_FA3 = "kernels-community/vllm-flash-attn3"


def test_the_config_accepts_exactly_the_backends_of_attention_toml():
    names = [row["name"] for row in facts.rows("attention", "backend")]
    assert list(Attention.__args__) == names and {"flex_attention", HUB_FA3} <= set(names)
    for name in names:
        assert parse_config({**CONFIG, "attn_implementation": name})[0].requested_attention == name
    with pytest.raises(ConfigError, match="attn_implementation.*flex_attention"):
        parse_config({**CONFIG, "attn_implementation": "kernels-community/flash-attn9"})


@pytest.mark.parametrize("requested, gpu, expected", [
    ("flex_attention", "a100", "flex_attention"),
    ("flex_attention", "h100", "flex_attention"),
    ("flex_attention", "t4", "sdpa"),  # triton flex kernels from sm_80 (attention.toml's source)
    ("flex_attention", "cpu", "sdpa"),  # no backward on CPU (the test below)
    (HUB_FA3, "h100", HUB_FA3),
    (HUB_FA3, "a100", "flash_attention_2"),  # the best backend that runs, as for flash_attention_3
    (HUB_FA3, "b200", "flash_attention_2"),
    (HUB_FA3, "cpu", "sdpa"),
])
def test_each_backend_is_kept_where_its_row_says_it_runs_and_falls_back_with_the_reason(requested, gpu, expected):
    cfg, _ = parse_config({**CONFIG, "attn_implementation": requested})
    runtime = adapt(cfg, gpu_from_name(gpu))
    assert runtime.attention == expected
    if expected != requested:
        assert any(change.startswith(f"attention: {requested} -> {expected}") for change in runtime.changes)


def test_axolotls_legacy_flex_attention_flag_means_the_backend():
    assert parse_config({**CONFIG, "flex_attention": True})[0].requested_attention == "flex_attention"
    with pytest.raises(ConfigError, match="choose one attention setting"):
        parse_config({**CONFIG, "flex_attention": True, "attn_implementation": "sdpa"})


def test_axolotls_flex_compile_kwargs_are_accepted_as_a_speed_option():
    cfg, notes = parse_config({**CONFIG, "attn_implementation": "flex_attention",
                               "flex_attn_compile_kwargs": {"dynamic": False, "mode": "max-autotune-no-cudagraphs"}})
    assert cfg.requested_attention == "flex_attention"
    assert any(n.startswith("ignored: flex_attn_compile_kwargs (torch.compile options") for n in notes)


def test_flex_attention_has_no_backward_on_cpu_which_is_why_its_row_needs_a_gpu():
    """The fact behind flex_attention's min_cc: torch 2.13 refuses gradients through flex on CPU. If a torch
    release lifts it, this fails and the row can allow CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v)
    row = next(r for r in facts.rows("attention", "backend") if r["name"] == "flex_attention")
    assert row["min_cc"] == "8.0" and "backward on CPU" in row["source"]


def test_the_collator_keeps_flex_rows_and_passes_position_ids_alone():
    batch = Collator(pad_token_id=0, attention="flex_attention")(examples(100))
    assert "attention_mask" not in batch and batch["input_ids"].shape == (2, 24)  # rows kept, not flattened
    assert batch["position_ids"][0, 6:9].tolist() == [6, 0, 1]  # restart where the second sequence starts
    hub = Collator(pad_token_id=0, attention=HUB_FA3)(examples(100))
    assert "attention_mask" not in hub and hub["input_ids"].shape == (1, 33)  # flash kernels: one flat row


@pytest.mark.slow
def test_packed_flex_attention_gives_sdpas_logits_and_loss(tiny_llama):
    """flex_attention's forward (compiled by torch for CPU, ~20 s) on packed rows: the same logits as sdpa with
    the block-diagonal mask, so no sequence sees another. (An open finding of 2026-11-28, NaN from the second
    sequence on, no longer reproduces: on 2026-12-07 it passed three runs in a row with transformers 5.23.0 and
    torch 2.13.0 CPU, which failed its strict xfail; the plan still never picks flex on CPU, min_cc 8.0.) fp32 on both sides; the kernels differ only in
    summation order, so 1e-5 is far above their rounding (measured ~2e-7) and far below a leak (~0.5)."""
    rows = examples(300)
    logits = {}
    for attention in ("sdpa", "flex_attention"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=attention,
                                                     dtype=torch.float32).eval()
        batch = Collator(pad_token_id=0, attention=attention)(rows)
        with torch.no_grad():
            logits[attention] = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, use_cache=False).logits
    real = torch.tensor([[True] * 24, [True] * 9 + [False] * 15])  # padding positions carry no target
    assert (logits["sdpa"] - logits["flex_attention"])[real].abs().max().item() < 1e-5
