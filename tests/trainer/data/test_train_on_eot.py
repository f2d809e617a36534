"""`datasets[].train_on_eot`, as Axolotl's ChatTemplateStrategy reads it (prompt_strategies/chat_template.py): which
end-of-turn tokens (eot_tokens, else the EOS) are trained; unset, train_on_eos decides; where the EOS is one of them
the two must agree (Axolotl raises "Conflict between train_on_eos and train_on_eot")."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import DatasetConfig, parse_config
from trainer.data.formats.prompts import render_chat
from trainer.errors import ConfigError, DataError
from trainer.model.tiny import build_tokenizer

ROW = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
BASE = {"base_model": "m", "learning_rate": 1e-4}


def _trained(ds: DatasetConfig, eot_tokens=None) -> list[str]:
    text, spans, _ = render_chat(ROW, ds, build_tokenizer(), eot_tokens)
    return [text[a:b] for a, b in spans]


def test_train_on_eot_decides_the_end_of_turn_tokens():
    eot = ["<|im_end|>"]  # the chatml turn end; the tokenizer's EOS (</s>) is not one of them
    turn = _trained(DatasetConfig(path="d", type="chat_template", train_on_eot="turn"), eot)
    assert turn == ["Hello.", "<|im_end|>", "Bye.", "<|im_end|>"]
    assert _trained(DatasetConfig(path="d", type="chat_template", train_on_eot="none"), eot) == ["Hello.", "Bye."]
    assert _trained(DatasetConfig(path="d", type="chat_template", train_on_eot="last"), eot) == \
        ["Hello.", "Bye.", "<|im_end|>"]
    # unset: train_on_eos decides, as before (Axolotl's backward compatibility)
    assert _trained(DatasetConfig(path="d", type="chat_template", train_on_eos="none"), eot) == ["Hello.", "Bye."]
    # the EOS among the end-of-turn tokens with the two differing: refused, as Axolotl refuses it
    with pytest.raises(DataError, match="train_on_eot: 'none' differs from train_on_eos"):
        _trained(DatasetConfig(path="d", type="chat_template", train_on_eot="none"), ["</s>", "<|im_end|>"])


def test_without_eot_tokens_a_differing_train_on_eot_is_refused_by_validate():
    ok, _ = parse_config({**BASE, "datasets": [{"path": "d.jsonl", "type": "chat_template", "train_on_eot": "turn"}]})
    assert ok.datasets[0].train_on_eot == "turn"
    with pytest.raises(ConfigError, match=r"datasets.0.train_on_eot: 'all' differs from train_on_eos \('turn'\)"):
        parse_config({**BASE, "datasets": [{"path": "d.jsonl", "type": "chat_template", "train_on_eot": "all"}]})
    cfg, _ = parse_config({**BASE, "eot_tokens": ["<|im_end|>"],
                           "datasets": [{"path": "d.jsonl", "type": "chat_template", "train_on_eot": "all"}]})
    assert cfg.datasets[0].train_on_eot == "all"


@pytest.mark.slow
def test_train_on_eot_trains_through_the_cli(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "chat.jsonl", [ROW] * 8)
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "chat_template": "chatml", "eot_tokens": ["<|im_end|>"],
        "datasets": [{"path": str(data), "type": "chat_template", "train_on_eot": "last"}],
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]

