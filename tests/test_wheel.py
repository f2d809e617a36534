"""The install route of the install guide (docs/guides/install.md): a wheel built from the repo with `uv build` installs into a
fresh venv with no index (dependencies from the local mirror), as the distribution `envtool-llm` with the command
`envtool`; it carries the matrices, and `envtool --help` and `envtool resolve` work there with no network."""

import json
import os
import shutil
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


def user_env(tmp_path: Path, **extra) -> dict:
    """A user's shell: nothing of this checkout or the test venv on the paths, caches of its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ENVTOOL_MATRIX_DIR", "VIRTUAL_ENV", "ENVTOOL_PLAN", "ENVTOOL_GPU", "HF_HUB_OFFLINE",
                        "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HOME")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def train_venv(tmp_path_factory):
    """The wheel with the `train` extra alone and torch's CPU build, in a clean venv, from the set-up's mirror of what
    pip resolves today (no index): what `pip install "envtool_llm-...whl[train]"` gives a user, and nothing the dev
    venv holds besides."""
    assert WHEELHOUSE.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    tmp = tmp_path_factory.mktemp("user-install")
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "build", "--wheel", "--offline", "-q", "--out-dir", str(tmp / "dist"), str(ROOT)],
                   check=True)
    (wheel,) = (tmp / "dist").glob("envtool_llm-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(uv), "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--offline",
                    "--no-index", "--find-links", str(WHEELHOUSE), f"{wheel}[train]", "torch==2.13.0"], check=True,
                   env={k: v for k, v in os.environ.items() if not k.startswith("UV_")})
    return venv


def tiny_hub_config(where: Path, base_model: str) -> Path:
    """examples/tiny-cpu.yml with a Hub model id for base_model, its data beside it, two steps."""
    import yaml

    cfg = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yml").read_text())
    (where / "data").mkdir(parents=True, exist_ok=True)
    (where / "data" / "rows.jsonl").write_text((ROOT / "examples" / "data" / "tiny-alpaca.jsonl").read_text())
    cfg.update(base_model=base_model, datasets=[{"path": "data/rows.jsonl", "type": "alpaca"}], max_steps=2,
               val_set_size=0, evals_per_epoch=None, saves_per_epoch=None, dataset_prepared_path="prepared",
               output_dir="out", auto_resume_from_checkpoints=False)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = where / "run.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_the_wheel_with_the_train_extra_trains_a_hub_model_or_says_why_not_in_one_line(train_venv, tmp_path):
    """A user's install (the wheel, `train` extra, torch's CPU build; no dev venv), `envtool train CONFIG --gpu cpu`
    with a Hub model id, against the Hub stand-in serving the tiny model: the run downloads it and saves a model. Then
    the same Hub unreachable: with the model in the Hugging Face cache the run goes offline and trains; with an
    empty cache, and offline (HF_HUB_OFFLINE=1) with an empty cache, one line naming the model and exit 2."""
    from tests.support.hub import fake_hub

    envtool = str(train_venv / "bin" / "envtool")
    check = subprocess.run([str(train_venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    model = tmp_path / "tiny-model"
    subprocess.run([str(train_venv / "bin" / "python"), "-m", "trainer", "make-tiny-model", str(model)], check=True,
                   capture_output=True, env=user_env(tmp_path), cwd=tmp_path)
    config = tiny_hub_config(tmp_path / "run", "tiny-org/tiny-llama")
    hf_home = tmp_path / "hf"

    def train(endpoint: str, home: Path, **extra):
        return subprocess.run([envtool, "train", str(config), "--gpu", "cpu"], capture_output=True, text=True,
                              cwd=config.parent, timeout=600,
                              env=user_env(tmp_path, HF_ENDPOINT=endpoint, HF_HOME=str(home), **extra))

    with fake_hub({"tiny-org/tiny-llama": model}) as (url, asked):
        online = train(url, hf_home)
    assert online.returncode == 0, online.stderr[-3000:]
    assert (config.parent / "out" / "final" / "model.safetensors").is_file()
    assert ("GET", "/tiny-org/tiny-llama/resolve/" + "a" * 40 + "/model.safetensors") in asked \
        or ("GET", "/tiny-org/tiny-llama/resolve/main/model.safetensors") in asked

    import socket

    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
    shutil.rmtree(config.parent / "out")
    cached = train(nowhere, hf_home)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "does not answer (connection refused): offline (HF_HUB_OFFLINE=1)" in cached.stderr
    assert (config.parent / "out" / "final" / "model.safetensors").is_file()

    for extra in ({}, {"HF_HUB_OFFLINE": "1"}):
        failed = train(nowhere, tmp_path / "empty-hf", **extra)
        lines = failed.stderr.strip().splitlines()  # said before any environment or process starts
        assert failed.returncode == 2, failed.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith("envtool: error: "), failed.stderr
        assert f"{config}: base_model: tiny-org/tiny-llama is not on this machine" in lines[0], lines[0]
        assert ("HF_HUB_OFFLINE is set" if extra else "does not answer (connection refused)") in lines[0]
