"""Which GPU we train on, and what the config's attention and precision become on it.

The GPU comes from, in order: ``validate --gpu NAME`` / ``--plan``, the plan envtool wrote (found by the one
rule in trainer/runtime/planfile.py), or torch's own probe. The facts (GPU catalog, architectures, attention backends)
are matrices/' rows, read through trainer/facts.py; each change carries its reason so ``validate`` can explain it.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import asdict, dataclass, field

from matrices import catalog
from trainer import facts
from trainer.config import Config
from trainer.errors import ConfigError, HardwareError
from trainer.runtime import vendors
from trainer.runtime.planfile import find_plan, read_plan  # noqa: F401 (the one rule for finding the plan)

# Every fact below comes from matrices/ (gpus.toml, archs.toml, attention.toml), the same files the resolver
# reads: the GPU catalog, what each architecture can do, and which attention backends run where.


def _arch(cc: str | None) -> dict | None:
    """The archs.toml row for a compute capability (nearest lower minor of its major), or None."""
    return None if cc is None else catalog.arch_for(cc, facts.rows("archs", "arch"))


def attention_backends() -> list[dict]:
    """attention.toml's rows, best first."""
    return facts.rows("attention", "backend")


def attention_backend(name: str) -> dict | None:
    return next((b for b in attention_backends() if b["name"] == name), None)


def varlen_kernels() -> list[dict]:
    """torch.toml's [[varlen]] rows: torch's own kernels that keep packed rows apart by cu_seqlens (no mask). The
    trainer registers each with transformers under the row's `name` (trainer/model/attention_varlen.py)."""
    return facts.rows("torch", "varlen")


def packing(transformers_name: str) -> str:
    """How packed sequences are kept apart for the backend transformers runs under this name (attention.toml's
    packing column: position_ids, row_position_ids, bool_mask or float_mask); torch's varlen kernels (torch.toml
    [[varlen]]) take position_ids, as flash-attn does."""
    if any(v["name"] == transformers_name for v in varlen_kernels()):
        return "position_ids"
    row = next((b for b in attention_backends() if b["transformers"] == transformers_name), {})
    return row.get("packing", "bool_mask")


@dataclass
class Gpu:
    name: str
    compute_capability: str | None  # "7.5"; None on CPU and on AMD, Intel and Apple GPUs
    count: int = 1
    source: str = "probe"
    vendor: str | None = None  # amd | intel | apple (trainer/runtime/vendors.py); None: NVIDIA, or the CPU without a cc
    target: str | None = None  # AMD's gfx target, Intel's AOT family, "mps"
    bf16_native: bool | None = None  # AMD: amd.toml's per target (or the plan's); None: decided on the device
    rocm: str | None = None  # a ROCm plan's ROCm (which bitsandbytes library loads)
    memory_gb: float | None = None  # per device (gpus.toml's, the plan's or the probe's); None: unknown

    @property
    def cc(self) -> tuple[int, int] | None:
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def kind(self) -> str:
        """nvidia | amd | intel | apple | cpu."""
        return self.vendor or ("cpu" if self.cc is None else "nvidia")

    @property
    def other_vendor(self) -> bool:
        """An AMD, Intel or Apple GPU: no compute capability, its own facts (trainer/runtime/vendors.py)."""
        return self.kind in ("amd", "intel", "apple")

    @property
    def device(self) -> str:
        """torch's device type: cuda (NVIDIA, and AMD under HIP), xpu, mps, cpu."""
        return vendors.DEVICE[self.kind]

    @property
    def arch(self) -> str:
        if self.other_vendor:
            return vendors.family(self.kind, self.target)
        if self.cc is None:
            return "cpu"
        row = _arch(self.compute_capability)
        return row["name"] if row else f"sm_{self.cc[0]}{self.cc[1]}"

    def has(self, feature: str) -> bool:
        """An archs.toml capability column ('bf16', 'tf32', 'fp8', 'tensor_cores'); False on CPU or for a
        compute capability the matrix does not know. AMD, Intel, Apple: bf16 as their facts or the plan say
        (True only where known), nothing else (TF32 and these fp8 paths are NVIDIA's)."""
        if self.other_vendor:
            return feature == "bf16" and self.bf16_native is True
        row = _arch(self.compute_capability)
        return bool(row and row.get(feature, False))

    def describe(self) -> str:
        if self.other_vendor:
            detail = ", ".join(x for x in (self.target, self.arch) if x and x not in self.name and x != "mps")
            return f"{self.name} ({detail})" if detail else self.name
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
    isolation: str = ""  # how packed rows are kept apart, and why (trainer/model/attention.py choose_packing)
    mask_without_cudnn: bool = False  # masked SDPA calls run with cuDNN attention off (the plan's mask_without_cudnn)

    @property
    def device(self) -> str:
        return self.gpu.device

    @property
    def packing(self) -> str:
        """The plan's vocabulary: "varlen" (cu_seqlens from position_ids, no mask) or "mask"."""
        return "varlen" if packing(self.attention) == "position_ids" else "mask"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpu"]["arch"] = self.gpu.arch
        d["device"] = self.device
        d["packing"] = self.packing
        return d


def gpu_from_name(name: str) -> Gpu:
    """'t4', 'A100', 'NVIDIA H100 80GB HBM3', 'sm_75', '7.5', 'cpu' -> Gpu, by the catalog in gpus.toml."""
    if catalog.normalize_name(name) in ("cpu", "none"):
        return Gpu(name="cpu", compute_capability=None, count=0, source="--gpu")
    cc = catalog.cc_from_text(name)
    if cc is not None:
        return Gpu(name=name, compute_capability=cc, source="--gpu")
    family = catalog.gpu_family(name, facts.rows("gpus", "gpu"))
    if family is not None:  # the row's product, or another of its line (same compute capability, its own memory)
        row, memory_gb, same = family
        return Gpu(name=row["name"] if same else name.strip(), compute_capability=row["compute_capability"],
                   source="--gpu", memory_gb=memory_gb)
    other = vendors.lookup(name)
    if other is not None:
        vendor, found, target = other
        return Gpu(name=found, compute_capability=None, source="--gpu", vendor=vendor, target=target,
                   bf16_native=vendors.bf16(vendor, target))
    by_family = catalog.family_cc(name, facts.rows("gpus", "gpu"))
    if by_family is not None:  # "NVIDIA L20": not a row, but every L4x row is 8.9 (the resolver's rule)
        return Gpu(name=name.strip(), compute_capability=by_family[0], source="--gpu",
                   memory_gb=catalog.memory_in_name(name))

    aliases = sorted({catalog.normalize_name(a) for g in facts.rows("gpus", "gpu") for a in g["aliases"]})
    close = difflib.get_close_matches(catalog.normalize_name(name), aliases, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"unknown GPU '{name}'{hint} (the catalog is matrices/gpus.toml, `envtool gpus` lists it; "
                      f"or give a compute capability like sm_75 or 7.5, an AMD target like gfx942, xpu or mps)")


def gpu_from_plan(plan: dict, source: str) -> Gpu:
    """The GPU a plan is for; an AMD, Intel or Apple plan (plan_version 1.2) names its vendor and target."""
    g = plan["gpu"]
    vendor = g.get("vendor")
    if vendor in ("amd", "intel", "apple"):
        return Gpu(name=g.get("name") or "gpu", compute_capability=None, count=int(g.get("count") or 1),
                   source=source, vendor=vendor, target=g.get("target"), bf16_native=g.get("bf16"),
                   rocm=(plan.get("torch") or {}).get("rocm"))
    return Gpu(name=g.get("name") or "gpu", compute_capability=g.get("compute_capability"),
               count=int(g.get("count") or 1), source=source, memory_gb=g.get("memory_gb"))


def probe_gpu() -> Gpu:
    """Ask torch. Compute capability decides bf16 — never torch.cuda.is_bf16_supported(), which says
    True on T4/V100 because it counts emulation. A HIP build (AMD), torch.xpu or MPS: vendors.probe()."""
    # heavy: torch loads only when this runs
    import torch

    other = vendors.probe()
    if other is not None:
        vendor, name, target, count = other
        rocm = ".".join(torch.version.hip.split(".")[:2]) if vendor == "amd" else None
        return Gpu(name=name, compute_capability=None, count=count, source="torch probe", vendor=vendor,
                   target=target, bf16_native=vendors.bf16(vendor, target), rocm=rocm)
    if not torch.cuda.is_available():
        return Gpu(name="cpu", compute_capability=None, count=0, source="torch probe")
    major, minor = torch.cuda.get_device_capability()
    return Gpu(name=torch.cuda.get_device_name(), compute_capability=f"{major}.{minor}",
               count=torch.cuda.device_count(), source="torch probe",
               memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1))


def full_weights(cfg, precision: str) -> str:
    """The dtype a full fine-tune holds its weights (and so its gradients and optimizer states) in: the training
    precision under bf16, as Axolotl loads them (torch_dtype bf16: 2 + 2 + 4 bytes per parameter with AdamW);
    fp32 master weights under autocast with `fp32_master_weights: true`, and always under fp16 (its loss scaler
    unscales fp32 gradients only) and fp32."""
    if precision == "bf16" and not getattr(cfg, "fp32_master_weights", False):
        return "bf16"
    return "fp32"


def _bf16_floor() -> str:
    """'sm_80': the oldest architecture with native bf16 (archs.toml)."""
    ccs = [catalog.cc_tuple(a["compute_capability"]) for a in facts.rows("archs", "arch") if a["bf16"]]
    major, minor = min(ccs)
    return f"sm_{major}{minor}"


def resolve_attention(cfg: Config, gpu: Gpu, plan: dict | None, changes: list[str]) -> str:
    """The attn_implementation transformers gets: the plan's when it was set on envtool's command line (the plan's
    `pinned`: a command-line option wins over the config), else what the config asks for, else what the plan chose,
    else the best backend attention.toml lists for this GPU; anything that cannot run here falls back with a reason.
    `flash_attention: false` means no flash attention (neither the plan's nor the best available)."""
    requested = cfg.requested_attention
    pinned = ((plan or {}).get("pinned") or {}).get("attention")
    if pinned and plan.get("attention"):
        asked = f"; the config asks for {requested}" if requested and requested != plan["attention"] else ""
        requested = plan["attention"]
        changes.append(f"attention: {requested} (set on the command line: {pinned}{asked})")
    elif cfg.asks_flash_kernels and plan and plan.get("packing") == "varlen" and plan.get("attention"):
        requested = plan["attention"]  # FlashAttention kernels as the plan serves them (FA3, varlen_attn, a wheel)
        changes.append(f"attention: {requested} (flash_attention: true: the plan's FlashAttention kernels)")
    no_flash = requested is None and cfg.flash_attention is False
    if requested is None and plan and plan.get("attention") and not (no_flash and _is_flash(plan["attention"])):
        requested = plan["attention"]
        changes.append(f"attention: {requested} (chosen by the plan)")
    if requested is None:
        backend = _best_available(gpu, plan, no_flash)
        why = "flash_attention: false" if no_flash else "not set"
        changes.append(f"attention: {backend['name']} ({why}; best available on {gpu.describe()})")
        return backend["transformers"]
    backend = attention_backend(requested)
    if backend is None:
        known = ", ".join(b["name"] for b in attention_backends())
        raise ConfigError(f"attention backend {requested!r} is not one of {known} (matrices/attention.toml)")
    why = None
    if not catalog.backend_runs_on(backend, gpu.compute_capability):
        why = (f"{requested} needs an NVIDIA GPU ({catalog.backend_range(backend)}); {gpu.describe()} runs torch's "
               f"SDPA" if gpu.other_vendor else f"{requested} needs a CUDA GPU; running on CPU" if gpu.cc is None else
               f"{requested} needs {catalog.backend_range(backend)}; {gpu.describe()} is outside that")
    elif not _available(backend, plan, gpu):
        why = (f"the plan has no {backend['module'].replace('_', '-')} wheel" if plan is not None
               else f"module {backend['module']} is not installed")
    if why:
        fallback = _best_available(gpu, plan)
        changes.append(f"attention: {requested} -> {fallback['transformers']} ({why})")
        return fallback["transformers"]
    if backend["transformers"] != requested:
        changes.append(f"attention: {requested} -> {backend['transformers']} ({backend.get('note', '')})")
    return backend["transformers"]


def _is_flash(name: str) -> bool:
    """A flash-attn backend (flash_attention_2, flash_attention_3): what `flash_attention: false` turns off."""
    return name.startswith("flash_attention")


def _best_available(gpu: Gpu, plan: dict | None, no_flash: bool = False) -> dict:
    """The first automatic backend (attention.toml order) that runs on this GPU and is installed."""
    for backend in attention_backends():
        if backend["auto"] and catalog.backend_runs_on(backend, gpu.compute_capability) \
                and _available(backend, plan, gpu) and not (no_flash and _is_flash(backend["name"])):
            return backend
    raise HardwareError(f"no attention backend in matrices/attention.toml runs on {gpu.describe()}")


def _available(backend: dict, plan: dict | None, gpu: Gpu) -> bool:
    """Is the backend's module there? The plan says (it installs the backend it names, with its wheel); for
    `--gpu NAME` (another machine) assume the environment envtool builds for that GPU has it; otherwise look in
    this environment."""
    module = backend.get("module")
    if module is None:
        return True
    if plan is not None:
        return plan.get("attention") == backend["name"]
    if gpu.source == "--gpu":
        return True
    return importlib.util.find_spec(module) is not None


def resolve_precision(cfg: Config, gpu: Gpu, plan: dict | None, changes: list[str]) -> str:
    if gpu.other_vendor:
        return _vendor_precision(cfg, gpu, plan, changes)
    native_bf16 = gpu.has("bf16")
    if cfg.bf16 is True:
        if gpu.cc is not None and not native_bf16:
            raise HardwareError(
                f"bf16: true needs native bf16 ({_bf16_floor()}+, Ampere or newer) but {gpu.describe()} "
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


def _vendor_precision(cfg: Config, gpu: Gpu, plan: dict | None, changes: list[str]) -> str:
    """AMD: bf16 where the target's matrix cores have it (amd.toml), else fp16 with loss scaling (HIP runs torch's
    CUDA amp). Intel: bf16 unless the device says no (torch.xpu.is_bf16_supported(), asked at start). Apple: bf16
    (MPS, macOS 14+) or fp32; fp16 on MPS is not planned."""
    if cfg.bf16 is True:
        if gpu.bf16_native is False:
            raise HardwareError(f"bf16: true needs bf16 on the matrix cores, and {gpu.describe()} has none "
                                f"(matrices/amd.toml); set bf16: auto (fp16 with loss scaling) or fp16: true")
        return "bf16"
    if cfg.fp16:
        if gpu.kind == "apple":
            raise HardwareError(f"fp16: true on {gpu.describe()}: fp16 mixed precision on MPS is not planned "
                                f"(unverified); use bf16: auto (bf16 on macOS 14+, else fp32)")
        return "fp16"
    if cfg.bf16 == "auto":
        if plan and plan.get("precision") in ("bf16", "fp16", "fp32") and not (
                plan["precision"] == "bf16" and gpu.bf16_native is False):
            choice, why = plan["precision"], "chosen by the plan"
        elif gpu.bf16_native is True or (gpu.bf16_native is None and gpu.kind != "apple"):
            choice, why = "bf16", f"{gpu.describe()} runs bf16" + (" (the device confirms at start)"
                                                                   if gpu.bf16_native is None else "")
        elif gpu.kind == "apple":
            choice, why = "bf16", "MPS runs bf16 on macOS 14+ (apple.toml)"
        else:
            choice, why = "fp16", f"{gpu.describe()} has no bf16 matrix cores; fp16 with dynamic loss scaling"
        changes.append(f"precision: bf16: auto -> {choice} ({why})")
        return choice
    return "fp32"


def resolve_tf32(cfg: Config, gpu: Gpu, changes: list[str]) -> bool:
    """TF32 tensor-core math arrived with bf16 (Ampere): archs.toml's bf16 column says both."""
    capable = gpu.has("bf16") and not gpu.other_vendor  # TF32 is NVIDIA's tensor-core format
    if cfg.tf32 == "auto":
        return capable
    if cfg.tf32 and not capable:
        where = (f"NVIDIA's tensor-core format (unverified on {gpu.describe()})" if gpu.other_vendor else
                 f"tf32 needs {_bf16_floor()}+; {gpu.describe()} has none")
        changes.append(f"tf32: true -> false ({where})")
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
