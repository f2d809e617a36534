"""Retired and renamed Axolotl forms (trainer/config/migrate.py): each read as its present form, with a note; a
rewrite never overrides a key the config also sets; every `migrated` row of matrices/axolotl_keys.toml has one."""

from __future__ import annotations

import pytest
from tests.support import oracle

from trainer.config import DatasetConfig, parse_config
from trainer.config import keys
from trainer.config.migrate import migration
from trainer.config.schema import Config
from trainer.errors import ConfigError

BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}


def test_every_migrated_key_of_the_table_has_its_rewrite():
    config_fields = set(Config.model_fields) | {"model_config"}
    for name, row in keys.rows().items():
        if row.get("decision") != "migrated":
            continue
        fields = set(DatasetConfig.model_fields) if name.startswith("datasets[].") else config_fields
        assert migration(name, fields) is not None, f"{name} -> {row.get('to')}: no rewrite"


def test_sharegpt_is_read_as_chat_template_with_its_conversation():
    cfg, notes = parse_config({**BASE, "datasets": [{"path": "org/chats", "type": "sharegpt", "conversation": "llama-3",
                                                     "field_human": "human"}]})
    ds = cfg.datasets[0]
    assert (ds.type, ds.field_messages, ds.role_key, ds.content_key, ds.chat_template) == (
        "chat_template", "conversations", "from", "value", "llama3")
    assert any("type: sharegpt (Axolotl's conversation format until 0.5) is read as type: chat_template" in n
               for n in notes)
    with pytest.raises(ConfigError, match="FastChat's 'vicuna_v0' conversation template has no chat template here"):
        parse_config({**BASE, "datasets": [{"path": "x", "type": "sharegpt", "conversation": "vicuna_v0"}]})


def test_renamed_keys_and_old_paths():
    cfg, notes = parse_config({**BASE, "sequence_parallel_degree": 2, "deepspeed": "deepspeed/zero2.json",
                               "base_model_config": "org/other"})
    assert cfg.context_parallel_size == 2
    assert cfg.deepspeed == "deepspeed_configs/zero2.json"
    assert cfg.tokenizer_config == "org/other"
    text = " ".join(notes)
    assert "sequence_parallel_degree: 2 read as context_parallel_size: 2" in text
    assert "Axolotl's folder before it was renamed deepspeed_configs/" in text


def test_a_rewrite_never_overrides_a_key_the_config_sets():
    with pytest.raises(ConfigError, match="sequence_parallel_degree conflicts with context_parallel_size"):
        parse_config({**BASE, "sequence_parallel_degree": 2, "context_parallel_size": 4})


@pytest.mark.parametrize("given,expected", [
    ({"gc_steps": 5}, (5, 5)),  # Axolotl's migrate_gc_steps: both
    ({"gc_steps": -1}, (None, -1)),  # > 0 only for the cache
    ({"gc_steps": 5, "torch_empty_cache_steps": 3}, (3, 5)),  # its trainer builder: gc_collect_steps or gc_steps
    ({"gc_steps": 5, "gc_collect_steps": 2}, (None, 2)),  # given: gc_steps ignored
])
def test_retired_gc_steps_is_read_as_axolotl_reads_it(given, expected):
    cfg, notes = parse_config({**BASE, **given})
    assert (cfg.torch_empty_cache_steps, cfg.gc_collect_steps) == expected
    assert any(n.startswith("gc_steps: ") for n in notes)


@pytest.mark.parametrize("value", ["abc", -5, 1.5, True])
def test_a_bad_gc_steps_is_named_as_written(value):
    with pytest.raises(ConfigError, match=r"gc_steps: .*: a whole number of steps, at least -1"):
        parse_config({**BASE, "gc_steps": value})


def test_a_falsy_value_axolotl_reads_as_its_default_is_read_so_here():
    """`eval_max_new_tokens: 0` (users' configs next to eval_table_size: 0) is 128 in Axolotl (normalize_config:
    `cfg.eval_max_new_tokens or 128`), not a refusal; every key of FALSY_AS_DEFAULT is read the same way, a value
    that is not falsy stays as written."""
    from trainer.config.migrate import FALSY_AS_DEFAULT

    cfg, notes = parse_config({**BASE, "eval_max_new_tokens": 0, "eval_table_size": 0})
    assert cfg.eval_max_new_tokens == 128
    assert any(n.startswith("eval_max_new_tokens: 0 read as 128, as Axolotl reads it") for n in notes)
    assert not any(n.startswith("eval_table_size:") for n in notes)  # 0 is its default: nothing to say
    assert parse_config({**BASE, "eval_max_new_tokens": 7})[0].eval_max_new_tokens == 7
    for key, default in FALSY_AS_DEFAULT.items():
        for falsy in (0, ""):
            _, notes = parse_config({**BASE, key: falsy})
            assert (falsy == default) or any(n.startswith(f"{key}: {falsy!r} read as {default!r}") for n in notes)


def test_falsy_as_default_is_every_such_rewrite_of_axolotls_normalize_config():
    """The table is Axolotl's own list: every `cfg.KEY = cfg.KEY or VALUE` line of its normalize_config (read from the
    axolotl wheel .ci/setup installs for the oracle test)."""
    import ast
    import re
    from pathlib import Path

    from trainer.config.migrate import FALSY_AS_DEFAULT

    source = Path(__file__).resolve().parents[3] / ".ci-cache/axolotl-oracle/axolotl/utils/config/__init__.py"
    oracle.require(source, source.parent)
    found, derived = {}, set()
    for m in re.finditer(r"^\s*cfg\.(\w+) = cfg\.\1 or (.+?)\s*$", source.read_text(), re.M):
        try:
            found[m.group(1)] = ast.literal_eval(m.group(2))
        except SyntaxError:  # a default spread over lines: derived, read by the key's own code here
            derived.add(m.group(1))
    assert found == FALSY_AS_DEFAULT
    # gradient_accumulation_steps from batch_size (migrate's batch_size rewrite); eval_causal_lm_metrics' list
    # (Config's own `or` of the same four metrics)
    assert derived == {"gradient_accumulation_steps", "eval_causal_lm_metrics"}


def _zero_configs():
    """One config per key of ZERO_AS_AXOLOTL, drawn from the table itself: the key at 0 (int), and at 0.0 where the
    field takes floats; each with what Axolotl trains: the value the table names, or the key's own default here."""
    from trainer.config.migrate import ZERO_AS_AXOLOTL

    for key, (value, where) in ZERO_AS_AXOLOTL.items():
        field = Config.model_fields[key]
        meant = field.default if value is None else value
        zeros = (0, 0.0, False) if "float" in str(field.annotation) else (0, False)  # (pydantic reads false as 0)
        for zero in zeros:
            yield pytest.param(key, zero, meant, where, id=f"{key}={zero!r}")


@pytest.mark.parametrize("key, zero, meant, where", list(_zero_configs()))
def test_a_zero_axolotl_reads_as_unset_validates_with_axolotls_meaning(tmp_path, key, zero, meant, where):
    """`KEY: 0` where Axolotl's builders read 0 as unset (issue 42): `validate` (trainer.setup.start, for an H100)
    accepts it, the effective config holds what Axolotl trains with, and a note says so naming Axolotl's source."""
    import yaml

    from trainer.setup import start

    path = tmp_path / "zero.yml"
    raw = {**BASE, "base_model": "NousResearch/Llama-3.2-1B", "sequence_len": 512, "micro_batch_size": 1,
           "learning_rate": 2e-4, key: zero}
    path.write_text(yaml.safe_dump(raw))
    cfg, notes, _ = start(path, "h100")
    assert getattr(cfg, key) == meant
    if key.startswith("lisa_"):  # a 0 of either LISA key turns LISA off
        assert cfg.lisa_n_layers is None and cfg.lisa_step_interval is None
    assert any(n.startswith(f"{key}: {zero!r} ") and where in n for n in notes), notes


def test_a_zero_of_one_lisa_key_turns_lisa_off_with_the_other_given():
    """Axolotl trains LISA only `if lisa_step_interval and lisa_n_layers`: a 0 of one, the other set, is LISA off."""
    cfg, notes = parse_config({**BASE, "lisa_n_layers": 0, "lisa_step_interval": 5})
    assert cfg.lisa_n_layers is None and cfg.lisa_step_interval is None
    assert any(n.startswith("lisa_step_interval: 5 not read: LISA is off") for n in notes)


def test_a_zero_warmup_ratio_beside_warmup_steps_is_not_read_and_a_zero_warmup_steps_beside_a_ratio_is_refused():
    cfg, notes = parse_config({**BASE, "warmup_steps": 10, "warmup_ratio": 0})
    assert cfg.warmup_steps == 10 and cfg.warmup_ratio is None
    with pytest.raises(ConfigError, match=r"warmup_steps: 0 beside warmup_ratio: 0.1: set one"):
        parse_config({**BASE, "warmup_steps": 0, "warmup_ratio": 0.1})


def test_a_warmup_ratio_of_1_warms_up_the_whole_run_as_in_axolotl():
    """Axolotl takes warmup_ratio: 1 (warmup_steps = the run's steps); with one_cycle torch's OneCycleLR divides by
    zero (Axolotl's too): refused in one line."""
    assert parse_config({**BASE, "warmup_ratio": 1.0})[0].warmup_ratio == 1.0
    with pytest.raises(ConfigError, match="warmup_ratio: 1 with lr_scheduler: one_cycle"):
        parse_config({**BASE, "warmup_ratio": 1.0, "lr_scheduler": "one_cycle"})
