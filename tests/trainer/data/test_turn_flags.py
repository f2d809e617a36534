"""message_field_training (a message's own flag says whether its turn trains) and split_thinking (the reasoning
in an assistant's <think> tags moved to the template's reasoning key), as Axolotl's chat_template strategy does
them: the trained tokens of generated conversations compared with Axolotl's own strategy (run from the installed
axolotl package in .ci-cache/axolotl-oracle) on the tiny model's tokenizer with Qwen3's template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.trainer.helpers import read_metrics, write_jsonl
from trainer.cli import main
from trainer.config import DatasetConfig
from trainer.data.formats.chat_templates import template_text
from trainer.data.formats.prompts import split_thinking, tokenize_row

ROOT = Path(__file__).resolve().parents[3]
ORACLE = ROOT / ".ci-cache" / "axolotl-oracle"
DS = {"type": "chat_template", "field_messages": "messages", "message_field_training": "train", "split_thinking": True,
      "roles_to_train": ["assistant"], "train_on_eos": "turn"}
AXOLOTL = """
import json, sys
from transformers import AutoTokenizer
from axolotl.prompt_strategies.chat_template import load
from axolotl.utils.dict import DictDefault
tokenizer_dir, template, ds, rows = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(tokenizer_dir)
cfg = DictDefault({"train_on_inputs": False, "sequence_len": 4096, "chat_template": template, "eot_tokens": ["<|im_end|>"]})
strategy = load(tok, cfg, ds_cfg=ds)
print(json.dumps([strategy.tokenize_prompt(r)["labels"] for r in rows]))
"""


def conversations(n: int, most_turns: int) -> list[dict]:
    from hypothesis import HealthCheck, given, settings, strategies as st

    words = st.sampled_from(["alpha", "beta", "gamma", "delta", "yes", "no"])
    text = st.lists(words, min_size=1, max_size=4).map(" ".join)
    thought = st.one_of(st.just(""), text.map(lambda t: f"<think>{t}</think> "),
                        text.map(lambda t: f"<reasoning> {t} </reasoning>\n"))
    flag = st.sampled_from([None, True, False])
    drawn = []

    @settings(max_examples=n, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(turns=st.lists(st.tuples(text, thought, text, flag, flag), min_size=1, max_size=most_turns))
    def draw(turns):
        messages = []
        for user, think, answer, user_flag, answer_flag in turns:
            messages.append({"role": "user", "content": user, **({"train": user_flag} if user_flag is not None else {})})
            messages.append({"role": "assistant", "content": think + answer,
                             **({"train": answer_flag} if answer_flag is not None else {})})
        drawn.append({"messages": messages})

    draw()
    return drawn


# Qwen3's template renders an assistant's reasoning only after the last user turn, so a conversation of several turns
# with reasoning is not rendered turn by turn there: its turns are located by the placeholder diff (22 of the 40).
@pytest.mark.slow  # Axolotl's strategy in a subprocess (its package imports transformers, datasets: ~8 s of CPU)
@pytest.mark.parametrize("template,most_turns", [("qwen3", 1), ("qwen3", 3), ("chatml", 3)])
def test_trained_tokens_are_axolotls_for_generated_conversations(template, most_turns, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = template_text(template)
    rows = conversations(40, most_turns)
    ds = DatasetConfig(path="d.jsonl", **DS)
    ours = [tokenize_row(r, ds, tokenizer, False, eot_tokens=["<|im_end|>"])["labels"] for r in rows]
    out = subprocess.run([sys.executable, "-c", AXOLOTL], input=json.dumps([str(tiny_llama), template, DS, rows]),
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ORACLE)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout)
    differ = [(r, a, b) for r, a, b in zip(rows, ours, theirs) if a != b]
    assert not differ, f"{len(differ)} of {len(rows)} differ; first: {differ[0]}"


DETAIL_DS = {"type": "chat_template", "field_messages": "messages", "message_field_training": "train",
             "message_field_training_detail": "detail", "roles_to_train": ["assistant"], "train_on_eos": "turn"}


def detailed_conversations(n: int) -> list[dict]:
    """Conversations whose messages carry training details at drawn character offsets (cutting words, running past
    the content's end, empty, overlapping), some with a turn flag too, some assistants' content as text parts."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    words = st.sampled_from(["alpha", "beta", "gamma", "delta", "yes", "no", "12", "x-ray", "don't"])
    text = st.lists(words, min_size=1, max_size=6).map(" ".join)
    span = st.tuples(st.integers(0, 40), st.integers(0, 40), st.booleans())
    detail = st.one_of(st.none(), st.just([]), st.lists(span, min_size=1, max_size=3))
    flag = st.sampled_from([None, None, True, False])
    drawn = []

    # content as a list of text parts, each with its own train / weight flag or none (Axolotl's content parts)
    part = st.tuples(text, st.sampled_from(["", " "]), st.sampled_from([{}, {"train": True}, {"train": False},
                                                                          {"weight": 0}, {"weight": 1}]))
    parts = st.one_of(st.none(), st.lists(part, min_size=1, max_size=3).map(
        lambda ps: [{"type": "text", "text": lead + t, **f} for t, lead, f in ps]))

    @settings(max_examples=n, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(turns=st.lists(st.tuples(text, text, detail, detail, flag, parts), min_size=1, max_size=3))
    def draw(turns):
        messages = []
        for user, answer, user_detail, answer_detail, answer_flag, answer_parts in turns:
            for role, content, spans, own in (("user", user, user_detail, None),
                                              ("assistant", answer_parts or answer, answer_detail, answer_flag)):
                message = {"role": role, "content": content}
                if spans is not None:
                    message["detail"] = [{"begin_offset": min(a, b), "end_offset": max(a, b), "train": t}
                                         for a, b, t in spans]
                if own is not None:
                    message["train"] = own
                messages.append(message)
        drawn.append({"messages": messages})

    draw()
    return drawn


@pytest.mark.slow  # Axolotl's strategy in a subprocess
def test_training_details_train_axolotls_tokens_for_generated_conversations(tiny_llama):
    """message_field_training_detail, and content given as parts with their own train/weight flags: the trained
    tokens of 80 generated conversations are Axolotl's own."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = template_text("chatml")
    rows = detailed_conversations(80)
    ds = DatasetConfig(path="d.jsonl", **DETAIL_DS)
    ours = [tokenize_row(r, ds, tokenizer, False, eot_tokens=["<|im_end|>"])["labels"] for r in rows]
    out = subprocess.run([sys.executable, "-c", AXOLOTL], input=json.dumps([str(tiny_llama), "chatml", DETAIL_DS, rows]),
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ORACLE)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout)
    assert sum(label != -100 for labels in ours for label in labels) > 0
    differ = [(r, a, b) for r, a, b in zip(rows, ours, theirs) if a != b]
    assert not differ, f"{len(differ)} of {len(rows)} differ; first: {differ[0]}"


def test_split_thinking_takes_the_first_pair_and_a_solution_block():
    assert split_thinking("<think> a b </think>\n  answer", "reasoning_content") == {
        "reasoning_content": "a b", "content": "answer"}
    assert split_thinking("<|begin_of_thought|>x<|end_of_thought|><|begin_of_solution|> y <|end_of_solution|>", "r") == {
        "r": "x", "content": "y"}
    assert split_thinking("no tags", "r") == {}


def test_a_flagged_turn_trains_and_an_unflagged_one_does_not_through_the_trainer(make_config, tmp_path):
    """message_field_training, split_thinking and message_field_training_detail through `train`."""
    rows = [{"messages": [{"role": "user", "content": f"say {i}", "train": i % 2 == 0},
                          {"role": "assistant", "content": f"<think>count</think> {i} and {i + 1}", "train": i % 3 != 0,
                           **({"detail": [{"begin_offset": 0, "end_offset": 1, "train": True}]} if i % 4 else {})}]}
            for i in range(12)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = make_config(datasets=[{"path": str(data), "message_field_training_detail": "detail",
                                    **{k: v for k, v in DS.items() if k != "train_on_eos"}}],
                         chat_template="qwen3", max_steps=2)
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]


def test_a_malformed_training_detail_is_one_line_naming_the_key(tiny_llama):
    from trainer.errors import DataError

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = template_text("chatml")
    ds = DatasetConfig(path="d.jsonl", **DETAIL_DS)
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "detail": "0-2"}]}
    with pytest.raises(DataError, match=r"dataset d.jsonl: a message's 'detail' must be a list of \{begin_offset"):
        tokenize_row(row, ds, tokenizer, False)
