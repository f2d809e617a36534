"""Plans for AMD (ROCm), Intel (XPU) and Apple silicon (MPS): the same shape as resolver/solve.py's for NVIDIA.
(`gpu` below is resolver/hardware.py's GpuSpec; `req` solve.py's Request: neither is imported, so that solve.py
and hardware.py, which call into this package, are not imported back.)

Every recorded torch build for the vendor is a candidate: rocm.toml [[build]] rows (each a torch release and
ROCm variant with the gfx targets it carries code for), every torch release the xpu index carries (intel.toml
[[build]]), torch's macOS arm64 wheels (apple.toml [[build]]). Each rule below lets a candidate through or
rejects it with a sentence; the survivors are ordered by an explicit preference (the newest torch, a stable
build, the newest ROCm). When nothing survives, the error names why the newest candidate failed and, for an AMD
target, the newest build that carries its code.

What the plan says beyond torch comes from the same files: attention (torch's SDPA; on ROCm its flash and
memory-efficient kernels come from AOTriton where it has code for the target, some only with
TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1), bf16 per target, the triton distribution torch requires, the
training stack with what does not run on the vendor left out ([[limit]] rows; bitsandbytes only where its
ROCm library carries the target's code).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from packaging.version import InvalidVersion
from packaging.version import Version

from ..errors import BadInput, Unsatisfiable
from ..matrix import PYTHON_RE, TORCH_INDEX_ENV, Matrix, TorchRelease, in_range, prefix_match, stack_for
from ..plan import Plan, Rejected, TorchChoice
from .facts import BnbRocm, Vendors, load

AOTRITON_EXPERIMENTAL_ENV = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"
PYPI_SIMPLE = "https://pypi.org/simple/"
DEVICE = {"rocm": "cuda", "xpu": "xpu", "mps": "mps"}  # torch's device type per backend (HIP answers to "cuda")
BACKEND_NAME = {"rocm": "ROCm", "xpu": "XPU", "mps": "MPS"}
PLANNED_ATTENTION = ("sdpa", "eager")  # what a plan for these GPUs may name


class Build(NamedTuple):
    """One vendor build of a torch release."""

    variant: str  # rocm7.2 | xpu | macos
    backend: str  # rocm | xpu | mps
    index_url: str
    status: str = "stable"  # rocm.toml: "stable" | "also"
    rocm: str | None = None
    gfx: tuple[str, ...] = ()  # AMD: the targets its kernels carry code for
    python: tuple[str, ...] | None = None  # Apple: the Pythons its wheels exist for (else the release's range)
    macos: str | None = None  # Apple: the macOS its wheels are tagged for
    source: str = ""


class Candidate(NamedTuple):
    release: TorchRelease
    build: Build

    @property
    def variant(self) -> str:
        return self.build.variant

    @property
    def label(self) -> str:
        if self.build.backend == "mps":
            return f"torch {self.release.version} (macOS arm64)"
        return f"torch {self.release.version}+{self.build.variant}"


# ---------------------------------------------------------------------------- candidates


def index_url(template: str, variant: str) -> str:
    """The index of a variant: the matrix's, or the mirror $ENVTOOL_TORCH_INDEX_URL names ({variant})."""
    # start-up: resolver.credentials imported only when this runs
    from ..credentials import strip

    return (strip(os.environ.get(TORCH_INDEX_ENV)) or template).format(variant=variant)


def candidates(gpu, m: Matrix, v: Vendors) -> list[Candidate]:
    releases = {r.version: r for r in m.torch}
    if gpu.vendor == "amd":
        return [Candidate(releases[b.torch], Build(b.variant, "rocm", index_url(v.rocm_index_url, b.variant),
                                                   b.status, b.rocm, tuple(b.gfx), source=b.source))
                for b in v.rocm_builds if b.torch in releases]
    if gpu.vendor == "intel":
        return [Candidate(r, Build("xpu", "xpu", index_url(v.xpu_index_url, "xpu"),
                                   source=next(b.source for b in v.xpu_builds if in_range(r.version, b.torch))))
                for r in m.torch if any(in_range(r.version, b.torch) for b in v.xpu_builds)]
    return [Candidate(releases[b.torch], Build("macos", "mps", PYPI_SIMPLE, python=tuple(b.python), macos=b.macos,
                                               source=b.source))
            for b in v.mac_builds if b.torch in releases]


# ---------------------------------------------------------------------------- input checks


def check_request(req, m: Matrix, v: Vendors) -> None:
    """What a plan for these GPUs cannot honour, refused before any candidate is looked at."""
    gpu = req.gpu
    backend = BACKEND_NAME[gpu.backend]
    if not PYTHON_RE.match(req.python):
        raise BadInput(f"--python {req.python!r} is not a Python version like 3.11")
    if req.cuda:
        raise BadInput(f"--cuda {req.cuda} pins a CUDA variant; {gpu.describe()} runs torch's {backend} builds: "
                       f"pin --torch instead")
    for flag, value in (("--torch", req.torch), ("--flash-attn", req.flash_attn)):
        if value:
            try:
                Version(value)
            except InvalidVersion:
                raise BadInput(f"{flag} {value!r} is not a version") from None
    names = [b.name for b in m.attention]
    if req.attention and req.attention not in names:
        raise BadInput(f"--attention {req.attention!r}: choose one of {', '.join(names)}")
    if req.flash_attn or (req.attention and req.attention not in PLANNED_ATTENTION):
        what = f"--flash-attn {req.flash_attn}" if req.flash_attn else f"--attention {req.attention}"
        raise Unsatisfiable(f"{what} with {gpu.describe()}: {attention_refusal(req.attention or 'flash_attention_2', gpu, v)}"
                            f"; use --attention sdpa")
    if gpu.vendor != "apple" and req.platform not in ("x86_64", "aarch64"):
        raise BadInput(f"--platform {req.platform!r}: choose x86_64 or aarch64")


def attention_refusal(attention: str, gpu, v: Vendors) -> str:
    """Why an attention backend other than SDPA/eager is not planned on this GPU, in one clause."""
    if attention.startswith("flash_attention") or attention == "flash-attn":
        limit = next((x for x in v.limits(gpu.vendor) if x.feature.startswith("flash-attn")), None)
        if limit is not None:
            return limit.reason
        return f"flash-attn publishes no {BACKEND_NAME[gpu.backend]} build (never built from source)"
    if attention == "xformers":
        return f"no xformers wheel for torch's {BACKEND_NAME[gpu.backend]} builds is recorded"
    if "/" in attention:
        return "Hub kernels are planned on NVIDIA GPUs only"
    return f"{attention} is planned on NVIDIA GPUs only (unverified on {BACKEND_NAME[gpu.backend]})"


# ---------------------------------------------------------------------------- the rules
# Each takes (request, matrix, vendors, candidate) and returns None (passes) or the reason it rejects.


def rule_python(req, m: Matrix, v: Vendors, c: Candidate) -> str | None:
    if c.build.python is not None:
        if req.python not in c.build.python:
            return f"{c.label} publishes wheels for Python {', '.join(c.build.python)}, not {req.python}"
        return None
    if not in_range(req.python, c.release.python):
        return f"{c.label} supports Python {c.release.python}, not {req.python}"
    return None


def rule_torch_pin(req, m: Matrix, v: Vendors, c: Candidate) -> str | None:
    if req.torch and not prefix_match(req.torch, c.release.version):
        return f"--torch {req.torch} excludes {c.release.version}"
    return None


def rule_platform(req, m: Matrix, v: Vendors, c: Candidate) -> str | None:
    if c.build.backend != "mps" and req.platform != "x86_64":
        return (f"{c.label} has no linux {req.platform} build: PyTorch publishes its {BACKEND_NAME[c.build.backend]} "
                f"wheels for linux x86_64 only")
    return None


def rule_gfx(req, m: Matrix, v: Vendors, c: Candidate) -> str | None:
    """Never a build without code objects for the target: ROCm has no PTX-like fallback."""
    if c.build.backend != "rocm" or req.gpu.target in c.build.gfx:
        return None
    return (f"{c.label} carries no {req.gpu.target} code (its targets: {' '.join(c.build.gfx)}); it would fail at "
            f"the first kernel with 'HIP error: invalid device function'")


def rule_macos(req, m: Matrix, v: Vendors, c: Candidate) -> str | None:
    if c.build.backend != "mps" or not req.gpu.macos:
        return None
    if Version(req.gpu.macos) < Version(c.build.macos):
        return f"{c.label}'s arm64 wheels need macOS {c.build.macos}+, this Mac runs macOS {req.gpu.macos}"
    return None


def rule_training_stack(req, m: Matrix, v: Vendors, c: Candidate) -> str | None:
    if stack_for(m, c.release.version, req.python) is None:
        return f"no training-stack row in packages.toml covers {c.label} on Python {req.python}"
    return None


PIN_RULES = (rule_python, rule_torch_pin)
GPU_RULES = (rule_platform, rule_gfx, rule_macos, rule_training_stack)


def preference(c: Candidate):
    """Sort key, best last: the newest torch, a stable build (rocm.toml's release-matrix ROCm before the second
    variant), the newest ROCm."""
    rocm = Version(c.build.rocm).release if c.build.rocm else (0,)
    return Version(c.release.version), c.build.status == "stable", rocm


def evaluate(req, m: Matrix, v: Vendors) -> tuple[list[Candidate], list[Rejected]]:
    survivors, rejected = [], []
    for c in candidates(req.gpu, m, v):
        failed = next(((rule.__name__.removeprefix("rule_"), why) for rule in PIN_RULES + GPU_RULES
                       if (why := rule(req, m, v, c))), None)
        if failed:
            rejected.append(Rejected(c.release.version, c.variant, *failed))
        else:
            survivors.append(c)
    return survivors, rejected


def solve(req, m: Matrix) -> Plan:
    v = load()
    check_request(req, m, v)
    survivors, rejected = evaluate(req, m, v)
    if not survivors:
        raise Unsatisfiable(unsatisfiable_message(req, m, v, rejected))
    best = max(survivors, key=preference)
    return build_plan(req, m, v, best, survivors, rejected)


def unsatisfiable_message(req, m: Matrix, v: Vendors, rejected: list[Rejected]) -> str:
    gpu = req.gpu
    pins = req.pins()
    head = f"{' '.join(pins)} with {gpu.describe()}" if pins else gpu.describe()
    pin_rules = {r.__name__.removeprefix("rule_") for r in PIN_RULES}
    beyond = [r for r in rejected if r.rule not in pin_rules]
    if gpu.vendor == "amd" and not v.rocm_builds_for(gpu.target):
        return (f"{head}: no torch ROCm build on record carries {gpu.target} code (rocm.toml: torch "
                f"{v.rocm_builds[0].torch} to {v.rocm_builds[-1].torch}, none with it): torch cannot run on this GPU")
    if beyond:
        why = max(beyond, key=lambda r: Version(r.torch)).reason
    elif req.torch and rejected:
        known = ", ".join(sorted({r.torch for r in rejected}, key=Version))
        why = f"no {BACKEND_NAME[gpu.backend]} build of torch matches --torch {req.torch} on Python {req.python} " \
              f"(known: {known})"
    else:
        why = rejected[0].reason if rejected else "the matrix has no torch build for it"
    return f"{head}: {why}{suggestion(req, m, v)}"


def suggestion(req, m: Matrix, v: Vendors) -> str:
    """The newest build that would run, when a pin or the Python excludes it."""
    if req.torch:
        try:
            plan = solve(req._replace(torch=None), m)
        except Unsatisfiable:
            plan = None
        if plan is not None:
            what = f"the newest build that carries {req.gpu.target} code" if req.gpu.vendor == "amd" else \
                "the newest build that runs here"
            return (f"; {what}: torch {plan.torch.version}+{plan.torch.variant}: use --torch "
                    f"{'.'.join(plan.torch.version.split('.')[:2])}")
    if req.gpu.vendor == "amd":
        newest = next((c for c in sorted(candidates(req.gpu, m, v), key=preference, reverse=True)
                       if rule_gfx(req, m, v, c) is None), None)
        if newest is not None:
            return f"; the newest build that carries {req.gpu.target} code is {newest.label}"
    return ""


# ---------------------------------------------------------------------------- the plan and its reasons


def build_plan(req, m: Matrix, v: Vendors, best: Candidate, survivors: list[Candidate],
               rejected: list[Rejected]) -> Plan:
    gpu = req.gpu
    reasons = list(req.notes)
    reasons.append(gpu.target_reason())
    if gpu.also:
        reasons.append(f"not planned for: {', '.join(gpu.also)}")
    reasons.append(torch_reason(req, m, v, best, survivors))
    reasons.append(host_reason(gpu, v, best))
    env: dict[str, str] = {}
    reasons.append(attention_reason(gpu, v, best, env))
    precision, why = choose_precision(gpu, v)
    reasons.append(why)
    triton, features, why = choose_triton(gpu, v, best)
    reasons.append(why)
    packages, notes = choose_packages(req, m, v, best, triton)
    reasons.extend(notes)
    if gpu.count > 1:
        reasons.append(multi_gpu_reason(gpu, v))
    return Plan(
        gpu={"name": gpu.name, "compute_capability": None, "arch": gpu.arch, "count": gpu.count,
             "memory_gb": gpu.memory_gb, "source": gpu.source, "bf16": gpu.bf16, "vendor": gpu.vendor,
             "target": gpu.target},
        driver={"version": None, "max_cuda": None},
        python=req.python,
        platform=req.platform if gpu.vendor != "apple" else "arm64",
        torch=TorchChoice(version=best.release.version, cuda=None, variant=best.variant,
                          index_url=best.build.index_url, min_driver=None, backend=best.build.backend,
                          rocm=best.build.rocm),
        attention=req.attention or "sdpa",
        flash_attn=None,
        packing="mask",
        mask_without_cudnn=False,
        precision=precision,
        triton=triton,
        features=features,
        packages=packages,
        reasons=reasons,
        matrix_version=m.version,
        target=req.target,
        rejected=rejected + [Rejected(c.release.version, c.variant, "preference", f"{c.label}: {why_not(c, best)}")
                             for c in sorted(survivors, key=preference, reverse=True) if c is not best],
        device=DEVICE[best.build.backend],
        env=env,
    )


def why_not(c: Candidate, best: Candidate) -> str:
    if Version(c.release.version) != Version(best.release.version):
        return f"torch {c.release.version} is older than {best.release.version}"
    if c.build.status != best.build.status:
        return f"{c.label} is the release's second ROCm variant (the release matrix names {best.variant})"
    return f"ROCm {c.build.rocm} is older than ROCm {best.build.rocm}"


def torch_reason(req, m: Matrix, v: Vendors, best: Candidate, survivors: list[Candidate]) -> str:
    gpu = req.gpu
    if best.build.backend == "rocm":
        code = next((c for c in sorted(candidates(gpu, m, v), key=preference, reverse=True)
                     if rule_python(req, m, v, c) is None and rule_gfx(req, m, v, c) is None), best)
        held = req.torch and Version(code.release.version) > Version(best.release.version)
        text = (f"{best.label}: {'carries' if held else 'newest build that carries'} {gpu.target} code (its targets: "
                f"{' '.join(best.build.gfx)}), from {best.build.index_url}")
        if held:  # never "newest" under a pin that excludes a newer build with the GPU's code
            return text + (f"; held back by the pin: {code.label} is newer and carries {gpu.target} code, but "
                           f"--torch {req.torch} excludes it")
        if best.build.status != "stable":
            text += f" (the second ROCm variant of torch {best.release.version})"
        newest = max((c for c in candidates(gpu, m, v) if rule_python(req, m, v, c) is None),
                     key=preference, default=best)
        if Version(newest.release.version) > Version(best.release.version) and not req.torch:
            text += f"; {newest.label} is newer but carries no {gpu.target} code"
        return text
    if best.build.backend == "xpu":
        text = f"{best.label}: the newest torch with an xpu build, from {best.build.index_url}"
        if gpu.target:
            target = v.intel_target(gpu.target)
            text += (f"; its kernels are compiled ahead of time for {gpu.target} ({target.family}, one of "
                     f"torch-xpu-ops' AOT targets)" if target else "")
        else:
            aots = ", ".join(t.aot for t in v.intel_targets)
            text += (f"; this Intel GPU is not in intel.toml's catalog: the wheels carry ahead-of-time code for "
                     f"{aots}, and other GPUs compile the wheels' SPIR-V at first use (slower; unverified here)")
        return text
    floor = best.build.macos
    text = (f"{best.label}: the newest release whose macOS arm64 wheel runs here (tagged macOS {floor}+), the "
            f"default `torch` on PyPI (its MPS build: no separate index)")
    if not gpu.macos:
        newer_floor = max((c for c in survivors), key=lambda c: Version(c.build.macos)).build.macos
        text += (f"; macOS not detected (a named Mac): torch's newest wheels need macOS {newer_floor}+, so on an "
                 f"older macOS pin an older --torch")
    return text


def host_reason(gpu, v: Vendors, best: Candidate) -> str:
    if best.build.backend == "rocm":
        rocm = best.build.rocm
        mm = ".".join(rocm.split(".")[:2])
        kmds = [k.rocm for k in v.kmd if mm in k.user_space]
        text = (f"host: only the amdgpu kernel driver and /dev/kfd: torch {best.release.version}'s ROCm wheel "
                f"carries ROCm {rocm}'s user space (HIP, rocBLAS, hipBLASLt, MIOpen, RCCL)")
        if kmds:
            return (text + f"; AMD supports a kernel driver with user space within two releases of its own: the "
                    f"amdgpu of ROCm {', '.join(sorted(kmds, key=Version))} runs ROCm {mm} (amd.toml [[kmd]])")
        return text + f"; no amd.toml [[kmd]] row names ROCm {mm} user space: the kernel driver's fit is unverified"
    if best.build.backend == "xpu":
        return ("host: Intel's GPU driver (kernel i915 or xe, Level Zero and the compute runtime); torch's xpu "
                "wheels bring the SYCL runtime as pip packages (intel-sycl-rt, ...)")
    macos = f"macOS {gpu.macos}" if gpu.macos else "macOS (not detected)"
    return (f"host: {macos} on Apple silicon; MPS needs macOS {v.mps_min_macos}+ (apple.toml), and nothing else "
            f"(no driver to match)")


def attention_reason(gpu, v: Vendors, best: Candidate, env: dict[str, str]) -> str:
    packing = ("packed rows kept apart by a block-diagonal attention mask (packing: mask): torch's varlen_attn is "
               "planned on NVIDIA sm_80+ only")
    if best.build.backend == "rocm":
        aot = v.aotriton_for(gpu.target)
        fa = attention_refusal("flash_attention_2", gpu, v)
        if aot is None:
            kernel = (f"AOTriton (torch's flash and memory-efficient SDPA kernels on ROCm) has no {gpu.target} code, "
                      f"so SDPA runs its math kernel (memory grows with the square of the sequence length)")
        elif aot.status == "experimental":
            env[AOTRITON_EXPERIMENTAL_ENV] = "1"
            kernel = (f"AOTriton supports {gpu.target} experimentally: torch admits its flash and memory-efficient "
                      f"kernels there only with {AOTRITON_EXPERIMENTAL_ENV}=1, which the plan sets (env)")
        else:
            kernel = f"its flash and memory-efficient kernels on {gpu.target} come from AOTriton (rocm.toml: supported)"
        return f"sdpa: torch's scaled_dot_product_attention; {kernel}; flash-attn passed over: {fa}; {packing}"
    if best.build.backend == "xpu":
        return (f"sdpa: torch's scaled_dot_product_attention on XPU; flash-attn passed over: "
                f"{attention_refusal('flash_attention_2', gpu, v)}; {packing}")
    return (f"sdpa: torch's scaled_dot_product_attention on MPS; flash-attn and xformers passed over: "
            f"{attention_refusal('flash_attention_2', gpu, v)}; {packing}")


def choose_precision(gpu, v: Vendors) -> tuple[str, str]:
    if gpu.vendor == "amd":
        t = v.amd_target(gpu.target)
        if t is None:
            return "fp16", (f"fp16 with loss scaling: amd.toml has no [[target]] row for {gpu.target}, so bf16 is "
                            f"not assumed")
        if t.bf16:
            return "bf16", f"bf16: {gpu.target} ({t.family}) has bf16 on its matrix cores (amd.toml, ROCm precision support)"
        return "fp16", f"fp16 with loss scaling: {gpu.target} ({t.family}) has no bf16 matrix cores (amd.toml)"
    if gpu.vendor == "intel":
        return "bf16", ("bf16: decided on the device: the trainer asks torch.xpu.is_bf16_supported() before "
                        "training and trains in fp32 where it says no (intel.toml records no bf16 per GPU)")
    if gpu.macos and Version(gpu.macos) < Version(v.bf16_min_macos):
        return "fp32", (f"fp32: MPS runs bfloat16 from macOS {v.bf16_min_macos} only (this Mac: {gpu.macos}); fp16 "
                        f"mixed precision on MPS is not planned (unverified)")
    assumed = "" if gpu.macos else " (macOS not detected: assumed, as torch's newest wheels need it anyway)"
    return "bf16", f"bf16: MPS runs bfloat16 on macOS {v.bf16_min_macos}+{assumed}"


def _limit(v: Vendors, vendor: str, *, package: str | None = None, feature: str | None = None):
    return next((x for x in v.limits(vendor) if (package and x.package == package)
                 or (feature and x.feature.lower().startswith(feature))), None)


def choose_triton(gpu, v: Vendors, best: Candidate) -> tuple[str | None, dict, str]:
    liger = _limit(v, gpu.vendor, feature="liger")
    no_liger = f"liger kernels off ({liger.reason})" if liger is not None else "liger kernels off"
    if best.build.backend == "mps":
        limit = _limit(v, "apple", package="triton")
        return None, {"torch_compile": False, "liger": False}, (
            f"triton: none: {limit.reason}; torch.compile's GPU backend and liger kernels are off")
    row = v.triton_package(gpu.vendor, best.release.version)
    version = best.release.triton
    if row is None or version is None:
        return None, {"torch_compile": False, "liger": False}, (
            f"triton: none recorded for {best.label}; torch.compile's GPU backend and liger kernels are off")
    return version, {"torch_compile": True, "liger": False}, (
        f"triton: {row.package} {version}, which torch {best.release.version}'s {BACKEND_NAME[best.build.backend]} "
        f"wheel requires, from {best.build.index_url}; torch.compile on; {no_liger}")


def choose_packages(req, m: Matrix, v: Vendors, best: Candidate, triton: str | None) -> tuple[dict, list[str]]:
    gpu = req.gpu
    stack = stack_for(m, best.release.version, req.python)
    packages = {"torch": best.release.version}
    row = v.triton_package(gpu.vendor, best.release.version)
    if triton and row is not None:
        packages[row.package] = triton
    notes = [f"training stack: {stack.source}"]
    for name, version in stack.packages.items():
        limit = _limit(v, gpu.vendor, package=name)
        if limit is not None and not limit.runs:
            notes.append(f"{name} left out: {limit.reason}")
            continue
        if limit is not None and limit.min_version and Version(version) < Version(limit.min_version):
            notes.append(f"{name} {version} left out: {limit.reason}")
            continue
        if name == "bitsandbytes":
            why = bitsandbytes_refusal(gpu, v, best, version)
            if why:
                notes.append(f"bitsandbytes left out: {why}")
                continue
            notes.append(f"bitsandbytes {version}: {bitsandbytes_note(gpu, v, best, version)}")
        elif limit is not None and limit.runs:
            notes.append(f"{name} {version}: {limit.reason}")
        packages[name] = version
    return packages, notes


def bnb_rocm_library(rows: list[BnbRocm], rocm: str) -> BnbRocm | None:
    """The library bitsandbytes loads for torch's HIP version (cextension.py): the highest packaged ROCm version
    <= the runtime's with the same major, else the lowest higher one."""
    want = Version(rocm)
    same = [r for r in rows if Version(r.rocm) <= want and Version(r.rocm).major == want.major]
    if same:
        return max(same, key=lambda r: Version(r.rocm))
    higher = [r for r in rows if Version(r.rocm) > want]
    return min(higher, key=lambda r: Version(r.rocm), default=None)


def bitsandbytes_refusal(gpu, v: Vendors, best: Candidate, version: str) -> str:
    if gpu.vendor == "amd":
        rows = [r for r in v.bnb_rocm if r.version == version]
        if not rows:
            return f"bitsandbytes {version}'s wheel carries no ROCm library (rocm.toml [[bitsandbytes]])"
        lib = bnb_rocm_library(rows, best.build.rocm)
        if lib is None or gpu.target not in lib.gfx:
            return (f"the ROCm {lib.rocm} library bitsandbytes {version} loads beside torch's ROCm "
                    f"{best.build.rocm} carries no {gpu.target} code (its targets: {' '.join(lib.gfx)})")
        return ""
    if gpu.vendor == "intel":
        if not any(r.version == version for r in v.bnb_xpu):
            return f"bitsandbytes {version}'s wheel carries no XPU library (intel.toml [[bitsandbytes]])"
    return ""


def bitsandbytes_note(gpu, v: Vendors, best: Candidate, version: str) -> str:
    if gpu.vendor == "amd":
        lib = bnb_rocm_library([r for r in v.bnb_rocm if r.version == version], best.build.rocm)
        return (f"its ROCm {lib.rocm} library (the one it loads beside torch's ROCm {best.build.rocm}) carries "
                f"{gpu.target} code")
    if gpu.vendor == "intel":
        row = next(r for r in v.bnb_xpu if r.version == version)
        return f"its XPU libraries ({', '.join(row.libraries)}) run on torch's xpu build"
    limit = _limit(v, "apple", package="bitsandbytes")
    return limit.reason if limit else "its MPS backend"


def multi_gpu_reason(gpu, v: Vendors) -> str:
    if gpu.vendor == "amd":
        return (f"{gpu.count} devices: torchrun, one process per device, collectives over RCCL (torch's ROCm build "
                f"answers to the 'nccl' backend)")
    if gpu.vendor == "intel":
        return f"{gpu.count} devices: torchrun, one process per device, collectives over torch's 'xccl' backend"
    return f"{gpu.count} devices"


def feature_refusal(plan: Plan, feature: str) -> str | None:
    """Why a config feature (packages.toml [[feature]] name) cannot run on this plan's GPU, else None."""
    vendor = plan.gpu.get("vendor")
    if vendor not in ("amd", "intel", "apple"):
        return None
    limit = next((x for x in load().limits(vendor) if feature in x.features and not x.runs), None)
    return f"{limit.feature}: {limit.reason}" if limit else None
