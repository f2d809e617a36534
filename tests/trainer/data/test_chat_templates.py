"""Chat templates by name (data files with their sources), eot_tokens / train_on_eos / roles_to_train, and
chat-template SFT with llama3 and chatml that trains and resumes exactly."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.trainer.helpers import train_then_resume, write_jsonl
from trainer.batch.labels import IGNORE
from trainer.cli import main
from trainer.config import DatasetConfig, parse_config
from trainer.data.formats import chat_templates
from trainer.data.formats.prompts import tokenize_row
from trainer.errors import ConfigError

# Llama 3's special tokens, added to the tiny tokenizer as a user adds them to a base model (tokens:).
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"},
                {"role": "assistant", "content": "Rome."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.add_tokens(LLAMA3_TOKENS, special_tokens=True)
    return tok


def trained(tokenizer, out) -> str:
    return tokenizer.decode([t for t, lab in zip(out["input_ids"], out["labels"]) if lab != IGNORE])


def test_every_template_is_a_file_with_its_source():
    names = chat_templates.names()
    # the names Axolotl's example configs use
    assert {"llama3", "chatml", "phi_3", "phi_35", "gemma", "gemma3", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken",
            "mistral_v7_tekken", "qwen_25", "qwen3", "deepseek_v2", "jamba", "cohere", "falcon_h1", "llama4"} <= set(names)
    for name in names:
        row = chat_templates.sources()[name]
        assert row["source"].startswith("github.com/axolotl-ai-cloud/axolotl/blob/") and row["publisher"]
        assert "{%" in chat_templates.template_text(name)


def test_named_templates_render_the_publishers_format(tokenizer):
    """Llama 3 and ChatML as their publishers document them (Meta's model card, OpenAI's ChatML)."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    llama3 = tokenizer.apply_chat_template(msgs, tokenize=False, chat_template=chat_templates.template_text("llama3"))
    assert llama3 == ("<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>")
    chatml = tokenizer.apply_chat_template(msgs, tokenize=False, chat_template=chat_templates.template_text("chatml"))
    assert chatml == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    phi3 = tokenizer.apply_chat_template(msgs, tokenize=False, chat_template=chat_templates.template_text("phi_3"))
    assert phi3 == "<s><|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n"


@pytest.mark.parametrize("policy, expected", [
    ("turn", "Paris.<|eot_id|>Rome.<|eot_id|>"),
    ("none", "Paris.Rome."),
    ("last", "Paris.Rome.<|eot_id|>"),
    ("all", "<|eot_id|><|eot_id|>Paris.<|eot_id|><|eot_id|>Rome.<|eot_id|>"),
])
def test_train_on_eos_with_eot_tokens(tokenizer, policy, expected):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.add_tokens(LLAMA3_TOKENS, special_tokens=True)
    tokenizer.chat_template = chat_templates.template_text("llama3")
    ds = DatasetConfig(path="x.jsonl", type="chat_template", train_on_eos=policy)
    out = tokenize_row({"messages": CONVERSATION}, ds, tokenizer, False, eot_tokens=["<|eot_id|>"])
    assert trained(tokenizer, out) == expected
    assert "<|start_header_id|>assistant" not in trained(tokenizer, out)  # turn headers are never trained


def test_roles_to_train_and_a_dataset_level_template(tokenizer):
    ds = DatasetConfig(path="x.jsonl", type="chat_template", chat_template="chatml", roles_to_train=["user"])
    out = tokenize_row({"messages": CONVERSATION}, ds, tokenizer, False, eot_tokens=["<|im_end|>"])
    assert trained(tokenizer, out) == "Capital of France?<|im_end|>And Italy?<|im_end|>"
    assert tokenizer.decode(out["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_choices_are_checked_without_a_tokenizer(tmp_path):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "chat_template"}]}
    assert parse_config({**base, "chat_template": "gemma3"})[0].chat_template == "gemma3"
    assert parse_config({**base, "chat_template": "tokenizer_default_fallback_chatml"})[0]
    with pytest.raises(ConfigError, match="chat_template: jinja needs chat_template_jinja"):
        parse_config({**base, "chat_template": "jinja"})
    with pytest.raises(ConfigError, match="unknown template 'gemma9'"):
        parse_config({**base, "datasets": [{"path": "x", "type": "chat_template", "chat_template": "gemma9"}]})


def test_jinja_file_and_fallback(tokenizer, tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert chat_templates.resolve("jinja", str(template), tokenizer) == template.read_text()
    bare = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    assert chat_templates.resolve("tokenizer_default_fallback_llama3", None, bare) == chat_templates.template_text("llama3")
    assert chat_templates.resolve("tokenizer_default_fallback_llama3", None, tokenizer) == tokenizer.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("template, eot", [("llama3", "<|eot_id|>"), ("chatml", "<|im_end|>")])
def test_chat_template_sft_trains_and_resumes_exactly(make_config, tmp_path, template, eot):
    """The shape of Axolotl's examples/llama-3/instruct-lora-8b.yml and its chatml configs."""
    rows = [{"conversations": [{"from": "human", "value": f"Repeat {i}: the quick brown fox"},
                               {"from": "gpt", "value": "the quick brown fox " * (1 + i % 4)}]} for i in range(40)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    common = dict(datasets=[{"path": str(data), "type": "chat_template", "field_messages": "conversations",
                             "message_property_mappings": {"role": "from", "content": "value"},
                             "roles": {"user": ["human"], "assistant": ["gpt"]}, "roles_to_train": ["assistant"],
                             "train_on_eos": "turn"}],
                  chat_template=template, eot_tokens=[eot], tokens=LLAMA3_TOKENS, adapter="lora", lora_r=4,
                  lora_target_linear=True, lora_dropout=0.1, sample_packing=True, max_steps=4, save_steps=2)
    full, _ = train_then_resume(main, make_config, tmp_path, **common)
    # the saved tokenizer carries the template it was trained with
    saved = json.loads((full / "final" / "tokenizer_config.json").read_text()).get("chat_template") or \
        (full / "final" / "chat_template.jinja").read_text()
    assert saved == chat_templates.template_text(template)
