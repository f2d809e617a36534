"""A wheel built from the repo carries the matrices: install it into a fresh venv, with no index, and resolve."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / ".ci-cache" / "pypi-mirror"


@pytest.mark.slow
def test_wheel_installs_and_resolves_from_a_fresh_venv(tmp_path):
    assert WHEELHOUSE.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    dist = tmp_path / "dist"
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "build", "--wheel", "--offline", "-q", "--out-dir", str(dist), str(ROOT)], check=True)
    (wheel,) = dist.glob("envtool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("matrices/") and n.endswith(".toml")}
    assert shipped == {f"matrices/{p.name}" for p in (ROOT / "matrices").glob("*.toml")}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
                    "--find-links", str(WHEELHOUSE), str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENVTOOL_MATRIX_DIR", "VIRTUAL_ENV")}
    out = subprocess.run([str(venv / "bin" / "envtool"), "resolve", "--gpu", "t4", "--json"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    meta = (ROOT / "matrices" / "meta.toml").read_text()
    assert f'version = "{plan["matrix_version"]}"' in meta
    assert plan["gpu"]["name"] == "Tesla T4" and plan["attention"] == "sdpa"
    # it ran from the venv, not from this checkout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import matrices; print(matrices.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout
    assert str(venv) in where
