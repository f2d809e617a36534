"""The ROCm chain for real: uv locks an MI300X plan against a local index that serves a stand-in ROCm torch and
its triton the way download.pytorch.org/whl/rocmX.Y does (torch's own triton only there, not on PyPI), installs
it, and envtool doctor inside the venv finds the HIP torch right for the GPU, or names the target it lacks.

The stand-in torch answers as torch 2.5.1+rocm6.2 does (torch.version.hip and its arch list are captured:
tests/support/captured/SOURCES.md), so the plan is pinned to torch 2.5."""

import json
import os
import tomllib

import pytest

from tests.support.pypi import CAPTURED_ROCM_ARCH, MIRROR, build_indexes, index_env, serve

from .conftest import run_envtool

pytestmark = pytest.mark.slow
MI300X = ["--gpu", "mi300x", "--torch", "2.5", "--python", "3.11", "--platform", "x86_64"]


@pytest.fixture
def rocm_index(tmp_path):
    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never"}
    out = run_envtool("resolve", "--json", *MI300X, env=env)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["torch"]["version"], plan["torch"]["variant"]) == ("2.5.1", "rocm6.2")

    def start(**options):
        build_indexes(tmp_path / "index", plan, CAPTURED_ROCM_ARCH[("2.5.1", "rocm6.2")], **options)

    return tmp_path / "index", env, plan, start


def lock(tmp_path, url, env):
    return run_envtool("lock", *MI300X, "--out", str(tmp_path / "envs" / "mi300x"), "--index-url", f"{url}/pypi/",
                       env={**env, **index_env(url)}, timeout=600)


def test_rocm_torch_and_its_triton_come_from_the_rocm_index_and_doctor_checks_the_target(tmp_path, rocm_index):
    root, env, plan, start = rocm_index
    start()
    assert plan["packages"]["pytorch-triton-rocm"] == plan["triton"] == "3.1.0"  # torch 2.5's pin, as on CUDA
    venv = tmp_path / ".venv"
    with serve(root) as url:
        out = lock(tmp_path, url, env)
        assert out.returncode == 0, out.stderr
        env_dir = tmp_path / "envs" / "mi300x"
        packages = {p["name"]: p for p in tomllib.loads((env_dir / "uv.lock").read_text())["package"]}
        rocm_index = {"registry": f"{url}/torch/rocm6.2/"}
        assert packages["torch"]["version"] == "2.5.1+rocm6.2" and packages["torch"]["source"] == rocm_index
        assert packages["pytorch-triton-rocm"]["source"] == rocm_index  # not looked for on PyPI, where it is not
        out = run_envtool("install", str(env_dir), "--venv", str(venv), "--json", env=env, timeout=600)
        assert out.returncode == 0, out.stderr
    out = run_envtool("doctor", "--venv", str(venv), "--gpu", "mi300x", "--json", env=env)
    assert out.returncode == 0, out.stdout
    result = json.loads(out.stdout)
    arch = next(f for f in result["findings"] if f["check"] == "arch")
    assert arch["level"] == "ok" and "gfx942" in arch["message"]
    assert result["packages"]["torch"] == "2.5.1+rocm6.2"
    # the same environment on an RX 7800 XT (gfx1101, which torch 2.5.1's ROCm wheels do not carry)
    out = run_envtool("doctor", "--venv", str(venv), "--gpu", "rx7800xt", "--json", env=env)
    assert out.returncode == 1
    result = json.loads(out.stdout)
    arch = next(f for f in result["findings"] if f["check"] == "arch")
    assert "has no gfx1101 code" in arch["message"] and arch["fix"] == f"envtool install --gpu rx7800xt --venv {venv}"
    plan_check = next(f for f in result["findings"] if f["check"] == "plan")
    assert plan_check["message"] == "the environment was planned for gfx942, the GPU named is gfx1101"  # --gpu names it: not this machine


def test_a_rocm_index_without_torch_s_triton_fails_the_lock_naming_it(tmp_path, rocm_index):
    root, env, plan, start = rocm_index
    start(serve_torch_triton=False)
    with serve(root) as url:
        out = lock(tmp_path, url, env)
    assert out.returncode == 2  # the index cannot satisfy the plan: envtool's missing-wheel answer, not uv's text
    assert "pytorch-triton-rocm (no version of it) is not on the index it comes from" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "envs" / "mi300x").exists()  # nothing half-written
