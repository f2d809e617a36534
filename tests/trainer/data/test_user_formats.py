"""Features users' own Axolotl configs use (issue 18): user-defined prompt formats and Axolotl's older instruction
types (rendered as Axolotl's prompters render them), NEFTune (transformers' noise, same numbers), fractional
eval_steps/save_steps, test_datasets and skip_prepare_dataset (through `python -m trainer train`)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from tests.trainer.helpers import read_metrics, run_cli, write_jsonl
from trainer.cli import main
from trainer.config import DatasetConfig, parse_config
from trainer.config.datasets import INSTRUCTION_TYPES
from trainer.data.formats import instruction


class Tok:
    eos_token = "</s>"


def rendered(row: dict, **entry) -> tuple[str, str]:
    """(prompt, trained text) of one row."""
    ds = DatasetConfig(path="d.jsonl", **entry)
    text, [(start, end)], _ = instruction.render(row, ds, Tok())
    return text[:start], text[start:end]


# Axolotl's UserDefinedPrompter (prompt_strategies/user_defined.py over alpaca_w_system.SystemDataPrompter,
# v0.4.0-v0.5.x): system_format around the row's system field (else system_prompt) where not empty, then format
# (with an input) or no_input_format; the output and EOS follow.
def test_a_format_of_your_own_renders_as_axolotls_user_defined_prompter():
    fmt = {"system_prompt": "Be brief.", "system_format": "<s>{system}</s>\n", "field_instruction": "q",
           "field_input": "ctx", "field_output": "a", "format": "[INST] {instruction}\n{input} [/INST] ",
           "no_input_format": "[INST] {instruction} [/INST] "}
    assert rendered({"q": "Hi?", "ctx": "x", "a": "Yes."}, type=fmt) == (
        "<s>Be brief.</s>\n[INST] Hi?\nx [/INST] ", "Yes.</s>")
    assert rendered({"q": "Hi?", "a": "Yes.", "system": "Row's own."}, type=fmt) == (
        "<s>Row's own.</s>\n[INST] Hi? [/INST] ", "Yes.</s>")  # no input: no_input_format; the row's system wins
    # Axolotl's defaults: no system text, "{instruction} {input} " / "{instruction} "
    assert rendered({"instruction": "Add 1+1", "output": "2"}, type={"format": "{instruction} {input} "}) == (
        "Add 1+1 ", "2</s>")


def test_a_format_of_your_own_is_checked_when_read():
    base = {"base_model": "org/model"}
    with pytest.raises(Exception, match=r"format: unknown placeholder\(s\) question"):
        parse_config({**base, "datasets": [{"path": "d.jsonl", "type": {"format": "{question}"}}]})
    with pytest.raises(Exception, match="a format of your own .* is for SFT here"):
        parse_config({**base, "rl": "dpo", "datasets": [{"path": "d.jsonl", "type": {"format": "{instruction}"}}]})


def test_axolotls_older_instruction_types_render_as_its_prompters():
    assert set(INSTRUCTION_TYPES) == set(instruction.NAMED)  # the config's list is the renderer's
    # prompt_strategies/context_qa.py load_v2: ContextV2Prompter, no system text
    assert rendered({"context": "Paris is in France.", "question": "Where is Paris?", "answer": "France"},
                    type="context_qa.load_v2") == ("Context: Paris is in France.\nQuestion: Where is Paris?\n",
                                                   "Answer: France</s>")
    # alpaca_chat.load_qa: AlpacaChatPrompter (chat style, its own system text ending in a blank line)
    prompt, out = rendered({"question": "2+2?", "answer": "4"}, type="alpaca_chat.load_qa")
    assert prompt == ("SYSTEM: Below is an instruction from a USER that describes a task. The ASSISTANT writes a "
                      "response that appropriately and concisely completes the request.\n\n\nUSER: 2+2?\nASSISTANT:")
    # type: oasst: AlpacaPrompter (instruct) over INSTRUCTION / RESPONSE
    assert rendered({"INSTRUCTION": "Say hi", "RESPONSE": "hi"}, type="oasst") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nSay hi\n\n### Response:\n", "hi</s>")


def test_neftune_is_transformers_noise_in_training_and_none_in_eval(tiny_llama):
    from transformers import AutoModelForCausalLM

    from trainer.model import neftune

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    cfg, _ = parse_config({"base_model": str(tiny_llama), "neftune_noise_alpha": 5,
                           "datasets": [{"path": "d.jsonl", "type": "alpaca"}]})
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    clean = model.get_input_embeddings()(ids)
    hook = neftune.hook(cfg, model)
    hook.start({}, None)
    model.train()
    torch.manual_seed(3)
    noisy = model.get_input_embeddings()(ids)
    # the oracle: NEFTune's noise (Jain et al. 2023, as transformers' neftune_post_forward_hook draws it):
    # U(-m, m) with m = alpha / sqrt(L * d), drawn from the same generator state
    torch.manual_seed(3)
    m = 5 / math.sqrt(ids.shape[1] * clean.shape[-1])
    expected = clean + torch.zeros_like(clean).uniform_(-m, m)
    assert torch.equal(noisy, expected)
    assert (noisy - clean).abs().max() <= m and (noisy - clean).abs().max() > m / 2
    model.eval()
    assert torch.equal(model.get_input_embeddings()(ids), clean)  # evaluation sees the clean embeddings
    hook.end(0)
    model.train()
    assert torch.equal(model.get_input_embeddings()(ids), clean)  # removed before the final model is written
    assert not hasattr(model.get_input_embeddings(), "neftune_noise_alpha")


def test_fractional_steps_are_a_share_of_the_total():
    from trainer.config.training import steps_from_fractions

    cfg, _ = parse_config({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                           "eval_steps": 0.05, "save_steps": 0.25, "logging_steps": 2.0, "val_set_size": 0.1})
    assert cfg.logging_steps == 2 and isinstance(cfg.logging_steps, int)
    steps_from_fractions(cfg, 30)
    assert (cfg.eval_steps, cfg.save_steps) == (2, 8)  # ceil(30 * 0.05), ceil(30 * 0.25), as TrainingArguments
    with pytest.raises(Exception, match="eval_steps: 1.5 is neither a step count nor a fraction"):
        parse_config({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "eval_steps": 1.5})


@pytest.mark.slow
def test_test_datasets_and_skip_prepare_dataset_and_fractions_train(tmp_path, tiny_llama, capsys):
    """One run through the CLI: a user-defined format, test_datasets as the validation rows, fractional eval and
    save steps, NEFTune, skip_prepare_dataset (nothing cached)."""
    rows = [{"q": f"What is {i} plus {i}?", "a": f"It is {2 * i}."} for i in range(24)]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:16])
    held = write_jsonl(tmp_path / "held.jsonl", rows[16:])
    fmt = {"field_instruction": "q", "field_output": "a", "no_input_format": "Q: {instruction}\nA: "}
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(train), "type": fmt}],
        "test_datasets": [{"path": str(held), "type": fmt, "split": "train"}], "skip_prepare_dataset": True,
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 4, "eval_steps": 0.5, "save_steps": 0.5,
        "neftune_noise_alpha": 5, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    evals = [m for m in read_metrics(tmp_path / "out") if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4]  # eval_steps 0.5 of 4 steps
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not (tmp_path / "prepared").exists()  # skip_prepare_dataset: nothing cached
    # the validation rows are test_datasets' 8 rows, all 16 train (preprocess shows what train read)
    raw = yaml.safe_load(config.read_text())
    assert main(["preprocess", str(config)]) == 2  # skip_prepare_dataset: nothing to prepare, said in one line
    raw.pop("skip_prepare_dataset")
    config.write_text(yaml.safe_dump(raw))
    assert main(["preprocess", str(config)]) == 0
    assert "prepared 16 training and 8 validation rows" in capsys.readouterr().out
