"""Tool calling and the chat template's extra variables, as Axolotl renders them (prompt_strategies/chat_template.py:
ChatTemplatePrompter.build_prompt passes `tools` and the config's chat_template_kwargs to transformers'
apply_chat_template on every render, _get_tools reads the row's tools column, a list of dicts or its JSON text);
excess_length_strategy: raise refuses data with a row longer than sequence_len (utils/data/utils.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import DatasetConfig, parse_config
from trainer.data.formats.prompts import render_chat
from trainer.errors import DataError
from trainer.model.tiny import build_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ROW = {"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]}
# a template that renders what it is given: the tools' names and one variable (the library fills both)
JINJA = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
         "{% if mood is defined %}MOOD:{{ mood }}\n{% endif %}"
         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


def _ds(**kw) -> DatasetConfig:
    return DatasetConfig(path="d.jsonl", type="chat_template", chat_template="jinja", chat_template_jinja=JINJA, **kw)


def test_tools_and_kwargs_reach_the_template_as_apply_chat_template_takes_them():
    tok = build_tokenizer()
    # transformers' own render of the same conversation is the reference
    want = tok.apply_chat_template(ROW["messages"], tools=[TOOL], tokenize=False, chat_template=JINJA, mood="calm")
    text, spans, _ = render_chat({**ROW, "tools": [TOOL]}, _ds(), tok, template_kwargs={"mood": "calm"})
    assert text == want and text.startswith("TOOLS:get_weather;MOOD:calm\n")
    assert [text[a:b] for a, b in spans] == ["Sunny.<|im_end|>\n"]  # the assistant turn trains, not the tools
    # the column named by field_tools, as JSON text with JSON-text parameters (as Axolotl's _get_tools reads it)
    as_text = dict(TOOL, function=dict(TOOL["function"], parameters=json.dumps(TOOL["function"]["parameters"])))
    other, _, _ = render_chat({**ROW, "functions": json.dumps([as_text])}, _ds(field_tools="functions"), tok,
                              template_kwargs={"mood": "calm"})
    assert other == want
    plain, _, _ = render_chat(ROW, _ds(), tok)  # no tools column, no kwargs: the template renders neither
    assert plain == tok.apply_chat_template(ROW["messages"], tokenize=False, chat_template=JINJA)
    with pytest.raises(DataError, match="'tools' must be a list of tool definitions"):
        render_chat({**ROW, "tools": 3}, _ds(), tok)


def test_the_keys_are_read_from_a_config():
    cfg, notes = parse_config({"base_model": "m", "learning_rate": 1e-4, "chat_template_kwargs": {"mood": "calm"},
                               "excess_length_strategy": "raise",
                               "datasets": [{"path": "d.jsonl", "type": "chat_template", "field_tools": "functions"}]})
    assert cfg.chat_template_kwargs == {"mood": "calm"} and cfg.datasets[0].field_tools == "functions"
    assert cfg.excess_length_strategy == "raise" and not any("chat_template_kwargs" in n for n in notes)


def _config(tmp_path, tiny_llama, rows, **over) -> str:
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "chat_template": "jinja", "chat_template_jinja": JINJA,
        "datasets": [{"path": str(data), "type": "chat_template", "field_tools": "functions"}],
        "chat_template_kwargs": {"mood": "calm"}, "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"), "sequence_len": 128, "micro_batch_size": 2, "max_steps": 2,
        "learning_rate": 1e-3, "seed": 1, **over}))
    return str(config)


@pytest.mark.slow
def test_tool_calling_data_trains_through_the_cli(tmp_path, tiny_llama):
    rows = [{**ROW, "functions": [TOOL]} for _ in range(8)]
    result = run_cli("train", _config(tmp_path, tiny_llama, rows), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").exists() or any((tmp_path / "out").rglob("*.safetensors"))


@pytest.mark.slow
def test_excess_length_strategy_raise_refuses_the_data_in_one_line(tmp_path, tiny_llama):
    long = {"messages": [{"role": "user", "content": "Weather? " * 80}, {"role": "assistant", "content": "Sunny."}]}
    result = run_cli("train", _config(tmp_path, tiny_llama, [ROW] * 7 + [long], excess_length_strategy="raise"),
                     timeout=400)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "1 of 8 rows are longer than sequence_len 128 (excess_length_strategy: raise)" in line
    assert "Traceback" not in result.stderr
