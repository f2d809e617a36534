"""Trust and damage (issue 22), the resolver's side: nothing runs from data, no secret is written, no value
reaches a Dockerfile, a script or a manifest unchecked, and every bad value is one line through the command."""

import json
import os
import pickle
from pathlib import Path

import pytest

from resolver import matrix

from .conftest import run_envtool


class Payload:
    """Unpickling this runs `touch MARKER`: what a planted cache would do if envtool unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_matrix_cache_runs_nothing_and_is_rebuilt(tmp_path):
    import subprocess

    from .conftest import ENVTOOL

    cache_home = tmp_path / "cache"
    # where the envtool command keeps it: its own installed matrices decide the key (an editable install's are this
    # checkout's, a wheel's are in site-packages), so the command's Python says, from outside this checkout
    where = Path(subprocess.run(
        [str(ENVTOOL.parent / "python"), "-c", "from resolver import matrix; print(matrix._cache_path(matrix.matrix_dir()))"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home), "PYTHONPATH": ""}).stdout.strip())
    where.parent.mkdir(parents=True)
    marker = tmp_path / "pwned"
    # a pickle where the old envtool kept it (same key, .pickle), and a JSON in the current place shaped like
    # what object-rebuilding JSON readers (jsonpickle) execute
    where.with_suffix(".pickle").write_bytes(pickle.dumps(Payload(marker)))
    where.write_text(json.dumps({"py/reduce": [{"py/function": "os.system"}, {"py/tuple": [f"touch {marker}"]}],
                                 "version": "planted"}))
    out = run_envtool("resolve", "--gpu", "t4", "--json", XDG_CACHE_HOME=str(cache_home))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gpu"]["compute_capability"] == "7.5"
    assert not marker.exists()
    rebuilt = json.loads(where.read_text())  # replaced by the real matrix, as data
    assert rebuilt["version"] == matrix.load().version and rebuilt["gpus"]
    # a cache of the right shape but a wrong type in a row is not trusted either
    rebuilt["gpus"][0]["memory_gb"] = {"py/function": "os.system"}
    where.write_text(json.dumps(rebuilt))
    out = run_envtool("resolve", "--gpu", "t4", "--json", XDG_CACHE_HOME=str(cache_home))
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(where.read_text())["gpus"][0]["memory_gb"], float)
    assert not marker.exists()


# ---------------------------------------------------------------------------- values that reach a Dockerfile

T4 = ["--python", "3.11", "--platform", "x86_64"]


@pytest.mark.parametrize("args, named", [
    (["--gpu", "t4\nRUN id"], "--gpu 't4\\nRUN id'"),
    (["--gpu", "t4", "--base-image", "debian\nRUN id"], "--base-image 'debian\\nRUN id'"),
    (["--gpu", "t4", "--base-image", "debian RUN id"], "--base-image 'debian RUN id'"),
    (["--gpu", "t4", "--base-image", 'debian"\nLABEL x="1'], "--base-image"),
])
def test_a_value_that_would_add_a_dockerfile_line_is_refused(args, named):
    out = run_envtool("dockerfile", *args, *T4)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and named in out.stderr


def test_a_registry_base_image_with_port_and_digest_is_an_image_reference():
    image = "registry.local:5000/ml/cuda-base:12.6-py3.11@sha256:" + "0123456789abcdef" * 4
    out = run_envtool("dockerfile", "--gpu", "t4", *T4, "--base-image", image)
    assert out.returncode == 0, out.stderr
    assert f'ARG BASE_IMAGE="{image}"' in out.stdout


def test_quoted_dockerfile_values_escape_quotes_backslashes_and_variables(m):
    """What a detected GPU name or a target could hold and still be one line: written as the same characters,
    not expanded by the Dockerfile's variable substitution."""
    from resolver.docker import render
    from resolver.errors import BadInput
    from resolver.pipeline import PlanOptions, one_plan

    plan = one_plan(PlanOptions(gpu="t4", python="3.11", platform="x86_64"))
    text = render(plan._replace(target='t4"$HOME\\'), m)
    assert 'ENVTOOL_TARGET="t4\\"\\$HOME\\\\"' in text
    assert 'io.envtool.target="t4\\"\\$HOME\\\\"' in text
    hostile = plan._replace(gpu={**plan.gpu, "name": "Tesla T4\nRUN id"})
    with pytest.raises(BadInput, match="would break a Dockerfile line"):
        render(hostile, m)


# ---------------------------------------------------------------------------- values that reach a script or manifest

HOSTILE_NAME = "x$(touch PWNED)`touch PWNED2`\necho INJECTED;'.yml"


def hostile_config(tmp_path) -> Path:
    config = tmp_path / HOSTILE_NAME
    config.write_text((Path(__file__).resolve().parents[2] / "examples" / "a100.yml").read_text())
    return config


def emit_here(tmp_path, *args, env=None):
    import subprocess

    from .conftest import ENVTOOL

    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")}
    environment.update(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), **(env or {}))
    return subprocess.run([str(ENVTOOL), "train", *args], capture_output=True, text=True, env=environment,
                          cwd=tmp_path, timeout=120)


A100 = ["--gpu", "a100", "--python", "3.11", "--platform", "x86_64"]
TOKENS = {"HF_TOKEN": "hf_TRUSTTESTTOKEN0123", "WANDB_API_KEY": "wandbTRUSTTESTKEY0123"}


def test_a_hostile_config_name_runs_nothing_in_the_sbatch_script(tmp_path):
    import subprocess

    config = hostile_config(tmp_path)
    script = tmp_path / "train.sbatch"
    out = emit_here(tmp_path, config.name, *A100, "--venv", str(tmp_path / "venv"), "--emit", "slurm", "-o",
                    str(script), "--dry-run", env=TOKENS)
    assert out.returncode == 0, out.stderr
    text = script.read_text()
    assert not any(v in text + out.stdout + out.stderr for v in TOKENS.values())  # tokens come from the environment
    assert "#SBATCH --export=ALL" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
    for f in (bin_dir / "scontrol", bin_dir / "srun", python):
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "7", "SLURM_NODEID": "0"}
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    args = ran.stdout.split("\0")[:-1]
    assert args[-1] == str(config)  # the name arrives whole, as one argument
    assert "INJECTED" not in ran.stdout.replace(str(config), "")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()


def test_the_k8s_job_takes_tokens_from_a_secret_and_a_hostile_name_stays_data(tmp_path):
    import yaml

    config = hostile_config(tmp_path)
    out = emit_here(tmp_path, config.name, *A100, "--emit", "k8s", "--dry-run", "--secret", "team-tokens", env=TOKENS)
    assert out.returncode == 0, out.stderr
    assert not any(v in out.stdout + out.stderr for v in TOKENS.values())
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]  # the name added no document and no key
    config_map, job = docs
    (key,) = config_map["data"]
    assert key == "x__touch_PWNED__touch_PWNED2__echo_INJECTED__.yml"
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["command"][-1] == f"/etc/envtool/{key}"
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert secrets == {k: {"name": "team-tokens", "key": k, "optional": True} for k in TOKENS}
    assert all(line.startswith("#") for line in out.stdout.split("apiVersion:")[0].splitlines())


@pytest.mark.parametrize("args, message", [
    (["--emit", "k8s", "--secret", "Team_Tokens"], "--secret 'Team_Tokens': a Secret name is lower-case"),
    (["--emit", "k8s", "--secret", "a\nb"], "--secret 'a\\nb'"),
    (["--emit", "slurm", "--secret", "tokens"], "--secret goes with --emit k8s"),
])
def test_secret_names_are_checked_before_anything_is_built(tmp_path, args, message):
    config = tmp_path / "a100.yml"
    config.write_text((Path(__file__).resolve().parents[2] / "examples" / "a100.yml").read_text())
    out = emit_here(tmp_path, config.name, *A100, *args)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr


# ---------------------------------------------------------------------------- bounded input

LAUGHS = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                   + [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("name, text, message", [
    ("laughs.yml", "base_model: x\n" + LAUGHS, "its aliases expand it to more than"),
    ("deep.yml", "base_model: " + "[" * 20000 + "]" * 20000 + "\n", "nests deeper than 100 levels"),
    ("self.yml", "base_model: x\nloop: &l [1, *l]\n", "an alias refers to the value that contains it"),
    ("big.yml", "base_model: x\n" + "# padding\n" * 200_000, "a config is at most 1048576 bytes"),
])
def test_hostile_yaml_fails_in_one_line_in_the_one_reader(tmp_path, name, text, message):
    import subprocess
    import sys

    config = tmp_path / name
    config.write_text(text)
    assert len(LAUGHS) < 1600  # the 1.5 KB file
    out = run_envtool("train", str(config), "--gpu", "cpu", "--dry-run")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr[-2000:]
    trainer = subprocess.run([sys.executable, "-m", "trainer", "validate", str(config), "--gpu", "cpu"],
                             capture_output=True, text=True, timeout=120)
    assert trainer.returncode == 2 and message in trainer.stderr and len(trainer.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_thousands_of_problems_are_the_first_ones_and_a_count_each_line_readable(tmp_path):
    config = tmp_path / "many.yml"  # 5000 unknown keys are ignored (Axolotl drops them); 5000 bad values are not
    config.write_text("base_model: x\nlearning_rate: 1.0e-4\n" + "".join(f"unknown_key_{i}: 1\n" for i in range(5000))
                      + "datasets:\n"
                      + "".join(f"  - {{path: d{i}.jsonl, type: alpaca, split: [{i}]}}\n" for i in range(5000)))
    out = run_envtool("train", str(config), "--gpu", "cpu", "--dry-run")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()  # one line per problem, as validate prints them: 24, then the count
    assert len(lines) == 25 and all(len(line) < 2100 for line in lines)
    assert lines[0] == f"envtool: error: {config}: datasets.0.split: Input should be a valid string"
    assert lines[-1] == f"envtool: error: {config}: ... and 4976 more problems"
    assert "unknown_key_" not in out.stderr


@pytest.mark.parametrize("option", ["--python", "--platform", "--attention", "--torch", "--cuda", "--driver"])
def test_an_empty_plan_option_is_an_error_not_the_default(option):
    out = run_envtool("resolve", "--gpu", "t4", option, "")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"envtool: error: {option} is empty: give a value, or leave the "
                                               "option out for the default"]


@pytest.mark.parametrize("args, message", [
    (["--index-url", ""], "--index-url is empty: give a value"),
    (["--extra-index-url", ""], "--extra-index-url is empty: give a value"),
    (["--torch-index", " "], "--torch-index is empty: give a value"),
    (["--ca-bundle", ""], "--ca-bundle is empty: give a value"),
    (["--index-url", "pypi.local/simple"], "--index-url 'pypi.local/simple': give an http(s):// or file:// URL"),
    (["--torch-index", "https://bot:tok3n@/whl/"], "--torch-index 'https://***@/whl/': give an http(s)://"),
])
def test_an_empty_or_hostless_source_is_an_error_not_the_default(tmp_path, args, message):
    out = run_envtool("lock", "--gpu", "t4", *T4[:2], "--out", str(tmp_path / "env"), *args)
    assert out.returncode == 2 and out.stdout == "" and "tok3n" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"envtool: error: {message}")
    assert not (tmp_path / "env").exists()


def test_an_empty_build_tag_is_an_error_not_the_default_tag():
    out = run_envtool("build", "--gpu", "t4", *T4, "--tag", "")
    assert out.returncode == 2 and out.stderr.startswith("envtool: error: --tag '' is not an image reference")


@pytest.mark.slow
def test_a_problem_quoting_a_huge_value_is_cut_and_the_others_stay_whole(tmp_path):
    config = tmp_path / "huge.yml"
    config.write_text(f"base_model: x\nlearning_rate: 1.0e-4\ndatasets: [{{path: {tmp_path / 'd.jsonl'}, type: alpaca}}]\n"
                      f"micro_batch_size: 0\nlr_scheduler: {'z' * 100_000}\n")
    (tmp_path / "d.jsonl").write_text("")
    out = run_envtool("train", str(config), "--gpu", "cpu", "--dry-run")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()  # one line per problem
    assert all(len(line) < 2100 for line in lines) and "characters cut" in out.stderr
    assert any("micro_batch_size: Input should be greater than or equal to 1" in line for line in lines)
    assert any("input should be 'cosine', 'linear', 'constant', 'constant_with_warmup'" in line and "or 'rex'" in line
               for line in lines)  # the choices named whole (trainer/config/training.py lr_scheduler)


# ---------------------------------------------------------------------------- index credentials, one writer per venv

from .test_lock import A100, a100_index, uv_cache  # noqa: E402,F401 (the locked A100 index's fixtures)

USER, TOKEN = "ci-bot", "s3cr3t-TRUST-TOKEN-42"


def scan(*roots: Path) -> list[Path]:
    """The files under `roots` whose bytes hold the token."""
    return [p for root in roots for p in root.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]


@pytest.mark.slow
def test_index_credentials_are_used_never_written_and_two_installs_take_turns(tmp_path, a100_index):
    """A private mirror behind HTTP Basic: the credentials in the URLs reach uv and the downloads, never a file
    or an output line; the install of the lock then authenticates by ~/.netrc (uv's own), and two installs into
    one venv at once take turns (before: the second deleted the first's half-built venv, a traceback)."""
    import subprocess

    from tests.support.pypi import index_env, serve

    from .conftest import ENVTOOL

    root, env, start = a100_index
    plan = start()
    seen = []
    env_dir, venv, house = tmp_path / "envs" / "a100", tmp_path / "project" / ".venv", tmp_path / "wheelhouse"
    with serve(root, auth=f"{USER}:{TOKEN}", seen=seen) as url:
        secret_url = url.replace("://", f"://{USER}:{TOKEN}@")
        out = run_envtool("lock", *A100, "--out", str(env_dir), "--index-url", f"{secret_url}/pypi/",
                          "--wheelhouse", str(house), "--json", env={**env, **index_env(secret_url)}, timeout=300)
        assert out.returncode == 0, out.stderr
        assert TOKEN not in out.stdout + out.stderr
        locked = json.loads(out.stdout)["plan"]
        assert locked["torch"]["index_url"] == f"{url}/torch/{plan['torch']['variant']}/"
        assert locked["flash_attn"]["wheel_url"].startswith(f"{url}/gh/")
        assert scan(env_dir, house) == [] and len(list(house.glob("*.whl"))) > 10
        authorized = {path.split("/")[1] for path, ok in seen if ok}
        assert {"pypi", "torch", "gh"} <= authorized  # every source was reached with the credentials

        fresh = {**env, "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "NETRC": str(tmp_path / "no-netrc")}
        out = run_envtool("install", str(env_dir), "--venv", str(venv), env=fresh, timeout=300)
        assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "401" in out.stderr and TOKEN not in out.stderr

        netrc = tmp_path / "netrc"
        netrc.write_text(f"machine 127.0.0.1 login {USER} password {TOKEN}\n")
        netrc.chmod(0o600)
        installs = [subprocess.Popen([str(ENVTOOL), "install", str(env_dir), "--venv", str(venv), "--json"],
                                     env={**fresh, "NETRC": str(netrc)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [p.communicate(timeout=600) for p in installs]
    for p, (stdout, stderr) in zip(installs, results):
        assert p.returncode == 0, stderr
        assert TOKEN not in stdout + stderr
    waited = [stderr for _, stderr in results if "waiting for pid" in stderr]
    assert len(waited) == 1 and str(installs[0].pid if waited[0] is results[1][1] else installs[1].pid) in waited[0]
    paths = [json.loads(stdout)["path"] for stdout, _ in results]
    assert str(venv.resolve()) in paths and all(Path(p).is_dir() for p in paths)  # neither deleted the other's
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, trainer; print(torch.__version__)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == f"{plan['torch']['version']}+{plan['torch']['variant']}", probe.stderr
    assert scan(venv.resolve(), env_dir) == []
