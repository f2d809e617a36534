"""FlashAttention-3 through the whole chain, as a Hopper user gets it: the plan names flash-attn-3 from the
PyTorch index of its torch build; `lock` routes it to that index (explicit, hashed), the wheelhouse and an offline
install carry it, `install --python` puts it into an existing interpreter, and doctor imports
`flash_attn_interface` where torch sees a GPU.

The index on 127.0.0.1 serves what download.pytorch.org serves: the torch build and `flash_attn_3-3.0.0-cp39-abi3-
manylinux_2_28_x86_64.whl` (stand-ins with the real file names, tags and Requires-Dist) in the variant's folder,
the real training stack (and flash-attn-3's einops / ninja / packaging) from .ci-cache/pypi-mirror."""

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from resolver.uvrun import uv_binary
from tests.support.pypi import MIRROR, build_indexes, index_env, serve

from .conftest import run_envtool

pytestmark = pytest.mark.slow
H100 = ["--gpu", "h100", "--python", "3.11", "--platform", "x86_64"]


@pytest.fixture
def hopper(tmp_path, m):
    """The H100 plan (driver unknown: torch's cu126 build) and its indexes; yields (root, env, plan)."""
    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    env = {**{k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "VIRTUAL_ENV")},
           "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never"}
    out = run_envtool("resolve", "--json", *H100, env=env)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["attention"] == "flash_attention_3" and plan["flash_attn"]["package"] == "flash-attn-3"
    release = next(r for r in m.torch if r.version == plan["torch"]["version"])
    sass = next(b for b in release.build if b.variant == plan["torch"]["variant"]).sass
    build_indexes(tmp_path / "index", plan, sass)
    return tmp_path / "index", env, plan


def lock(tmp_path, url, env, *extra):
    return run_envtool("lock", *H100, "--out", str(tmp_path / "envs" / "h100"), "--index-url", f"{url}/pypi/", *extra,
                       env={**env, **index_env(url)})


def test_lock_takes_flash_attn_3_from_the_torch_index_with_its_hash(tmp_path, hopper):
    root, env, plan = hopper
    variant, fa = plan["torch"]["variant"], plan["flash_attn"]
    assert fa["filename"] == "flash_attn_3-3.0.0-cp39-abi3-manylinux_2_28_x86_64.whl"
    with serve(root) as url:
        out = lock(tmp_path, url, env)
        assert out.returncode == 0, out.stderr
    env_dir = tmp_path / "envs" / "h100"
    torch_index = f"{url}/torch/{variant}/"
    written = json.loads((env_dir / "plan.json").read_text())
    assert written["flash_attn"]["index_url"] == written["torch"]["index_url"] == torch_index
    project = tomllib.loads((env_dir / "pyproject.toml").read_text())
    assert project["tool"]["uv"]["sources"]["flash-attn-3"] == {"index": f"pytorch-{variant}"}
    assert "flash-attn-3==3.0.0" in project["project"]["dependencies"]
    assert "flash-attn-3" in project["tool"]["uv"]["no-build-package"]
    lock_rows = {p["name"]: p for p in tomllib.loads((env_dir / "uv.lock").read_text())["package"]}
    fa3 = lock_rows["flash-attn-3"]
    assert fa3["version"] == "3.0.0" and fa3["source"] == {"registry": torch_index}
    (wheel,) = fa3["wheels"]
    assert wheel["url"].endswith(fa["filename"]) and wheel["hash"].startswith("sha256:")
    assert {d["name"] for d in fa3["dependencies"]} == {"torch", "einops", "packaging", "ninja"}
    assert lock_rows["einops"]["source"] == {"registry": f"{url}/pypi/"}  # its requirements come from PyPI


def test_a_missing_flash_attn_3_wheel_fails_the_lock_in_one_line(tmp_path, hopper):
    _, env, plan = hopper
    root = tmp_path / "index-without-fa3"
    build_indexes(root, plan, [], serve_flash_attn=False)  # the torch folder without flash-attn-3
    with serve(root) as url:
        out = lock(tmp_path, url, env)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert (f"flash-attn-3==3.0.0 is not on the index it comes from; envtool never builds flash-attn-3 from source: "
            f"{url}/torch/{plan['torch']['variant']}/ lists no {plan['flash_attn']['filename']}") in out.stderr
    assert not (tmp_path / "envs" / "h100").exists()


def test_wheelhouse_offline_install_and_doctor_on_the_gpu(tmp_path, hopper):
    root, env, plan = hopper
    env_dir, venv, wheelhouse = tmp_path / "envs" / "h100", tmp_path / ".venv-h100", tmp_path / "wheelhouse"
    with serve(root) as url:
        out = lock(tmp_path, url, env, "--wheelhouse", str(wheelhouse))
        assert out.returncode == 0, out.stderr
    assert (wheelhouse / plan["flash_attn"]["filename"]).is_file()
    assert "flash-attn-3==3.0.0 --hash=sha256:" in (wheelhouse / "requirements.txt").read_text()
    # the server is gone: the wheelhouse alone installs it
    out = run_envtool("install", str(env_dir), "--venv", str(venv), "--offline", "--wheelhouse", str(wheelhouse),
                      "--json", env=env)
    assert out.returncode == 0, out.stderr
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import flash_attn_interface, importlib.metadata as m; "
                            "print(m.version('flash-attn-3'))"], capture_output=True, text=True)
    assert probe.stdout.strip() == "3.0.0", probe.stderr

    def doctor(*extra):
        out = run_envtool("doctor", "--venv", str(venv), "--driver", "580.65.06", "--json", *extra, env=env)
        return out.returncode, {f["check"]: f for f in json.loads(out.stdout)["findings"]}

    # this machine has no GPU: torch (the stand-in of the CUDA build) sees none, so the import is not tried
    code, found = doctor("--gpu", "h100")
    assert code == 0 and found["flash-attn-3"]["level"] == "warning"
    assert "torch sees no CUDA device" in found["flash-attn-3"]["message"]
    # on the H100 (torch sees the GPU) the kernels' module is imported: it loads
    site = next((venv.resolve() / "lib").glob("python3.*/site-packages"))
    (site / "torch" / "cuda.py").write_text("def is_available():\n    return True\n")
    code, found = doctor("--gpu", "h100")
    assert code == 0, found
    assert found["flash-attn-3"] == {"level": "ok", "check": "flash-attn-3", "fix": None,
                                     "message": "flash-attn-3 3.0.0: flash_attn_interface imports on the GPU"}
    # a flash_attn_3 whose compiled part does not load against this torch (what an older torch gives: the
    # stable-ABI symbols it needs are missing): an error naming the import failure, with the fix
    (site / "flash_attn_3" / "_C.py").write_text(
        "raise ImportError('flash_attn_3/_C.abi3.so: undefined symbol: aoti_torch_abi_version')\n")
    code, found = doctor("--gpu", "h100")
    assert code == 1 and found["flash-attn-3"]["level"] == "error"
    assert "undefined symbol: aoti_torch_abi_version" in found["flash-attn-3"]["message"]
    assert found["flash-attn-3"]["fix"] == f"envtool install --gpu h100 --driver 580.65.06 --venv {venv}"
    # the same environment on an A100: FA3 is Hopper-only
    code, found = doctor("--gpu", "a100")
    assert code == 1 and "cannot run FlashAttention-3 (needs sm_90 only)" in found["flash-attn-3"]["message"]


def test_install_into_an_existing_interpreter_takes_flash_attn_3_from_the_torch_index(tmp_path, hopper):
    root, env, plan = hopper
    notebook = tmp_path / "notebook"
    subprocess.run([uv_binary(), "venv", "--quiet", "--python", "3.11", str(notebook)], check=True, env=env)
    python = notebook / "bin" / "python"
    with serve(root) as url:
        out = run_envtool("install", "--python", str(python), *H100[:2], "--index-url", f"{url}/pypi/", "--json",
                          env={**env, **index_env(url), "ENVTOOL_GPU": "h100"}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = subprocess.run([str(python), "-c", "import torch, flash_attn_interface, importlib.metadata as m; "
                            "print(torch.__version__, m.version('flash-attn-3'))"], capture_output=True, text=True)
    assert probe.stdout.split() == [f"{plan['torch']['version']}+{plan['torch']['variant']}", "3.0.0"], probe.stderr
    assert json.loads((notebook / "plan.json").read_text())["attention"] == "flash_attention_3"
