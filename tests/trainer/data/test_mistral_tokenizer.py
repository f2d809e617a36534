"""tokenizer_use_mistral_common: chat_template data encoded by a real mistral-common tokenizer (a tekken file cut
down from the one mistral-common ships), labels exactly the trained turns' tokens (mistral-common's own encoding
of each message is the oracle), Axolotl's Magistral thinking example trains and resumes on a tiny Mistral, and
what cannot go with it is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.oracle import require_extra

require_extra("mistral_common", "mistral")  # skipped here without it, fails under CI

from tests.trainer.helpers import run_cli, train_then_resume, write_jsonl
from trainer.batch.labels import IGNORE
from trainer.cli import main
from trainer.config import parse_config
from trainer.data.formats.prompts import tokenize_row
from trainer.data.prepare import load_tokenizer, tokenizer_identity
from trainer.model.tiny import build_mistral_tokenizer, make_tiny_model

EXAMPLE = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "magistral__think__magistral-small-think-qlora.yaml"

SYSTEM_MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]
THINKING = [  # Axolotl's thinking format (examples/magistral/think/README.md): chunks, `thinking` among them
    {"role": "system", "content": [{"type": "text", "text": "Think first."}]},
    {"role": "user", "content": [{"type": "text", "text": "What is 15% of 240?"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "0.15 times 240 is 36."},
                                      {"type": "text", "text": "It is 36."}]},
    {"role": "user", "content": "And 10%?"},
    {"role": "assistant", "content": "24.", "reasoning_content": "A tenth of 240."},  # OpenAI/SGLang's field
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    """Model directories holding a tokenizer file: tekken v3 (the system prompt goes into the last user turn) and
    v13 ([SYSTEM_PROMPT], [THINK]), cut down; and SentencePiece v1 and v3 as mistral-common ships them."""
    import shutil

    import mistral_common

    dirs = {v: build_mistral_tokenizer(tmp_path_factory.mktemp(f"tekken-{v}"), version=v).parent for v in ("v3", "v13")}
    shipped = Path(mistral_common.__file__).parent / "data"
    for name, source in (("spm-v1", "tokenizer.model.v1"), ("spm-v3", "mistral_instruct_tokenizer_240323.model.v3")):
        dirs[name] = tmp_path_factory.mktemp(name)
        shutil.copy(shipped / source, dirs[name] / f"tokenizer.model.{name[-2:]}")
    return dirs


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), family="mistral", seed=0)


def setup(model_dir: Path, **dataset):
    cfg, notes = parse_config({"base_model": str(model_dir), "tokenizer_use_mistral_common": True,
                               "datasets": [{"path": "chat.jsonl", "type": "chat_template", **dataset}]})
    return cfg, load_tokenizer(cfg)


def oracle(model_dir: Path, messages: list[dict]) -> tuple[list[int], list[list[int]]]:
    """mistral-common alone (no transformers, none of the trainer's code): the conversation's ids and each
    assistant message's own encoding (its content, thinking included, and the closing </s>)."""
    from mistral_common.protocol.instruct.messages import AssistantMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    (path,) = [p for p in model_dir.iterdir() if p.name.startswith(("tekken", "tokenizer.model"))]
    tok = MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)
    ids = tok.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    turns = [tok.instruct_tokenizer.encode_assistant_message(AssistantMessage.from_openai(m), i < last_user)
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    return ids, turns


def runs(out: dict) -> list[list[int]]:
    """The labelled tokens, as runs of consecutive positions (labels equal to the ids where set)."""
    found, last = [], None
    for pos, (tok, lab) in enumerate(zip(out["input_ids"], out["labels"])):
        if lab == IGNORE:
            continue
        assert lab == tok
        if last is None or pos != last + 1:
            found.append([])
        found[-1].append(tok)
        last = pos
    return found


@pytest.mark.parametrize("version, conversation", [
    ("v3", SYSTEM_MULTI_TURN), ("v13", SYSTEM_MULTI_TURN), ("v13", THINKING), ("spm-v1", SYSTEM_MULTI_TURN),
    ("spm-v3", SYSTEM_MULTI_TURN)], ids=["v3-system", "v13-system", "v13-thinking", "spm-v1", "spm-v3"])
def test_labels_are_exactly_the_assistant_turns(tokenizers, version, conversation):
    cfg, tok = setup(tokenizers[version])
    assert type(tok).__name__ == "MistralCommonBackend" and tok.mode.value == "finetuning"
    out = tokenize_row({"messages": conversation}, cfg.datasets[0], tok, train_on_inputs=False)
    ids, turns = oracle(tokenizers[version], conversation)
    assert out["input_ids"] == ids
    assert runs(out) == turns  # each assistant turn, whole and in order, and nothing else
    if version == "v3":  # the system prompt sits in the last user turn: a prefix of the chat is not a prefix of ids
        assert tok.decode(ids, skip_special_tokens=False).startswith("<s>[INST]What is the capital")
    if conversation is THINKING:
        assert tok.decode(runs(out)[0], skip_special_tokens=False) == "[THINK]0.15 times 240 is 36.[/THINK]It is 36.</s>"
        assert tok.decode(runs(out)[1], skip_special_tokens=False) == "[THINK]A tenth of 240.[/THINK]24.</s>"


@pytest.mark.parametrize("policy, roles, expected", [
    ("turn", ["assistant"], ["Paris.</s>", "Rome is the capital of Italy.</s>"]),
    ("none", ["assistant"], ["Paris.", "Rome is the capital of Italy."]),
    ("last", ["assistant"], ["Paris.", "Rome is the capital of Italy.</s>"]),
    ("all", [], ["</s>", "</s>"]),
    ("turn", ["user"], ["What is the capital of France?", "And of Italy?"]),
])
def test_train_on_eos_and_roles_to_train(tokenizers, policy, roles, expected):
    cfg, tok = setup(tokenizers["v13"], train_on_eos=policy, roles_to_train=roles)
    out = tokenize_row({"messages": SYSTEM_MULTI_TURN}, cfg.datasets[0], tok, train_on_inputs=False)
    assert [tok.decode(run, skip_special_tokens=False) for run in runs(out)] == expected


@pytest.mark.parametrize("roles", [None, {"user": ["human"], "assistant": ["gpt"], "system": ["system"]}])
def test_mapped_fields_roles_and_train_on_inputs(tokenizers, roles):
    """The shape of Axolotl's voxtral example (ShareGPT fields, and no `roles`: human and gpt are mapped as
    Axolotl maps them), and train_on_inputs."""
    row = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                             {"from": "gpt", "value": "Hello."}]}
    cfg, tok = setup(tokenizers["v13"], field_messages="conversations",
                     message_property_mappings={"role": "from", "content": "value"}, **({"roles": roles} if roles else {}))
    out = tokenize_row(row, cfg.datasets[0], tok, train_on_inputs=False)
    ids, turns = oracle(tokenizers["v13"], [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}])
    assert out["input_ids"] == ids and runs(out) == turns
    assert tokenize_row(row, cfg.datasets[0], tok, train_on_inputs=True)["labels"] == ids


def test_a_conversation_mistral_common_refuses_is_one_line(tokenizers):
    from trainer.errors import DataError

    cfg, tok = setup(tokenizers["v3"])
    thinking = {"messages": THINKING[1:3]}  # [THINK] needs a v13 tokenizer
    with pytest.raises(DataError, match="mistral-common cannot encode a conversation") as err:
        tokenize_row(thinking, cfg.datasets[0], tok, train_on_inputs=False)
    assert "\n" not in str(err.value)


def test_the_cache_key_follows_the_tokenizer_version(tokenizers):
    """v3 and v13 files share their vocabulary but encode differently: they must not share a dataset cache."""
    keys = {v: tokenizer_identity(setup(path)[1]) for v, path in tokenizers.items()}
    assert keys["v3"] != keys["v13"]
    assert tokenizer_identity(setup(tokenizers["v3"])[1]) == keys["v3"]


@pytest.mark.slow
@pytest.mark.parametrize("extra, says", [
    ({"chat_template": "chatml"}, "chat_template cannot be set with tokenizer_use_mistral_common"),
    ({"special_tokens": {"pad_token": "<pad>"}}, "special_tokens cannot be used with tokenizer_use_mistral_common"),
    ({"datasets": [{"path": "a.jsonl", "type": "alpaca"}]}, "datasets.0.type: alpaca with tokenizer_use_mistral_common"),
])
def test_unsupported_combinations_are_one_line(tmp_path, extra, says):
    raw = {"base_model": "mistralai/Magistral-Small-2507", "tokenizer_use_mistral_common": True, "learning_rate": 2e-5,
           "datasets": [{"path": "org/chats", "type": "chat_template"}], **extra}
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump(raw))
    (tmp_path / "a.jsonl").write_text('{"instruction": "x", "output": "y"}\n')  # a local dataset is there: one problem
    result = run_cli("validate", str(config), "--gpu", "a100", cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.stderr


def test_unset_is_true_for_magistral_as_axolotl_infers_it():
    raw = {"base_model": "mistralai/Magistral-Small-2507", "datasets": [{"path": "org/chats", "type": "chat_template"}]}
    cfg, notes = parse_config(raw)
    assert cfg.tokenizer_use_mistral_common is True and any("read as true for a Magistral" in n for n in notes)
    cfg, notes = parse_config({**raw, "tokenizer_use_mistral_common": False})
    assert cfg.tokenizer_use_mistral_common is False and not any("Magistral" in n for n in notes)
    cfg, _ = parse_config({**raw, "base_model": "mistralai/Mistral-7B-v0.1"})
    assert not cfg.tokenizer_use_mistral_common


def test_tokenizer_config_may_name_the_file(tokenizers):
    cfg, _ = parse_config({"base_model": "org/model", "tokenizer_use_mistral_common": True,
                           "tokenizer_config": str(tokenizers["v13"] / "tekken.json"),
                           "datasets": [{"path": "chat.jsonl", "type": "chat_template"}]})
    assert load_tokenizer(cfg).tokenizer.instruct_tokenizer.tokenizer.version.value == "v13"


def test_missing_package_is_a_config_error(tokenizers, monkeypatch):
    import importlib.util

    from trainer.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mistral_common" else real(name, *a))
    with pytest.raises(ConfigError, match="mistral-common package is not installed"):
        setup(tokenizers["v13"])


@pytest.mark.slow
def test_the_example_validates_with_its_notes(tmp_path):
    result = run_cli("validate", str(EXAMPLE), "--gpu", "a100", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["tokenizer_use_mistral_common"] is True


@pytest.mark.slow
def test_magistral_thinking_example_trains_and_resumes(tiny_mistral, make_config, tmp_path):
    """Axolotl's examples/magistral/think config (QLoRA, 8-bit AdamW, packing), with only the model and data
    swapped for local ones: it trains on the assistant turns (thinking included), resumes exactly, and the
    final adapter carries the mistral-common tokenizer file."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert raw["tokenizer_use_mistral_common"] is True
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"Repeat {i}: the quick brown fox"}]},
                          {"role": "assistant", "content": [{"type": "thinking", "thinking": f"Repeat it {i % 3} times."},
                                                            {"type": "text", "text": "the quick brown fox " * (1 + i % 3)}]}]}
            for i in range(40)]
    data = write_jsonl(tmp_path / "think.jsonl", rows)
    keep = ("tokenizer_use_mistral_common", "load_in_4bit", "adapter", "sample_packing", "lora_r", "lora_alpha",
            "lora_dropout", "lora_target_modules", "optimizer", "lr_scheduler", "learning_rate",
            "gradient_checkpointing", "warmup_ratio")
    common = {k: raw[k] for k in keep}
    common.update(base_model=str(tiny_mistral), datasets=[{**raw["datasets"][0], "path": str(data)}],
                  max_steps=4, save_steps=2, sequence_len=256)
    full, _ = train_then_resume(main, make_config, tmp_path, **common)
    assert (full / "final" / "tekken.json").read_bytes() == (tiny_mistral / "tekken.json").read_bytes()
    import datasets

    prepared = datasets.load_from_disk(str(next((tmp_path / "prepared").glob("*/train"))))
    expected = {tuple(ids): turns for ids, turns in (oracle(tiny_mistral, r["messages"]) for r in rows)}
    assert len(prepared) == 40
    for row in prepared:  # what was trained on: mistral-common's ids, labels on the assistant turns alone
        assert runs(row) == expected[tuple(row["input_ids"])]
