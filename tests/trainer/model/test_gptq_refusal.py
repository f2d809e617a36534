"""gptq (Axolotl's examples/llama-2/gptq-lora.yml) stays refused: one line naming the key and the true reason
(gptqmodel, the package transformers loads GPTQ checkpoints with, does not install beside the tested stack)."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import run_cli


@pytest.mark.slow
def test_gptq_lora_is_refused_in_one_line_naming_gptqmodel(make_config):
    config = make_config(adapter="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"], gptq=True,
                         gptq_disable_exllama=True)
    result = run_cli("validate", str(config), "--gpu", "a100")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: gptq: GPTQ checkpoints load through gptqmodel and optimum")
    assert "Traceback" not in result.stderr
    off = run_cli("validate", str(make_config("off.yml", gptq=False)), "--gpu", "a100")
    assert off.returncode == 0 and "gptq:" not in off.stdout  # gptq: false (its default) asks for nothing
