"""The model facts kept on disk (trainer/model/attention.py `_model_class`): a validate, dry run or fit of a model
read before answers from what was kept, without importing transformers' model code. The oracle is the first
answer, computed by transformers itself: the kept answer must fit the attention the same way on every GPU, for
models whose classes differ in what the rules read (no sdpa path, attention sinks, soft-capping, sliding windows,
attention dropout). And the rules may read nothing of the config or the class that the kept answer does not hold."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from trainer.config import parse_config
from trainer.model import attention
from trainer.model.attention import KIND, MODEL_FACTS, for_model
from trainer.runtime import kept as answers
from trainer.runtime.hardware import gpu_from_name, gpu_from_plan
from trainer.setup import fit
from tests.trainer.runtime.test_hardware import plan_for

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
MODELS = {  # what the rules read, one model each way it can differ
    "llama": ("llama", {}),
    "gemma2": ("gemma2", {"attn_logit_softcapping": 50.0}),  # soft-capped logits: no varlen
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
    "mistral-dropout": ("mistral", {"attention_dropout": 0.1}),
    "gpt-oss": ("gpt_oss", {"num_local_experts": 2, "num_experts_per_tok": 1}),  # no sdpa path; sinks
}
for _kind, _ in MODELS.values():  # the model classes imported once, at collection, not in a test's time
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(_kind))]
RUNS = [("cpu", "sdpa", None), ("t4", "sdpa", None), ("a100", "flash_attention_2", None),
        ("h100", "flash_attention_2", None), ("a100", "flex_attention", None),
        ("a100", "sdpa", plan_for("A100", "8.0", "sdpa", "bf16") | {"packing": "varlen"})]


def facts_dir():
    return answers.directory(KIND)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, (kind, extra) in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        AutoConfig.for_model(kind, **SMALL, **extra).save_pretrained(path)
        out[name] = str(path)
    return out


def fitted(model: str, gpu: str, choice: str, plan: dict | None):
    cfg, _ = parse_config({"base_model": model, "attn_implementation": choice,
                           "datasets": [{"path": "d.jsonl", "type": "completion"}]})
    runtime = fit(cfg, gpu_from_plan(plan, "plan") if plan else gpu_from_name(gpu), plan, model_class=False)
    notes = for_model(cfg, runtime, local_only=True)
    return runtime.attention, runtime.isolation, notes


def test_the_kept_answer_fits_the_attention_as_transformers_own_classes_do(models, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asked = []  # each time transformers itself was asked (the kept answer is written then)
    real = attention._keep_facts
    monkeypatch.setattr(attention, "_keep_facts", lambda *args: (asked.append(args[0]), real(*args)))
    for name, model in models.items():
        asked.clear()
        for gpu, choice, plan in RUNS:
            first = fitted(model, gpu, choice, plan)
            assert fitted(model, gpu, choice, plan) == first, (name, gpu, choice)
        assert len(asked) == 1, name  # asked once; every other answer was the kept one
    assert len(list(facts_dir().glob("*.json"))) == len(MODELS)  # one kept answer per model, read from then on
    # the models differ where the rules look: each answer is not the same everywhere
    answers = {name: [fitted(model, gpu, choice, plan)[0] for gpu, choice, plan in RUNS] for name, model in models.items()}
    assert len({tuple(a) for a in answers.values()}) >= 3, answers


class Recording:
    """A model config or class that records each attribute the rules read of it."""

    def __init__(self, real, seen: set):
        self._real, self._seen = real, seen

    def __getattr__(self, name):
        self._seen.add(name)
        return getattr(self._real, name)


def test_the_rules_read_nothing_the_kept_answer_does_not_hold(models, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seen = {"config": set(), "class": set()}
    computed = attention._model_class

    def recorded(cfg, local_only):
        found = computed(cfg, local_only)
        return None if found is None else (Recording(found[0], seen["config"]), Recording(found[1], seen["class"]))

    monkeypatch.setattr(attention, "_model_class", recorded)
    for model in models.values():
        for gpu, choice, plan in RUNS:
            fitted(model, gpu, choice, plan)
    assert seen["class"] <= set(MODEL_FACTS["class"]), seen["class"] - set(MODEL_FACTS["class"])
    assert seen["config"] <= set(MODEL_FACTS["config"]), seen["config"] - set(MODEL_FACTS["config"])
    assert "_supports_sdpa" in seen["class"] and "attn_logit_softcapping" in seen["config"]  # it did record


def test_a_damaged_or_older_answer_is_asked_again_and_remote_code_is_never_kept(models, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = fitted(models["gpt-oss"], "a100", "flash_attention_2", None)
    kept = next(facts_dir().glob("*.json"))
    for damage in ("{not json", json.dumps({"config": {}, "class": {"__name__": "X"}}), ""):
        kept.write_text(damage)
        assert fitted(models["gpt-oss"], "a100", "flash_attention_2", None) == expected
        assert json.loads(kept.read_text())["class"]["__name__"] == "GptOssForCausalLM"  # written again, whole
    monkeypatch.setattr(attention, "FACTS_FORMAT", attention.FACTS_FORMAT + 1)
    assert fitted(models["gpt-oss"], "a100", "flash_attention_2", None) == expected
    assert len(list(facts_dir().glob("*.json"))) == 2 and not list(facts_dir().glob("*.tmp"))
    cfg, _ = parse_config({"base_model": models["llama"], "trust_remote_code": True,
                           "datasets": [{"path": "d.jsonl", "type": "completion"}]})
    assert attention._model_class(cfg, local_only=True) is not None
    assert len(list(facts_dir().glob("*.json"))) == 2
