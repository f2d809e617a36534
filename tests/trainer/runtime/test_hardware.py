"""Hardware adaptation: what attention and precision become on each GPU, and why."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.trainer.helpers import REPO, run_cli
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError, HardwareError
from trainer.runtime.hardware import Gpu, adapt, detect, gpu_from_name

BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}


def runtime_for(gpu: str, plan: dict | None = None, **keys):
    cfg, _ = parse_config({**BASE, **keys})
    return adapt(cfg, gpu_from_name(gpu), plan)


@pytest.mark.parametrize("gpu, precision, tf32", [
    ("cpu", "fp32", False), ("v100", "fp16", False), ("t4", "fp16", False),
    ("a100", "bf16", True), ("a10g", "bf16", True), ("l4", "bf16", True), ("h100", "bf16", True),
])
def test_bf16_auto_follows_compute_capability(gpu, precision, tf32):
    rt = runtime_for(gpu, bf16="auto")
    assert (rt.precision, rt.tf32) == (precision, tf32)
    assert any(f"bf16: auto -> {precision}" in c for c in rt.changes)


@pytest.mark.parametrize("gpu", ["t4", "v100", "sm_75", "7.0"])
def test_bf16_true_below_ampere_is_an_error_that_says_what_to_set(gpu):
    with pytest.raises(HardwareError, match=r"bf16: true needs native bf16 .*set bf16: auto .* or fp16: true"):
        runtime_for(gpu, bf16=True)


def test_fp16_on_cpu_is_an_error():
    with pytest.raises(HardwareError, match="fp16: true needs a CUDA GPU"):
        runtime_for("cpu", fp16=True, bf16=False)


@pytest.mark.parametrize("gpu, flag, expected", [
    ("t4", {"flash_attention": True}, "sdpa"),
    ("v100", {"attn_implementation": "flash_attention_2"}, "sdpa"),
    ("a100", {"attn_implementation": "flash_attention_3"}, "flash_attention_2"),  # FA3 is sm_90 only
    ("h100", {"attn_implementation": "flash_attention_3"}, "flash_attention_3"),
    ("a100", {"flash_attention": True}, "flash_attention_2"),
    ("cpu", {"flash_attention": True}, "sdpa"),
    ("t4", {"xformers_attention": True}, "sdpa"),
    ("t4", {"attn_implementation": "eager"}, "eager"),
])
def test_attention_falls_back_with_a_reason(gpu, flag, expected):
    rt = runtime_for(gpu, **flag)
    assert rt.attention == expected
    if expected != (flag.get("attn_implementation") or "flash_attention_2"):
        assert any(f"-> {expected} (" in c for c in rt.changes)


def test_gpu_names_and_compute_capability_forms():
    assert gpu_from_name("T4").compute_capability == "7.5"
    assert gpu_from_name("NVIDIA A100").compute_capability == "8.0"
    assert gpu_from_name("sm_89").compute_capability == "8.9"
    assert gpu_from_name("9.0").arch == "hopper"
    assert gpu_from_name("cpu").cc is None
    with pytest.raises(ConfigError, match="unknown GPU 'k80x'"):
        gpu_from_name("k80x")


def plan_for(gpu: str, cc: str | None, attention: str, precision: str, flash_attn=None) -> dict:
    return {
        "gpu": {"name": gpu, "compute_capability": cc, "arch": "turing", "count": 1, "memory_gb": 16, "source": "nvml"},
        "driver": {"version": "550.54", "max_cuda": "12.4"}, "python": "3.11",
        "torch": {"version": "2.5.1", "cuda": "12.4", "variant": "cu124", "index_url": "https://download.pytorch.org/whl/cu124"},
        "attention": attention, "flash_attn": flash_attn, "precision": precision, "triton": "3.1.0",
        "features": {"torch_compile": True, "liger": False}, "packages": {}, "reasons": [], "matrix_version": "1",
    }


def test_plan_from_envtool_plan_decides(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_for("Tesla T4", "7.5", "sdpa", "fp16")))
    monkeypatch.setenv("ENVTOOL_PLAN", str(plan))
    gpu, loaded = detect()
    assert (gpu.name, gpu.compute_capability, gpu.source) == ("Tesla T4", "7.5", f"ENVTOOL_PLAN={plan}")
    cfg, _ = parse_config(BASE)
    rt = adapt(cfg, gpu, loaded)
    assert (rt.attention, rt.precision) == ("sdpa", "fp16")
    assert "chosen by the plan" in " ".join(rt.changes)


def test_plan_without_flash_attn_wheel_means_sdpa(tmp_path):
    plan = plan_for("A100", "8.0", "sdpa", "bf16", flash_attn=None)
    cfg, _ = parse_config({**BASE, "flash_attention": True})
    rt = adapt(cfg, Gpu("A100", "8.0", source="plan"), plan)
    assert rt.attention == "sdpa" and "the plan has no flash-attn wheel" in " ".join(rt.changes)


def test_plan_json_in_working_dir_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv("ENVTOOL_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(plan_for("V100", "7.0", "sdpa", "fp16")))
    gpu, plan = detect()
    assert gpu.compute_capability == "7.0" and gpu.source == "./plan.json"


def test_without_plan_torch_is_probed(monkeypatch, tmp_path):
    monkeypatch.delenv("ENVTOOL_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)
    gpu, plan = detect()
    assert plan is None and gpu.source == "torch probe" and gpu.cc is None  # this machine has no GPU


@pytest.mark.slow
def test_broken_plan_is_bad_input(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    result = run_cli("validate", str(REPO / "examples/tiny-cpu.yml"), "--plan", str(bad))
    assert result.returncode == 2 and "is not valid JSON" in result.stderr


def test_validate_json_reports_runtime_for_another_gpu(capsys):
    assert main(["validate", str(REPO / "examples/t4.yml"), "--gpu", "t4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runtime"]["precision"] == "fp16" and out["runtime"]["attention"] == "sdpa"
    assert out["runtime"]["gpu"]["compute_capability"] == "7.5" and out["runtime"]["device"] == "cuda"
    assert out["config"]["micro_batch_size"] == 2


HARDWARE_KEYS = {"bf16", "fp16", "tf32", "attn_implementation", "flash_attention", "micro_batch_size",
                 "gradient_accumulation_steps", "gradient_checkpointing"}  # (the attention key: either spelling)


def test_gpu_examples_differ_only_where_the_hardware_demands():
    configs = {g: yaml.safe_load((REPO / f"examples/{g}.yml").read_text()) for g in ("t4", "v100", "a100")}
    for a in configs:
        for b in configs:
            differing = {k for k in configs[a].keys() | configs[b].keys() if configs[a].get(k) != configs[b].get(k)}
            assert differing <= HARDWARE_KEYS, (a, b, differing - HARDWARE_KEYS)
    assert len({c["micro_batch_size"] * c["gradient_accumulation_steps"] for c in configs.values()}) == 1


@pytest.mark.parametrize("config, gpu, code", [
    ("t4", "t4", 0), ("v100", "v100", 0), ("a100", "a100", 0), ("a100", "t4", 2), ("a100", "v100", 2),
    ("tiny-cpu", "cpu", 0),
])
def test_examples_validate_on_their_gpu(config, gpu, code, capsys):
    assert main(["validate", str(REPO / f"examples/{config}.yml"), "--gpu", gpu]) == code
    if code == 2:
        assert "bf16: true needs native bf16" in capsys.readouterr().err
