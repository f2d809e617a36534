"""Every command the README shows, run as a user types it.

The README's commands are read from it (its fenced bash blocks, and the commands named inline: `envtool ...`,
`python -m trainer ...`, `bash ...`, `pip install ...`, `source ...`); each is listed in COMMANDS below with the test
that runs it, and a command the README gains without a test here fails `test_every_readme_command_has_a_test`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
MIRROR = ROOT / ".ci-cache" / "pypi-mirror"
INLINE = re.compile(r"`((?:envtool|python -m trainer|bash|pip install|source|\.venv/bin/\S+) [^`]+)`")

# README command -> the test that runs it (here, unless it names another file)
COMMANDS = {
    "bash scripts/quickstart.sh": "test_first_run_trains_the_tiny_model_without_root_or_docker",
    "bash .ci/setup && .venv/bin/python -m pytest -q": "test_ci_runs_the_readme_test_command (CI runs it)",
    "python -m trainer make-tiny-model outputs/tiny-model": "test_first_run_trains_the_tiny_model_without_root_or_docker",
    "envtool train examples/tiny-cpu.yml --gpu cpu": "test_first_run_trains_the_tiny_model_without_root_or_docker",
    "source .venv/bin/activate": "test_first_run_trains_the_tiny_model_without_root_or_docker",
    'pip install -e ".[train]"': "test_first_run_trains_the_tiny_model_without_root_or_docker (quickstart's pip line)",
    "bash .ci/run": "test_ci_runs_the_readme_test_command (CI runs it)",
    "envtool resolve --gpu t4,v100,a100,h100 --python 3.11 --platform x86_64 --format markdown":
        "tests/test_docs.py::test_generated_pages_are_not_stale (the table below it)",
    "envtool resolve --gpu t4 --explain": "test_resolve_explain",
    ".venv/bin/uv build --wheel --out-dir dist": "tests/test_wheel.py::test_wheel_installs_and_resolves_from_a_fresh_venv",
    "pip install dist/envtool_llm-0.1.0-py3-none-any.whl":
        "tests/test_wheel.py::test_wheel_installs_and_resolves_from_a_fresh_venv",
    "python -m trainer validate examples/t4-qlora.yml --gpu t4": "test_the_config_to_copy",
    "envtool train examples/t4-qlora.yml --gpu t4 --dry-run": "test_the_config_to_copy",
    "envtool fit examples/t4-qlora.yml --gpu t4": "test_the_config_to_copy",
    "envtool train examples/t4-qlora.yml": "test_the_config_to_copy",
}


def readme_commands() -> list[str]:
    text = README.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith("#"):
                found.append(command)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    inline = [" ".join(c.split()) for c in INLINE.findall(prose)]
    # a command's bare name (`envtool train`, `python -m trainer validate`) names it; with arguments it is a command
    found += [c for c in inline if not re.fullmatch(r"(envtool|python -m trainer) [\w-]+", c)]
    return list(dict.fromkeys(found))


def test_every_readme_command_has_a_test():
    commands = readme_commands()
    assert set(commands) == set(COMMANDS), (f"README commands without a test here: {set(commands) - set(COMMANDS)}; "
                                            f"listed here but gone from the README: {set(COMMANDS) - set(commands)}")
    here = Path(__file__).read_text()
    for command, where in COMMANDS.items():
        test = where.split(" ")[0]
        if "::" in test:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), (command, where)
        else:
            assert f"def {test}(" in here, (command, where)


def test_ci_runs_the_readme_test_command():
    """CI runs `bash .ci/run`, the README's command for every test: it sets up as the README's fast-tier command does,
    and its tiers (with --extended's) split every combination of markers a test can carry into exactly one tier, so
    CI runs the README's fast tier and the rest, and nothing falls between the tiers."""
    from itertools import combinations

    from _pytest.mark.expression import Expression

    ci = (ROOT / ".ci" / "run").read_text()
    commands = readme_commands()
    assert "bash .ci/run" in commands
    fast = [c for c in commands if c.startswith("bash .ci/setup && ")]
    assert fast == ["bash .ci/setup && .venv/bin/python -m pytest -q"], fast
    assert "bash .ci/setup" in ci and ".venv/bin/python -m pytest -q" in ci
    tiers = dict(re.findall(r'^\s*tier "([^"]+)" \S+ -m "([^"]+)"', ci, re.M))
    assert tiers["fast (no marker)"] == "not slow and not distributed and not docker"
    assert "extended" in tiers
    base = ("slow", "distributed", "docker")
    for size in range(len(base) + 1):
        for marks in combinations(base, size):
            for extended in ((False, True) if marks else (False,)):
                names = set(marks) | ({"extended"} if extended else set())
                hits = [t for t, expr in tiers.items() if Expression.compile(expr).evaluate(lambda n: n in names)]
                assert len(hits) == 1, (names, hits)
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "not slow and not distributed and not docker" in addopts  # plain `pytest` is the fast tier


def test_the_config_shown_is_the_example_file():
    """The README's YAML is examples/t4-qlora.yml as it is, less its comment header: copying either is the same."""
    (shown,) = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    example = (ROOT / "examples" / "t4-qlora.yml").read_text()
    assert shown == "".join(line for line in example.splitlines(keepends=True) if not line.startswith("#"))


def test_quickstart_needs_no_root_no_docker_no_npm():
    script = (ROOT / "scripts" / "quickstart.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    for word in ("sudo", "apt-get", "docker", "npm", ".ci/setup"):
        assert word not in code, word
    assert '-e ".[train]"' in code and "torch==2.13.0" in code
    assert "make-tiny-model outputs/tiny-model" in code and "train examples/tiny-cpu.yml --gpu cpu" in code


def user_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "ENVTOOL_PLAN", "ENVTOOL_GPU", "ENVTOOL_DRIVER_VERSION",
                        "ENVTOOL_MATRIX_DIR", "HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update(extra)
    return env


@pytest.mark.slow
def test_first_run_trains_the_tiny_model_without_root_or_docker(tmp_path):
    """`bash scripts/quickstart.sh` in a copy of the repository, as it would run in a fresh clone: a new .venv, the
    `train` extra, the tiny model, and a real training on the CPU. Offline: pip (torch, first and alone: it finds
    the CPU build) and uv (on PATH here, from the test environment: the rest) install from the set-up's wheel mirror,
    which holds torch 2.13.0's CPU build; the pip route for the rest (no uv on PATH) differs only in the installer."""
    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    clone = tmp_path / "envtool"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for name in filter(None, files):
        if (ROOT / name).is_file() and not (ROOT / name).is_symlink():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    env = user_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", UV_OFFLINE="1", UV_NO_INDEX="1",
                   UV_FIND_LINKS=str(MIRROR), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(MIRROR), HF_HUB_OFFLINE="1",
                   OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path))
    env.pop("UV_INDEX_URL", None)
    run = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "training in active environment" in run.stderr and str(clone / ".venv") in run.stderr
    assert "install-torch: torch==2.13.0+cpu (pip finds the CPU build" in run.stderr
    assert (clone / "outputs/tiny-model/config.json").exists()
    assert (clone / "outputs/tiny-cpu/final/model.safetensors").exists()
    # then, as the README says, the venv is the user's: activated, `envtool` and `python -m trainer` are there
    activated = subprocess.run(["bash", "-c", "source .venv/bin/activate && command -v envtool && "
                                              "python -m trainer --version"], cwd=clone, env=env,
                               capture_output=True, text=True, timeout=120)
    assert activated.returncode == 0, activated.stderr
    assert activated.stdout.splitlines()[0] == str(clone / ".venv/bin/envtool")


@pytest.mark.slow
def test_resolve_explain():
    out = subprocess.run([str(BIN / "envtool"), "resolve", "--gpu", "t4", "--explain"], capture_output=True,
                         text=True, env=user_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Tesla T4" in out.stdout and "sdpa" in out.stdout and "flash_attention_2 (needs sm_80+)" in out.stdout


@pytest.fixture
def workdir(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return tmp_path


@pytest.mark.slow
def test_the_config_to_copy(workdir, tmp_path):
    """The four commands under "One config to copy", in a directory holding the examples, with no GPU here:
    validate, the dry run and fit name the T4 themselves; the plain `train` is the one the README runs on the T4
    machine, so it runs here with detection replaced by ENVTOOL_GPU=t4 and `--dry-run` (it would build the cu126
    environment and download a 7B model). The real training on a T4 is the GPU matrix workflow's job."""
    from tests.support.hub import fake_hub, published_config

    env = user_env(HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
                   HF_HUB_ETAG_TIMEOUT="60", HF_HUB_DOWNLOAD_TIMEOUT="60", PYTHONPATH=str(ROOT))

    def run(command: str, **extra):
        argv = command.split()
        argv = [sys.executable, *argv[1:]] if argv[0] == "python" else [str(BIN / argv[0]), *argv[1:]]
        return subprocess.run(argv, cwd=workdir, env={**env, **extra}, capture_output=True, text=True, timeout=300)

    validate = run("python -m trainer validate examples/t4-qlora.yml --gpu t4")
    assert validate.returncode == 0, validate.stderr
    assert "precision: bf16: auto -> fp16" in validate.stdout
    assert "attention: flash_attention_2 -> sdpa (flash_attention_2 needs sm_80+" in validate.stdout

    dry = run("envtool train examples/t4-qlora.yml --gpu t4 --dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "envtool plan for Tesla T4" in dry.stdout and "trainer: attention sdpa, precision fp16" in dry.stdout
    assert dry.stdout.splitlines()[-1].startswith("command: ENVTOOL_PLAN=")

    with fake_hub({"Qwen/Qwen2.5-7B-Instruct": published_config("Qwen/Qwen2.5-7B-Instruct")}) as (url, asked):
        fit = run("envtool fit examples/t4-qlora.yml --gpu t4", HF_ENDPOINT=url)
    assert fit.returncode == 0, fit.stderr
    assert "Tesla T4 (16 GB) x 1" in fit.stdout and re.search(r"\b(fits|tight)\b", fit.stdout), fit.stdout

    on_the_t4 = run("envtool train examples/t4-qlora.yml --dry-run", ENVTOOL_GPU="t4")
    assert on_the_t4.returncode == 0, on_the_t4.stderr
    assert "envtool plan for Tesla T4" in on_the_t4.stdout and "trainer: attention sdpa, precision fp16" in on_the_t4.stdout
    same = re.compile(r"plans/\w+/")  # the same command as for --gpu t4 (the plan file's key differs: its target)
    assert same.sub("", on_the_t4.stdout.splitlines()[-1]) == same.sub("", dry.stdout.splitlines()[-1])
    assert not (workdir / "outputs").exists()  # nothing ran


@pytest.mark.slow
def test_the_quickstart_resolves_as_pip_does_across_pips_indexes(tmp_path):
    """The quickstart's uv takes pip's index settings (scripts/uv-from-pip.sh) and, as pip does, the newest version
    any index holds: with an extra index holding an older release listed beside the main one, uv's own default
    (first-index) would install the older one, as it did to the quickstart's venv (trl 1.13, transformers 5.17 from
    this machine's local index). PyTorch's index, given as an extra index, is not carried: it is for torch alone."""
    from tests.support.pypi import make_wheel, serve, write_simple_index

    root = tmp_path / "indexes"
    write_simple_index(root, "older", [make_wheel(tmp_path / "w1", "envtool-probe", "1.0")])
    write_simple_index(root, "newer", [make_wheel(tmp_path / "w2", "envtool-probe", "2.0")])
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"

    def installed(**extra) -> tuple[str, str]:
        script = (f'source scripts/uv-from-pip.sh "{sys.executable}" && '
                  f'"{BIN / "uv"}" pip install -q --reinstall --python "{python}" envtool-probe && '
                  f'"{python}" -c "import envtool_probe; print(envtool_probe.__version__)" && echo "$UV_EXTRA_INDEX_URL"')
        env = {k: v for k, v in user_env(**extra).items() if not k.startswith(("UV_", "PIP_"))} | extra
        out = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**env, "PIP_CONFIG_FILE": "/dev/null", **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        version, extras = out.stdout.splitlines()[-2:]
        return version, extras

    with serve(root) as url:
        pip_settings = {"PIP_INDEX_URL": f"{url}/newer/",
                        "PIP_EXTRA_INDEX_URL": f"{url}/older/ https://download.pytorch.org/whl/cpu"}
        version, extras = installed(**pip_settings)
        assert version == "2.0"  # pip's answer
        assert extras == f"{url}/older/"  # PyTorch's index left out
        assert installed(**pip_settings, UV_INDEX_STRATEGY="first-index")[0] == "1.0"  # what uv's default did
