"""A ROCm image from a real engine: `envtool build --gpu mi300x` on the locally made base, offline, from a local
index serving stand-in ROCm wheels (torch 2.5.1+rocm6.2 as it reports itself: captured, and its
pytorch-triton-rocm on the torch index); doctor inside it, and `envtool run` of it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.resolver.conftest import run_envtool
from tests.support.pypi import CAPTURED_HIP, CAPTURED_ROCM_ARCH, build_indexes, index_env, serve

from .conftest import BASE_IMAGE
from .test_images import in_image, plan_for

pytestmark = [pytest.mark.docker, pytest.mark.slow]
BIN = Path(sys.executable).parent
MI300X = ["--gpu", "mi300x", "--torch", "2.5", "--python", "3.11", "--platform", "x86_64"]


def test_mi300x_image_carries_the_hip_torch_and_runs(tmp_path, docker_host, docker_client):
    plan = plan_for(MI300X)
    root = tmp_path / "index"
    build_indexes(root, plan, CAPTURED_ROCM_ARCH[("2.5.1", "rocm6.2")])
    env = {**os.environ, "DOCKER_HOST": docker_host, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    with serve(root) as url:
        out = run_envtool("build", *MI300X, "--base-image", BASE_IMAGE, "--network", "none", "--index-url",
                          f"{url}/pypi/", "--json", env={**env, **index_env(url)}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = json.loads(out.stdout)
    tag = built["tag"]
    assert tag == "envtool-trainer:gfx942-rocm6.2-torch2.5-py3.11"
    image = docker_client.images.get(tag)
    assert json.loads(image.labels["io.envtool.plan"])["gpu"]["target"] == "gfx942"
    config_env = dict(e.split("=", 1) for e in image.attrs["Config"]["Env"])
    assert config_env["PYTORCH_ROCM_ARCH"] == "gfx942" and "NVIDIA_VISIBLE_DEVICES" not in config_env
    assert in_image(docker_client, tag, "python", "-c", "import torch; print(torch.version.hip)").strip() == \
        CAPTURED_HIP["rocm6.2"]
    assert in_image(docker_client, tag, "python", "-c", "import importlib.metadata as m; "
                    "print(m.version('pytorch-triton-rocm'))").strip() == "3.1.0"
    doctor = json.loads(in_image(docker_client, tag, "envtool", "doctor", "--gpu", "mi300x", "--json"))
    assert doctor["ok"], doctor
    assert any(f["check"] == "arch" and "torch carries gfx942 code" in f["message"] for f in doctor["findings"])

    # envtool run: the image runs as the invoking user; the GPUs it needs are the image plan's (AMD: /dev/kfd)
    run = [str(BIN / "envtool"), "run", "--image", tag, "--", "python", "-c", "import torch; print(torch.version.hip)"]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == CAPTURED_HIP["rocm6.2"], out.stderr
    out = subprocess.run(run[:2] + ["--gpus", "all"] + run[2:], capture_output=True, text=True, env=env, timeout=300)
    if not Path("/dev/kfd").exists():  # no AMD GPU driver on this host: refused before a container starts
        assert out.returncode == 2
        assert out.stderr.strip() == (f"envtool: error: --gpus all for {plan['gpu']['name']}: no /dev/kfd on this "
                                      f"host (the amdgpu driver with KFD is not loaded)")
    else:
        assert out.returncode == 0, out.stderr
