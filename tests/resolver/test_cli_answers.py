"""What the command line says must be what it does (issue 16, item 8): an empty or `None` target is an error,
not a CPU plan; `--help` says which commands take a list of GPUs, and those are the ones that do; a driver older
than the GPU's first driver branch gets no plan."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from .conftest import run_envtool

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples" / "tiny-cpu.yml")


@pytest.mark.parametrize("args, env, message", [
    (["resolve", "--gpu", ""], {}, "--gpu is empty"),
    (["resolve", "--gpu", "None"], {}, "--gpu 'None' is not a GPU"),
    (["resolve", "--gpu", "t4,none"], {}, "--gpu 'none' is not a GPU"),
    (["resolve", "--gpu", "auto"], {"ENVTOOL_GPU": ""}, "ENVTOOL_GPU is set but empty"),
    (["resolve"], {"ENVTOOL_GPU": "None"}, "ENVTOOL_GPU 'None' is not a GPU"),
    (["lock", "--gpu", "", "--out", "OUT"], {}, "--gpu is empty"),
    (["install", "--gpu", "", "--venv", "OUT"], {}, "--gpu is empty"),
    (["dockerfile", "--gpu", "None"], {}, "--gpu 'None' is not a GPU"),
    (["doctor", "--gpu", ""], {}, "--gpu is empty"),
    (["train", TINY, "--gpu", "", "--dry-run"], {}, "--gpu is empty"),
    (["train", TINY, "--dry-run"], {"ENVTOOL_GPU": ""}, "ENVTOOL_GPU is set but empty"),
])
def test_an_empty_or_none_gpu_is_an_error_not_a_cpu_plan(tmp_path, args, env, message):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    out = run_envtool(*args, **env, ENVTOOL_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith(f"envtool: error: {message}") and len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == "" and not (tmp_path / "out").exists()


def gpu_help(command: str) -> str:
    out = run_envtool(command, "--help", COLUMNS="300")
    assert out.returncode == 0, out.stderr
    block = re.search(r"^  --gpu <str>(.*?)(?=^  -|\Z)", out.stdout, re.M | re.S)
    assert block, out.stdout
    return " ".join(block.group(1).split())


# command -> the rest of a call that runs it up to where it would use --gpu (nothing is built: a dead engine,
# --dry-run, a lock directory in tmp)
CALLS = {
    "resolve": [],
    "build": [],
    "lock": ["--out", "OUT"],
    "install": ["--venv", "OUT"],
    "dockerfile": [],
    "doctor": [],
    "train": [TINY, "--dry-run"],
}


@pytest.mark.parametrize("command", sorted(CALLS))
def test_help_says_a_list_exactly_where_a_list_is_taken(tmp_path, command):
    says_list = "comma list" in gpu_help(command)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in CALLS[command]]
    args = args[:1] + ["--gpu", "t4,a100"] + args[1:] if command == "train" else [*args, "--gpu", "t4,a100"]
    out = run_envtool(command, *args, DOCKER_HOST=f"unix://{tmp_path / 'no-engine.sock'}",
                      ENVTOOL_CACHE_DIR=str(tmp_path / "cache"))
    refused = out.returncode == 2 and ("single target" in out.stderr or "one GPU" in out.stderr)
    assert refused != says_list, (command, out.returncode, out.stderr)
    if not says_list:
        assert "one target" in gpu_help(command)


@pytest.mark.parametrize("gpu, driver, branch", [
    ("h100", "470.82.01", "R520"),
    ("rtx4090", "470.82.01", "R520"),
    ("l4", "515.65.01", "R520"),
    ("a10", "450.80.02", "R455"),
])
def test_a_driver_older_than_the_gpu_gets_no_plan(tmp_path, gpu, driver, branch):
    for args in (["resolve", "--gpu", gpu, "--driver", driver],
                 ["train", TINY, "--gpu", gpu, "--driver", driver, "--dry-run"]):
        out = run_envtool(*args, ENVTOOL_CACHE_DIR=str(tmp_path / "cache"))
        assert out.returncode == 2, out.stdout
        line = out.stderr.strip()
        assert len(line.splitlines()) == 1 and f"driver {driver} cannot run" in line
        assert f"(needs {branch} or newer); upgrade the NVIDIA driver" in line


@pytest.mark.parametrize("gpu, driver", [("a100", "470.82.01"), ("h100", "520.61.05"), ("a10", "455.23.04")])
def test_a_driver_of_the_gpus_first_branch_or_later_gets_a_plan(gpu, driver):
    out = run_envtool("resolve", "--gpu", gpu, "--driver", driver, "--json")
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_train_never_runs_a_plan_for_another_python_in_this_environment(tmp_path):
    """`--python 3.9` from a 3.11 environment: the plan is 3.9's, so the active 3.11 environment is not used; with
    no 3.9 interpreter uv can find, the run refuses in one line before it says where it trains and before locking
    or building anything, and --dry-run refuses the same way (a dry run shows what the run would do)."""
    env = dict(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), ENVTOOL_PLAN=None, ENVTOOL_GPU=None)
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    other = "3.9" if host != "3.9" else "3.10"
    refusal = (f"envtool: error: the plan is for Python {other} and uv finds no Python {other} interpreter on this "
               f"machine: install one (`uv python install {other}`) or drop --python to plan for this one")
    # PATH without pyenv or other interpreters, no uv-managed ones: uv finds no Python `other`
    bare = dict(PATH="/usr/bin:/bin", UV_PYTHON_INSTALL_DIR=str(tmp_path / "no-pythons"), **env)
    for dry in ([], ["--dry-run"], ["--dry-run", "--json"]):
        out = run_envtool("train", TINY, "--gpu", "cpu", "--python", other, *dry, **bare)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert out.stderr.strip() == refusal  # the only line: no "training in ... environment" before it
    assert not (tmp_path / "cache" / "envs").exists() or not any((tmp_path / "cache" / "envs").iterdir())
    # the host's own Python is found: the plan for it runs here (the active environment), no interpreter asked for
    same = run_envtool("train", TINY, "--gpu", "cpu", "--python", host, "--dry-run", "--json", **bare)
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["environment"]["kind"] == "active"


@pytest.mark.parametrize("command", [["envtool", "resolve", "--gpu", "t4"],
                                     ["python", "-m", "trainer", "validate", "examples/tiny-cpu.yml"]])
def test_a_user_without_a_home_directory_gets_one_line(command, tmp_path):
    """A container run with an arbitrary uid: HOME unset and no passwd entry (issue 44 item 7). One line, exit 2,
    not a RuntimeError from pathlib deep in a cache path."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.oracle import missing

    setpriv = shutil.which("setpriv")
    if not setpriv or os.geteuid() != 0:  # another uid needs root (CI runs as root)
        missing("running as a user without a passwd entry needs root and setpriv (util-linux)")
    uid = 54321
    exe = [str(Path(sys.executable).parent / "envtool")] if command[0] == "envtool" else [sys.executable]
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    # the user may read what root can (CAP_DAC_READ_SEARCH): a checkout under a folder only root enters (a fresh
    # clone in `mktemp -d`, root's home) stays readable to it, so the run reaches the home check
    argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search", *exe, *command[1:]]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"{'envtool: ' if command[0] == 'envtool' else ''}error: no home directory: HOME is not set and user {uid} has "
        "no passwd entry; set HOME to a writable folder (caches go under $HOME/.cache)"]
