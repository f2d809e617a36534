"""`envtool install --python PATH` (and `--system`): a plan into an interpreter that already exists, as in a
notebook. A throw-away interpreter (a venv made in tmp, no system site-packages) stands in for Colab's: it
already has the real CPU torch, which doctor finds right for a CPU machine, so it must be kept, untouched,
while the rest of the plan is installed (hash-checked) from the tests' PEP 503 index on 127.0.0.1."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from resolver.uvrun import uv_binary
from tests.support.pypi import MIRROR, build_indexes, index_env, serve

from .conftest import run_envtool

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CPU = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64"]


@pytest.fixture
def notebook(tmp_path):
    """An index serving the real CPU stack, and an interpreter with torch 2.13.0+cpu preinstalled."""
    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    env = {**{k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "VIRTUAL_ENV")},
           "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never", "ENVTOOL_GPU": "cpu"}
    plan = json.loads(run_envtool("resolve", "--json", *CPU, env=env).stdout)
    build_indexes(tmp_path / "index", plan, [], real_torch=next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
    python = tmp_path / "notebook" / "bin" / "python"
    subprocess.run([uv_binary(), "venv", "--quiet", "--python", "3.11", str(tmp_path / "notebook")], check=True,
                   env=env)
    return tmp_path / "index", env, python


def preinstall(python, url, env, *requirements):
    subprocess.run([uv_binary(), "pip", "install", "--quiet", "--python", str(python), "--index-url", f"{url}/pypi/",
                    "--extra-index-url", f"{url}/torch/cpu/", *requirements], check=True, env=env,
                   capture_output=True)


def torch_files(python):
    out = subprocess.run([str(python), "-c", "import torch, os; s = os.stat(torch.__file__); "
                          "print(torch.__version__, s.st_ino, s.st_mtime_ns)"], capture_output=True, text=True)
    return out.stdout.split()


def test_a_preinstalled_torch_that_fits_is_kept_and_the_plan_installed_around_it(notebook):
    index, env, python = notebook
    with serve(index) as url:
        preinstall(python, url, env, "torch==2.13.0+cpu")
        before = torch_files(python)
        assert before[0] == "2.13.0+cpu"
        out = run_envtool("install", "--python", str(python), "--gpu", "cpu", "--index-url", f"{url}/pypi/", "--json",
                          env={**env, **index_env(url)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["kept"] == ["torch==2.13.0+cpu"] and result["torch"] == "2.13.0+cpu"
    assert "keeping the installed torch 2.13.0+cpu" in out.stderr
    assert torch_files(python) == before  # the same files: not reinstalled
    prefix = python.parent.parent
    plan = json.loads((prefix / "plan.json").read_text())
    assert result["plan"] == str(prefix / "plan.json") and plan["torch"]["version"] == "2.13.0"
    assert result["transformers"] == plan["packages"]["transformers"]
    # the trainer in that interpreter finds the plan by its rule (the environment's own copy)
    found = subprocess.run([str(python), "-c", "from trainer.runtime.planfile import find_plan; print(find_plan()[1])"],
                           capture_output=True, text=True, cwd=prefix,
                           env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert found.stdout.strip() == f"the environment's {prefix / 'plan.json'}", found.stderr


@pytest.mark.parametrize("args, message", [
    (["--python", "/no/such/python", "--gpu", "cpu"], "could not run /no/such/python"),
    (["--system", "--offline"], "--offline installs into a venv; --system / --python PATH use an index"),
])
def test_bad_interpreters_and_contradictions_are_one_line(args, message):
    out = run_envtool("install", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_preinstalled_torch_wrong_for_the_gpu_is_replaced_by_the_plans(notebook, tmp_path, m):
    """The CPU torch in an interpreter on a T4 host: doctor finds it wrong, so the T4 plan's CUDA torch
    (a stand-in with the real build's arch list) replaces it, and envtool says why."""
    cpu_index, env, python = notebook
    t4_args = ["--gpu", "t4", "--python", "3.11", "--platform", "x86_64"]
    t4 = json.loads(run_envtool("resolve", "--json", *t4_args, env=env).stdout)
    release = next(r for r in m.torch if r.version == t4["torch"]["version"])
    sass = next(b for b in release.build if b.variant == t4["torch"]["variant"]).sass
    build_indexes(tmp_path / "t4-index", t4, sass)
    with serve(cpu_index) as cpu_url:
        preinstall(python, cpu_url, env, "torch==2.13.0+cpu")
    with serve(tmp_path / "t4-index") as url:
        out = run_envtool("install", "--python", str(python), "--gpu", "t4", "--index-url", f"{url}/pypi/", "--json",
                          env={**env, **index_env(url), "ENVTOOL_GPU": "t4"}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replacing the installed torch 2.13.0+cpu: torch is the CPU build, but Tesla T4 (sm_75, Turing) is named (--gpu, not detected here)" in out.stderr
    result = json.loads(out.stdout)
    assert result["kept"] == [] and result["torch"] == f"{t4['torch']['version']}+cu126"
    assert torch_files(python)[0] == f"{t4['torch']['version']}+cu126"
    assert json.loads((python.parent.parent / "plan.json").read_text())["gpu"]["name"] == "Tesla T4"
