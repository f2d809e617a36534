"""`envtool train`: a config to a trained model in one command, as a user runs it (subprocesses, real trainer).

The active-environment path trains the tiny example for real; the cached-environment path builds the real CPU
stack from a PEP 503 index on 127.0.0.1 (the first run builds, the second reuses); two launchers on 127.0.0.1
form one torchrun job over a c10d rendezvous.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.pypi import MIRROR, build_indexes, index_env, serve

from .conftest import ENVTOOL, run_envtool

REPO = Path(__file__).resolve().parents[2]
CPU = ["--gpu", "cpu"]

# every test runs `envtool train` on a config in a subprocess, and even --dry-run checks the config with the
# trainer (torch imported): 5.5 s of CPU measured for the README's dry run
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from trainer.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), family="llama", seed=0)


@pytest.fixture
def env(tmp_path):
    """envtool's caches in tmp; no plan from the outside; one thread per process."""
    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")}
    environment.update(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
                       PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    return environment


@pytest.fixture
def config(tmp_path, tiny_model):
    """examples/tiny-cpu.yml with its outputs in tmp and a few steps."""
    def make(**overrides):
        cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
        cfg.update(base_model=str(tiny_model), datasets=[{"path": str(REPO / "examples/data/tiny-alpaca.jsonl"),
                                                           "type": "alpaca"}],
                   dataset_prepared_path=str(tmp_path / "prepared"), output_dir=str(tmp_path / "out"),
                   max_steps=4, saves_per_epoch=None, evals_per_epoch=None, save_total_limit=None,
                   auto_resume_from_checkpoints=None)  # (the example resumes; these runs start clean)
        for key, value in overrides.items():
            cfg[key] = value
        path = tmp_path / "config.yml"
        path.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
        return path

    return make


def train(*args, env, cwd=None, timeout=300):
    return subprocess.run([str(ENVTOOL), "train", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def losses(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.slow
def test_trains_the_tiny_example_in_the_active_environment(tmp_path, config, env):
    path = config(save_steps=2, adapter="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])
    out = train(str(path), *CPU, "--json", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["environment"]["kind"] == "active" and result["exit_code"] == 0
    assert result["command"][1:] == ["-m", "trainer", "train", str(path)]
    assert [r["step"] for r in losses(tmp_path / "out")] == [1, 2, 3, 4]
    assert (tmp_path / "out" / "final").is_dir()
    plan = json.loads(Path(result["env"]["ENVTOOL_PLAN"]).read_text())  # what the trainer was pointed at
    assert plan["gpu"]["compute_capability"] is None and plan["attention"] == "sdpa"
    # what to run next, in the environment it trained in: an adapter to merge, a family the exporter writes, a
    # tokenizer with a chat template
    python = result["command"][0]
    assert [s["command"] for s in result["next_steps"]] == [
        [python, "-m", "trainer", "merge-lora", str(path)],
        [python, "-m", "trainer", "export", str(path), "--format", "gguf"],
        [python, "-m", "trainer", "chat-check", str(path)]]
    # the same command again would start over beside checkpoint-4: refused in one line before anything starts
    again = train(str(path), *CPU, env=env)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.startswith(f"envtool: error: {path}: output_dir {tmp_path / 'out'} holds checkpoint-4 from an "
                                   "earlier run") and len(again.stderr.strip().splitlines()) == 1
    assert [r["step"] for r in losses(tmp_path / "out")] == [1, 2, 3, 4]


def test_the_readme_command_from_the_repository(env, tmp_path):
    """`envtool train examples/tiny-cpu.yml --gpu cpu` as scripts/quickstart.sh (the README's first line) runs it
    (dry run: the real run writes into the checkout's outputs/)."""
    out = train("examples/tiny-cpu.yml", *CPU, "--dry-run", env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "environment: active" in out.stdout
    assert "trainer: loss chosen each step by cost: " in out.stdout  # chunked_cross_entropy unset
    assert "-m trainer train examples/tiny-cpu.yml" in out.stdout.splitlines()[-1]
    assert out.stdout.splitlines()[-1].startswith("command: ENVTOOL_PLAN=")


def test_dry_run_prints_the_plan_and_the_exact_command_and_runs_nothing(tmp_path, config, env):
    out = train(str(config()), *CPU, "--nproc", "2", "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["plan"]["plan_version"] == "1.2" and result["plan"]["precision"] == "fp32"
    assert result["command"][1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1"]
    assert "--standalone" in result["command"] and result["command"][-3:] == ["trainer", "train",
                                                                               str(tmp_path / "config.yml")]
    assert not (tmp_path / "out").exists()
    several = train(str(config()), *CPU, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400",
                    "--dry-run", "--json", env=env)
    command = json.loads(several.stdout)["command"]
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"} <= set(command)


@pytest.mark.parametrize("overrides, args, message", [
    # explicit pins that would change the result: the trainer's own refusal, in one line, before anything is built
    ({"bf16": True, "attn_implementation": "sdpa"}, ["--gpu", "v100"],
     "bf16: true needs native bf16 (sm_80+, Ampere or newer) but Tesla V100 (sm_70, volta) only emulates it"),
    ({"fp16": True, "bf16": None}, CPU, "fp16: true needs a CUDA GPU"),
    ({"load_in_8bit": True, "adapter": "lora"}, ["--gpu", "p100"], "load_in_8bit: bitsandbytes LLM.int8()"),
    ({}, ["--gpu", "cpu", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
])
def test_explicit_pins_that_would_change_the_result_are_refused(config, env, overrides, args, message):
    out = train(str(config(**overrides)), *args, "--dry-run", env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("envtool: error: ")


def test_what_the_gpu_cannot_run_is_adapted_where_the_intent_is_clear(config, env):
    """attn_implementation: flash_attention_2 on a T4 trains with sdpa (the fastest that runs), bf16: auto with fp16:
    the plan and the trainer say so, as `python -m trainer validate --gpu t4` does."""
    out = train(str(config(attn_implementation="flash_attention_2", bf16="auto")), "--gpu", "t4", "--python", "3.11",
                "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["plan"]["attention"] == "sdpa" and result["plan"]["flash_attn"] is None
    assert any(r.startswith("attn_implementation: flash_attention_2 in ") and "-> sdpa: flash_attention_2 needs "
               "sm_80+" in r for r in result["plan"]["reasons"]), result["plan"]["reasons"]
    assert result["trainer"]["attention"] == "sdpa" and result["trainer"]["precision"] == "fp16"
    assert "attention: flash_attention_2 -> sdpa (flash_attention_2 needs sm_80+; Tesla T4 (sm_75, turing) is " \
           "outside that)" in result["trainer"]["notes"]


def test_config_pins_are_honoured(config, env):
    out = train(str(config(attn_implementation="flash_attention_2", bf16=True)), "--gpu", "a100", "--python",
                "3.11", "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["plan"]["attention"] == "flash_attention_2" and result["plan"]["flash_attn"]
    assert result["plan"]["precision"] == "bf16" and "pinned" not in result["plan"]
    assert any("attn_implementation: flash_attention_2 in" in r for r in result["plan"]["reasons"])
    assert result["trainer"]["attention"] == "flash_attention_2"
    eager = json.loads(train(str(config(attn_implementation="eager")), *CPU, "--dry-run", "--json", env=env).stdout)
    assert eager["plan"]["attention"] == "eager" and eager["trainer"]["attention"] == "eager"
    fp16 = json.loads(train(str(config(fp16=True, bf16=None)), "--gpu", "a100", "--python", "3.11", "--dry-run",
                            "--json", env=env).stdout)  # the plan records the config's precision, not its default
    assert fp16["plan"]["precision"] == fp16["trainer"]["precision"] == "fp16"


@pytest.mark.slow
def test_a_config_error_is_the_trainers_own_line_before_anything_starts(config, env, tmp_path):
    """Read by the trainer's reader: the same words `python -m trainer validate` prints, exit 2, nothing built."""
    path = config(learning_rate="fast")
    out = train(str(path), *CPU, "--isolated", env=env)
    assert out.returncode == 2
    validate = subprocess.run([sys.executable, "-m", "trainer", "validate", str(path)], capture_output=True,
                              text=True, env=env)
    assert validate.returncode == 2 and validate.stderr.startswith("error: ")
    assert out.stderr == f"envtool: error: {path}: {validate.stderr.removeprefix('error: ')}"
    assert not (tmp_path / "cache" / "envs").exists()  # --isolated: the environment it would build was not started
    missing = train("no-such.yml", *CPU, env=env)
    assert missing.returncode == 2 and missing.stderr.strip() == "envtool: error: config file not found: no-such.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_launchers_on_one_host_form_one_job_and_train(tmp_path, config, env):
    path = config(max_steps=3)
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [subprocess.Popen([str(ENVTOOL), "train", str(path), *CPU, "--nnodes", "2", "--node-rank", str(i),
                                   "--rdzv-endpoint", endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for i in range(2)]
    results = [p.communicate(timeout=420) for p in launchers]
    for p, (_, err) in zip(launchers, results):
        assert p.returncode == 0, err[-3000:]
    rows = losses(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # one job of two processes: each step's tokens are both ranks' (a single process sees half the data)
    single = train(str(config(max_steps=3, output_dir=str(tmp_path / "single"))), *CPU, env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    assert sum(r["tokens"] for r in rows) > 1.5 * sum(r["tokens"] for r in losses(tmp_path / "single"))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_that_share_no_disk_are_told_in_one_line_within_seconds(tmp_path, config, env):
    """Each launcher in its own working directory, with relative dataset_prepared_path and output_dir: the two
    "nodes" see different directories, as machines without a shared filesystem do. The preflight before the first
    step (trainer/parallel/preflight.py) stops both launchers in one line naming the directory, instead of node 1
    waiting dataset_prepare_timeout (30 min) for rank 0's cache; nothing is prepared."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    raw = yaml.safe_load(config(max_steps=2, dataset_prepared_path="prepared", output_dir="out",
                                preflight_timeout=10).read_text())  # (machine 1 looks for the marker that long)
    for node in nodes:
        node.mkdir()
        (node / "config.yml").write_text(yaml.safe_dump(raw))
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [subprocess.Popen([str(ENVTOOL), "train", "config.yml", *CPU, "--nnodes", "2", "--node-rank", str(i),
                                   "--rdzv-endpoint", endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=node) for i, node in enumerate(nodes)]
    results = [(p, p.communicate(timeout=420)[1]) for p in launchers]
    for p, err in results:
        assert p.returncode == 1, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and "ChildFailedError" not in err and "Traceback" not in err, err[-3000:]
        assert re.match(r"error( \(rank 1\))?: preflight: machine 1 does not see output_dir out \(", errors[0])
    assert not [p for node in nodes for p in (node / "prepared").rglob("*") if p.is_file()]  # nothing prepared


@pytest.mark.slow
def test_a_cached_environment_is_built_once_for_the_plan_and_reused(tmp_path, config, env):
    """--isolated: never the active environment. The first run locks and installs the real CPU stack from a
    local index into the cache (keyed by the plan); the second finds it and starts the trainer at once."""
    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    args = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64", "--isolated"]
    env = {**env, "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    plan = json.loads(run_envtool("resolve", "--json", *args[:-1], env=env).stdout)
    build_indexes(tmp_path / "index", plan, [], real_torch=next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
    racer = config(output_dir=str(tmp_path / "out-b")).rename(tmp_path / "config-b.yml")
    path = config()
    with serve(tmp_path / "index") as url:  # two launchers at once: one builds, the other waits for it (issue 22)
        racers = [subprocess.Popen([str(ENVTOOL), "train", str(p), *args, "--index-url", f"{url}/pypi/", "--json"],
                                   env={**env, **index_env(url)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for p in (path, racer)]
        (first, first_err), (other, other_err) = [r.communicate(timeout=900) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], (first_err + other_err)[-3000:]
    built, waited = json.loads(first)["environment"], json.loads(other)["environment"]
    assert built["kind"] == "cached" and not built["ready"] and waited["path"] == built["path"]
    assert (first_err + other_err).count("waiting for pid") == 1
    assert len(list(Path(f"{built['path']}.versions").iterdir())) == 1  # built once, not twice
    assert [r["step"] for r in losses(tmp_path / "out-b")] == [1, 2, 3, 4]
    assert built["path"].startswith(str(tmp_path / "cache" / "envs"))
    assert [r["step"] for r in losses(tmp_path / "out")] == [1, 2, 3, 4]
    # the environment carries its plan where the trainer's rule finds it
    assert json.loads((Path(built["path"]) / "plan.json").read_text())["torch"]["version"] == "2.13.0"
    # second run: no index at all; it must not need one
    second = train(str(config(output_dir=str(tmp_path / "out2"))), *args, "--json", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    reused = json.loads(second.stdout)["environment"]
    assert reused["ready"] and reused["path"] == built["path"]
    assert json.loads(second.stdout)["command"][0] == str(Path(built["path"]) / "bin" / "python")
    assert [r["step"] for r in losses(tmp_path / "out2")] == [1, 2, 3, 4]


def test_one_process_per_detected_gpu_and_a_cached_environment_when_the_active_one_cannot_run_the_plan(
        tmp_path, config, env):
    """A machine with four A100s (nvidia-smi answers as the real one does): torchrun with four processes, and
    since this CPU-only environment is wrong for an A100 (doctor says so), the environment cached for the plan."""
    from .conftest import FAKES, write_nvidia_smi

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_nvidia_smi(bin_dir, "nvidia-smi-4xa100.csv")
    env = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": f"{FAKES}:{REPO}"}
    out = train(str(config(attn_implementation=None, bf16="auto")), "--python", "3.11", "--dry-run", "--json",
                env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["plan"]["gpu"]["count"] == 4 and result["plan"]["precision"] == "bf16"
    assert "--nproc-per-node=4" in result["command"] and "--standalone" in result["command"]
    where = result["environment"]
    assert where["kind"] == "cached" and not where["ready"]
    assert "doctor finds the active environment wrong for this plan: torch is the CPU build" in where["why"]
    assert result["command"][0] == f"{where['path']}/bin/python"
    assert not (tmp_path / "cache" / "envs").exists() or not any((tmp_path / "cache" / "envs").iterdir())


def test_a_named_venv_is_used_when_it_runs_the_plan_and_built_for_it_otherwise(tmp_path, config, env):
    fresh = json.loads(train(str(config()), *CPU, "--venv", str(tmp_path / "v"), "--dry-run", "--json",
                             env=env).stdout)["environment"]
    assert fresh == {"kind": "venv", "path": str(tmp_path / "v"), "ready": False,
                     "why": f"--venv {tmp_path / 'v'} (built for the plan first)"}
    # a venv that runs the plan (the tests' own environment): used as it is

    venv = Path(sys.executable).parent.parent
    ready = json.loads(train(str(config()), *CPU, "--venv", str(venv), "--dry-run", "--json", env=env).stdout)
    assert ready["environment"]["ready"] and ready["command"][0] == str(venv / "bin" / "python")
    both = train(str(config()), *CPU, "--venv", str(tmp_path / "v"), "--image", env=env)
    assert both.returncode == 2 and "--venv and --image are two places to train" in both.stderr


@pytest.mark.slow
def test_a_trainer_killed_by_a_signal_is_one_named_line_and_the_shells_exit_code(config, env, tmp_path):
    """The kernel's OOM killer sends SIGKILL: `envtool train` exits 137 (128 + 9, as a shell and a scheduler read
    it), not Popen's -9 turned into 247, with one line naming the signal and what sends it."""
    import signal
    import time

    proc = subprocess.Popen([str(ENVTOOL), "train", str(config(max_steps=10_000)), "--gpu", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline, trainer = time.monotonic() + 240, None
    while trainer is None and time.monotonic() < deadline and proc.poll() is None:
        for entry in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = entry.read_bytes().split(b"\0")
                parent = int((entry.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == proc.pid and b"trainer" in argv and b"train" in argv:
                trainer = int(entry.parent.name)
        time.sleep(0.2)
    assert trainer is not None, "the trainer process never started"
    time.sleep(3)  # into its start-up
    os.kill(trainer, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 137, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("envtool: error: the trainer was killed by SIGKILL (the kernel's out-of-memory killer")
    assert last.endswith("exit 137") and "Traceback" not in err
