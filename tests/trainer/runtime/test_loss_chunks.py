"""The chunked loss's two facts (trainer/runtime/loss_chunks.py), against their sources: the chunk size keeps one
chunk's logits within its budget, and every model in the installed transformers that changes its logits after the
head names that change in a config field the pattern finds (so the estimate and the trainer keep the full logits for
it before the trainer's probe has to)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from trainer.runtime import loss_chunks

# a line of a causal LM's forward, after `logits = self.lm_head(...)`, that changes the logits (a scale, a soft-cap,
# a slice of the vocabulary); casts, moves and `logits=logits` keyword arguments do not
CHANGE = re.compile(r"^\s*(logits\s*(\*=|/=)|logits\s*=\s*(?!logits\s*$)(?!logits\.(float|to|contiguous)\(\S*\)\s*$)"
                    r"(?=.*(logits\s*[*/]|tanh|softcap|logits\[)).*)")
MODELS = Path(transformers.__file__).parent / "models"


def changes_after_head() -> dict[str, list[str]]:
    """model folder -> the lines that change the logits after the head, read from transformers' own modeling code."""
    found = {}
    for path in sorted(MODELS.glob("*/modeling_*.py")):
        for match in re.finditer(r"logits = self\.lm_head\(.*\n((?:.*\n){0,8})", path.read_text()):
            lines = [line.strip() for line in match.group(1).splitlines() if CHANGE.match(line)]
            if lines:
                found.setdefault(path.parent.name, lines)
    return found


def config_fields(model: str) -> dict:
    """The union of the default fields of the model's config classes (nested configs as dicts)."""
    module = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    fields: dict = {}
    for cls in vars(module).values():
        if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig) and cls.__module__ == module.__name__:
            try:
                fields.update(cls().to_dict())
            except Exception:  # noqa: BLE001 - a config that needs arguments: its declared fields
                fields.update(dict.fromkeys(getattr(cls, "__annotations__", {}), 2.0))
    return fields


def named(fields: dict) -> bool:
    return any((isinstance(v, dict) and named(v)) or loss_chunks.AFTER_HEAD.match(str(k)) for k, v in fields.items())


# changes made without a config value: the trainer's probe (the head's output against the model's logits) finds them
PROBE_ONLY = {"prophetnet": "slices its n-gram stream's logits, an encoder-decoder's; shapes then differ in the probe"}


def test_every_model_that_changes_its_logits_after_the_head_names_it_in_its_config():
    changed = changes_after_head()
    assert {"gemma2", "cohere", "granite"} <= set(changed), sorted(changed)  # the scan reads the code it should
    missing = {}
    for model, lines in changed.items():
        try:
            fields = config_fields(model)
        except ImportError:
            continue  # a model folder without its own configuration module (shares another's)
        # the value read for the change (from the model's own config, or a sub-config's as PaliGemma's text_config)
        in_line = any(loss_chunks.AFTER_HEAD.match(word) for line in lines for word in re.findall(r"\w+", line))
        if not (named(fields) or in_line or model in PROBE_ONLY):
            missing[model] = lines[0]
    assert not missing, f"config fields the pattern misses (the trainer's probe is then the only guard): {missing}"


def test_a_no_op_value_is_not_a_change_and_nested_configs_are_read():
    assert loss_chunks.after_head({"logits_scaling": 1.0, "final_logit_softcapping": None}) == ""
    assert loss_chunks.after_head({"attn_logit_softcapping": 50.0}) == ""  # attention's, not the head's
    assert loss_chunks.after_head({"text_config": {"final_logit_softcapping": 30.0}}) == \
        "text_config.final_logit_softcapping: 30.0"


@given(tokens=st.integers(1, 10**6), vocab=st.integers(2, 10**6), budget=st.sampled_from([4096, 2**20, 256 * 2**20]))
def test_a_chunk_keeps_its_fp32_logits_within_the_budget(tokens, vocab, budget):
    size = loss_chunks.chunk_tokens(tokens, vocab, budget)
    assert 1 <= size <= tokens
    assert size * vocab * 4 <= budget or size <= 16
    assert size & (size - 1) == 0 or size == tokens  # a power of two, or the whole batch


@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 262144])
def test_the_chunk_at_real_vocabularies(vocab):
    size = loss_chunks.chunk_tokens(4 * 4096, vocab)
    assert size * vocab * 4 <= loss_chunks.CHUNK_LOGITS_BYTES < 2 * size * vocab * 4 + 16 * vocab * 4
