"""do_causal_lm_eval with eval_causal_lm_metrics: [perplexity]: Axolotl's perplexity of the reference answers,
logged as eval_perplexity at every evaluation. The oracle is Axolotl's Perplexity.compute, written out here
(axolotl/utils/callbacks/perplexity.py): one padded batch, windows of max_seq_len with stride 512, the model's
own loss."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import read_metrics
from trainer.cli import main
from trainer.config import load_config, parse_config
from trainer.errors import ConfigError
from trainer.objectives.causal_lm_eval import perplexity, references


def axolotl_perplexity(model, tokenizer, refs, max_seq_len, stride=512):
    input_ids = tokenizer(refs, return_tensors="pt", padding=True, truncation=True)["input_ids"]
    length, losses, prev_end = input_ids.size(1), [], 0
    for begin in range(0, length, stride):
        end = min(begin + max_seq_len, length)
        trg_len = end - prev_end
        ids = input_ids[:, begin:end]
        labels = ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=labels).loss)
        prev_end = end
        if end == length:
            break
    return torch.exp(torch.stack(losses).mean()).item()


@pytest.mark.parametrize("window", [6, 64])
def test_perplexity_is_axolotls(tiny_llama, window):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    refs = ["the quick brown fox", "paris", "two plus four nine water boils the lazy dog while cats sleep"] * 7
    ours = perplexity(model, tokenizer, refs, window, "cpu", chunk=4)  # rows in chunks: same value
    assert ours == pytest.approx(axolotl_perplexity(model, tokenizer, refs, window), rel=1e-5)


def test_training_logs_eval_perplexity(make_config, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.data.prepare import load_tokenizer, prepare

    config = make_config(val_set_size=8, eval_steps=2, max_steps=4, do_causal_lm_eval=True,
                         eval_causal_lm_metrics=["perplexity"], eval_max_new_tokens=8)
    assert main(["train", str(config)]) == 0
    cfg, _ = load_config(config)
    rows = [r for r in read_metrics(cfg.output_dir) if "eval_loss" in r]
    assert [r["step"] for r in rows] == [2, 4] and rows[0]["eval_perplexity"] != rows[1]["eval_perplexity"]
    # the last one is the final model's perplexity of the validation split's answers
    tokenizer = load_tokenizer(cfg)
    refs = references(prepare(cfg, tokenizer).validation, tokenizer)
    assert all(refs) and len(refs) == 8
    final = AutoModelForCausalLM.from_pretrained(f"{cfg.output_dir}/final").eval()
    assert rows[1]["eval_perplexity"] == pytest.approx(axolotl_perplexity(final, tokenizer, refs, 8), rel=1e-4)


BASE = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}]}


def test_generation_metrics_and_table_logging_are_refused():
    with pytest.raises(ConfigError, match="sacrebleu, comet, ter, chrf not supported"):
        parse_config({**BASE, "do_causal_lm_eval": True})  # Axolotl's default metric list
    _, notes = parse_config({**BASE, "eval_table_size": 2, "wandb_project": "p"})  # a tracker's output, not training
    assert any(n.startswith("eval_table_size: ignored (no prediction tables are logged") for n in notes)
    _, notes = parse_config({**BASE, "eval_table_size": 2, "eval_max_new_tokens": 32})
    assert any(n.startswith("eval_table_size: ignored") for n in notes)
