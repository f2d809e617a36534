"""What a config uses is in the environment its plan builds (issue 27, item 2).

trainer/features.py is one table from a config's features to the packages they import; the plan for a config pins
them (resolver/launch.py `_needs`), so the lock's pyproject lists them (resolver/lock.py), and the environment and
image installed from that lock carry them. Checked here:

- the table against the packages' own metadata: each module a feature imports is provided (importlib.metadata's
  packages_distributions, in this environment that has every extra installed) by a package the feature names;
- over every config in examples/ and the users' corpus x every GPU of the README's plan tables: the lock written for
  the plan lists every package the trainer will import for that config (the trainer's own judgement under the
  plan: trackers, liger where the trainer switches its kernels on, ...), with its extras; a config refused is
  refused in one line, naming the key when a package does not install there;
- through the CLI: `envtool train CFG --gpu t4 --dry-run` for a wandb config plans wandb, a Liger config plans
  liger-kernel, an 8-bit torchao optimizer on ROCm plans torchao; validate and the dry-run refuse the same
  uninstallable package in one line naming the key;
- the real thing (slow): the CPU plan for a wandb + gguf config locked and installed from the local mirror; every
  module the trainer imports for that config imports there, and `export --format gguf`'s gguf is there.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from resolver.errors import EnvtoolError
from resolver.launch import plan_for_config
from resolver.lock import Sources, pyproject_text, requirements
from resolver.matrix import load
from resolver.pipeline import PlanOptions
from trainer import facts
from trainer.features import FEATURES

from .conftest import run_envtool

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted([*REPO.glob("examples/**/*.yml"), *(REPO / "tests/trainer/fixtures/user_configs").glob("*.y*ml")])
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def readme_gpus() -> list[str]:
    """The GPUs of the README's plan tables (each table is `envtool resolve --gpu A,B,... --format markdown`)."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted(REPO.glob("docs/**/*.md"))] if p.is_file())
    found = re.findall(r"`envtool resolve --gpu\s+(\S+)[^`]*--format markdown`", text)
    return list(dict.fromkeys(g for group in found for g in group.split(",")))


GPUS = readme_gpus()


def _stack_packages() -> set[str]:
    return {canonicalize_name(n) for row in facts.rows("packages", "stack") for n in row["packages"]}


def test_every_feature_names_packages_the_matrices_pin_and_every_package_row_serves_a_feature():
    rows = {canonicalize_name(r["name"]) for r in facts.rows("packages", "package")}
    named = {canonicalize_name(p) for f in FEATURES for p in f.packages}
    # `kernels`: pinned by the plan's transformers ([[kernels_requirement]] / [[kernels_release]] rows)
    hub = {"kernels"} if facts.rows("packages", "kernels_release") else set()
    assert named <= rows | _stack_packages() | hub, named - rows - _stack_packages() - hub
    assert rows <= named, rows - named  # no [[package]] row that no feature imports
    assert len({f.name for f in FEATURES}) == len(FEATURES)


def test_each_module_a_feature_imports_comes_from_a_package_it_names():
    """The oracle is the installed packages' own RECORDs (packages_distributions): this environment has every
    extra installed (.ci/setup). Not installed here, by name and reason: liger-kernel (it needs triton, which the
    CPU torch lacks); SonicMoE's kernels, nvidia-cutlass-dsl and apache-tvm-ffi (expert_kernels: planned for CUDA
    GPUs at sm_90+ only; `kernels` in a CPU venv would make transformers and bitsandbytes fetch Hub kernels)."""
    providers = md.packages_distributions()
    checked = 0
    for feature in FEATURES:
        for module in feature.imports:
            top = module.split(".")[0]
            if top not in providers:
                if feature.name not in ("liger", "expert_kernels"):
                    from tests.support.oracle import missing

                    missing(f"{feature.name}: {module} is not installed here (its extra; .ci/setup installs every "
                            "extra)")
                continue
            by = {canonicalize_name(d) for d in providers[top]}
            allowed = {canonicalize_name(p) for p in feature.packages} | {"torch", "transformers"}
            assert by & allowed, (feature.name, module, by)
            checked += 1
    assert checked >= sum(1 for f in FEATURES if f.imports) - 1


def _read(path: Path):
    """The config as the trainer reads it; one whose only problems are local files that are not on this machine
    (the authors' data and models) is taken as read. None for one the trainer refuses for anything else."""
    from trainer.config import load_config
    from trainer.errors import ConfigError

    try:
        return load_config(path)[0]
    except ConfigError as err:
        if err.config is not None and err.problems and all("not found" in p[1] or "no such" in p[1].lower()
                                                           for p in err.problems):
            return err.config
        return None


def _lock_requirements(plan, m) -> dict[str, Requirement]:
    text = pyproject_text(plan, Sources(), "envtool_llm-0.1.0-py3-none-any.whl", m.no_build, m)
    import tomllib

    deps = tomllib.loads(text)["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


@pytest.mark.slow  # every config x every GPU of the README's tables: about a minute
def test_the_lock_for_every_config_on_every_gpu_lists_what_the_trainer_will_import(monkeypatch):
    from trainer.outputs import loggers
    from trainer.setup import for_plan, needs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert len(GPUS) >= 6, GPUS
    m = load()
    extras = {canonicalize_name(p.name): set(p.extras) for p in m.packages}
    planned = refused = 0
    seen: set[str] = set()
    for path in CONFIGS:
        cfg = _read(path)
        if cfg is None:
            continue
        for gpu in GPUS:
            opts = PlanOptions(gpu=gpu, python="3.11", platform="x86_64")
            try:
                fitted = plan_for_config(cfg, [], path, opts)
            except EnvtoolError as err:  # refused: one line; a package that installs nowhere here names its key
                refused += 1
                assert err.exit_code == 2 and "\n" not in str(err), (path.name, gpu, str(err))
                if "which no plan installs" in str(err):
                    assert any(str(err).split(": ", 1)[1].startswith(n.key) for n in needs(cfg)), str(err)
                continue
            planned += 1
            plan = fitted.plan
            locked = _lock_requirements(plan, m)
            # the trainer's own judgement under this plan: what it will import
            runtime = for_plan(cfg, plan.to_dict())
            # (a server's package beside training -- vllm for trl.use_vllm, step "serve" -- is no import of the
            # trainer's: planned where a release fits, else left out with a note)
            wanted = {canonicalize_name(n.package) for n in needs(cfg, plan.to_dict())
                      if n.step != "serve" or n.package in plan.packages}
            if runtime.kernels:  # the trainer applies liger's kernels under this plan
                wanted.add("liger-kernel")
            wanted |= {canonicalize_name(loggers.PACKAGES[t] if t != "mlflow" else "mlflow-skinny")
                       for t in loggers.wanted(cfg)}
            missing = wanted - set(locked)
            assert not missing, (path.name, gpu, missing)
            for name in wanted:
                assert set(locked[name].extras) == extras.get(name, set()), (path.name, gpu, locked[name])
                assert str(locked[name].specifier) == f"=={plan.packages[locked[name].name]}"
            assert requirements(plan, m)[0].startswith("envtool-llm[train]")
            seen |= wanted
    assert planned >= 100 and refused < planned, (planned, refused)
    assert {"wandb", "bitsandbytes", "gguf"} <= seen, seen  # the corpus exercises trackers, QLoRA, export


def _write(tmp_path: Path, **keys) -> Path:
    base = {"base_model": "org/model", "learning_rate": 2e-5, "datasets": [{"path": "org/data", "type": "alpaca"}],
            "output_dir": str(tmp_path / "out")}
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump({**base, **keys}))
    return path


def _dry_run(path: Path, gpu: str) -> subprocess.CompletedProcess:
    return run_envtool("train", str(path), "--gpu", gpu, "--python", "3.11", "--platform", "x86_64", "--dry-run",
                       "--json", "--isolated", env={**os.environ, **OFFLINE})


@pytest.mark.slow  # four `envtool train --dry-run` runs
@pytest.mark.parametrize("keys, gpu, package", [
    ({"wandb_project": "demo"}, "t4", "wandb"),
    ({"liger_rms_norm": True, "liger_rope": True}, "t4", "liger-kernel"),
    ({"optimizer": "adamw_torch_8bit"}, "mi300x", "torchao"),
    ({"do_causal_lm_eval": True, "val_set_size": 0.1}, "cpu", "sacrebleu"),  # unset metrics: sacrebleu, ter, chrf
])
def test_the_dry_run_plans_the_package_a_config_feature_imports(keys, gpu, package, tmp_path):
    out = _dry_run(_write(tmp_path, **keys), gpu)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["plan"]
    row = next(r for r in facts.rows("packages", "package") if r["name"] == package)
    assert plan["packages"][package] == row["version"]
    assert plan["packages"]["gguf"]  # the export step printed after training runs in the same environment


@pytest.mark.slow  # one dry-run, one validate
def test_a_package_no_plan_installs_is_refused_by_validate_and_the_dry_run_in_one_line_naming_the_key(tmp_path):
    path = _write(tmp_path, optimizer="adamw_torch_8bit")
    out = _dry_run(path, "max1550")  # torchao is unverified on Intel GPUs: packages.toml [[package]] not_on
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "optimizer: adamw_torch_8bit needs torchao, which no plan installs for Intel" in out.stderr
    validate = subprocess.run([sys.executable, "-m", "trainer", "validate", str(path), "--gpu", "max1550"],
                              capture_output=True, text=True, env={**os.environ, **OFFLINE})
    assert validate.returncode == 2, validate.stdout + validate.stderr
    assert "optimizer: adamw_torch_8bit needs torchao, which no plan installs for Intel" in validate.stderr


@pytest.mark.slow  # one plan, with the trainer's imports: ~3-5 s
def test_the_lock_installs_a_feature_package_with_the_extras_its_row_names(tmp_path):
    """use_ray needs ray[train] (Ray Train's pyarrow, pandas ...): the lock asks for the extra, not bare ray."""
    from resolver.launch import read_config

    path = _write(tmp_path, use_ray=True, use_mlflow=True)
    cfg, notes = read_config(path)
    plan = plan_for_config(cfg, notes, path, PlanOptions(gpu="cpu", python="3.11", platform="x86_64")).plan
    locked = _lock_requirements(plan, load())
    assert locked["ray"].extras == {"train"} and str(locked["ray"].specifier) == f"=={plan.packages['ray']}"
    assert str(locked["mlflow-skinny"].specifier) == f"=={plan.packages['mlflow-skinny']}"


@pytest.mark.slow  # four plans (about 4 s)
def test_liger_is_planned_only_where_the_trainer_runs_its_kernels(tmp_path):
    """The trainer's kernels decision (trainer/model/kernels.py) and the plan's packages agree on every GPU."""
    from resolver.launch import read_config
    from trainer.setup import for_plan

    path = _write(tmp_path, liger_rms_norm=True)
    cfg, notes = read_config(path)
    for gpu in ("t4", "v100", "a100", "cpu"):
        fitted = plan_for_config(cfg, notes, path, PlanOptions(gpu=gpu, python="3.11", platform="x86_64"))
        on = for_plan(cfg, fitted.plan.to_dict()).kernels
        assert on == ("liger-kernel" in fitted.plan.packages), (gpu, on, fitted.plan.packages)


@pytest.mark.slow  # six plans (about 6 s)
def test_sonicmoe_is_planned_exactly_where_the_trainer_runs_it(tmp_path):
    """use_sonicmoe (Axolotl's kernels plugin): the plan installs SonicMoE's packages on the GPUs where the trainer's
    choice (trainer/model/expert_kernels.py, transformers' own sm_90 floor) runs it, and nowhere else; `kernels` at
    the release the plan's transformers admits, the two build dependencies at their packages.toml rows."""
    from resolver.launch import read_config
    from resolver.solve import hub_kernels_release
    from trainer.model import expert_kernels
    from trainer.runtime.hardware import gpu_from_name

    path = _write(tmp_path, use_sonicmoe=True, plugins=["axolotl.integrations.kernels.KernelsPlugin"])
    cfg, notes = read_config(path)
    m = load()
    seen = set()
    for gpu, platform in (("h100", "x86_64"), ("b200", "x86_64"), ("gh200", "aarch64"), ("a100", "x86_64"),
                          ("l4", "x86_64"), ("cpu", "x86_64")):
        plan = plan_for_config(cfg, notes, path, PlanOptions(gpu=gpu, python="3.11", platform=platform)).plan
        runs = expert_kernels.choose(cfg, gpu_from_name(gpu)).runs == "sonicmoe"
        planned = {"kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi"} & set(plan.packages)
        assert planned == ({"kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi"} if runs else set()), (gpu, planned)
        if runs:
            rows = {r["name"]: r["version"] for r in facts.rows("packages", "package")}
            assert plan.packages["nvidia-cutlass-dsl"] == rows["nvidia-cutlass-dsl"]
            assert plan.packages["kernels"] == hub_kernels_release(m, plan.packages["transformers"])[0].version
        seen.add(runs)
    assert seen == {True, False}


# ---------------------------------------------------------------------------- the real thing, on the CPU

from .test_train_cmd import config, env, tiny_model, train  # noqa: E402,F401 (fixtures)


@pytest.mark.slow  # locks and installs the real CPU stack from a local index, trains 4 steps, exports (~3 min)
def test_a_wandb_config_trains_in_the_environment_its_cpu_plan_builds_and_the_printed_export_step_runs(
        tmp_path, config, env):
    from tests.support.pypi import MIRROR, build_indexes, index_env, serve

    from resolver.launch import read_config

    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    args = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64", "--isolated"]
    env = {**env, "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "WANDB_SILENT": "true"}
    path = config(wandb_project="envtool-test", wandb_mode="offline")
    dry = train(str(path), *args, "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)["plan"]
    assert {"wandb", "gguf"} <= set(plan["packages"]), plan["packages"]
    build_indexes(tmp_path / "index", plan, [], real_torch=next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
    with serve(tmp_path / "index") as url:
        out = train(str(path), *args, "--index-url", f"{url}/pypi/", "--json", env={**env, **index_env(url)},
                    timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["environment"]["kind"] == "cached"
    python = result["command"][0]
    assert (tmp_path / "out" / "wandb").is_dir()  # the run logged to wandb (offline), in the environment built
    # every module the trainer imports for this config's features imports in that environment
    cfg, _ = read_config(path)
    modules = [m for f in FEATURES if f.uses(cfg, plan) for m in f.imports]
    assert {"wandb", "gguf"} <= set(modules), modules
    probe = subprocess.run([python, "-c", "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)",
                            *modules], capture_output=True, text=True, env={**env, "PYTHONPATH": ""})
    assert probe.returncode == 0, probe.stderr[-2000:]
    # the export step printed after training runs there (gguf installed by the plan)
    export = next(s["command"] for s in result["next_steps"] if "export" in s["command"])
    assert export[0] == python
    done = subprocess.run(export, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "out").rglob("*.gguf")), done.stdout + done.stderr
