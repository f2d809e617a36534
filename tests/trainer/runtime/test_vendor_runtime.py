"""The trainer on AMD, Intel and Apple GPUs, through the plan envtool writes: the device it trains on (`cuda` under
HIP, `xpu`, `mps`), the precision (bf16 per AMD target, fp16 with loss scaling on GCN), the attention, and what it
refuses, as `python -m trainer validate --plan` and `train` report them. torch's own probe of a HIP build is
checked with torch answering as one does (torch.version.hip and the device's gcnArchName)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from resolver.pipeline import PlanOptions, one_plan
from trainer.config import parse_config
from trainer.errors import HardwareError
from trainer.runtime.hardware import adapt, gpu_from_name, gpu_from_plan, probe_gpu

ROOT = Path(__file__).resolve().parents[3]
CONFIG = {"base_model": "tiny", "datasets": [{"path": "d.jsonl", "type": "completion"}]}


def plan_for(gpu: str, **kw) -> dict:
    return one_plan(PlanOptions(gpu=gpu, python="3.11", platform="x86_64", **kw)).to_dict()


@pytest.mark.parametrize("gpu, device, precision, kind", [
    ("mi300x", "cuda", "bf16", "amd"),      # HIP answers to torch.cuda
    ("mi50", "cuda", "fp16", "amd"),        # gfx906: no bf16 matrix cores
    ("max1550", "xpu", "bf16", "intel"),
    ("mps", "mps", "bf16", "apple"),
])
def test_the_plan_decides_device_and_precision(gpu, device, precision, kind):
    plan = plan_for(gpu)
    cfg, _ = parse_config({**CONFIG, "bf16": "auto"})
    runtime = adapt(cfg, gpu_from_plan(plan, "plan"), plan)
    assert (runtime.device, runtime.precision, runtime.gpu.kind) == (device, precision, kind)
    assert runtime.attention == "sdpa" and runtime.tf32 is False
    assert runtime.device == plan["device"]


@pytest.mark.slow
def test_validate_with_an_amd_plan_reports_the_device(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_for("mi50")))
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", "examples/mi300x.yml", "--plan", str(plan),
                          "--json"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stdout  # mi300x.yml sets bf16: true, and gfx906 has no bf16 matrix cores
    assert out.stderr.strip().endswith("bf16: true needs bf16 on the matrix cores, and AMD Instinct MI50 (gfx906, "
                                       "GCN5.1) has none (matrices/amd.toml); set bf16: auto (fp16 with loss scaling) "
                                       "or fp16: true")
    plan.write_text(json.dumps(plan_for("mi300x")))
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", "examples/mi300x.yml", "--plan", str(plan),
                          "--json"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    runtime = json.loads(out.stdout)["runtime"]
    assert (runtime["device"], runtime["precision"], runtime["gpu"]["target"]) == ("cuda", "bf16", "gfx942")
    assert runtime["gpu"]["arch"] == "CDNA3"


@pytest.mark.slow
def test_training_with_an_amd_plan_where_torch_sees_no_device_stops_in_one_line(tmp_path):
    """This machine has a CPU torch: the plan's device is not there, and the trainer says which torch it needs."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_for("mi300x")))
    out = subprocess.run([sys.executable, "-m", "trainer", "train", "examples/tiny-cpu.yml"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "ENVTOOL_PLAN": str(plan),
                                        "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "the plan is for AMD Instinct MI300X (gfx942, CDNA3) but torch sees no CUDA device here (it needs a ROCm " \
           "(HIP) build of torch and the GPU's driver)" in last


@pytest.mark.parametrize("name, kind, target, device", [
    ("mi300x", "amd", "gfx942", "cuda"), ("gfx1100", "amd", "gfx1100", "cuda"), ("rx7900xtx", "amd", "gfx1100", "cuda"),
    ("max1550", "intel", "pvc", "xpu"), ("xpu", "intel", None, "xpu"), ("mps", "apple", "mps", "mps"),
])
def test_the_trainer_names_the_gpus_the_resolver_names(name, kind, target, device):
    gpu = gpu_from_name(name)
    assert (gpu.kind, gpu.target, gpu.device) == (kind, target, device)


def test_configs_asking_for_what_the_gpu_cannot_run_are_refused():
    eight_bit, _ = parse_config({**CONFIG, "optimizer": "adamw_bnb_8bit"})
    plan = plan_for("mps")
    with pytest.raises(HardwareError, match="bitsandbytes 8-bit optimizers: bitsandbytes registers no 8-bit"):
        from trainer.setup import fit
        fit(eight_bit, gpu_from_plan(plan, "plan"), plan, model_class=False)
    qlora, _ = parse_config({**CONFIG, "adapter": "qlora", "load_in_4bit": True})
    plan = plan_for("mi50")
    with pytest.raises(HardwareError, match="needs bitsandbytes, which the plan for AMD Instinct MI50 .* leaves out: "
                                            "the ROCm 7.2 library"):
        fit(qlora, gpu_from_plan(plan, "plan"), plan, model_class=False)
    runtime = fit(qlora, gpu_from_plan(plan_for("mi300x"), "plan"), plan_for("mi300x"), model_class=False)
    assert any(n.startswith("load_in_4bit (adapter: qlora): bitsandbytes on AMD Instinct MI300X") for n in runtime.changes)


def test_torch_s_probe_of_a_hip_build(monkeypatch):
    """torch answering as a ROCm build on an MI300X does: torch.version.hip set, torch.cuda available, the device's
    gcnArchName with its feature suffixes."""
    import torch

    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "AMD Instinct MI300X")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    gpu = probe_gpu()
    assert (gpu.kind, gpu.target, gpu.count, gpu.device, gpu.rocm) == ("amd", "gfx942", 8, "cuda", "6.2")
    assert gpu.bf16_native is True and gpu.describe() == "AMD Instinct MI300X (gfx942, CDNA3)"
