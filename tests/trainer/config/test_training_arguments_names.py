"""A config that writes transformers' name for one of Axolotl's keys (lr_scheduler_type for lr_scheduler, optim for
optimizer, ...): Axolotl's schema drops it and trains with its own key's default; here it is a near miss of that key
(issue 31: tayaee's GRPO configs set `lr_scheduler_type: constant_with_warmup` and would train with cosine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.support import oracle

from trainer.config import parse_config
from trainer.config.keys import TRAINING_ARGUMENTS_NAMES
from trainer.config.schema import Config
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
BUILDERS = ROOT / ".ci-cache" / "axolotl-oracle" / "axolotl" / "core" / "builders"
BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "learning_rate": 2e-4}


def test_each_name_is_one_axolotl_fills_from_its_key():
    """Each pair is an assignment in Axolotl's trainer builders: training_args_kwargs["<name>"] = self.cfg.<key>
    (read as text: envtool's process never imports axolotl), and names a key of envtool's config, not one of its own."""
    oracle.require(BUILDERS, BUILDERS.parents[2])
    source = "\n".join(p.read_text() for p in sorted(BUILDERS.glob("*.py")))
    found = set(re.findall(r'training_arg(?:ument)?s_kwargs\["(\w+)"\]\s*=\s*\(?\s*self\.cfg\.(\w+)', source))
    assert set(TRAINING_ARGUMENTS_NAMES.items()) <= found, set(TRAINING_ARGUMENTS_NAMES.items()) - found
    assert set(TRAINING_ARGUMENTS_NAMES.values()) <= set(Config.model_fields)
    assert not set(TRAINING_ARGUMENTS_NAMES) & set(Config.model_fields)


@pytest.mark.parametrize("name", sorted(TRAINING_ARGUMENTS_NAMES))
def test_the_transformers_name_alone_is_an_error_or_a_warning_naming_axolotls_key(name):
    key = TRAINING_ARGUMENTS_NAMES[name]
    try:
        _, notes = parse_config({**BASE, name: 1})
    except ConfigError as err:  # the key changes what is trained: ignoring the value would train with the default
        assert f"'{name}' is not a key; did you mean '{key}'? (the config does not set {key}" in str(err)
    else:
        assert f"warning: '{name}' is not a key (ignored); did you mean '{key}'?" in notes


def test_lr_scheduler_type_without_lr_scheduler_is_refused_and_with_it_a_warning():
    with pytest.raises(ConfigError, match=r"'lr_scheduler_type' is not a key; did you mean 'lr_scheduler'\? \(the "
                                          r"config does not set lr_scheduler: ignoring lr_scheduler_type would train"):
        parse_config({**BASE, "lr_scheduler_type": "constant_with_warmup"})
    cfg, notes = parse_config({**BASE, "lr_scheduler": "constant", "lr_scheduler_type": "constant_with_warmup"})
    assert cfg.lr_scheduler == "constant"
    assert "warning: 'lr_scheduler_type' is not a key (ignored); did you mean 'lr_scheduler'?" in notes


def test_through_the_command(tmp_path, capsys):
    from trainer.cli import main

    config = tmp_path / "grpo.yml"
    config.write_text("base_model: org/model\nlearning_rate: 1.0e-6\ndatasets:\n  - path: org/data\n    type: alpaca\n"
                      "lr_scheduler_type: constant_with_warmup\n")
    assert main(["validate", str(config), "--gpu", "a100"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {config}: 'lr_scheduler_type' is not a key; did you mean 'lr_scheduler'? (the config does not set "
        "lr_scheduler: ignoring lr_scheduler_type would train with its default)")


@pytest.mark.parametrize("name,key", [("num_train_epochs", "num_epochs"), ("max_step", "max_steps"),
                                      ("num_epoch", "num_epochs")])
def test_a_near_miss_of_the_length_is_refused(name, key):
    """num_epochs and max_steps may change on resume (resume.py), but ignoring a near miss of one would train for
    the default length instead of the one written: an error, not a warning."""
    with pytest.raises(ConfigError, match=f"'{name}' is not a key; did you mean '{key}'"):
        parse_config({**BASE, name: 3})
