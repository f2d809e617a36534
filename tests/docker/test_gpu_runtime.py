"""`envtool run --gpus all` (and so `envtool train --image` of a GPU plan) on an engine with no GPU runtime -- the
state of a fresh GPU host, and of the private engine .ci/docker-up starts: one line naming the fix (the NVIDIA
Container Toolkit or CDI), exit 2, and no container left behind (issue 27, item 4)."""

import os
import subprocess

import pytest

from resolver.docker import RUN_LABEL
from tests.resolver.conftest import ENVTOOL

from .conftest import BASE_IMAGE

pytestmark = pytest.mark.docker


def test_gpus_without_a_gpu_runtime_is_one_line_naming_the_toolkit_and_leaves_no_container(docker_host,
                                                                                           docker_client):
    before = {c.id for c in docker_client.containers.list(all=True)}
    env = {**os.environ, "DOCKER_HOST": docker_host}
    out = subprocess.run([str(ENVTOOL), "run", "--image", BASE_IMAGE, "--gpus", "all", "--", "true"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("envtool: error: --gpus all: this Docker engine cannot give containers GPUs")
    assert "NVIDIA Container Toolkit" in lines[0] and "CDI" in lines[0]
    left = [c for c in docker_client.containers.list(all=True, filters={"label": RUN_LABEL}) if c.id not in before]
    assert left == [], [(c.name, c.status) for c in left]
    # the same engine runs the same image without --gpus: the refusal is the GPU runtime's, not the engine's
    plain = subprocess.run([str(ENVTOOL), "run", "--image", BASE_IMAGE, "--", "true"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
