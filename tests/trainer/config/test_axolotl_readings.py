"""Keys whose reading follows Axolotl 0.19's source, through `python -m trainer validate` as a user types it."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import run_cli, write_jsonl


@pytest.mark.slow
def test_default_system_message_noise_0_and_safetensors_false_read_as_axolotl_reads_them(tmp_path):
    """default_system_message changes nothing Axolotl 0.19 trains (its chatml template has no default system message
    to replace): accepted, named as ignored; noisy_embedding_alpha / neftune_noise_alpha 0 is NEFTune off (Axolotl
    moves only a non-zero noisy_embedding_alpha, and transformers' noise at alpha 0 is 0); save_safetensors: false is
    refused, as Axolotl refuses it."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}])
    base = {"base_model": "NousResearch/Llama-3.2-1B", "learning_rate": 1e-4, "chat_template": "chatml",
            "datasets": [{"path": str(data), "type": "alpaca"}]}
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({**base, "default_system_message": "You are terse.", "noisy_embedding_alpha": 0}))
    result = run_cli("validate", str(config), "--gpu", "h100", env={"HF_HUB_OFFLINE": "1"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "default_system_message" in out and "NEFTune" not in out
    config.write_text(yaml.safe_dump({**base, "save_safetensors": False}))
    result = run_cli("validate", str(config), "--gpu", "h100", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "save_safetensors: false is not supported" in result.stderr.strip().splitlines()[-1]
