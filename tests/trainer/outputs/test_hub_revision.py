"""hub_revision: the final model is pushed to that branch of hub_model_id (created where missing), as Axolotl passes
it to transformers' hub_revision. Against tests/support/hub.py's stand-in for the Hub's write side."""

from __future__ import annotations

import pytest
import yaml

from tests.support.hub import fake_hub_uploads
from tests.trainer.helpers import run_cli


@pytest.mark.slow
def test_the_final_model_is_pushed_to_the_branch_named(make_config):
    config = make_config(hub_model_id="tester/tiny-run", hub_revision="exp-1", max_steps=1)
    with fake_hub_uploads() as (url, commits, branches):
        result = run_cli("train", str(config), timeout=400,
                         env={"HF_ENDPOINT": url, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0",
                              "HF_HUB_DISABLE_XET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pushed the final model to https://huggingface.co/tester/tiny-run (branch exp-1)" in result.stderr
    assert ("tester/tiny-run", "exp-1") in branches
    assert commits and {c["revision"] for c in commits} == {"exp-1"}  # nothing to main
    pushed = {f for c in commits for f in c["files"]}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= pushed


def test_without_hub_model_id_it_is_named_as_not_read(make_config):
    from trainer.config import parse_config

    _, notes = parse_config(yaml.safe_load(make_config(hub_revision="exp-1").read_text()))
    assert any(n.startswith("hub_revision: exp-1 not read: nothing is pushed without hub_model_id") for n in notes)
