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


def test_hostile_or_wrong_kept_answers_are_damage_never_a_decision_and_training_asks_transformers(
        models, tmp_path, monkeypatch):
    """The cache is outside envtool's control (issue 44 item 2): a FIFO or a link to /dev/zero in its place is not read
    (no wait, no endless read), an oversized or 200,000-deep file and wrong types are damage (asked again), and a
    training run never takes the kept answer: a planted `_supports_sdpa: false` (or a Gemma 2 entry without its
    soft-capping) would train with another attention."""
    import os

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = fitted(models["gpt-oss"], "a100", "flash_attention_2", None)
    kept = next(facts_dir().glob("*.json"))
    good = json.loads(kept.read_text())
    wrong_types = [{**good, "class": {**good["class"], "_supports_sdpa": "no"}},
                   {**good, "config": {**good["config"], "attention_dropout": {"py/function": "os.system"}}},
                   {**good, "class": {**good["class"], "_compatible_flash_implementations": [1, 2]}}]
    for damage in ([json.dumps(w) for w in wrong_types] + ["[" * 200_000 + "]" * 200_000,
                                                              json.dumps(good) + " " * (answers.MAX_BYTES + 1)]):
        kept.write_text(damage)
        assert fitted(models["gpt-oss"], "a100", "flash_attention_2", None) == expected
    kept.unlink()
    for hostile in ("fifo", "zero"):
        os.mkfifo(kept) if hostile == "fifo" else kept.symlink_to("/dev/zero")
        key = kept.stem
        assert answers.read(KIND, key) is None  # at once: a FIFO with no writer would block a plain open()
        kept.unlink()
    # planted: a class without sdpa. A planner may take the kept answer (validate, the dry run); training never does
    cfg, _ = parse_config({"base_model": models["llama"], "datasets": [{"path": "d.jsonl", "type": "completion"}]})
    attention._model_class(cfg, local_only=True)
    planted = next(p for p in facts_dir().glob("*.json")
                   if json.loads(p.read_text())["class"]["__name__"] == "LlamaForCausalLM")
    answer = json.loads(planted.read_text())
    answer["class"]["_supports_sdpa"] = False
    planted.write_text(json.dumps(answer))
    assert attention._model_class(cfg, local_only=True)[1]._supports_sdpa is False  # the planners' shortcut
    assert attention._model_class(cfg, local_only=False)[1]._supports_sdpa is True  # transformers' own class


def test_model_config_overrides_count_in_the_attention_checks(models):
    """An override the model trains with (Axolotl's model_config) is read by the rules as the model's own value:
    attention_dropout 0.1 as an override rules out varlen_attn, which does no dropout."""
    base = {"base_model": models["llama"], "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    plain, _ = parse_config(base)
    dropped, _ = parse_config({**base, "model_config_overrides": {"attention_dropout": 0.1}})
    assert attention.model_varlen_limit(plain, "2.13.0") is None
    assert attention.model_varlen_limit(dropped, "2.13.0")[0] == "dropout"
