"""Templates and patterns from files run under a budget (issue 33, item 6; issue 44, item 4): a chat template with nested
`range(100000)` loops, rendered by data preparation (with its lock released after), the final save, merge-lora, export
and chat-check (trainer/runtime/templates.py `render`), and adapter_config.json's rank_pattern / alpha_pattern keys (trainer/outputs/merge.py `pattern_key`).
What a user notices: one line naming the file and what to fix instead of a command that never ends; the save still
completes (the eos alone); everything that rendered before renders the same."""

from __future__ import annotations

import copy
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peft.utils.other import get_pattern_key

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.errors import ConfigError
from trainer.model.tiny import build_tokenizer
from trainer.outputs import chat_check, merge
from trainer.runtime import templates

TEMPLATES = Path(chat_check.__file__).resolve().parents[1] / "templates"
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_a_template_that_never_ends_is_one_line_and_the_save_keeps_the_eos(tokenizer, monkeypatch):
    monkeypatch.setattr(templates, "TEMPLATE_SECONDS", 0.3)
    before = signal.getsignal(signal.SIGALRM)
    hostile = copy.deepcopy(tokenizer)  # the fixture is shared: work on a copy
    hostile.chat_template = NESTED
    with pytest.raises(ConfigError, match=r"the chat template did not finish rendering a 2-message conversation in "
                                          r"0\.3 s \(a loop without bound"):
        chat_check.end_of_turn(hostile)
    assert chat_check.stop_ids(hostile) == [hostile.eos_token_id]  # what the final save and merge-lora write
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma", "phi_3", "qwen3", "mistral_v7_tekken"])
def test_bounded_rendering_agrees_with_transformers(tokenizer, name):
    """The oracle: every template this project ships renders the same through the budget as without it."""
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{name}.jinja is not shipped")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": chat_check.MARKER}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=path.read_text())
    assert chat_check.render(tokenizer, messages, tokenize=False, chat_template=path.read_text()) == plain


MODULES = st.builds(lambda i, part: f"base_model.model.model.layers.{i}.{part}", st.integers(0, 80),
                    st.sampled_from(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj",
                                     "mlp.gate_proj"]))
KEYS = st.sampled_from(["q_proj", "k_proj", "self_attn.v_proj", r"layers\.1\d?\.mlp\.down_proj", "layers.0.mlp.gate_proj",
                        r".*\.[0-3]\.self_attn\.q_proj", "down_proj", "(.|.)*X", r"(\w|\w)*X"])


@given(st.lists(KEYS, max_size=4, unique=True), MODULES)
@settings(max_examples=80, deadline=timedelta(seconds=1))
def test_pattern_keys_match_as_peft_does_in_bounded_time(keys, module):
    """Agrees with peft's get_pattern_key wherever Python's re answers quickly; `(.|.)*X`, which re backtracks on
    for ever, answers at once (the deadline)."""
    patterns = {k: 8 for k in keys}
    found = merge.pattern_key(Path("final"), "rank_pattern", patterns, module)
    if not any("X" in k for k in keys):
        assert found == get_pattern_key(patterns.keys(), module)
    else:
        assert found in (*keys, module)


def test_a_pattern_that_is_not_a_regex_or_takes_too_long_names_the_file_and_key(monkeypatch):
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    with pytest.raises(ConfigError, match=r"^merge-lora: final/adapter_config.json: rank_pattern key '\(\[' is not a "
                                          r"regular expression"):
        merge.pattern_key(Path("final"), "rank_pattern", {"([": 4}, module)
    monkeypatch.setattr(merge, "PATTERN_SECONDS", 1e-9)  # a budget the match cannot meet: the refusal it gives
    with pytest.raises(ConfigError, match=r"^merge-lora: final/adapter_config.json: alpha_pattern key '\(\.\|\.\)\*X' "
                                          r"took more than 1e-09 s to match the module name"):
        merge.pattern_key(Path("final"), "alpha_pattern", {"(.|.)*X": 4}, module)


# ------------------------------------------------------------------ data preparation renders under the budget too
ENDLESS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}"
           "{% endfor %}{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
ROWS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4


@pytest.mark.slow
def test_an_endless_template_stops_preprocess_in_one_line_and_releases_the_lock(make_config, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    config = make_config(datasets=[{"path": str(data), "type": "chat_template"}], chat_template="jinja",
                         chat_template_jinja=ENDLESS)
    for _ in range(2):  # the second run is not held by a lock the first left
        out = run_cli("preprocess", str(config), timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and lines[-1].startswith("error: ")
        assert "the chat template did not finish rendering a 2-message conversation in 10 s" in lines[-1]
        assert "chat_template_jinja" in lines[-1]
    assert not list((tmp_path / "prepared").glob("*/*.arrow"))  # nothing half-written kept


def test_a_template_renders_within_its_budget_and_the_budget_is_left_unarmed():
    from trainer.runtime.templates import render

    class Tokenizer:
        name_or_path = "tiny"

        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages)

    assert render(Tokenizer(), ROWS[0]["messages"]) == "hihello"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)
