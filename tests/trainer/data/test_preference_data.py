"""Preference datasets: Axolotl's types rendered and masked, KTO's labels and mismatched pairs, length
filtering with counts, the cache, and the rl: keys of the config."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import trainer.objectives.preference_data as data_mod
from tests.trainer.pref_helpers import kto_rows, pair_rows, write_jsonl
from trainer.batch.labels import IGNORE
from trainer.config import DatasetConfig, load_config, parse_config
from trainer.data.formats.preference_prompts import render, tokenize
from trainer.data.prepare import load_tokenizer
from trainer.errors import ConfigError, DataError
from trainer.objectives import prepare


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def trained(tokenizer, seq) -> str:
    return tokenizer.decode([t for t, l in zip(seq["input_ids"], seq["labels"]) if l != IGNORE])


def pair(row, type_, tokenizer, **ds):
    prompt, completions, special = render(row, DatasetConfig(path="x.jsonl", type=type_, **ds), tokenizer, kto=False)
    return prompt, [tokenize(prompt, c, tokenizer, special) for c in completions]


def test_chat_template_default_masks_the_prompt_and_trains_on_each_answer(tokenizer):
    row = {"conversation": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Capital of France?"}],
           "good": {"from": "gpt", "value": "Paris."}, "bad": [{"from": "gpt", "value": "Rome."}]}
    prompt, (chosen, rejected) = pair(row, "chat_template.default", tokenizer, field_messages="conversation",
                                      field_chosen="good", field_rejected="bad",
                                      message_property_mappings={"role": "from", "content": "value"},
                                      roles={"user": ["human"], "assistant": ["gpt"]})
    assert prompt.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert trained(tokenizer, chosen) == "Paris.<|im_end|>" and trained(tokenizer, rejected) == "Rome.<|im_end|>"
    n = chosen["prompt_len"]
    assert chosen["input_ids"][:n] == rejected["input_ids"][:n] and set(chosen["labels"][:n]) == {IGNORE}


@pytest.mark.parametrize("type_,row,user,answers", [
    ("chatml.intel", {"system": "S", "question": "Q?", "chosen": "yes", "rejected": "no"}, "Q?", ("yes", "no")),
    ("chatml.argilla", {"instruction": "Q?", "chosen_response": "yes", "rejected_response": "no"}, "Q?", ("yes", "no")),
    ("chatml.icr", {"input": "Q?", "chosen": "yes", "rejected": "no"}, "Q?", ("yes", "no")),
    ("chatml.prompt_pairs", {"prompt": "Q?", "chosen": "yes", "rejected": "no"}, "Q?", ("yes", "no")),
    ("chatml", {"question": "Q?", "chosen_response": "yes", "rejected": "no"}, "Q?", ("yes", "no")),
    ("chatml.ultra", {"prompt": "Q?", "chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "yes"}],
                      "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "no"}]}, "Q?", ("yes", "no")),
    ("chatml.argilla_chat", {"chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "yes"}],
                             "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "no"}]}, "Q?", ("yes", "no")),
])
def test_chatml_types_write_the_template_and_mask_the_prompt(tokenizer, type_, row, user, answers):
    prompt, seqs = pair(row, type_, tokenizer)
    assert f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert ("<|im_start|>system\nS<|im_end|>\n" in prompt) == ("system" in row)
    assert [trained(tokenizer, s) for s in seqs] == [f"{a}<|im_end|>" for a in answers]
    llama = pair(row, type_.replace("chatml", "llama3"), tokenizer)
    assert llama[0].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert [trained(tokenizer, s) for s in llama[1]] == [f"{a}<|eot_id|>" for a in answers]


def test_chat_template_argilla_takes_the_prompt_from_the_chosen_conversation(tokenizer):
    row = {"system": "Be kind.",
           "chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello!"}],
           "rejected": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Go away."}]}
    prompt, (chosen, rejected) = pair(row, "chat_template.argilla", tokenizer)
    assert prompt == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert trained(tokenizer, chosen) == "Hello!<|im_end|>" and trained(tokenizer, rejected) == "Go away.<|im_end|>"


def test_missing_field_is_one_clear_error(tokenizer):
    with pytest.raises(DataError, match=r"a row has no 'question' field \(type chatml.intel\)"):
        pair({"prompt": "Q?", "chosen": "a", "rejected": "b"}, "chatml.intel", tokenizer)


def config(tmp_path, tiny_llama, rows_file, rl="dpo", type_="chat_template.default", **extra):
    import yaml

    cfg = {"base_model": str(tiny_llama), "learning_rate": 2e-5, "rl": rl, "datasets": [{"path": str(rows_file), "type": type_}],
           "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"), "sequence_len": 64,
           **extra}
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)[0]


def test_pairs_are_filtered_by_length_with_counts_and_cached(tmp_path, tiny_llama, monkeypatch):
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(30, long_every=5))  # 6 rows with a 40-word answer
    cfg = config(tmp_path, tiny_llama, data)
    prepared = prepare(cfg, load_tokenizer(cfg))
    stats = prepared.stats
    assert stats["rows"] == 30 and stats["too_long"] == stats["dropped_too_long"] == 6 and stats["train_rows"] == 24
    row = prepared.train[0]
    assert row["length"] == len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])
    assert max(max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in prepared.train) <= 64

    monkeypatch.setattr(data_mod, "build_preference", lambda *a: pytest.fail("the cache was not reused"))
    assert prepare(cfg, load_tokenizer(cfg)).path == prepared.path
    monkeypatch.undo()
    truncated = prepare(config(tmp_path, tiny_llama, data, excess_length_strategy="truncate"), load_tokenizer(cfg))
    assert truncated.stats["truncated"] == 6 and truncated.stats["train_rows"] == 30 and truncated.path != prepared.path


def test_kto_rows_keep_their_label_and_get_a_mismatched_completion(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "kto.jsonl", kto_rows(12))
    cfg = config(tmp_path, tiny_llama, data, rl="kto", type_="chatml.prompt_pairs", shuffle_merged_datasets=False)
    tokenizer = load_tokenizer(cfg)
    train = prepare(cfg, tokenizer).train
    assert train["label"] == [i % 3 != 0 for i in range(12)]
    for i in range(12):
        this, previous = train[i], train[i - 1]
        p = this["input_ids"].index(next(t for t, l in zip(this["input_ids"], this["labels"]) if l != IGNORE))
        assert this["kl_input_ids"][:p] == this["input_ids"][:p]  # its own prompt ...
        assert trained(tokenizer, {"input_ids": this["kl_input_ids"], "labels": this["kl_labels"]}) == \
            trained(tokenizer, previous)  # ... with the previous example's completion


def test_kto_needs_a_boolean_label(tmp_path, tiny_llama):
    rows = kto_rows(4)
    rows[2]["label"] = "yes"
    cfg = config(tmp_path, tiny_llama, write_jsonl(tmp_path / "kto.jsonl", rows), rl="kto", type_="chatml.prompt_pairs")
    with pytest.raises(DataError, match="KTO's 'label' must be true"):
        prepare(cfg, load_tokenizer(cfg))


BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "chat_template.default"}]}


def test_rl_keys_with_axolotls_names_validate():
    cfg, _ = parse_config({**BASE, "rl": "dpo", "rl_beta": 0.2, "dpo_label_smoothing": 0.1, "remove_unused_columns": False})
    assert cfg.objective == "dpo" and cfg.beta == 0.2 and cfg.dpo_label_smoothing == 0.1
    assert parse_config({**BASE, "rl": "dpo", "dpo_loss_type": ["ipo"]})[0].objective == "ipo"
    assert parse_config({**BASE, "rl": "ipo"})[0].objective == "ipo"
    orpo, _ = parse_config({**BASE, "rl": "orpo", "orpo_alpha": 0.05})
    assert orpo.beta == 0.05
    assert parse_config({**BASE, "rl": "orpo", "orpo_alpha": 0.05, "rl_beta": 0.2})[0].beta == 0.2  # Axolotl's order
    simpo, _ = parse_config({**BASE, "rl": "simpo", "rl_beta": 2.0, "simpo_gamma": 0.8, "cpo_alpha": 0.0})
    assert (simpo.beta, simpo.simpo_gamma, simpo.cpo_alpha) == (2.0, 0.8, 0.0)
    kto, _ = parse_config({"base_model": "m/m", "rl": "kto", "rl_beta": 0.5, "kto_desirable_weight": 0.2,
                           "remove_unused_columns": False, "datasets": [{"path": "o/d", "type": "llama3.ultra", "split": "train"}]})
    assert (kto.beta, kto.kto_desirable_weight, kto.kto_undesirable_weight) == (0.5, 0.2, 1.0)


@pytest.mark.parametrize("raw,message", [
    ({**BASE, "rl": "grpo"}, "rl: grpo needs trl.reward_funcs"),
    ({**BASE, "datasets": [{"path": "org/data", "type": "chatml.intel"}]}, "a preference type: set rl"),
    ({**BASE, "rl": "dpo", "datasets": [{"path": "o/d", "type": "chatml.intell"}]}, "not a preference pair dataset type"),
    ({**BASE, "rl": "kto"}, "not a KTO dataset type"),
    ({**BASE, "rl": "orpo", "dpo_loss_type": ["ipo"]}, "dpo_loss_type / dpo_loss_weights: only with rl: dpo"),
    ({**BASE, "rl": "dpo", "precompute_ref_log_probs": False}, "always computed once before training"),
    ({**BASE, "rl": "dpo", "trl": {"beta": 0.1}}, "trl: configures rl: grpo, gdpo or ebft, not rl: dpo"),
])
def test_bad_preference_configs_are_one_clear_error(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(raw)


def test_preprocessing_workers_are_bounded_as_for_sft():
    from trainer.data.prepare import workers_for

    cfg, _ = parse_config({**BASE, "rl": "kto", "datasets": [{"path": "o/d", "type": "chatml.intel"}], "dataset_processes": 96})
    assert workers_for(cfg, 500) == 1 and workers_for(cfg, 10_000) == 10 and workers_for(cfg, 10**7) == 96
    cfg, _ = parse_config({**BASE, "rl": "dpo"})
    assert workers_for(cfg, 10**7) <= 8


QLORA_KEYS = ("load_in_4bit", "adapter: got 'qlora'", "optimizer: got 'adamw_bnb_8bit'")


@pytest.mark.parametrize("method", ["dpo", "orpo", "kto"])
def test_preference_examples_validate(method, capsys):
    import yaml

    from tests.trainer.helpers import REPO
    from trainer.cli import main

    assert main(["validate", str(REPO / f"examples/preference/{method}-a100.yml"), "--gpu", "a100"]) == 0
    assert f"objective:  {method} (beta 0.1; " in capsys.readouterr().out
    t4 = REPO / f"examples/preference/{method}-t4.yml"
    code = main(["validate", str(t4), "--gpu", "t4"])
    err = capsys.readouterr().err
    # QLoRA lands with a parallel change: until then the T4 examples fail on its keys and nothing else
    problems = err.count(": got ") + err.count("does not support") + err.count("unknown key")
    assert code == 0 or (code == 2 and all(k in err for k in QLORA_KEYS) and problems == len(QLORA_KEYS)), err
    raw = yaml.safe_load(t4.read_text())
    raw.pop("load_in_4bit")
    cfg, _ = parse_config({**raw, "adapter": "lora", "optimizer": "adamw_torch"})
    assert cfg.rl == method


@pytest.mark.parametrize("sharding", [
    {"deepspeed": "deepspeed_configs/zero3.json"},
    {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}},
])
def test_preference_with_weights_sharded_per_forward_validates(tmp_path, capsys, sharding):
    """FSDP and ZeRO-3 run the reference pass in lock-step (tests/trainer/parallel/test_preference_sharded.py trains them)."""
    import yaml

    from trainer.cli import main

    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({**BASE, "learning_rate": 2e-5, "rl": "dpo", **sharding}))
    assert main(["validate", str(config), "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    assert "objective:  dpo (beta 0.1; reference log-probs computed once" in out and "sharding:" in out


def test_rl_adapter_ref_model_is_named_as_ignored_as_axolotls_schema_drops_it():
    """Axolotl 0.19's validate_config keeps only its schema's keys, and none declares rl_adapter_ref_model: its
    train.py reads it as unset, the reference being the policy with the adapter disabled, as here."""
    cfg, notes = parse_config({**BASE, "rl": "dpo", "adapter": "lora", "rl_adapter_ref_model": True})
    assert cfg.objective == "dpo"
    assert any("ignored: rl_adapter_ref_model" in n and "adapter disabled" in n for n in notes), notes
