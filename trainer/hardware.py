"""Which GPU we train on, and what the config's attention and precision become on it.

The GPU comes from, in order: ``validate --gpu NAME`` / ``--plan``, the plan envtool wrote
(``ENVTOOL_PLAN`` or ``./plan.json``), or torch's own probe. The rules that turn a request into a
setting are tables below, not if-chains: each change carries its reason so ``validate`` can explain it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.config import Config
from trainer.errors import ConfigError, HardwareError
from trainer.planfile import find_plan, read_plan  # noqa: F401 (the one rule for finding the plan)

# Name or alias -> compute capability ("cpu" has none). Enough to answer `validate --gpu NAME`
# without the resolver; the resolver's matrices hold the full list.
KNOWN_GPUS: dict[str, str | None] = {
    "cpu": None,
    "p100": "6.0",
    "v100": "7.0",
    "t4": "7.5",
    "rtx2080": "7.5",
    "a100": "8.0",
    "a30": "8.0",
    "a10": "8.6",
    "a10g": "8.6",
    "rtx3090": "8.6",
    "a40": "8.6",
    "l4": "8.9",
    "l40s": "8.9",
    "rtx4090": "8.9",
    "h100": "9.0",
    "h200": "9.0",
}

# Architecture names by compute-capability major (minor where it matters).
ARCH_BY_CC: dict[str, str] = {
    "6": "pascal", "7.0": "volta", "7.2": "volta", "7.5": "turing", "8.0": "ampere", "8.6": "ampere",
    "8.7": "ampere", "8.9": "ada", "9": "hopper", "10": "blackwell", "12": "blackwell",
}

# Minimum compute capability of each attention backend (None: runs everywhere, CPU included).
ATTENTION_MIN_CC: dict[str, tuple[int, int] | None] = {
    "flash_attention_2": (8, 0),
    "flash_attention_3": (9, 0),
    "xformers": (5, 0),
    "sdpa": None,
    "eager": None,
}

# Attention backends that need a package beyond torch/transformers.
ATTENTION_PACKAGE: dict[str, str] = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}

NATIVE_BF16_CC = (8, 0)  # bf16 tensor cores start with Ampere; below it bf16 is emulated (slow)
TF32_CC = (8, 0)


@dataclass
class Gpu:
    name: str
    compute_capability: str | None  # "7.5"; None on CPU
    count: int = 1
    source: str = "probe"

    @property
    def cc(self) -> tuple[int, int] | None:
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def arch(self) -> str:
        if self.cc is None:
            return "cpu"
        return ARCH_BY_CC.get(self.compute_capability) or ARCH_BY_CC.get(str(self.cc[0]), f"sm_{self.cc[0]}{self.cc[1]}")

    def describe(self) -> str:
        if self.cc is None:
            return f"{self.name} (no GPU)"
        return f"{self.name} (sm_{self.cc[0]}{self.cc[1]}, {self.arch})"


@dataclass
class Runtime:
    """What the trainer will actually use, with the reason for every change from the config."""

    gpu: Gpu
    attention: str
    precision: str  # bf16 | fp16 | fp32
    tf32: bool
    changes: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        return "cpu" if self.gpu.cc is None else "cuda"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpu"]["arch"] = self.gpu.arch
        d["device"] = self.device
        return d


def gpu_from_name(name: str) -> Gpu:
    """'t4', 'A100', 'sm_75', '7.5' -> Gpu."""
    key = re.sub(r"[\s_-]", "", name.lower()).removeprefix("nvidia").removeprefix("tesla")
    if key in KNOWN_GPUS:
        return Gpu(name=name, compute_capability=KNOWN_GPUS[key], source="--gpu")
    m = re.fullmatch(r"(?:sm)?(\d{1,2})\.?(\d)", key)
    if m:
        return Gpu(name=name, compute_capability=f"{int(m.group(1))}.{m.group(2)}", source="--gpu")
    raise ConfigError(f"unknown GPU '{name}'; known: {', '.join(KNOWN_GPUS)}, or a compute capability like sm_75 or 7.5")


def gpu_from_plan(plan: dict, source: str) -> Gpu:
    g = plan["gpu"]
    return Gpu(name=g.get("name") or "gpu", compute_capability=g.get("compute_capability"),
               count=int(g.get("count") or 1), source=source)


def probe_gpu() -> Gpu:
    """Ask torch. Compute capability decides bf16 — never torch.cuda.is_bf16_supported(), which says
    True on T4/V100 because it counts emulation."""
    import torch

    if not torch.cuda.is_available():
        return Gpu(name="cpu", compute_capability=None, count=0, source="torch probe")
    major, minor = torch.cuda.get_device_capability()
    return Gpu(name=torch.cuda.get_device_name(), compute_capability=f"{major}.{minor}",
               count=torch.cuda.device_count(), source="torch probe")


def _cc_str(cc: tuple[int, int]) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def resolve_attention(cfg: Config, gpu: Gpu, plan: dict | None, changes: list[str]) -> str:
    requested = cfg.requested_attention
    if requested is None:
        if plan and plan.get("attention"):
            changes.append(f"attention: {plan['attention']} (chosen by the plan)")
            return _usable_attention(plan["attention"], gpu, plan, changes)
        default = "flash_attention_2" if gpu.cc and gpu.cc >= ATTENTION_MIN_CC["flash_attention_2"] and _has_package("flash_attention_2", plan, gpu) else "sdpa"
        changes.append(f"attention: {default} (not set; best available on {gpu.describe()})")
        return default
    if requested == "xformers":
        changes.append("attention: xformers -> sdpa (transformers has no xformers backend; torch sdpa's "
                       "memory-efficient kernel is the same cutlass kernel and runs on sm_50+)")
        requested = "sdpa"
    return _usable_attention(requested, gpu, plan, changes)


def _has_package(backend: str, plan: dict | None, gpu: Gpu) -> bool:
    """Is the backend's package there? The plan says; for `--gpu NAME` (another machine) assume the
    environment envtool builds for that GPU has it; otherwise look in this environment."""
    package = ATTENTION_PACKAGE.get(backend)
    if package is None:
        return True
    if plan is not None:
        return bool(plan.get("flash_attn")) if backend == "flash_attention_2" else plan.get("attention") == backend
    if gpu.source == "--gpu":
        return True
    return importlib.util.find_spec(package) is not None


def _usable_attention(backend: str, gpu: Gpu, plan: dict | None, changes: list[str]) -> str:
    need = ATTENTION_MIN_CC.get(backend)
    if need is not None and gpu.cc is None:
        changes.append(f"attention: {backend} -> sdpa ({backend} needs a CUDA GPU; running on CPU)")
        return "sdpa"
    if need is not None and gpu.cc < need:
        changes.append(f"attention: {backend} -> sdpa ({backend} needs {_cc_str(need)}+; "
                       f"{gpu.describe()} is below, and sdpa packs safely with the block-diagonal mask)")
        return "sdpa"
    if not _has_package(backend, plan, gpu):
        where = "the plan has no flash-attn wheel" if plan is not None else f"package {ATTENTION_PACKAGE[backend]} is not installed"
        changes.append(f"attention: {backend} -> sdpa ({where})")
        return "sdpa"
    return backend


def resolve_precision(cfg: Config, gpu: Gpu, plan: dict | None, changes: list[str]) -> str:
    native_bf16 = gpu.cc is not None and gpu.cc >= NATIVE_BF16_CC
    if cfg.bf16 is True:
        if gpu.cc is not None and not native_bf16:
            raise HardwareError(
                f"bf16: true needs native bf16 ({_cc_str(NATIVE_BF16_CC)}+, Ampere or newer) but {gpu.describe()} "
                f"only emulates it; set bf16: auto (fp16 with loss scaling) or fp16: true")
        return "bf16"
    if cfg.fp16:
        if gpu.cc is None:
            raise HardwareError("fp16: true needs a CUDA GPU (fp16 autocast with loss scaling); on CPU use bf16: auto (fp32)")
        if native_bf16:
            changes.append(f"precision: fp16 as set; {gpu.describe()} has native bf16, which bf16: auto would pick "
                           "(no loss scaling, wider range)")
        return "fp16"
    if cfg.bf16 == "auto":
        if plan and plan.get("precision") in ("bf16", "fp16", "fp32") and not (plan["precision"] == "bf16" and not native_bf16):
            choice, why = plan["precision"], "chosen by the plan"
        elif gpu.cc is None:
            choice, why = "fp32", "no GPU: CPU trains in fp32"
        elif native_bf16:
            choice, why = "bf16", f"{gpu.describe()} has native bf16"
        else:
            choice, why = "fp16", f"{gpu.describe()} has no native bf16; fp16 with dynamic loss scaling"
        changes.append(f"precision: bf16: auto -> {choice} ({why})")
        return choice
    return "fp32"  # bf16: false and fp16 unset


def resolve_tf32(cfg: Config, gpu: Gpu, changes: list[str]) -> bool:
    capable = gpu.cc is not None and gpu.cc >= TF32_CC
    if cfg.tf32 == "auto":
        return capable
    if cfg.tf32 and not capable:
        changes.append(f"tf32: true -> false (tf32 needs {_cc_str(TF32_CC)}+; {gpu.describe()} has none)")
        return False
    return bool(cfg.tf32)


def adapt(cfg: Config, gpu: Gpu, plan: dict | None = None) -> Runtime:
    """Resolve attention, precision and tf32 for this GPU; raise HardwareError for impossible requests."""
    changes: list[str] = []
    attention = resolve_attention(cfg, gpu, plan, changes)
    precision = resolve_precision(cfg, gpu, plan, changes)
    tf32 = resolve_tf32(cfg, gpu, changes)
    return Runtime(gpu=gpu, attention=attention, precision=precision, tf32=tf32, changes=changes)


def detect(gpu_name: str | None = None, plan_path: str | None = None) -> tuple[Gpu, dict | None]:
    """The GPU to plan for: --gpu, then --plan, then ENVTOOL_PLAN/./plan.json, then torch."""
    if gpu_name:
        return gpu_from_name(gpu_name), None
    if plan_path:
        plan = read_plan(plan_path)
        return gpu_from_plan(plan, f"--plan {plan_path}"), plan
    found = find_plan()
    if found:
        plan, source = found
        return gpu_from_plan(plan, source), plan
    return probe_gpu(), None
