"""Resuming after a config change: each key refused (exit 2, one line naming the checkpoint, the key and both
values, before the model loads) or noted, from the one table in trainer/config/resume.py."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trainer.train as train_mod
from tests.trainer.helpers import run_cli
from trainer.cli import main
from trainer.config import Config, load_config
from trainer.config import resume as resume_keys
from trainer.errors import ConfigError

KEYS = sorted(Config.model_fields)


def test_every_config_key_is_classified_once():
    """A key added to the schema must be given a class here, or this fails."""
    lists = resume_keys._TRAINS.split() + resume_keys._MAY_CHANGE.split() + resume_keys._RESUME.split()
    assert sorted(lists) == sorted(set(lists)), "a key is in two classes"
    assert set(KEYS) - set(resume_keys.CLASSES) == set(), "unclassified: give each a class in trainer/config/resume.py"
    assert set(resume_keys.CLASSES) - set(KEYS) == set(), "classified, but not a config key"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=200),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)


def test_a_changed_key_is_refused_or_noted_never_ignored(make_config):
    cfg, _ = load_config(make_config())
    now = resume_keys.recorded(cfg)

    @settings(max_examples=100, deadline=None)
    @given(key=st.sampled_from(KEYS), old=JSON)
    def check(key, old):
        before = {**now, key: old}
        try:
            notes = resume_keys.compare("out/checkpoint-3", before, now)
        except ConfigError as err:  # refused: one line, the checkpoint and the key
            line = str(err)
            assert "\n" not in line and "out/checkpoint-3" in line and f"{key}: " in line
            assert resume_keys.CLASSES[key] == resume_keys.TRAINS and old != now[key]
            return
        if old == now[key] or resume_keys.CLASSES[key] == resume_keys.RESUME:
            assert notes == []
        else:
            assert resume_keys.CLASSES[key] == resume_keys.MAY_CHANGE
            assert len(notes) == 1 and notes[0].startswith(f"note: {key} changed since out/checkpoint-3")

    check()


def test_values_are_shown_both_ways_and_an_older_checkpoint_is_noted(make_config):
    cfg, _ = load_config(make_config(learning_rate=1e-4, max_steps=8))
    before = {**resume_keys.recorded(cfg), "learning_rate": 1e-3, "lora_r": 16, "max_steps": 4}
    with pytest.raises(ConfigError) as err:
        resume_keys.compare("o/checkpoint-2", before, resume_keys.recorded(cfg))
    assert "learning_rate: 0.001 -> 0.0001" in str(err.value) and "lora_r: 16 -> 8" in str(err.value)
    assert "max_steps" not in str(err.value)
    notes = resume_keys.compare("o/checkpoint-2", {**before, "learning_rate": 1e-4, "lora_r": 8},
                                resume_keys.recorded(cfg))
    assert notes == ["note: max_steps changed since o/checkpoint-2 was saved: 4 -> 8 (allowed on a resume)"]
    assert "does not record the config" in resume_keys.compare("o/checkpoint-2", None, {})[0]
    # a key an older checkpoint does not record is compared with its default
    older = {k: v for k, v in resume_keys.recorded(cfg).items() if k != "neftune_noise_alpha"}
    cfg2, _ = load_config(make_config("n.yml", learning_rate=1e-4, max_steps=8, neftune_noise_alpha=5))
    with pytest.raises(ConfigError, match="neftune_noise_alpha: unset -> 5"):
        resume_keys.compare("o/checkpoint-2", older, resume_keys.recorded(cfg2))


def fake_checkpoint(out, cfg, step=2):
    """A checkpoint directory as far as the comparison reads it: trainer_state.json with the recorded config
    (what Trainer.save writes; the slow test below checks a real one)."""
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "world_size": 1, "config":
                                                         resume_keys.recorded(cfg)}))
    return ckpt


def test_a_changed_lora_r_is_refused_before_the_model_loads(make_config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    lora = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True, output_dir=str(out))
    cfg, _ = load_config(make_config("a.yml", **lora))
    ckpt = fake_checkpoint(out, cfg)
    monkeypatch.setattr(train_mod, "load_tokenizer", lambda *_: pytest.fail("loaded before the refusal"))
    changed = make_config("b.yml", **{**lora, "lora_r": 8, "lora_alpha": 16, "base_model": cfg.base_model + "/"},
                          auto_resume_from_checkpoints=True)
    assert main(["train", str(changed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(ckpt) in err and "lora_r: 4 -> 8" in err and "lora_alpha: 8 -> 16" in err and "base_model: " in err
    assert "Traceback" not in err and "new output_dir" in err


@pytest.mark.slow
def test_a_real_checkpoint_records_its_config_and_the_command_line_refuses_a_change(make_config, tmp_path, capsys):
    """A trained checkpoint records its config; through `python -m trainer train` a changed learning_rate is refused
    (exit 2, one line); a longer max_steps and a new logging cadence resume with one note each."""
    out = tmp_path / "out"
    base = dict(output_dir=str(out), max_steps=2, save_steps=2, adapter="lora", lora_r=4, lora_target_linear=True)
    assert main(["train", str(make_config("a.yml", **base))]) == 0
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["config"]["lora_r"] == 4 and state["config"]["learning_rate"] == 1e-3
    shutil.rmtree(out / "final")
    lr = run_cli("train", str(make_config("b.yml", **base, learning_rate=5e-4, auto_resume_from_checkpoints=True)))
    last = lr.stderr.strip().splitlines()[-1]
    assert lr.returncode == 2 and "learning_rate: 0.001 -> 0.0005" in last and str(out / "checkpoint-2") in last, \
        lr.stderr[-2000:]
    assert "Traceback" not in lr.stderr
    capsys.readouterr()
    assert main(["train", str(make_config("c.yml", **{**base, "max_steps": 3, "logging_steps": 2},
                                          auto_resume_from_checkpoints=True))]) == 0
    err = capsys.readouterr().err
    assert "note: max_steps changed since" in err and "2 -> 3" in err
    assert "note: logging_steps changed since" in err
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in err


def test_an_older_checkpoint_of_another_lora_r_is_one_line_naming_it(tiny_llama, tmp_path):
    """No recorded config to compare: the shape mismatch on load is still one line (exit 2) naming the checkpoint."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.model.load import load_weights

    def adapter(r):
        base = AutoModelForCausalLM.from_pretrained(tiny_llama)
        return get_peft_model(base, LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj"]))

    ckpt = tmp_path / "checkpoint-2"
    adapter(4).save_pretrained(ckpt)
    with pytest.raises(ConfigError) as err:
        load_weights(adapter(8), ckpt)
    line = str(err.value)
    assert "\n" not in line and str(ckpt) in line and "size mismatch" in line and "lora_r" in line
    assert err.value.exit_code == 2


def test_a_grpo_servers_new_address_resumes_and_a_block_change_is_named_by_its_key():
    """A GRPO run's vLLM server restarted on another port (issue 44 item 6): the checkpoint resumes with a note. A
    change inside the trl block that trains is refused naming trl.<key> and its two values, not the whole block cut
    at 80 characters (which showed the same truncated text twice)."""
    base = {"vllm_server_host": "127.0.0.1", "vllm_server_port": 8000, "vllm_server_timeout": 240, "beta": 0.04,
            "num_generations": 4, "use_vllm": True, "vllm_lora_sync": True, "max_completion_length": 64}
    before = {"trl": base}
    moved = resume_keys.compare("checkpoint-2", before, {"trl": {**base, "vllm_server_port": 8001,
                                                                 "vllm_server_timeout": 600}})
    assert moved == ["note: trl.vllm_server_port changed since checkpoint-2 was saved: 8000 -> 8001 (allowed on a resume)",
                     "note: trl.vllm_server_timeout changed since checkpoint-2 was saved: 240 -> 600 (allowed on a "
                     "resume)"]
    with pytest.raises(ConfigError, match=r"in what it trains \(trl\.beta: 0\.04 -> 0\.1\)"):
        resume_keys.compare("checkpoint-2", before, {"trl": {**base, "beta": 0.1}})
