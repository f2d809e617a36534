"""`envtool fit` against MoE peaks someone measured and published, each row naming where: within 20% of every one.

Axolotl's GLM-4.7-Flash README (examples/glm47-flash/README.md at 067b021c8b87) gives the memory its own example
configs reach on one 48 GB GPU: QLoRA with the experts quantized on load ~24 GiB, the same with LoRA on the experts
(lora_target_parameters) ~34 GiB, the 8-bit LoRA ~35 GiB; and on two, under FSDP2 (with FSDP's activation
checkpointing), ~29 and ~43 GiB per GPU. The configs are Axolotl's own (copies in
tests/trainer/fixtures/axolotl_examples/), with only base_model pointed at the checkpoint's config.json (captured:
tests/support/captured/SOURCES.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.trainer.test_moe_training import envtool
from trainer.fit import memory

FIXTURES = Path(__file__).parents[1] / "fixtures" / "axolotl_examples"
CAPTURED = Path(__file__).parents[2] / "support" / "captured" / "models"
README = "github.com/axolotl-ai-cloud/axolotl/blob/067b021c8b87/examples/glm47-flash/README.md"
EXPERT_LORA = {"lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}

PUBLISHED = [  # (example copy, keys changed, GPUs, GiB measured per GPU, where it is published)
    ("glm47-flash__qlora.yaml", {}, 1, 24, f"{README}: QLoRA, no target experts (1x48GB @ ~24GiB/GPU)"),
    ("glm47-flash__qlora.yaml", EXPERT_LORA, 1, 34, f"{README}: QLoRA, target experts (1x48GB @ ~34GiB/GPU)"),
    ("glm47-flash__lora.yaml", {}, 1, 35, f"{README}: LoRA, no target experts (1x48GB @ ~35GiB/GPU)"),
    ("glm47-flash__qlora_fsdp.yaml", {}, 2, 29, f"{README}: QLoRA FSDP2 no target experts (2x48GB @ ~29GiB/GPU)"),
    ("glm47-flash__lora_fsdp.yaml", {}, 2, 43, f"{README}: LoRA FSDP2 no target experts (2x48GB @ ~43GiB/GPU)"),
]


@pytest.mark.slow  # envtool in a subprocess per row (a 30B model built on the meta device)
@pytest.mark.parametrize("example,keys,gpus,published,source", PUBLISHED,
                         ids=["glm47-qlora", "glm47-qlora-expert-lora", "glm47-lora-8bit", "glm47-qlora-fsdp2",
                              "glm47-lora-8bit-fsdp2"])
def test_fit_is_within_20_percent_of_a_published_moe_peak(tmp_path, example, keys, gpus, published, source):
    model = tmp_path / "GLM-4.7-Flash"
    model.mkdir()
    shutil.copy(CAPTURED / "glm-4.7-flash-config.json", model / "config.json")
    raw = yaml.safe_load((FIXTURES / example).read_text())
    assert raw["base_model"] == "zai-org/GLM-4.7-Flash" and raw.get("quantize_moe_experts") is True
    raw.update(base_model=str(model), **keys)
    config = tmp_path / "glm.yml"
    config.write_text(yaml.safe_dump(raw))
    out = envtool("fit", str(config), "--gpu", "l40s", "--nproc", str(gpus), "--json", tmp_path=tmp_path)  # as a user types it
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    peak = result["peak_gb"]
    assert abs(peak - published) <= 0.2 * published, f"fit says {peak:.1f} GiB; {source}"
    assert result["verdict"] == "fits" and result["unit"] == "GB" and memory.GB == 2 ** 30  # its GB is a GiB
