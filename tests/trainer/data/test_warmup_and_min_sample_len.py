"""Axolotl scalars next to parallelism in its examples: warmup_steps as a fraction (examples/expert_parallel),
min_sample_len (examples/alst), accelerator_config's sync_each_batch (examples/falcon-e), its refusals
and the tiled MLP notes."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import alpaca_rows, read_metrics, write_jsonl
from trainer.cli import main
from trainer.config import load_config, parse_config
from trainer.data.prepare import load_tokenizer, prepare
from trainer.errors import ConfigError
from trainer.optim.schedule import warmup_steps

BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}


@pytest.mark.parametrize("value, total", [(0.1, 20), (0.25, 10), (0.5, 3), (0.0, 7), (5, 40), (5.0, 40)])
def test_warmup_steps_reads_fractions_as_transformers_does(value, total):
    """Axolotl hands warmup_steps to transformers v5's TrainingArguments, whose get_warmup_steps is the oracle:
    a float below 1 is a fraction of the steps (rounded up), anything else a step count."""
    from transformers import TrainingArguments

    cfg = parse_config({**BASE, "warmup_steps": value})[0]
    oracle = TrainingArguments(output_dir="unused", warmup_steps=value, report_to=[]).get_warmup_steps(total)
    assert warmup_steps(cfg, total) == oracle


def test_warmup_steps_that_is_neither_count_nor_fraction_is_refused():
    with pytest.raises(ConfigError, match="warmup_steps: 2.5 is neither a step count nor a fraction"):
        parse_config({**BASE, "warmup_steps": 2.5})


def test_a_fractional_warmup_ramps_the_learning_rate_over_that_share_of_the_steps(make_config, tmp_path):
    out = tmp_path / "out"
    assert main(["train", str(make_config(warmup_steps=0.5, max_steps=4, lr_scheduler="constant",
                                          output_dir=str(out)))]) == 0
    lrs = [r["lr"] for r in read_metrics(out) if "lr" in r]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])  # 2 of 4 steps warm up to learning_rate 1e-3


def test_min_sample_len_drops_shorter_rows_and_counts_them(make_config, tmp_path):
    path = write_jsonl(tmp_path / "skewed.jsonl", alpaca_rows(40, long_every=5))  # 8 rows of ~60 words
    cfg, _ = load_config(make_config(datasets=[{"path": str(path), "type": "alpaca"}], sequence_len=400))
    tok = load_tokenizer(cfg)
    everything = prepare(cfg, tok)
    threshold = sorted(everything.train["length"])[-8]  # the long rows' shortest length
    cfg.min_sample_len = threshold
    kept = prepare(cfg, tok)
    assert kept.stats["train_rows"] == 8 and kept.stats["dropped_too_short"] == 32
    assert min(kept.train["length"]) >= threshold
    assert kept.path != everything.path  # part of the cache key


@pytest.mark.parametrize("keys, message", [
    ({"min_sample_len": 4096, "sequence_len": 2048}, "min_sample_len: 4096 must be at most sequence_len (2048)"),
    ({"accelerator_config": {"split_batches": True}}, "accelerator_config.split_batches: not supported"),
    ({"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 4}}},
     "accelerator_config.gradient_accumulation_kwargs.num_steps: not supported"),
])
def test_refusals_name_the_key(keys, message):
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, **keys})
    assert message in str(err.value)


def test_tiled_mlp_is_read_and_sync_each_batch_is_accepted():
    cfg, notes = parse_config({**BASE, "tiled_mlp": True,
                               "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}})
    assert cfg.tiled_mlp is True and not any("tiled_mlp" in n and n.startswith("ignored") for n in notes)  # honoured
    from trainer.config.parallel import sync_each_batch

    assert sync_each_batch(cfg) is True
