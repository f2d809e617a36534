"""From a target GPU, a driver and the user's pins to a Plan, with a reason for every decision.

Shape (after huggingface/kernels' variants): every torch build in the matrix is a candidate; each rule
below either lets it through or rejects it with a sentence; the survivors are ordered by an explicit
preference. When nothing survives, the error names the rule that rejected the closest candidates and,
where dropping one pin would help, the pin value that works.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import NamedTuple

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .errors import BadInput, Unsatisfiable
from .hardware import GpuSpec
from matrices.catalog import backend_range, backend_runs_on

from .matrix import (CudnnSdpa, FlashAttnImpl, FlashAttnRelease, KernelsRelease, Matrix, TorchBuild,
                     TorchRelease, VarlenKernel, Xformers, cc_tuple, in_range)
from .credentials import strip
from .matrix import FLASH_ATTN_URL_ENV, PYTHON_RE, TORCH_INDEX_ENV, stack_for  # noqa: F401 (also read from here)
from .matrix import prefix_match as _prefix_match
from .plan import PYPI_SIMPLE, FlashAttnChoice, Plan, Rejected, TorchChoice

PLATFORMS = ("x86_64", "aarch64")


class Request(NamedTuple):
    gpu: GpuSpec
    driver: str | None
    python: str
    platform: str = "x86_64"
    torch: str | None = None  # "2.8" or "2.8.0"
    cuda: str | None = None  # "12.6" or "12"
    flash_attn: str | None = None  # exact flash-attn version
    no_flash_attn: bool = False
    attention: str | None = None  # an attention.toml backend name
    target: str = ""
    notes: list[str] = []  # what detection said, carried into the reasons

    def pins(self) -> list[str]:
        flags = [("--torch", self.torch), ("--cuda", self.cuda), ("--flash-attn", self.flash_attn),
                 ("--attention", self.attention)]
        return [f"{flag} {value}" for flag, value in flags if value]


class Candidate:
    """One torch build under consideration; the rules fill in what they learn about it."""

    def __init__(self, release: TorchRelease, build: TorchBuild | None):
        self.release = release
        self.build = build  # None: the CPU build
        self.native_driver = True  # False: runs only through CUDA minor-version compatibility
        self.flash_attn: FlashAttnChoice | None = None
        self.flash_attn_impl: FlashAttnImpl | None = None
        self.flash_attn_missing = ""  # why no wheel, when the GPU could run flash-attn
        self.fa_missing: dict[str, str] = {}  # per implementation ("fa2", "fa3"): why it has no wheel here
        self.varlen: VarlenKernel | None = None  # torch's own mask-free packing kernel, where it runs
        self.xformers: Xformers | None = None
        self.xformers_missing = ""  # why no xformers release fits, when none does

    @property
    def variant(self) -> str:
        return self.build.variant if self.build else "cpu"

    @property
    def cuda(self) -> str | None:
        return self.build.cuda if self.build else None

    @property
    def cxx11abi(self) -> bool:
        if self.build is not None and self.build.cxx11abi is not None:
            return self.build.cxx11abi
        return self.release.cxx11abi

    @property
    def label(self) -> str:
        return f"torch {self.release.version}+{self.variant}"


# ---------------------------------------------------------------------------- input checks


def check_request(req: Request, m: Matrix) -> None:
    if not PYTHON_RE.match(req.python):
        raise BadInput(f"--python {req.python!r} is not a Python version like 3.11")
    if req.platform not in PLATFORMS:
        raise BadInput(f"--platform {req.platform!r}: choose one of {', '.join(PLATFORMS)}")
    names = [b.name for b in m.attention]
    if req.attention and req.attention not in names:
        aliases = ", ".join(f"{i.name} ({i.attention})" for i in m.flash_attn_impls)
        raise BadInput(f"--attention {req.attention!r}: choose one of {', '.join(names)} (or {aliases})")
    for flag, value in (("--torch", req.torch), ("--cuda", req.cuda), ("--flash-attn", req.flash_attn)):
        if value is None:
            continue
        try:
            Version(value)
        except InvalidVersion:
            raise BadInput(f"{flag} {value!r} is not a version") from None
    if req.cuda and req.gpu.is_cpu:
        raise Unsatisfiable(f"--cuda {req.cuda} with a CPU target: CPU plans use torch's CPU build")
    impl_for = {i.attention: i.name for i in m.flash_attn_impls}
    if req.no_flash_attn and (req.flash_attn or req.attention in impl_for):
        raise BadInput("--no-flash-attn contradicts --flash-attn / --attention flash_attention_*")
    wanted = impl_for.get(req.attention or "")
    if req.flash_attn and not wanted:
        release = next((r for r in m.flash_attn_releases if r.version == req.flash_attn), None)
        if release is None:
            known = ", ".join(r.version for r in m.flash_attn_releases)
            raise Unsatisfiable(f"--flash-attn {req.flash_attn}: no prebuilt wheels recorded for it (known: {known})")
        wanted = release.impl
    if wanted:
        backend = m.backend(m.flash_attn_impl(wanted).attention)
        if not backend_runs_on(backend, req.gpu.compute_capability):
            raise Unsatisfiable(f"{' '.join(req.pins())} with {req.gpu.describe()}: {backend.name} needs "
                                f"{backend_range(backend)}; use --attention sdpa")




# ---------------------------------------------------------------------------- the rules
# Each takes (request, matrix, candidate) and returns None (passes) or the reason it rejects.


def rule_python(req: Request, m: Matrix, c: Candidate) -> str | None:
    if not in_range(req.python, c.release.python):
        return f"{c.label} supports Python {c.release.python}, not {req.python}"
    return None


def rule_torch_pin(req: Request, m: Matrix, c: Candidate) -> str | None:
    if req.torch and not _prefix_match(req.torch, c.release.version):
        return f"--torch {req.torch} excludes {c.release.version}"
    return None


def rule_cuda_pin(req: Request, m: Matrix, c: Candidate) -> str | None:
    if req.cuda and not _prefix_match(req.cuda, c.cuda):
        return f"--cuda {req.cuda} excludes CUDA {c.cuda}"
    return None


def rule_gpu_platform(req: Request, m: Matrix, c: Candidate) -> str | None:
    row = next((g for g in m.gpus if g.name == req.gpu.name), None)
    if row is not None and req.platform not in row.platforms:
        return (f"{row.name} comes only with an {'/'.join(row.platforms)} host CPU, not {req.platform}: "
                f"pass --platform {row.platforms[0]}")
    return None


def rule_driver_supports_gpu(req: Request, m: Matrix, c: Candidate) -> str | None:
    """The driver must know the GPU at all: older than the GPU's first branch (R450 for the A100, R520 for Ada and
    Hopper, R570 for Blackwell), or past the last branch for Kepler/Maxwell/Pascal/Volta. A fact of the GPU and
    the driver, so it rejects every candidate alike."""
    if req.driver is None:
        return None
    arch = m.arch_for(req.gpu.compute_capability)
    if arch is None:
        return None
    if arch.min_driver and Version(req.driver) < Version(arch.min_driver):
        needs = f"R{arch.min_driver} or newer" if "." not in arch.min_driver else f"≥ {arch.min_driver}"
        return (f"driver {req.driver} cannot run {req.gpu.describe()}: {arch.driver_note} "
                f"(needs {needs}); upgrade the NVIDIA driver")
    if arch.max_driver_branch is not None and Version(req.driver).release[0] > arch.max_driver_branch:
        return (f"driver {req.driver} no longer supports {req.gpu.describe()}: {arch.driver_note}; "
                f"use an R{arch.max_driver_branch} driver ({arch.max_driver_branch}.x), the last that drives it")
    return None


def rule_platform_build(req: Request, m: Matrix, c: Candidate) -> str | None:
    if sass_for(c.build, req.platform) is None:
        return f"{c.label} has no linux {req.platform} CUDA build recorded in torch.toml"
    return None


def rule_cuda_major_supports_gpu(req: Request, m: Matrix, c: Candidate) -> str | None:
    major = m.cuda_major(int(c.cuda.split(".")[0]))
    if major.min_cc and cc_tuple(req.gpu.compute_capability) < cc_tuple(major.min_cc):
        return (f"CUDA {major.major} torch builds carry no {req.gpu.sm} code: CUDA {major.major} supports "
                f"sm_{major.min_cc.replace('.', '')}+ only ({major.min_cc_note})")
    return None


def rule_sass(req: Request, m: Matrix, c: Candidate) -> str | None:
    if not has_sass(c.build, req.gpu.compute_capability, req.platform):
        where = "" if req.platform == "x86_64" else f" {req.platform}"
        return (f"{c.label}{where} carries no {req.gpu.sm} code (its SASS: "
                f"{' '.join(sass_for(c.build, req.platform))}); it would fail with 'CUDA capability "
                f"{req.gpu.sm} is not compatible with the current PyTorch installation'")
    return None


def rule_driver(req: Request, m: Matrix, c: Candidate) -> str | None:
    if req.driver is None:
        return None
    jetpack = {g.jetpack_cuda for g in m.gpu_rows(req.gpu.name, req.gpu.compute_capability)
               if g.jetpack_driver == req.driver}
    if jetpack:  # JetPack's own driver numbering (Thor's 580.00 runs CUDA 13.0): not a desktop branch's build
        if Version(c.cuda) <= Version(max(jetpack, key=Version)):
            c.native_driver = True
            return None
        return f"JetPack's driver {req.driver} runs CUDA ≤ {max(jetpack, key=Version)}, not {c.cuda}"
    toolkit = m.toolkit(c.cuda)
    major = m.cuda_major(int(c.cuda.split(".")[0]))
    driver = Version(req.driver)
    if toolkit.min_driver and driver >= Version(toolkit.min_driver):
        c.native_driver = True
        return None
    if driver >= Version(major.compat_min_driver):
        c.native_driver = False
        return None
    needs = f"≥ {toolkit.min_driver}, or " if toolkit.min_driver else ""
    return (f"driver {req.driver} cannot run CUDA {c.cuda} (needs {needs}≥ {major.compat_min_driver} "
            f"through minor-version compatibility)")


def rule_training_stack(req: Request, m: Matrix, c: Candidate) -> str | None:
    if stack_for(m, c.release.version, req.python) is None:
        return f"no training-stack row in packages.toml covers {c.label} on Python {req.python}"
    return None


def rule_attention_pin(req: Request, m: Matrix, c: Candidate) -> str | None:
    wants_fa = req.flash_attn or req.attention in {i.attention for i in m.flash_attn_impls}
    if wants_fa and c.flash_attn is None:
        return c.flash_attn_missing or "no flash-attn wheel"
    if req.attention in {i.attention for i in m.flash_attn_impls} and c.flash_attn_impl \
            and c.flash_attn_impl.attention != req.attention:
        return f"the flash-attn wheel for {c.label} is {c.flash_attn_impl.attention}, not {req.attention}"
    if req.attention == "xformers" and c.xformers is None:
        return c.xformers_missing or f"no xformers release pins torch {c.release.version}"
    return None


def rule_hub_kernels(req: Request, m: Matrix, c: Candidate) -> str | None:
    """A Hub kernel (an attention.toml name with a slash) loads through `kernels`, in the range the stack's
    transformers requires: a plan names one only where a recorded kernels release fits that range, and only
    with the newest training stack for the Python (never an older transformers and torch to fit a kernels)."""
    if not req.attention or "/" not in req.attention:
        return None
    newest = next((s for s in m.stacks if in_range(req.python, s.python)), None)
    stack = stack_for(m, c.release.version, req.python)
    if newest is None or stack is None:
        return None  # rule_training_stack says why
    if stack is not newest:
        return (f"{c.label} takes transformers {stack.packages.get('transformers')}; Hub kernels are planned with "
                f"the newest training stack for Python {req.python} (transformers "
                f"{newest.packages_for(req.attention).get('transformers')}) only, never by holding torch back")
    release, why = hub_kernels_release(m, stack.packages_for(req.attention).get("transformers"))
    return None if release else why


def hub_kernels_release(m: Matrix, transformers: str | None) -> tuple[KernelsRelease | None, str]:
    """The newest recorded `kernels` release inside this transformers' range, or why there is none."""
    need = next((k for k in m.kernels_requirements if k.transformers == transformers), None)
    if need is None:
        return None, (f"Hub kernels load through the `kernels` package, and packages.toml records no kernels "
                      f"requirement for transformers {transformers}")
    fits = [k for k in m.kernels_releases if in_range(k.version, need.kernels)]
    if not fits:
        newest = max((k.version for k in m.kernels_releases), key=Version, default="none recorded")
        return None, (f"transformers {transformers} loads Hub kernels through kernels{need.kernels}, and no "
                      f"kernels release in that range exists (PyPI's newest: {newest}), so none installs "
                      f"beside it")
    return max(fits, key=lambda k: Version(k.version)), ""


PIN_RULES = (rule_python, rule_torch_pin, rule_cuda_pin)
GPU_RULES = (rule_gpu_platform, rule_driver_supports_gpu, rule_platform_build, rule_cuda_major_supports_gpu,
             rule_sass, rule_driver)
LATE_RULES = (rule_training_stack, rule_attention_pin, rule_hub_kernels)


def sass_for(build: TorchBuild, platform: str = "x86_64") -> list[str] | None:
    """The build's arch list on `platform`; None where no build for that platform is recorded."""
    return build.sass if platform == "x86_64" else build.sass_aarch64


def has_sass(build: TorchBuild, cc: str, platform: str = "x86_64") -> bool:
    """SASS for X.Y runs on X.Z when Y <= Z (same major); PTX is not counted."""
    major, minor = cc_tuple(cc)
    return any(cc_tuple(s)[0] == major and cc_tuple(s)[1] <= minor for s in sass_for(build, platform) or ())


# ---------------------------------------------------------------------------- attention kernels


def gpu_can_run(m: Matrix, impl: FlashAttnImpl, gpu: GpuSpec) -> bool:
    """Whether the GPU runs the attention backend this flash-attn implementation provides (attention.toml)."""
    return not gpu.is_cpu and backend_runs_on(m.backend(impl.attention), gpu.compute_capability)


def wheel_fits(rel: FlashAttnRelease, req: Request, c: Candidate) -> bool:
    """Whether the release publishes a wheel for this torch build, Python and platform."""
    torch_mm = ".".join(c.release.version.split(".")[:2])
    py = req.python
    if rel.min_torch:
        if _v(torch_mm) < _v(rel.min_torch):
            return False
    elif rel.torch and torch_mm not in rel.torch:  # (a PyPI row without either: its Requires-Dist pins no torch)
        return False
    if rel.min_python:
        if _v(py) < _v(rel.min_python):
            return False
    elif py not in rel.python:
        return False
    if rel.index == "torch":
        if c.variant not in rel.variants:
            return False
    elif c.cuda.split(".")[0] not in rel.cuda:
        return False
    return (c.cxx11abi in rel.cxx11abi and req.platform in rel.platforms
            and f"torch{torch_mm}-py{py}" not in rel.exclude)


def _wheel_range(rel: FlashAttnRelease) -> str:
    """What a release publishes wheels for, for the reasons: 'torch 2.4-2.8, CUDA 12' / 'torch >= 2.9 in cu126, ...'."""
    if rel.index == "pypi":
        torch = f"torch >= {rel.min_torch}" if rel.min_torch else "any torch"
        return f"{torch}, CUDA {'/'.join(rel.cuda)}, Python >= {rel.min_python}, {'/'.join(rel.platforms)} (PyPI)"
    if rel.index is not None:
        torch = f"torch >= {rel.min_torch}" if rel.min_torch else f"torch {rel.torch[0]}-{rel.torch[-1]}"
        return f"{torch} builds {', '.join(rel.variants)} on {'/'.join(rel.platforms)}"
    torch = f"torch >= {rel.min_torch}" if rel.min_torch else f"torch {rel.torch[0]}-{rel.torch[-1]}"
    return f"{torch}, CUDA {'/'.join(rel.cuda)}, {'/'.join(rel.platforms)}"


def find_flash_attn(req: Request, m: Matrix, c: Candidate) -> None:
    """Attach the newest prebuilt flash-attn wheel that exists for this candidate, or why there is none."""
    pinned = {i.attention: i for i in m.flash_attn_impls}.get(req.attention or "")
    if pinned is None and req.flash_attn:  # --flash-attn VERSION: that release's implementation
        pinned = next((m.flash_attn_impl(r.impl) for r in m.flash_attn_releases if r.version == req.flash_attn), None)
    # a beta implementation (flash-attn-4 while it has pre-releases only) only when asked for
    usable = [i for i in m.flash_attn_impls if gpu_can_run(m, i, req.gpu)
              and (i is pinned or m.is_auto(m.backend(i.attention)))]
    if pinned is not None:  # --attention flash_attention_N: only that implementation's wheels
        usable = [i for i in usable if i is pinned]
    if req.no_flash_attn or not usable or c.build is None:
        return
    torch_mm = ".".join(c.release.version.split(".")[:2])
    py = req.python
    found: list[tuple[Version, FlashAttnImpl, FlashAttnRelease]] = []
    for impl in usable:
        releases = [r for r in m.flash_attn_releases
                    if r.impl == impl.name and (not req.flash_attn or r.version == req.flash_attn)]
        if impl.min_cuda and Version(c.cuda) < Version(impl.min_cuda):
            c.fa_missing[impl.name] = f"{impl.package} needs CUDA >= {impl.min_cuda}, not {c.cuda}"
            continue
        stack = stack_for(m, c.release.version, py) if impl.min_transformers else None
        transformers = stack.packages.get("transformers") if stack else None
        if impl.min_transformers and (transformers is None or _v(transformers) < _v(impl.min_transformers)):
            c.fa_missing[impl.name] = (f"{impl.attention} needs transformers >= {impl.min_transformers}; torch "
                                       f"{torch_mm} + Python {py} takes transformers {transformers or '(none)'}")
            continue
        fits = [r for r in releases if wheel_fits(r, req, c)]
        found += [(_v(r.version), impl, r) for r in fits]
        if not fits:
            which = f"{impl.package} {req.flash_attn}" if req.flash_attn else impl.package
            newest = max(releases, key=lambda r: _v(r.version), default=None)
            publishes = f" (its wheels: {_wheel_range(newest)})" if newest else ""
            c.fa_missing[impl.name] = (f"{which} publishes no prebuilt wheel for torch {torch_mm}+{c.variant} + "
                                       f"Python {py} + {req.platform}{publishes}; never built from source")
    if not found:
        which = f"flash-attn {req.flash_attn}" if req.flash_attn else "flash-attn"
        c.flash_attn_missing = (f"{which} publishes no prebuilt wheel for torch {torch_mm} + CUDA "
                                f"{c.cuda.split('.')[0]} + Python {py} + {req.platform} (never built from source)")
        if len(c.fa_missing) == 1 or pinned is not None:
            c.flash_attn_missing = next(iter(c.fa_missing.values()), c.flash_attn_missing)
        return
    # FA3 before FA2 where both exist (Hopper), then the newest release (attention.toml's order decides the rest).
    first = min(_tier(m, f[1].attention) for f in found)
    _, impl, rel = max((f for f in found if _tier(m, f[1].attention) == first), key=lambda f: f[0])
    c.flash_attn = flash_attn_choice(req, m, c, impl, rel)
    c.flash_attn_impl = impl


def flash_attn_choice(req: Request, m: Matrix, c: Candidate, impl: FlashAttnImpl,
                      rel: FlashAttnRelease) -> FlashAttnChoice:
    """The exact wheel: its file name, and where uv gets it (a URL, or the PyTorch index of the build)."""
    torch_mm = ".".join(c.release.version.split(".")[:2])
    abi = "TRUE" if c.cxx11abi else "FALSE"
    filename = rel.filename.format(version=rel.version, cuda=rel.cuda.get(c.cuda.split(".")[0], ""),
                                   torch=torch_mm, abi=abi, py=req.python.replace(".", ""), platform=req.platform,
                                   platform_tag=rel.platform_tags.get(req.platform, f"linux_{req.platform}"))
    if rel.index == "torch":
        index = torch_index_url(m, c.variant)
        return FlashAttnChoice(version=rel.version, package=impl.package, filename=filename,
                               wheel_url=f"{index.rstrip('/')}/{filename}", index_url=index)
    if rel.index == "pypi":  # installed from the environment's package index like the stack (PyPI, or its mirror)
        page = f"{PYPI_SIMPLE}{canonicalize_name(impl.package)}/"
        return FlashAttnChoice(version=rel.version, package=impl.package, filename=filename, wheel_url=page,
                               index_url=PYPI_SIMPLE)
    template = strip(os.environ.get(FLASH_ATTN_URL_ENV)) or m.flash_attn_url  # a plan never holds a credential
    return FlashAttnChoice(version=rel.version, package=impl.package, filename=filename,
                           wheel_url=template.format(version=rel.version, filename=filename))


def torch_index_url(m: Matrix, variant: str) -> str:
    """The PyTorch index of a variant: the matrix's, or the mirror $ENVTOOL_TORCH_INDEX_URL names (without the
    credentials it may carry: those reach uv at run time, never a plan)."""
    return (strip(os.environ.get(TORCH_INDEX_ENV)) or m.torch_index_url).format(variant=variant)


def find_varlen(req: Request, m: Matrix, c: Candidate) -> None:
    """torch's own kernel that keeps packed rows apart without a mask, where this build and GPU run it."""
    if c.build is None:
        return
    cc = cc_tuple(req.gpu.compute_capability)
    c.varlen = next((v for v in m.varlen if in_range(c.release.version, v.torch) and cc >= cc_tuple(v.min_cc)),
                    None)


def cudnn_sdpa_first(m: Matrix, gpu: GpuSpec, c: Candidate) -> CudnnSdpa | None:
    """The [[cudnn_sdpa]] row when this build's SDPA puts cuDNN attention first on this GPU."""
    if c.build is None:
        return None
    cc = cc_tuple(gpu.compute_capability)
    return next((r for r in m.cudnn_sdpa if in_range(c.release.version, r.torch) and in_range(c.cuda, r.cuda)
                 and cc_tuple(r.min_cc) <= cc <= cc_tuple(r.max_cc)), None)


# ---------------------------------------------------------------------------- which attention a candidate gets


class Attention(NamedTuple):
    """The attention a plan on this candidate would name, how it packs, and how fast it ranks."""

    backend: str  # attention.toml name: the plan's `attention`
    packing: str  # "varlen" (cu_seqlens, no mask) | "mask"
    tier: int  # attention.toml position of the backend whose kernels run (lower is faster)
    kernel: str  # the kernel that runs, for the reasons
    passed_over: tuple[str, ...] = ()  # backends not taken on this candidate, each with why
    short: str = ""  # the kernel in a few words: "the flash-attn-3 3.0.0 wheel", "torch's varlen_attn"

    def describe(self) -> str:
        if self.packing == "varlen":
            return f"{self.backend} through {self.short}"
        return f"{self.backend} with a packing mask"


PACKING_OF = {"position_ids": "varlen", "row_position_ids": "mask", "bool_mask": "mask", "float_mask": "mask"}


def _tier(m: Matrix, backend: str) -> int:
    return next(i for i, b in enumerate(m.attention) if b.name == backend)


def _fa_kernel(c: Candidate) -> str:
    fa = c.flash_attn
    where = f"from the PyTorch index {fa.index_url}" if fa.index_url else "its release wheel"
    return f"{fa.package} {fa.version} ({where}: {fa.filename})"


def _fa_short(c: Candidate) -> str:
    return f"the {c.flash_attn.package} {c.flash_attn.version} wheel"


def _varlen_short(c: Candidate) -> str:
    return f"torch's {c.varlen.name}"


def _varlen_kernel(c: Candidate) -> str:
    v = c.varlen
    return (f"torch {c.release.version}'s own {v.name} ({v.function}: {v.counts_as}-class kernels built into "
            f"torch{v.torch}, sm_{v.min_cc.replace('.', '')}+)")


def attention_for(req: Request, m: Matrix, c: Candidate) -> Attention:
    """The backend a plan on this candidate names: the one asked for, else the first `auto` backend of
    attention.toml that runs here, counting torch's own varlen kernel as fast as the backend it `counts_as`
    (where both a wheel and torch itself offer the same class, torch's own wins: no extra package)."""
    cached = getattr(c, "_attention", None)
    if cached is not None and cached[0] is req and cached[1] is m:
        return cached[2]
    choice = _attention_for(req, m, c)
    c._attention = (req, m, choice)
    return choice


def _attention_for(req: Request, m: Matrix, c: Candidate) -> Attention:
    gpu = req.gpu
    if req.attention:
        backend = m.backend(req.attention)
        if c.flash_attn_impl is not None and c.flash_attn_impl.attention == backend.name:
            return Attention(backend.name, "varlen", 0, _fa_kernel(c), short=_fa_short(c))
        if c.varlen is not None and c.varlen.attention == backend.name:
            return Attention(backend.name, "varlen", 0, _varlen_kernel(c), short=_varlen_short(c))
        return Attention(backend.name, PACKING_OF[backend.packing], 0, backend.transformers,
                         short=backend.transformers)
    passed_over = []
    for i, backend in enumerate(m.attention):
        if not m.is_auto(backend):
            continue
        if not backend_runs_on(backend, gpu.compute_capability):
            passed_over.append(f"{backend.name} (needs {'a CUDA GPU' if gpu.is_cpu else backend_range(backend)})")
            continue
        impl = next((x for x in m.flash_attn_impls if x.attention == backend.name), None)
        builtin = c.varlen is not None and c.varlen.counts_as == backend.name
        if impl is not None:
            has_wheel = c.flash_attn_impl is not None and c.flash_attn_impl.name == impl.name
            if has_wheel and not builtin:
                return Attention(backend.name, "varlen", i, _fa_kernel(c), tuple(passed_over), _fa_short(c))
            if has_wheel:
                why = (f"{impl.package} {c.flash_attn.version} has a wheel, but torch {c.release.version}'s own "
                       f"{c.varlen.name} runs the same kernels without it")
            else:
                why = "turned off by --no-flash-attn" if req.no_flash_attn else (
                    c.fa_missing.get(impl.name) or c.flash_attn_missing or f"no {impl.package} wheel")
                if builtin:
                    why += f"; torch {c.release.version}'s own {c.varlen.name} runs the same kernels"
            passed_over.append(f"{backend.name} ({why})")
            continue
        if c.varlen is not None and c.varlen.attention == backend.name:
            return Attention(backend.name, "varlen", _tier(m, c.varlen.counts_as), _varlen_kernel(c),
                             tuple(passed_over), _varlen_short(c))
        return Attention(backend.name, PACKING_OF[backend.packing], i, backend.transformers, tuple(passed_over),
                         backend.transformers)
    raise Unsatisfiable(f"{gpu.describe()}: no attention backend in attention.toml runs on it")


@lru_cache(maxsize=512)
def _admitting(specs: tuple[str, ...], version: str) -> tuple[int, ...]:
    """Which of the ranges admit `version` (each candidate of a solve asks again: parsing versions is the cost)."""
    return tuple(i for i, spec in enumerate(specs) if in_range(version, spec))


def find_xformers(req: Request, m: Matrix, c: Candidate) -> None:
    """The newest xformers release that pins this torch and has a wheel for the Python and platform."""
    pins = [m.xformers[i] for i in _admitting(tuple(x.torch for x in m.xformers), c.release.version)]
    fits = [x for x in pins if req.platform in x.platforms and (x.python is None or in_range(req.python, x.python))]
    major = c.cuda.split(".")[0] if c.cuda else None
    built_for = [x for x in fits if x.cuda is None or major is None or x.cuda == major]
    runs = [x for x in built_for if req.gpu.is_cpu or cc_tuple(req.gpu.compute_capability) >= cc_tuple(x.min_cc)]
    c.xformers = max(runs, key=lambda x: Version(x.version), default=None)
    if c.xformers is None and built_for:
        x = max(built_for, key=lambda x: Version(x.version))
        c.xformers_missing = (f"xformers {x.version} (for torch {c.release.version}) carries kernels for "
                              f"sm_{x.min_cc.replace('.', '')}+ only, not {req.gpu.sm}")
    elif c.xformers is None and fits:
        x = max(fits, key=lambda x: Version(x.version))
        c.xformers_missing = (f"xformers {x.version}'s PyPI wheel is built against a CUDA {x.cuda} torch; with "
                              f"{c.label} (CUDA {c.cuda}) its C++/CUDA extensions do not load")
    elif c.xformers is None and pins:
        x = max(pins, key=lambda x: Version(x.version))
        c.xformers_missing = (f"xformers {x.version} (the release for torch {c.release.version}) publishes wheels "
                              f"for Python {x.python or 'any'} on {', '.join(x.platforms)} only, not Python "
                              f"{req.python} on {req.platform} (never built from source)")


# ---------------------------------------------------------------------------- solving


def candidates(req: Request, m: Matrix) -> list[Candidate]:
    if req.gpu.is_cpu:
        return [Candidate(r, None) for r in m.torch]
    return [Candidate(r, b) for r in m.torch for b in r.build]


def evaluate(req: Request, m: Matrix) -> tuple[list[Candidate], list[Rejected]]:
    survivors, rejected = [], []
    rules = PIN_RULES + (() if req.gpu.is_cpu else GPU_RULES)
    for c in candidates(req, m):
        failed = first_failure(rules, req, m, c)
        if failed is None:
            find_flash_attn(req, m, c)
            find_varlen(req, m, c)
            find_xformers(req, m, c)
            failed = first_failure(LATE_RULES, req, m, c)
        if failed:
            rejected.append(Rejected(c.release.version, c.variant, *failed))
        else:
            survivors.append(c)
    return survivors, rejected


def first_failure(rules, req: Request, m: Matrix, c: Candidate) -> tuple[str, str] | None:
    """(rule name, reason) of the first rule that rejects the candidate, or None."""
    for rule in rules:
        reason = rule(req, m, c)
        if reason:
            return rule.__name__.removeprefix("rule_"), reason
    return None


PREFERENCE = ("attention", "assumed_driver", "torch", "stable", "native_driver", "cuda")
_LAST_PREFERENCE: list = [None, None, None]  # (req, m, key): one solve asks for its key many times


@lru_cache(maxsize=256)
def _v(text: str) -> Version:
    return Version(text)


def preference(req: Request, m: Matrix):
    if _LAST_PREFERENCE[0] is req and _LAST_PREFERENCE[1] is m:
        return _LAST_PREFERENCE[2]
    key = _preference(req, m)
    _LAST_PREFERENCE[:] = [req, m, key]
    return key


def _preference(req: Request, m: Matrix):
    """Sort key, best last: the fastest attention the candidate runs (attention.toml's order, torch's own
    varlen kernel counted as the backend it matches; no preference when --attention names one); with the
    driver unknown, a build that runs on the driver cuda.toml assumes then; the newest torch; a stable build; a
    driver that runs the toolkit natively; then the newest CUDA the driver runs, or, driver unknown, the CUDA
    that runs on the oldest drivers. The parts are named in PREFERENCE (the reasons say which part decided)."""
    cache: dict[int, tuple] = {}

    def key(c: Candidate):
        if id(c) in cache:
            return cache[id(c)][1]
        cuda = _v(c.cuda).release if c.build else (0, 0)
        speed = 0 if req.attention else -attention_for(req, m, c).tier
        stable = c.build is None or c.build.status == "stable"
        if req.driver is None:
            value = (speed, c.build is None or runs_on(m, c.cuda, m.assumed_driver), _v(c.release.version),
                     stable, True, tuple(-x for x in cuda))
        else:
            value = (speed, True, _v(c.release.version), stable, c.native_driver, cuda)
        cache[id(c)] = (c, value)  # (c kept alive, so its id is not reused)
        return value

    return key


def runs_on(m: Matrix, cuda: str, driver: str) -> bool:
    """Whether a driver runs a CUDA toolkit, natively or through minor-version compatibility."""
    major = m.cuda_major(int(cuda.split(".")[0]))
    return Version(driver) >= Version(major.compat_min_driver)


def solve(req: Request, m: Matrix) -> Plan:
    if req.gpu.vendor in ("amd", "intel", "apple"):
        # start-up: resolver.vendors.solve imported only when this runs
        from .vendors.solve import solve as solve_vendor

        return solve_vendor(req, m)
    check_request(req, m)
    survivors, rejected = evaluate(req, m)
    if not survivors:
        raise Unsatisfiable(unsatisfiable_message(req, m, rejected))
    best = max(survivors, key=preference(req, m))
    return build_plan(req, m, best, survivors, rejected)


def unsatisfiable_message(req: Request, m: Matrix, rejected: list[Rejected]) -> str:
    pins = req.pins()
    head = f"{' '.join(pins)} with {req.gpu.describe()}" if pins else req.gpu.describe()
    if req.driver:
        head += f" and driver {req.driver}"
    pin_rules = {rule.__name__.removeprefix("rule_") for rule in PIN_RULES}
    beyond_pins = [r for r in rejected if r.rule not in pin_rules]
    if beyond_pins:  # the candidates the pins allow: say why the one that got furthest (the newest of them) fails
        late = {rule.__name__.removeprefix("rule_") for rule in LATE_RULES}
        why = max(beyond_pins, key=lambda r: (r.rule in late, Version(r.torch))).reason
    elif req.torch and rejected:
        known = ", ".join(r.version for r in m.torch)
        why = f"no torch release matches --torch {req.torch} on Python {req.python} (known: {known})"
    elif rejected:
        why = rejected[0].reason
    else:
        why = "the matrix has no torch build for it"
    return f"{head}: {why}{suggestion(req, m)}"


def suggestion(req: Request, m: Matrix) -> str:
    """Where dropping one pin gives a plan, say which value of that pin works."""
    relaxations = [
        ("cuda", lambda p: f"use --cuda {p.torch.cuda}"),
        ("torch", lambda p: f"use --torch {'.'.join(p.torch.version.split('.')[:2])}"),
        ("flash_attn", lambda p: f"use --flash-attn {p.flash_attn.version}" if p.flash_attn
         else "drop --flash-attn"),
        ("attention", lambda p: f"use --attention {p.attention}"),
    ]
    for attr, say in relaxations:
        if getattr(req, attr) is None:
            continue
        try:
            plan = solve(req._replace(**{attr: None}), m)
        except Unsatisfiable:
            continue
        return f"; {say(plan)}"
    if req.driver and rule_driver_supports_gpu(req, m, None) is None:  # else the reason says which driver
        return "; upgrade the NVIDIA driver or pin an older --torch"
    return ""


# ---------------------------------------------------------------------------- the plan and its reasons


def build_plan(req: Request, m: Matrix, best: Candidate, survivors: list[Candidate],
               rejected: list[Rejected]) -> Plan:
    gpu = req.gpu
    reasons = list(req.notes)
    reasons.append(describe_target(gpu))
    reasons.append(torch_reason(req, m, best, survivors, rejected))
    if best.build is not None:
        reasons.append(driver_reason(req, m, best))
    chosen, why = choose_attention(req, m, best)
    attention = chosen.backend
    reasons.append(why)
    reasons.extend(beta_reasons(req, m, best, chosen))
    reasons.extend(attention_alternatives(req, m, best, chosen, survivors))
    mask_without_cudnn, why = cudnn_reason(req, m, best, chosen)
    if why:
        reasons.append(why)
    precision, why = choose_precision(gpu)
    reasons.append(why)
    triton, features, why = choose_triton(req, m, best)
    reasons.append(why)
    packages, notes = choose_packages(req, m, best, triton, attention)
    reasons.extend(notes)
    toolkit = m.toolkit(best.cuda) if best.build else None
    return Plan(
        gpu={"name": gpu.name, "compute_capability": gpu.compute_capability, "arch": gpu.arch,
             "count": gpu.count, "memory_gb": gpu.memory_gb, "source": gpu.source, "bf16": gpu.bf16,
             "vendor": gpu.vendor, "target": None if gpu.is_cpu else gpu.sm},
        driver={"version": req.driver, "max_cuda": max_cuda(m, req.driver)},
        python=req.python,
        platform=req.platform,
        torch=TorchChoice(version=best.release.version, cuda=best.cuda, variant=best.variant,
                          index_url=torch_index_url(m, best.variant),
                          min_driver=toolkit.min_driver if toolkit else None,
                          backend="cpu" if best.build is None else "cuda"),
        attention=attention,
        flash_attn=best.flash_attn if best.flash_attn_impl and best.flash_attn_impl.attention == attention else None,
        packing=chosen.packing,
        mask_without_cudnn=mask_without_cudnn,
        precision=precision,
        triton=triton,
        features=features,
        packages=packages,
        reasons=reasons,
        matrix_version=m.version,
        target=req.target,
        rejected=rejected + preference_rejections(req, m, best, survivors),
        device="cpu" if gpu.is_cpu else "cuda",
    )


def describe_target(gpu: GpuSpec) -> str:
    return gpu.target_reason()


# What holds torch back, by the rule that rejected a newer build that carries code for the GPU.
HELD_BACK_BY = {"python": "the Python", "torch_pin": "the pin", "cuda_pin": "the pin", "driver": "the driver",
                "training_stack": "the training stack", "attention_pin": "the attention asked for",
                "hub_kernels": "the Hub kernel asked for"}
CODE_RULES = (rule_platform_build, rule_cuda_major_supports_gpu, rule_sass)  # whether a build runs on the GPU at all


def held_back(req: Request, m: Matrix, best: Candidate, rejected: list[Rejected]) -> Rejected | None:
    """Why the newest torch release newer than the chosen one that has a build carrying code for the GPU was not
    taken, when a rule rejected it (a pin, the Python, the driver, the wheel the attention asked for needs): its
    rejection, with the rule. None where no newer release carries code for the GPU, or where one passed every rule
    and lost on preference (torch_reason says why then)."""
    why = {(r.torch, r.variant): r for r in rejected}
    newer = sorted((r for r in m.torch if Version(r.version) > Version(best.release.version)),
                   key=lambda r: Version(r.version), reverse=True)
    for release in newer:
        runs = [c for c in (Candidate(release, b) for b in release.build)
                if sass_for(c.build, req.platform) is not None and first_failure(CODE_RULES, req, m, c) is None
                and (req.driver is not None or runs_on(m, c.cuda, m.assumed_driver))]  # (else: "pass --driver")
        if not runs:
            continue
        found = [why.get((release.version, c.variant)) for c in runs]
        if any(r is None for r in found):
            return None  # a survivor: it lost on preference, not to a rule
        return next((r for r in found if r.rule in HELD_BACK_BY), None)
    return None


def held_back_what(req: Request, m: Matrix, held: Rejected) -> str:
    """What a rejection holds torch back by, in a few words: 'the flash-attn wheel (--attention flash_attention_2)'."""
    if held.rule != "attention_pin":
        return HELD_BACK_BY[held.rule]
    impl = next((i for i in m.flash_attn_impls if i.attention == req.attention), None)
    package = impl.package if impl else "flash-attn" if req.flash_attn else req.attention
    asked = ", ".join(p for p in req.pins() if p.startswith(("--attention", "--flash-attn")))
    return f"the {package} wheel ({asked})" if impl or req.flash_attn else f"{package} ({asked})"


def torch_reason(req: Request, m: Matrix, best: Candidate, survivors: list[Candidate],
                 rejected: list[Rejected] = ()) -> str:
    if best.build is None:
        return f"torch {best.release.version} (cpu): the newest release for Python {req.python}"
    sass = f"carries {req.gpu.sm} code (SASS {' '.join(sass_for(best.build, req.platform))})"
    rank = preference(req, m)
    slower = max(survivors, key=lambda c: rank(c)[1:])  # the best candidate had attention speed not counted
    newest = max(survivors, key=lambda c: Version(c.release.version))
    status = "" if best.build.status == "stable" else f" (an experimental build of {best.release.version})"
    held = held_back(req, m, best, rejected)
    if held is not None:  # never "newest build that carries sm_XX code" when a newer one does and was refused
        return (f"{best.label}{status}: {sass}; held back by {held_back_what(req, m, held)}: torch {held.torch} is "
                f"newer and carries {req.gpu.sm} code, but {held.reason}")
    text = f"{best.label}{status}: newest build that {sass}"
    if slower is not best and rank(slower)[0] < rank(best)[0]:
        here, there = attention_for(req, m, slower), attention_for(req, m, best)
        newer = Version(slower.release.version) > Version(best.release.version)
        what = (f"torch {slower.release.version} is newer" if newer else
                f"{slower.label} ranks higher by its build ({why_not(req, m, best, slower, skip=1)})")
        text += (f"; {what}, but its fastest attention here is {here.describe()}, slower than "
                 f"{there.describe()}, so {best.label} was chosen for it")
        if best.flash_attn:
            text += f" (--no-flash-attn gives {slower.label} with {here.backend})"
    elif req.driver is None and Version(newest.release.version) > Version(best.release.version):
        floor = m.cuda_major(int(newest.cuda.split(".")[0])).compat_min_driver
        text += (f"; torch {newest.release.version} is newer but needs CUDA {newest.cuda} (driver ≥ {floor}): "
                 f"pass --driver to allow it")
    return text


def driver_reason(req: Request, m: Matrix, best: Candidate) -> str:
    toolkit = m.toolkit(best.cuda)
    major = m.cuda_major(int(best.cuda.split(".")[0]))
    if req.driver is None:
        needs = toolkit.min_driver or major.compat_min_driver
        return (f"driver unknown (assumed ≥ {m.assumed_driver}): chose CUDA {best.cuda}, which runs on drivers "
                f"≥ {needs}, or ≥ {major.compat_min_driver} with minor-version compatibility; "
                f"pass --driver to pick the newest CUDA your driver supports")
    if best.native_driver:
        return f"driver {req.driver} runs CUDA {best.cuda} (needs ≥ {toolkit.min_driver})"
    return (f"driver {req.driver} is older than CUDA {best.cuda}'s {toolkit.min_driver or 'GA driver'}; it runs "
            f"through minor-version compatibility (≥ {major.compat_min_driver}, no PTX JIT of newer PTX)")


def choose_attention(req: Request, m: Matrix, best: Candidate) -> tuple[Attention, str]:
    """The backend asked for, else the first `auto` backend of attention.toml (its preference order) that runs
    on the GPU and that the plan can install; every backend passed over is named with why, and so is how
    packed rows are kept apart (the plan's `packing`)."""
    gpu = req.gpu
    choice = attention_for(req, m, best)
    backend = m.backend(choice.backend)
    packing = _packing_reason(choice)
    if req.attention:
        # (an xformers release whose kernels miss this GPU never got here: find_xformers/rule_attention_pin drop it)
        if not backend_runs_on(backend, gpu.compute_capability):
            raise Unsatisfiable(f"--attention {backend.name} with {gpu.describe()}: {backend.name} needs "
                                f"{backend_range(backend)}")
    if best.flash_attn_impl is not None and best.flash_attn_impl.attention == backend.name:
        packing = _packing_reason(choice._replace(kernel=choice.short))
        return choice, f"{_fa_reason(gpu, backend, best)}; {packing}{_skipped(gpu, choice)}"
    note = f"; {backend.note}" if backend.note else ""
    if req.attention == "xformers":
        return choice, (f"xformers {best.xformers.version} (--attention xformers; needs "
                        f"torch{best.xformers.torch}){note}; {packing}")
    if req.attention and "/" in req.attention:
        stack = stack_for(m, best.release.version, req.python)
        transformers = stack.packages_for(req.attention).get("transformers")
        kernels, _ = hub_kernels_release(m, transformers)
        held = (f" (transformers {transformers}, not {stack.packages.get('transformers')}, whose range no kernels "
                f"release fits)" if transformers != stack.packages.get("transformers") else "")
        return choice, (f"{backend.name} (--attention {backend.name}){note}; kernels {kernels.version}: the newest "
                        f"release inside the range transformers requires{held}; {packing}")
    if req.attention and req.attention != "sdpa":
        return choice, f"{backend.name} (--attention {backend.name}){note}; {packing}"
    kernel = "torch's scaled_dot_product_attention" + (" (math/CPU kernels)" if gpu.is_cpu else "")
    asked = " (--attention sdpa)" if req.attention else ""
    return choice, f"{backend.name}{asked}: {kernel}; {packing}{_skipped(gpu, choice)}"


def _packing_reason(choice: Attention) -> str:
    if choice.packing == "varlen":
        return f"packed rows kept apart by cu_seqlens, no mask (packing: varlen), through {choice.kernel}"
    return "packed rows kept apart by a block-diagonal attention mask (packing: mask): no varlen kernel runs here"


def _skipped(gpu: GpuSpec, choice: Attention) -> str:
    return f"; passed over on {gpu.describe()}: {', '.join(choice.passed_over)}" if choice.passed_over else ""


def _fa_reason(gpu: GpuSpec, backend, best: Candidate) -> str:
    fa = best.flash_attn
    where = f" from the PyTorch index {fa.index_url}" if fa.index_url else ""
    if fa.index_url == PYPI_SIMPLE:
        where = " from PyPI (or the --index-url that replaces it)"
    beta = (f" (beta: {fa.package} {fa.version} is a pre-release; plans take it only when asked)"
            if Version(fa.version).is_prerelease else "")
    return (f"{backend.name}{beta}: {gpu.describe()} runs it (needs {backend_range(backend)}); exact prebuilt wheel "
            f"{fa.filename}{where}")


def beta_reasons(req: Request, m: Matrix, best: Candidate, chosen: Attention) -> list[str]:
    """For each beta backend (attention.toml `auto_when_final`, its implementation's releases all pre-releases) that
    runs on this GPU, in a plan that asked for no backend: when a plan would pick it by default, one line. It ranks where its
    attention.toml row stands: before the chosen backend, it would be chosen here once a final release is recorded
    (and its wheel fits this torch build); after it, it would not be."""
    lines = []
    for i, backend in enumerate(m.attention):
        rel = m.beta(backend)
        if rel is None or req.attention or req.gpu.is_cpu \
                or not backend_runs_on(backend, req.gpu.compute_capability):
            continue
        impl = next(x for x in m.flash_attn_impls if x.attention == backend.name)
        ask = f"--attention {backend.name} (or {impl.name}) takes it now"
        head = (f"{backend.name} (beta): not picked on its own while {impl.package}'s newest release {rel.version} is "
                f"a pre-release")
        if i > chosen.tier:
            lines.append(f"{head}; on {req.gpu.describe()} it would not be chosen by default even once final: it ranks "
                         f"after {chosen.describe()} (attention.toml order); {ask}")
        elif req.no_flash_attn:
            lines.append(f"{head}; --no-flash-attn rules it out here; without it, {ask}")
        elif best.build is None or not wheel_fits(rel, req, best):
            lines.append(f"{head}; its wheel does not fit {best.label} + Python {req.python} ({_wheel_range(rel)}), "
                         f"so it would not be chosen here either")
        else:
            lines.append(f"{head}; it would be chosen by default on {req.gpu.describe()}, before {chosen.describe()}, "
                         f"once a final {impl.package} release is recorded (envtool matrix update reads PyPI); {ask}")
    return lines


def attention_alternatives(req: Request, m: Matrix, best: Candidate, chosen: Attention,
                           survivors: list[Candidate]) -> list[str]:
    """Other (torch build, attention) pairs as fast as the chosen one that the plan did not take, one line each:
    why the plan holds to the newer torch instead of, say, an older torch with a flash-attn wheel."""
    if req.attention or req.flash_attn:
        return []
    rank = preference(req, m)
    seen = {(chosen.backend, chosen.short.split(" ")[1] if chosen.short.startswith("the ") else chosen.short)}
    lines = []
    for c in sorted(survivors, key=rank, reverse=True):
        if c is best:
            continue
        other = attention_for(req, m, c)
        kind = (other.backend, other.short.split(" ")[1] if other.short.startswith("the ") else other.short)
        if other.tier != chosen.tier or kind in seen:
            continue
        seen.add(kind)
        lines.append(f"not taken: {other.describe()} on {c.label}: the same attention class as "
                     f"{chosen.describe()} on {best.label}, and {why_not(req, m, c, best)}")
    return lines


def why_not(req: Request, m: Matrix, c: Candidate, best: Candidate, skip: int = 0) -> str:
    """The part of the preference where `c` lost to `best` (its first `skip` parts left out), as a clause."""
    rank = preference(req, m)
    mine, theirs = rank(c), rank(best)
    part = next((name for name, a, b in list(zip(PREFERENCE, mine, theirs))[skip:] if a != b), "cuda")
    if part == "attention":
        here, there = attention_for(req, m, c), attention_for(req, m, best)
        return f"its fastest attention here is {here.describe()}, slower than {there.describe()}"
    if part == "assumed_driver":
        floor = m.cuda_major(int(c.cuda.split(".")[0])).compat_min_driver
        return (f"it needs CUDA {c.cuda} (driver ≥ {floor}), above the driver assumed when none is given "
                f"({m.assumed_driver}): pass --driver")
    if part == "torch":
        return f"torch {c.release.version} is older than {best.release.version}"
    if part == "stable":
        return f"{c.label} is an experimental build"
    if part == "native_driver":
        return f"driver {req.driver} runs CUDA {c.cuda} only through minor-version compatibility"
    if req.driver is None:
        return f"CUDA {c.cuda} needs a newer driver than CUDA {best.cuda}"
    return f"CUDA {c.cuda} is older than CUDA {best.cuda}, which the driver runs"


def preference_rejections(req: Request, m: Matrix, best: Candidate, survivors: list[Candidate]) -> list[Rejected]:
    """For --explain: every candidate that passed the rules but ranked below the chosen one, with why."""
    return [Rejected(c.release.version, c.variant, "preference", f"{c.label}: {why_not(req, m, c, best)}")
            for c in sorted(survivors, key=preference(req, m), reverse=True) if c is not best]


def cudnn_reason(req: Request, m: Matrix, best: Candidate, chosen: Attention) -> tuple[bool, str | None]:
    """Whether masked SDPA calls must run with cuDNN attention switched off, and the reason line."""
    if m.backend(chosen.backend).transformers != "sdpa":
        return False, None
    row = cudnn_sdpa_first(m, req.gpu, best)
    if row is None:
        return False, None
    calls = "padding masks" + ("" if chosen.packing == "varlen" else " and the packing mask")
    return True, (f"cuDNN SDPA off for masked calls ({calls}; mask_without_cudnn): {best.label} puts cuDNN "
                  f"attention first on {req.gpu.sm} (torch{row.torch}, CUDA {best.cuda}), and cuDNN SDPA has open "
                  f"correctness bugs with explicit masks: {row.bugs}; the trainer runs those calls on flash or "
                  f"memory-efficient SDPA instead")


def choose_precision(gpu: GpuSpec) -> tuple[str, str]:
    if gpu.is_cpu:
        return "fp32", "fp32: CPU training (no fp16/bf16 speed-up on CPU)"
    if gpu.bf16:
        return "bf16", f"bf16: {gpu.describe()} has native bf16 (sm_80+)"
    return "fp16", (f"fp16 with loss scaling: {gpu.describe()} has no native bf16 (needs sm_80+; "
                    f"torch.cuda.is_bf16_supported() says True here only through slow emulation)")


def choose_triton(req: Request, m: Matrix, best: Candidate) -> tuple[str | None, dict, str]:
    if best.build is None:
        return None, {"torch_compile": True, "liger": False}, (
            "triton: none (CPU build); torch.compile uses its C++ backend; liger kernels need a GPU")
    version = best.release.triton
    missing = triton_missing(req, m, best)
    if missing:
        return None, {"torch_compile": False, "liger": False}, (
            f"triton: none: {missing}; torch.compile's GPU backend and liger kernels need triton, so they are off")
    support = next((t for t in m.triton_support if in_range(version, t.triton)), None)
    ok = support is None or cc_tuple(req.gpu.compute_capability) >= cc_tuple(support.min_cc)
    features = {"torch_compile": ok, "liger": ok}
    if ok:
        return version, features, f"triton {version}: pinned by torch {best.release.version}; triton kernels on"
    return version, features, (f"triton {version}: pinned by torch {best.release.version}, but triton kernels "
                               f"(torch.compile, liger) are off: {support.reason}")


def triton_missing(req: Request, m: Matrix, best: Candidate) -> str:
    """Why this torch build installs no triton here ("" when it does): its wheel's requirement marker leaves
    this Python or platform out, or triton publishes no wheel for it (which then makes the pin uninstallable)."""
    r = best.release
    if r.triton is None:
        return f"torch {r.version} requires no triton"
    if req.platform not in r.triton_platforms:
        return f"torch {r.version}'s wheel requires triton only on {', '.join(r.triton_platforms)}"
    if r.triton_python and not in_range(req.python, r.triton_python):
        return f"torch {r.version}'s wheel requires triton only for Python {r.triton_python}"
    wheels = m.triton_release(r.triton)
    if wheels is not None and (req.platform not in wheels.platforms or not in_range(req.python, wheels.python)):
        return (f"triton {r.triton} publishes wheels for Python {wheels.python} on {', '.join(wheels.platforms)} "
                f"only")
    return ""


def choose_packages(req: Request, m: Matrix, best: Candidate, triton: str | None,
                    attention: str) -> tuple[dict[str, str], list[str]]:
    stack = stack_for(m, best.release.version, req.python)
    packages = {"torch": best.release.version}
    if triton:
        packages["triton"] = triton
    if best.flash_attn_impl is not None and best.flash_attn_impl.attention == attention:
        packages[best.flash_attn.package] = best.flash_attn.version
    if attention == "xformers":
        packages["xformers"] = best.xformers.version
    pins = stack.packages_for(attention)
    if "/" in attention:  # a Hub kernel: the `kernels` release inside transformers' range (rule_hub_kernels)
        packages["kernels"] = hub_kernels_release(m, pins.get("transformers"))[0].version
    notes = [f"training stack: {stack.source}"]
    if pins != stack.packages:
        notes.append(f"Hub kernels: {stack.hub_kernels_source}")
    for name, version in pins.items():
        need = next((r for r in m.gpu_requirements if r.package == name), None)
        if need and (req.gpu.is_cpu or cc_tuple(req.gpu.compute_capability) < cc_tuple(need.min_cc)):
            notes.append(f"{name} left out: {need.reason}")
            continue
        why = features_exclude(req, m, name)
        if why:
            notes.append(f"{name} left out: {why}")
            continue
        packages[name] = version
    return packages, notes


def features_exclude(req: Request, m: Matrix, package: str) -> str:
    """Why a package whose features have hardware floors ([[feature]] rows) is left out: none of its
    features runs on the target. "" when one does, or when the package has no feature rows."""
    features = [f for f in m.features if f.package == package]
    if not features:
        return ""
    if req.gpu.is_cpu:
        if any(f.cpu for f in features):
            return ""
        return f"none of its features runs without a GPU ({', '.join(f.name for f in features)})"
    cc = cc_tuple(req.gpu.compute_capability)
    if any(cc >= cc_tuple(f.min_cc) for f in features):
        return ""
    floors = "; ".join(f"{f.name} ({f.reason}) needs sm_{f.min_cc.replace('.', '')}+" for f in features)
    return f"{req.gpu.describe()} is below every feature's floor: {floors}"


def max_cuda(m: Matrix, driver: str | None) -> str | None:
    """The newest CUDA toolkit this driver runs at full feature level."""
    if driver is None:
        return None
    runs = [t.version for t in m.toolkits if t.min_driver and Version(driver) >= Version(t.min_driver)]
    return max(runs, key=Version, default=None)
