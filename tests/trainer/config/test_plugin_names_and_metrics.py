"""Causes found in users' vision-language and recent configs (issue 31, tests/trainer/fixtures/user_configs/SOURCES.md):
a `plugins:` entry is the plugin Axolotl's load_plugin would load, a plugin module of the user's own is refused in one
line that says so, and eval_causal_lm_metrics takes Axolotl's metric names only (its check_causal_lm_evals)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tests.support import oracle

from trainer.cli import main
from trainer.config import parse_config
from trainer.config.hardware import ACCEPTED_PLUGINS, REFUSED_PLUGINS, axolotl_plugin_name
from trainer.config.training import CAUSAL_LM_METRICS
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}
ORACLE_VALIDATION = ROOT / ".ci-cache" / "axolotl-oracle" / "axolotl" / "utils" / "schemas" / "validation.py"


@pytest.mark.parametrize("full", sorted(ACCEPTED_PLUGINS) + sorted(REFUSED_PLUGINS))
def test_a_plugin_named_without_axolotl_integrations_is_that_integration(full):
    """load_plugin imports the module as written and, where none exists, the same name under axolotl.integrations."""
    short = full.removeprefix("axolotl.integrations.")
    assert axolotl_plugin_name(short) == full == axolotl_plugin_name(full)


def test_the_short_name_switches_the_integration_on():
    with pytest.raises(ConfigError, match="needs an llmcompressor: block"):  # the plugin's own rule: it is that plugin
        parse_config({**BASE, "plugins": ["llm_compressor.LLMCompressorPlugin"]})
    cfg, _ = parse_config({**BASE, "plugins": ["liger.LigerPlugin"], "liger_rms_norm": True})
    assert cfg.plugins == ["axolotl.integrations.liger.LigerPlugin"]


def test_a_plugin_module_of_ones_own_is_refused_in_one_line_saying_so():
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "plugins": ["scripts.custom.wandb_image_callback.WandbImagePlugin"]})
    assert [p for _, p in err.value.problems] == [
        "plugins: scripts.custom.wandb_image_callback.WandbImagePlugin is a plugin module of your own, not an Axolotl "
        "integration; running plugin code is not supported here (its hooks could change what is trained), remove it"]
    with pytest.raises(ConfigError, match=r"axolotl\.integrations\.mora\.MoraPlugin is not supported \(an Axolotl "
                                          r"integration this trainer does not implement; supported: "):
        parse_config({**BASE, "plugins": ["axolotl.integrations.mora.MoraPlugin"]})


def test_eval_causal_lm_metrics_takes_axolotls_metric_names_only():
    with pytest.raises(ConfigError, match=r"eval_causal_lm_metrics: accuracy is not one of Axolotl's metrics"):
        parse_config({**BASE, "eval_causal_lm_metrics": ["accuracy"]})  # refused whether do_causal_lm_eval is on or not
    assert parse_config({**BASE, "eval_causal_lm_metrics": ["perplexity", "chrf"]})[0].eval_causal_lm_metrics


def test_the_metric_names_are_axolotls():
    """The oracle environment's own SUPPORTED_METRICS (read as text: envtool's process never imports axolotl)."""
    oracle.require(ORACLE_VALIDATION, ORACLE_VALIDATION.parents[3])
    tree = ast.parse(ORACLE_VALIDATION.read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "SUPPORTED_METRICS" for t in n.targets)]
    assert set(ast.literal_eval(value)) == set(CAUSAL_LM_METRICS)


def test_a_users_plugin_through_the_command(tmp_path, capsys):
    config = tmp_path / "vlm.yml"
    config.write_text("base_model: org/model\nlearning_rate: 2.0e-4\ndatasets:\n  - path: org/data\n    type: alpaca\n"
                      "plugins:\n  - scripts.custom.wandb_image_callback.WandbImagePlugin\n")
    assert main(["validate", str(config), "--gpu", "a100"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: plugins: scripts.custom.wandb_image_callback.WandbImagePlugin is a plugin module of your own, not an "
        "Axolotl integration; running plugin code is not supported here (its hooks could change what is trained), "
        "remove it")
