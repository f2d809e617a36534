"""The seam between `envtool train` and the trainer: one reader of a config, one rule for what it asks.

- every config `python -m trainer validate CONFIG --gpu G` accepts passes `envtool train CONFIG --gpu G --dry-run`
  and every one it refuses is refused, over the project's examples and the copies of Axolotl's own examples;
- every optimizer name in matrices/optimizers.toml (and the other keys envtool acts on: attention, precision,
  quantization, use_ray, deepspeed/fsdp) leads to the plan the trainer's own classification asks for;
- a command-line option wins over the config, and the trainer (its own process) follows it; `flash_attention:
  false` means off on an A100, in the plan and in the trainer;
- the config is read once, before anything is built, and in --dry-run; under torchrun a trainer failure keeps
  its one line and exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resolver.errors import EnvtoolError, Unsatisfiable
from resolver.launch import Distribution, launcher_nproc, plan_for_config, read_config
from resolver.pipeline import PlanOptions, one_plan
from trainer import facts
from trainer.optim import optimizers as optim
from trainer.errors import TrainerError
from trainer.setup import start

from .conftest import run_envtool
from .test_train_cmd import CPU, config, env, losses, tiny_model, train  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(REPO.glob("examples/**/*.yml"))
AXOLOTL = sorted((REPO / "tests" / "trainer" / "fixtures").rglob("*.y*ml"))  # Axolotl's examples, users' configs
GPUS = ("t4", "v100", "a100", "h100", "cpu")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def opts(gpu: str, **more) -> PlanOptions:
    return PlanOptions(gpu=gpu, python="3.11", platform="x86_64", **more)


def write(tmp_path: Path, name: str = "config.yml", **keys) -> Path:
    base = {"base_model": "org/model", "learning_rate": 2e-5, "datasets": [{"path": "org/data", "type": "alpaca"}]}
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**base, **keys}))
    return path


def envtool_side(path: Path, gpu: str, **more):
    """What `envtool train PATH --gpu GPU` decides before it builds anything: the config read once, the plan for
    it checked by the trainer's rule, the launcher's process count."""
    cfg, notes = read_config(path)
    fitted = plan_for_config(cfg, notes, path, opts(gpu, **more))
    return cfg, fitted, launcher_nproc(fitted.plan, cfg, path, Distribution())


# ---------------------------------------------------------------------------- one rule: validate <=> train


@pytest.mark.slow
@pytest.mark.parametrize("gpu", GPUS)
def test_train_accepts_what_validate_accepts_and_refuses_what_it_refuses(gpu, monkeypatch, tmp_path):
    """Both commands over every config here, through their own entry points (in this process, for speed: the
    trainer's `main` and envtool's typer app with --dry-run --isolated, which probes no environment)."""
    from typer.testing import CliRunner

    from resolver.cli import app
    from trainer.cli import main as trainer_main

    monkeypatch.chdir(REPO)  # the examples name files relative to the checkout (outputs/tiny-model, examples/data)
    for key, value in {**OFFLINE, "ENVTOOL_CACHE_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ENVTOOL_PLAN", raising=False)
    runner = CliRunner()
    verdicts = {}
    for path in EXAMPLES + AXOLOTL:
        validate = trainer_main(["validate", str(path), "--gpu", gpu])
        result = runner.invoke(app, ["train", str(path), "--gpu", gpu, "--python", "3.11", "--platform", "x86_64",
                                     "--isolated", "--dry-run", "--json"])
        verdicts[path] = validate, result.exit_code
        assert validate == result.exit_code, (path, validate, result.output)
        if result.exit_code == 0:  # and what the trainer will run is what the plan installs
            summary = json.loads(result.stdout)
            assert summary["trainer"]["precision"] == summary["plan"]["precision"]
    # the rule is exercised both ways on every GPU, and the project's examples for this GPU pass
    assert (0, 0) in verdicts.values() and (2, 2) in verdicts.values()
    assert all(verdicts[path] == (0, 0) for path in EXAMPLES if gpu in path.stem.split("-") or "cpu" in path.stem
               and gpu == "cpu"), verdicts


@pytest.mark.slow
def test_the_t4_qlora_example_dry_run_says_flash_attention_becomes_sdpa():
    """The scenario this project exists for: an Axolotl config with flash_attention: true taken to a T4."""
    out = run_envtool("train", "examples/t4-qlora.yml", "--gpu", "t4", "--dry-run", env={**os.environ, **OFFLINE})
    assert out.returncode == 0, out.stderr
    assert "flash_attention: true in examples/t4-qlora.yml -> sdpa: flash_attention_2 needs sm_80+" in \
        " ".join(out.stdout.split())
    assert "trainer: attention sdpa, precision fp16" in out.stdout
    assert "note: precision: bf16: auto -> fp16" in out.stdout
    assert "config: optimizer: paged_adamw_8bit: bitsandbytes" in out.stdout


# ---------------------------------------------------------------------------- one classification


OLD_REGEX_GOT_WRONG = {"lion_32bit", "paged_lion_32bit", "ademamix", "paged_ademamix_32bit",  # bitsandbytes, missed
                       "adamw_torch_8bit", "ao_adamw_8bit"}  # torchao, taken for bitsandbytes


@pytest.mark.parametrize("gpu", ["a100", "cpu"])
def test_every_optimizer_name_gets_the_library_the_trainer_builds_it_with(gpu, tmp_path):
    table = optim.table()
    assert OLD_REGEX_GOT_WRONG <= set(table) and len(table) >= 38
    for name, row in table.items():
        path = write(tmp_path, optimizer=name)
        if "unsupported" in row:  # refused by both, in the trainer's words
            with pytest.raises(TrainerError) as trainer_side:
                start(path, gpu)
            with pytest.raises(EnvtoolError) as envtool_side_:
                envtool_side(path, gpu)
            assert str(trainer_side.value) in str(envtool_side_.value) and envtool_side_.value.exit_code == 2
            continue
        _, fitted, _ = envtool_side(path, gpu)
        mentions = [n for n in fitted.notes if n.startswith(f"optimizer: {name}:")]
        library = row["library"]
        if library in ("torch", "transformers"):
            assert mentions == [], (name, fitted.notes)
        elif row.get("feature"):  # bitsandbytes: the plan installs it (its floor is the trainer's check)
            package = facts.feature(row["feature"])["package"]
            assert package == library == "bitsandbytes"
            assert mentions == [f"optimizer: {name}: {package} {fitted.plan.packages[package]} "
                                f"({facts.feature(row['feature'])['reason']})"], (name, fitted.notes)
        else:  # torchao: the plan for the config pins it (packages.toml [[package]]), never mistaken for bitsandbytes
            assert library == "torchao" and "bitsandbytes" not in mentions[0], (name, fitted.notes)
            assert mentions == [f"optimizer: {name}: torchao {fitted.plan.packages['torchao']}, added to the plan "
                                "for this config"], (name, fitted.notes)


@pytest.mark.parametrize("keys, gpu, package, note", [
    ({"load_in_4bit": True, "adapter": "qlora"}, "t4", "bitsandbytes", "load_in_4bit (adapter: qlora): bitsandbytes "),
    ({"load_in_4bit": True, "adapter": "lora"}, "cpu", "bitsandbytes", "load_in_4bit: bitsandbytes "),
    ({"load_in_8bit": True, "adapter": "lora"}, "a100", "bitsandbytes", "load_in_8bit: bitsandbytes "),
    ({"deepspeed": "deepspeed_configs/zero2.json"}, "a100", "deepspeed", "deepspeed: deepspeed_configs/zero2.json: "
                                                                         "deepspeed "),
    ({"deepspeed": "deepspeed_configs/zero3.json"}, "cpu", "deepspeed",  # ZeRO over gloo: added to the CPU plan
     "deepspeed: deepspeed_configs/zero3.json: deepspeed 0.19.8, added to the plan for this config (CPU plans leave"),
])
def test_the_plan_carries_the_library_each_config_choice_runs_on(keys, gpu, package, note, tmp_path):
    _, fitted, _ = envtool_side(write(tmp_path, **keys), gpu)
    assert package in fitted.plan.packages
    assert any(n.startswith(note) for n in fitted.notes), fitted.notes


@pytest.mark.parametrize("keys", [
    {"flash_attention": True}, {"sdp_attention": True}, {"eager_attention": True}, {"flex_attention": True},
    {"xformers_attention": True}, {"attn_implementation": "flash_attention_3"},
    {"attn_implementation": "kernels-community/vllm-flash-attn3"}, {"flash_attention": False}, {},
])
@pytest.mark.parametrize("gpu", ["t4", "a100", "h100", "cpu"])
def test_the_attention_the_trainer_runs_is_the_one_the_plan_installs(keys, gpu, tmp_path):
    """The trainer's attention under the plan needs no module the plan lacks, and a backend the config asks for
    that runs on this GPU is kept (xformers: sdpa, as transformers runs it); `flash_attention: true` asks for
    FlashAttention kernels, and gets the ones `envtool resolve` plans (FA3, torch's varlen_attn)."""
    from matrices.catalog import backend_runs_on
    from trainer.runtime.hardware import attention_backend, attention_backends, varlen_kernels

    cfg, fitted, _ = envtool_side(write(tmp_path, **keys), gpu)
    plan, ran = fitted.plan, fitted.trainer["attention"]
    torchs = {v["name"]: v["attention"] for v in varlen_kernels()}  # torch's varlen_attn: the plan's sdpa, packed
    if ran in torchs:
        assert plan.packing == fitted.trainer["packing"] == "varlen" and plan.attention == torchs[ran], (plan, ran)
        ran = torchs[ran]
    row = next(b for b in attention_backends() if b["name"] == ran)  # what transformers runs, as attention.toml's row
    assert not row.get("module") or plan.attention == ran, (plan.attention, ran)  # its module is the plan's
    asked = cfg.requested_attention
    cc = plan.gpu["compute_capability"]
    if cfg.asks_flash_kernels and plan.packing == "varlen":  # FlashAttention, as `envtool resolve` serves it here
        plain = one_plan(opts(gpu))
        assert (plan.torch, plan.attention, plan.flash_attn) == (plain.torch, plain.attention, plain.flash_attn)
        assert ran == attention_backend(plan.attention)["transformers"], (plan.attention, ran)
    elif asked and backend_runs_on(attention_backend(asked), cc):  # kept where a plan can install it
        runs_as = attention_backend(asked)["transformers"]
        try:
            one_plan(opts(gpu, attention=runs_as))
        except Unsatisfiable:  # (FA3 on an H100: flash-attn publishes no wheel for this torch + Python)
            assert ran != runs_as and plan.attention != runs_as
        else:
            assert ran == runs_as, (asked, ran)
    if keys == {"flash_attention": False}:
        assert not plan.attention.startswith("flash_attention") and not ran.startswith("flash_attention")
        assert plan.flash_attn is None
    if not keys and cc is not None and backend_runs_on(attention_backend("flash_attention_2"), cc):
        # not set: the fastest that runs -- flash kernels, from a wheel or torch's own varlen_attn (packing varlen)
        assert plan.packing == "varlen" and ran == attention_backend(plan.attention)["transformers"], (plan, ran)


@pytest.mark.parametrize("keys, gpu, precision", [
    ({"bf16": "auto"}, "t4", "fp16"), ({"bf16": "auto"}, "a100", "bf16"), ({"bf16": "auto"}, "cpu", "fp32"),
    ({"bf16": True}, "a100", "bf16"), ({"bf16": False}, "a100", "fp32"), ({"fp16": True, "bf16": False}, "a100", "fp16"),
    ({"bf16": True}, "t4", None), ({"fp16": True, "bf16": False}, "cpu", None),
])
def test_precision_is_one_decision_for_plan_and_trainer(keys, gpu, precision, tmp_path):
    path = write(tmp_path, **keys)
    if precision is None:
        with pytest.raises(EnvtoolError) as refused:
            envtool_side(path, gpu)
        with pytest.raises(TrainerError) as trainer_refused:
            start(path, gpu)
        assert refused.value.exit_code == 2 and str(trainer_refused.value) in str(refused.value)
        return
    _, fitted, _ = envtool_side(path, gpu)
    assert fitted.plan.precision == fitted.trainer["precision"] == precision


def test_use_ray_and_fsdp_are_read_by_the_trainers_classification(tmp_path):
    cfg, fitted, nproc = envtool_side(write(tmp_path, use_ray=True, ray_num_workers=3), "a100")
    assert nproc == 1 and any(n.startswith("use_ray: one trainer process, which starts 3 Ray Train") for n in fitted.notes)
    _, fitted, nproc = envtool_side(write(tmp_path, fsdp_version=1, fsdp_config={"reshard_after_forward": True}), "cpu")
    assert "fsdp_version: 1 runs as FSDP2 on CPU" in " ".join(fitted.trainer["notes"])


def test_a_plan_pinned_on_the_command_line_records_it(tmp_path):
    plan = json.loads(run_envtool("resolve", "--gpu", "a100", "--python", "3.11", "--attention", "sdpa", "--json").stdout)
    assert plan["pinned"] == {"attention": "--attention sdpa"} and plan["plan_version"] == "1.2"
    plain = json.loads(run_envtool("resolve", "--gpu", "a100", "--python", "3.11", "--json").stdout)
    assert "pinned" not in plain  # only when something was pinned: the contract's key set is otherwise unchanged


# ---------------------------------------------------------------------------- the command line wins


def validate_with_plan(path: Path, plan_path: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
    return subprocess.run([sys.executable, "-m", "trainer", "validate", str(path), "--plan", plan_path],
                          capture_output=True, text=True, env={**environment, "PYTHONPATH": str(REPO), **OFFLINE})


@pytest.mark.slow
@pytest.mark.parametrize("option", [["--attention", "sdpa"], ["--no-flash-attn"]])
def test_the_command_line_wins_over_the_config_and_the_trainer_follows_the_plan(option, tmp_path, env):
    path = write(tmp_path, flash_attention=True)
    out = train(str(path), "--gpu", "a100", "--python", "3.11", *option, "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["plan"]["attention"] == "sdpa" and result["plan"]["pinned"] == {"attention": " ".join(option)}
    assert any(f"{' '.join(option)} wins over flash_attention: true in {path}" in r for r in result["plan"]["reasons"])
    assert result["trainer"]["attention"] == "varlen_attn"  # sdpa's packing, torch's own varlen kernel (torch 2.15)
    assert result["trainer"]["packing"] == result["plan"]["packing"] == "varlen"
    # the trainer, in its own process, reading the plan envtool points it at
    checked = validate_with_plan(path, result["env"]["ENVTOOL_PLAN"])
    assert checked.returncode == 0, checked.stderr
    assert "attention:  varlen_attn" in checked.stdout
    assert f"attention: sdpa (set on the command line: {' '.join(option)}; the config asks for flash_attention_2)" \
        in checked.stdout


@pytest.mark.slow
def test_flash_attention_false_is_off_on_an_a100_in_the_plan_and_in_the_trainer(tmp_path, env):
    path = write(tmp_path, flash_attention=False)
    out = train(str(path), "--gpu", "a100", "--python", "3.11", "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["plan"]["attention"] == "sdpa" and result["plan"]["flash_attn"] is None
    assert result["trainer"]["attention"] == "varlen_attn"  # torch's own, no flash-attn package
    # a plan made without the config (an A100 image's, with flash-attn installed: torch 2.8 has no varlen_attn of
    # its own, so its plan takes the flash-attn 2 wheel): the trainer still keeps it off
    a100 = run_envtool("resolve", "--gpu", "a100", "--python", "3.11", "--torch", "2.8", "--json")
    assert json.loads(a100.stdout)["attention"] == "flash_attention_2"
    (tmp_path / "a100-plan.json").write_text(a100.stdout)
    checked = validate_with_plan(path, str(tmp_path / "a100-plan.json"))
    assert checked.returncode == 0, checked.stderr
    assert "attention:  sdpa" in checked.stdout and "attention: sdpa (flash_attention: false;" in checked.stdout


@pytest.mark.slow
def test_an_attention_option_is_what_the_trainer_really_trains_with(config, env, tmp_path):
    """`--attention eager` over a config's `attn_implementation: sdpa`: the trainer runs eager (its own log line)."""
    out = train(str(config(attn_implementation="sdpa", max_steps=2)), *CPU, "--attention", "eager", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "training on 1 process(es), CPU (no GPU), attention eager" in out.stderr
    assert "note: attention: eager (set on the command line: --attention eager; the config asks for sdpa)" in out.stderr
    assert [r["step"] for r in losses(tmp_path / "out")] == [1, 2]


# ---------------------------------------------------------------------------- fail early, read once


def typo_config(config) -> Path:
    path = config()
    path.write_text(path.read_text() + "\noptimizer: adamw_bnb_9bit\n")  # (YAML: the last value of a key counts)
    return path


TYPO = "optimizer: unknown optimizer 'adamw_bnb_9bit'; did you mean 'adamw_bnb_8bit'?"  # (a key typo is a warning)


@pytest.mark.parametrize("args", [["--dry-run"], ["--isolated"], ["--image"], ["--nproc", "2"],
                                  ["--emit", "slurm", "--gpu", "a100", "--python", "3.11"]])
def test_a_typo_is_one_line_before_anything_is_built_pulled_or_started(args, config, env, tmp_path):
    """With --dry-run and without: no environment is built (--isolated), no engine asked (--image, with no Docker
    reachable), no torchrun started (--nproc 2), no launcher written (--emit)."""
    path = typo_config(config)
    out = train(str(path), *(CPU if "--gpu" not in args else []), *args, env={**env, "DOCKER_HOST": "tcp://127.0.0.1:9"})
    assert out.returncode == 2
    assert out.stderr.startswith(f"envtool: error: {path}: {TYPO} (supported: ") and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1
    assert not (tmp_path / "cache" / "envs").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--dry-run"], ["--emit", "slurm"], ["--emit", "k8s"]])
def test_the_config_is_parsed_once(args, tmp_path, env):
    """Counted in envtool's own process: the YAML parser runs on the config once (the k8s ConfigMap copies the
    file's text as it is)."""
    path = write(tmp_path, attn_implementation="sdpa", optimizer="paged_adamw_8bit")
    # counted where every YAML loader builds a document (yaml.safe_load and the reader's bounded loader alike)
    script = ("import sys, yaml, runpy\nparsed = []\n"
              "original = yaml.constructor.BaseConstructor.construct_document\n"
              "def counting(self, node):\n    data = original(self, node)\n"
              f"    parsed.append(isinstance(data, dict) and data.get('optimizer') == 'paged_adamw_8bit')\n"
              "    return data\nyaml.constructor.BaseConstructor.construct_document = counting\n"
              f"sys.argv = ['envtool', 'train', {str(path)!r}, '--gpu', 'a100', '--python', '3.11', '--dry-run', "
              f"*{args!r}]\n"
              "try:\n    runpy.run_module('resolver', run_name='__main__')\nexcept SystemExit as e:\n"
              "    print('exit', e.code, file=sys.stderr)\nprint('parsed', sum(parsed), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.stderr.strip().splitlines()[-1] == "parsed 1", out.stderr[-2000:]


@pytest.mark.slow
def test_train_needs_no_torch_to_read_a_config(tmp_path, env):
    """envtool installed without the train extra (its own dependencies only, from the local wheel mirror):
    `envtool train --dry-run` reads and checks the config (pydantic, pyyaml) and plans the environment."""
    mirror = REPO / ".ci-cache" / "pypi-mirror"
    assert mirror.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    uv = Path(sys.executable).parent / "uv"
    venv = tmp_path / "bare"
    subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
    subprocess.run([str(uv), "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-index",
                    "--find-links", str(mirror), *deps], check=True, env={**env, "UV_CACHE_DIR": str(tmp_path / "uv")})
    bare = {**env, "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "VIRTUAL_ENV": str(venv), **OFFLINE}
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "resolver", "train", "examples/t4-qlora.yml", "--gpu",
                          "t4", "--dry-run", "--json"], capture_output=True, text=True, env=bare, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["trainer"]["attention"] == "sdpa" and result["environment"]["kind"] == "cached"
    assert "the active environment lacks torch" in result["environment"]["why"]
    typo = tmp_path / "typo.yml"
    typo.write_text((REPO / "examples" / "t4-qlora.yml").read_text() + "\noptimizer: adamw_bnb_9bit\n")
    refused = subprocess.run([str(venv / "bin" / "python"), "-m", "resolver", "train", str(typo), "--gpu", "t4",
                              "--dry-run"], capture_output=True, text=True, env=bare, cwd=REPO)
    assert refused.returncode == 2 and refused.stderr.startswith(f"envtool: error: {typo}: {TYPO}")


# ---------------------------------------------------------------------------- several processes, one error line


TORCHRUN_NOISE = ("ChildFailedError", "Traceback", "torch.distributed.elastic")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_data_error_under_torchrun_is_the_trainers_one_line_and_exit_code(config, env, tmp_path):
    """A malformed row shows only when rank 0 tokenizes: torchrun alone prints both ranks' fate, its 48-line
    ChildFailedError report and exits 1; envtool prints the trainer's line once and exits 2."""
    from trainer.data.inputs import FIRST_ROWS

    bad = tmp_path / "bad.jsonl"  # the bad row past the rows envtool checks before it starts (tests/resolver/
    bad.write_text('{"instruction": "a", "output": "b"}\n' * FIRST_ROWS  # test_dry_run_inputs.py: those it refuses)
                   + '{"question": "no instruction here"}\n')
    path = config(datasets=[{"path": str(bad), "type": "alpaca"}])
    out = train(str(path), *CPU, "--nproc", "2", env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith(("error", "envtool: error"))]
    assert errors == [f"error: dataset {bad}: a row has no 'instruction' field (type alpaca); columns are "
                      "['instruction', 'output', 'question']; map the field in the dataset's config"], out.stderr
    assert out.stderr.rstrip().endswith(errors[0])
    assert not any(noise in out.stderr for noise in TORCHRUN_NOISE), out.stderr


@pytest.mark.distributed
def test_torchrun_keeps_its_report_when_no_rank_recorded_an_error(tmp_path):
    """resolver.launch.run_torchrun around the real torchrun and a two-line rank script. A rank that dies without
    the trainer's error handler (a crash, a signal): torchrun's own report is all there is, so it is shown as it
    was, with torchrun's exit code. Ranks that record their error: the first one's line, once, and its code."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nfrom trainer.errors import record\nrank = int(os.environ['RANK'])\n"
                      "if sys.argv[1] == 'record':\n    time.sleep(rank)\n"
                      "    assert record(f'error (rank {rank}): bad row' if rank else 'error: bad row', 2)\n"
                      "    sys.exit(2)\nos._exit(7)\n")
    environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    for mode, code, expected in (("crash", 1, "ChildFailedError"), ("record", 2, "error: bad row\n")):
        probe = subprocess.run([sys.executable, "-c", f"""
import sys
from resolver.launch import run_torchrun
sys.exit(run_torchrun({[*command, mode]!r}, {environment!r}, None))"""], capture_output=True, text=True,
                               env=environment, timeout=120)
        assert probe.returncode == code, probe.stderr[-3000:]
        assert expected in probe.stderr
        if mode == "record":
            assert probe.stderr.count("bad row") == 1 and "ChildFailedError" not in probe.stderr, probe.stderr

