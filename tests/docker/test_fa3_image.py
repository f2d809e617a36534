"""The Hopper image: flash-attn-3 (from the PyTorch index of the plan's torch build) goes into the image like
every other locked wheel, offline, and `envtool doctor` inside it finds it."""

import json

import pytest

from .conftest import BASE_IMAGE  # noqa: F401 (the base the image builds on; checked by the docker_host fixture)
from .test_images import build_image, in_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]
H100 = ["--gpu", "h100", "--python", "3.11", "--platform", "x86_64"]


def test_h100_image_carries_flash_attn_3(tmp_path, docker_host, docker_client):
    plan, built = build_image(tmp_path, docker_host, H100)
    assert plan["attention"] == "flash_attention_3" and plan["packing"] == "varlen"
    tag = built["tag"]
    assert tag.startswith("envtool-trainer:sm90-")
    found = in_image(docker_client, tag, "python", "-c", "import flash_attn_interface, importlib.metadata as m; "
                     "print(m.version('flash-attn-3'))").strip()
    assert found == plan["flash_attn"]["version"]
    labels = docker_client.images.get(tag).labels
    assert json.loads(labels["io.envtool.plan"])["flash_attn"]["package"] == "flash-attn-3"
    doctor = json.loads(in_image(docker_client, tag, "envtool", "doctor", "--gpu", "h100", "--driver", "580.65.06",
                                 "--json"))
    finding = next(f for f in doctor["findings"] if f["check"] == "flash-attn-3")
    assert finding["level"] == "warning" and "torch sees no CUDA device" in finding["message"]  # no GPU here
