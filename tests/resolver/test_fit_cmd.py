"""`envtool fit CONFIG --gpu NAME`: as a user runs it (subprocesses), on the repository's example configs.

Hub models are read from a stand-in of the Hub's file endpoint on 127.0.0.1 (tests/support/hub.py) serving their
published config.json; the tests check that nothing but config.json is asked for, that a second run works offline
from the cache, and what the command says when the Hub cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.hub import fake_hub, published_config

from .conftest import ENVTOOL

REPO = Path(__file__).resolve().parents[2]
CONTRACT = {"gpu", "unit", "peak_gb", "low_gb", "high_gb", "fits", "verdict", "breakdown", "suggestions", "options",
            "ignored_memory_options"}
TERMS = {"weights", "gradients", "optimizer", "activations", "logits", "overhead"}
HUB_MODELS = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B")

# each `envtool fit` on a config counts the model with torch: 13-15 s of CPU a test, measured
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A copy of examples/ with the tiny model built where examples/tiny-cpu.yml expects it."""
    from trainer.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fit")
    shutil.copytree(REPO / "examples", root / "examples")
    make_tiny_model(root / "outputs" / "tiny-model", family="llama", seed=0)
    return root


@pytest.fixture
def env(tmp_path):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_TOKEN")}
    environment.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                       OMP_NUM_THREADS="1",
                       # the local stand-in hub answers slowly on a busy machine: huggingface_hub's 10 s metadata
                       # timeout turned a fetch into "unknown" in one run of two (the verdict says why now)
                       HF_HUB_ETAG_TIMEOUT="60", HF_HUB_DOWNLOAD_TIMEOUT="60")
    return environment


def fit(workdir, *args, env, timeout=180):
    return subprocess.run([str(ENVTOOL), "fit", *map(str, args)], capture_output=True, text=True, cwd=workdir,
                          env=env, timeout=timeout)


def fit_json(workdir, *args, env) -> dict:
    result = fit(workdir, *args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def write_config(path: Path, base: str | Path, **keys) -> Path:
    cfg = yaml.safe_load((REPO / base).read_text()) if str(base).endswith(".yml") else {"base_model": str(base), "learning_rate": 2e-5}
    cfg.setdefault("datasets", [{"path": "examples/data/tiny-alpaca.jsonl", "type": "alpaca"}])
    for key, value in keys.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture
def hub(env):
    with fake_hub({name: published_config(name) for name in HUB_MODELS}) as (url, requests):
        env["HF_ENDPOINT"] = url
        yield requests


def test_json_is_the_documented_object(workdir, env):
    out = fit_json(workdir, "examples/tiny-cpu.yml", "--gpu", "t4", env=env)
    assert set(out) == CONTRACT
    assert out["gpu"] == {"name": "Tesla T4", "memory_gb": 16.0, "count": 1}
    assert out["unit"] == "GB"
    assert out["low_gb"] <= out["peak_gb"] <= out["high_gb"]
    assert (out["fits"], out["verdict"]) == (True, "fits")
    assert TERMS <= set(out["breakdown"]) and all(v >= 0 for v in out["breakdown"].values())
    assert sum(out["breakdown"].values()) == pytest.approx(out["peak_gb"], abs=0.02)  # the terms at the peak
    kinds = [s["kind"] for s in out["suggestions"]]
    assert kinds == ["max_micro_batch_size", "max_sequence_len"]  # it fits: nothing to change, only the limits
    assert all({"kind", "change", "text", "peak_gb"} <= set(s) for s in out["suggestions"])
    # what each memory option saves or costs (tests/trainer/fit/test_options.py checks the numbers on an 8B model)
    options = {o["key"]: o for o in out["options"]}
    assert {"gradient_checkpointing", "activation_offloading", "tiled_mlp", "chunked loss"} <= set(options)
    assert options["chunked loss"]["on"] and not options["gradient_checkpointing"]["on"]
    assert all({"key", "on", "term", "gb", "other_gb", "peak_gb", "other_peak_gb", "text"} <= set(o)
               for o in out["options"])
    assert out["ignored_memory_options"] == []  # the memory options Axolotl has that this estimate lacks


# a `peft` first on the path that says it was imported (peft's rule-based fallback can give the same JSON)
NO_PEFT = "open(__file__ + '.imported', 'w').close()\nraise ImportError('peft imported')\n"


@pytest.mark.parametrize("adapter", [
    {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
    {"adapter": "qlora", "load_in_4bit": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]},
], ids=["lora", "qlora"])
def test_a_lora_count_is_kept_and_the_kept_answer_is_the_counted_one(workdir, env, tmp_path, adapter):
    """The first fit of a LoRA/QLoRA config applies peft to the meta-device model (5-15 s); it keeps what peft wraps
    and trains (trainer/runtime/kept.py, lora-layouts/), and the second run answers from it with the same JSON,
    without importing peft (a stand-in `peft` first on the path records an import)."""
    config = write_config(tmp_path / "adapter.yml", "examples/tiny-cpu.yml",
                          base_model=str(workdir / "outputs" / "tiny-model"), **adapter)
    counted = fit_json(workdir, config, "--gpu", "a100", env=env)
    layouts = list((tmp_path / "cache" / "envtool" / "lora-layouts").glob("*.json"))
    assert len(layouts) == 1 and json.loads(layouts[0].read_text())["params"] > 0  # peft's count, kept
    shadow = tmp_path / "no-peft" / "peft"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(NO_PEFT)
    again = fit_json(workdir, config, "--gpu", "a100", env={**env, "PYTHONPATH": f"{shadow.parent}:{REPO}"})
    assert again == counted
    assert not (shadow / "__init__.py.imported").exists(), "the second run imported peft"


def test_human_output(workdir, env):
    """The estimate, and a memory option Axolotl has that this trainer does not named in one line (the estimate is
    the run without it)."""
    config = write_config(workdir / "offload.yml", "examples/tiny-cpu.yml", layer_offloading=True, lora_on_cpu=True)
    result = fit(workdir, config, "--gpu", "a100", env=env)
    assert result.returncode == 0, result.stderr
    assert "NVIDIA A100 (40 GB) x 1" in result.stdout and "fits" in result.stdout
    assert "activations" in result.stdout and "largest micro_batch_size" in result.stdout
    assert "note: ignored memory options: layer_offloading, lora_on_cpu (not implemented here: the run may need more " \
           "memory than in Axolotl; `envtool fit` estimates it without them)" in result.stderr


def test_hub_model_reads_config_json_only_then_works_offline(workdir, env, hub):
    first = fit_json(workdir, "examples/t4-qlora.yml", "--gpu", "t4", env=env)
    assert first["verdict"] in ("fits", "tight") and first["fits"] is True, first.get("reason")
    assert first["breakdown"]["weights"] > 5  # 7.6B parameters: NF4 layers, fp32 embeddings and head (k-bit prep)
    asked = {path.split("?")[0] for _, path in hub if path.startswith("/Qwen/")}
    assert asked == {"/Qwen/Qwen2.5-7B-Instruct/resolve/main/config.json"}  # never a weight file
    hub.clear()
    again = fit_json(workdir, "examples/t4-qlora.yml", "--gpu", "t4", env={**env, "HF_HUB_OFFLINE": "1"})
    assert again == first and not [path for _, path in hub if path.startswith("/Qwen/")]


def test_unknown_when_the_hub_cannot_be_reached(workdir, env):
    result = fit(workdir, "examples/a100.yml", "--gpu", "a100", "--json", env={**env, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0
    out = json.loads(result.stdout)
    assert (out["verdict"], out["peak_gb"], out["fits"]) == ("unknown", None, None)
    assert "Qwen/Qwen2.5-0.5B" in result.stderr and "HF_HUB_OFFLINE" in result.stderr


def test_gated_model_says_how(workdir, env, tmp_path):
    with fake_hub({}, gated=("meta-llama/Llama-3.1-8B",)) as (url, _):
        config = write_config(tmp_path / "gated.yml", "meta-llama/Llama-3.1-8B")
        result = fit(workdir, config, "--gpu", "a100", "--json", env={**env, "HF_ENDPOINT": url})
    assert result.returncode == 0 and json.loads(result.stdout)["verdict"] == "unknown"
    assert "gated" in result.stderr and "HF_TOKEN" in result.stderr


def test_the_first_suggestion_applied_fits(workdir, env, hub, tmp_path):
    """A 7B full fine-tune does not fit an A10G; the change the command names, written into the config, fits."""
    config = write_config(tmp_path / "full.yml", "examples/a100.yml", base_model="Qwen/Qwen2.5-7B-Instruct",
                          adapter=None, lora_r=None, lora_alpha=None, lora_dropout=None, lora_target_linear=None,
                          micro_batch_size=1, gradient_accumulation_steps=16)
    out = fit_json(workdir, config, "--gpu", "a10g", env=env)
    assert (out["verdict"], out["fits"]) == ("does_not_fit", False)
    change = next(s for s in out["suggestions"] if not s["kind"].startswith("max_"))
    assert change["peak_gb"] <= 24
    write_config(config, config, **change["change"])
    applied = fit_json(workdir, config, "--gpu", "a10g", env=env)
    assert applied["fits"] is True and applied["peak_gb"] == pytest.approx(change["peak_gb"], abs=0.01)


def test_micro_batch_suggestion_keeps_the_global_batch(workdir, env, hub, tmp_path):
    config = write_config(tmp_path / "big-batch.yml", "examples/t4.yml", micro_batch_size=64,
                          gradient_accumulation_steps=2)
    out = fit_json(workdir, config, "--gpu", "t4", env=env)
    assert out["fits"] is False
    first = out["suggestions"][0]
    assert first["kind"] == "micro_batch"  # checkpointing is on already: the next cheapest change
    keys = first["change"]
    assert keys["micro_batch_size"] * keys["gradient_accumulation_steps"] == 64 * 2
    assert keys["micro_batch_size"] < 64 and first["peak_gb"] <= 16


def test_largest_micro_batch_is_the_edge(workdir, env, hub, tmp_path):
    config = write_config(tmp_path / "t4.yml", "examples/t4.yml")
    out = fit_json(workdir, config, "--gpu", "t4", env=env)
    largest = next(s for s in out["suggestions"] if s["kind"] == "max_micro_batch_size")
    assert largest["peak_gb"] <= 16
    write_config(config, config, micro_batch_size=largest["change"]["micro_batch_size"] + 1)
    assert fit_json(workdir, config, "--gpu", "t4", env=env)["fits"] is False


def test_zero3_shards_over_the_processes(workdir, env, hub, tmp_path):
    config = write_config(tmp_path / "z3.yml", "examples/a100.yml", base_model="Qwen/Qwen2.5-7B-Instruct",
                          adapter=None, lora_r=None, lora_alpha=None, lora_dropout=None, lora_target_linear=None,
                          deepspeed="deepspeed_configs/zero3_bf16.json", gradient_checkpointing=True)
    one = fit_json(workdir, config, "--gpu", "a100-80gb", "--nproc", "1", env=env)
    eight = fit_json(workdir, config, "--gpu", "a100-80gb", "--nproc", "8", env=env)
    assert eight["gpu"]["count"] == 8
    assert eight["breakdown"]["optimizer"] == pytest.approx(one["breakdown"]["optimizer"] / 8, rel=0.01)
    assert eight["peak_gb"] < one["peak_gb"] / 3 and eight["fits"] and not one["fits"]


def test_memory_unknown_gpu_gives_the_peak_and_an_unknown_verdict(workdir, env):
    result = fit(workdir, "examples/tiny-cpu.yml", "--gpu", "sm_80", "--json", env=env)
    assert result.returncode == 0
    out = json.loads(result.stdout)
    assert out["verdict"] == "unknown" and out["fits"] is None and out["peak_gb"] > 0
    assert out["gpu"]["memory_gb"] is None and "memory" in result.stderr


@pytest.mark.parametrize("args,message", [
    (("examples/tiny-cpu.yml", "--gpu", "nosuchgpu"), "unknown GPU"),
    (("examples/nope.yml", "--gpu", "t4"), "not found"),
    (("examples/tiny-cpu.yml", "--gpu", "cpu"), "name a GPU"),
    (("examples/tiny-cpu.yml", "--gpu", "t4,a100"), "one GPU"),
    (("examples/tiny-cpu.yml", "--gpu", "t4", "--nproc", "0"), "--nproc"),
])
def test_bad_input_is_one_line_and_exit_2(workdir, env, args, message):
    result = fit(workdir, *args, env=env)
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("envtool:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_a_misspelt_key_is_named_and_a_bad_value_is_exit_2(workdir, env, tmp_path):
    # an unknown key is ignored as Axolotl ignores it, with the closest key named (the estimate is the default's)
    config = write_config(tmp_path / "typo.yml", "examples/tiny-cpu.yml", micro_batch_sise=2)
    result = fit(workdir, config, "--gpu", "t4", env=env)
    assert result.returncode == 0, result.stderr
    assert "'micro_batch_sise' is not a key (ignored); did you mean 'micro_batch_size'?" in result.stderr
    config = write_config(tmp_path / "bad.yml", "examples/tiny-cpu.yml", micro_batch_size=0)
    result = fit(workdir, config, "--gpu", "t4", env=env)
    assert result.returncode == 2 and "micro_batch_size" in result.stderr


BLOCK_TORCH = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
            raise ImportError(f"No module named {name!r} (blocked: an environment without the training stack)")
sys.meta_path.insert(0, Block())
sys.argv = ["envtool", *sys.argv[1:]]
from resolver.cli import main
main()
"""


def test_without_torch_the_count_is_analytic(workdir, env, hub):
    """The resolver can run without torch and transformers: the parameters are then counted from config.json's
    sizes (matrices/model_families.toml), the command says so, and the estimate agrees with the exact one."""
    exact = fit_json(workdir, "examples/t4-qlora.yml", "--gpu", "a10g", env=env)
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "fit", "examples/t4-qlora.yml", "--gpu", "a10g"],
                            capture_output=True, text=True, cwd=workdir, env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "(analytic)" in result.stdout and "counted from config.json's sizes" in " ".join(result.stdout.split())
    json_run = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "fit", "examples/t4-qlora.yml", "--gpu", "a10g",
                               "--json"], capture_output=True, text=True, cwd=workdir, env=env, timeout=180)
    analytic = json.loads(json_run.stdout)
    assert analytic["peak_gb"] == pytest.approx(exact["peak_gb"], rel=0.02)
    assert analytic["high_gb"] > exact["high_gb"]  # less sure, so a wider band
