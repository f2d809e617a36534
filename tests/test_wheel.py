"""The install route of the install guide (docs/guides/install.md): a wheel built from the repo with `uv build` installs into a
fresh venv with no index (dependencies from the local mirror), as the distribution `envtool-llm` with the command
`envtool`; it carries the matrices, and `envtool --help` and `envtool resolve` work there with no network."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from resolver import DISTRIBUTION, __version__

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / ".ci-cache" / "pypi-mirror"


@pytest.mark.slow
def test_wheel_installs_and_resolves_from_a_fresh_venv(tmp_path):
    assert WHEELHOUSE.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    dist = tmp_path / "dist"
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "build", "--wheel", "--offline", "-q", "--out-dir", str(dist), str(ROOT)], check=True)
    (wheel,) = dist.glob("envtool_llm-*.whl")
    assert f"-{__version__}-py3-none-any.whl" in wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("matrices/") and n.endswith(".toml")}
    assert shipped == {f"matrices/{p.name}" for p in (ROOT / "matrices").glob("*.toml")}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
                    "--find-links", str(WHEELHOUSE), str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENVTOOL_MATRIX_DIR", "VIRTUAL_ENV")}
    shown = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "show", DISTRIBUTION], capture_output=True,
                           text=True, env=env, check=True).stdout
    assert f"Name: {DISTRIBUTION}" in shown and f"Version: {__version__}" in shown
    helped = subprocess.run([str(venv / "bin" / "envtool"), "--help"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "Usage: envtool" in helped.stdout and "train" in helped.stdout and "install" in helped.stdout
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


def test_every_install_line_installs_this_project_not_pypis_envtool():
    """PyPI's `envtool` is an unrelated project: no command of the README or the docs, notebook cell or workflow may
    install it."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / ".github" / "workflows").glob("*.yml"))]
    texts = {p: p.read_text() for p in pages}
    for path, text in texts.items():
        for line in text.splitlines():
            assert not re.search(r"pip install (-\S+ )*['\"]?envtool(['\"\s\[]|$)", line), f"{path.name}: {line}"
    install = texts[ROOT / "docs" / "guides" / "install.md"]
    assert "uv build --wheel" in install and "envtool_llm-" in install
    assert f'pip install "{DISTRIBUTION} @ git+https://github.com/' in install
    assert "pip install -q envtool_llm-" in texts[ROOT / "docs" / "guides" / "notebooks.md"]  # the notebook cell
    assert "uv build --wheel" in texts[ROOT / "README.md"]
    workflow = (ROOT / ".github" / "workflows" / "gpu-matrix.yml").read_text()
    assert 'pip install "$ENVTOOL_SPEC"' in workflow or "pip install --quiet \"$ENVTOOL_SPEC\"" in workflow
