"""Load the compatibility matrices (matrices/*.toml) into typed rows, rejecting malformed ones.

The row classes below (NamedTuples: cheap to define, which keeps `envtool resolve` fast) are the schema: a row must carry every field without a default, no unknown field,
and values of the annotated types. `load()` then checks the facts hang together (versions parse, every
build's CUDA toolkit is known, ...). Code elsewhere only queries the result; facts never live in `if`s.
"""

import json
import operator
import os
import re
import sys
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from packaging.version import InvalidVersion, Version

from matrices import catalog
from matrices.catalog import MATRIX_DIR_ENV, cc_tuple, matrix_dir, normalize_name  # noqa: F401 (re-exported)

from . import __version__
from .errors import MatrixError

PLATFORMS = ("x86_64", "aarch64")
CC_RE = re.compile(r"^\d+\.\d$")


# ---------------------------------------------------------------------------- rows (the schema)


class Arch(NamedTuple):
    compute_capability: str
    name: str
    bf16: bool
    fp8: bool
    tensor_cores: bool
    source: str
    max_driver_branch: int | None = None  # the last driver branch that supports it (R580 for Maxwell..Volta)
    min_driver: str | None = None  # the first driver that runs it (Blackwell: R570)
    driver_note: str = ""


class Gpu(NamedTuple):
    name: str
    aliases: list[str]
    compute_capability: str
    source: str
    memory_gb: float | None = None  # None: no source gives it (NVIDIA's tables do not): detection reports it
    platforms: list[str] = ["x86_64", "aarch64"]  # host CPUs it comes with (GH200/GB200: aarch64)
    p2p: str | None = None  # "none": no GPU peer-to-peer (NCCL goes through host memory); None: not recorded
    p2p_hang_below_driver: str | None = None  # older drivers claim P2P the card does not have: NCCL hangs
    p2p_source: str = ""
    jetpack_driver: str | None = None  # Jetson: the driver version JetPack's nvidia-smi prints (its own numbering)
    jetpack_cuda: str | None = None  # the CUDA that JetPack runs with that driver
    l4t: bool = False  # Jetson on L4T's CUDA (nvgpu): the PyTorch index's SBSA wheels do not run there
    l4t_note: str = ""
    pci_ids: list[str] = []  # PCI device ids (vendor 10de) in pci.ids, "2c05": detection names the GPU by them


class CudaMajor(NamedTuple):
    major: int
    compat_min_driver: str
    source: str
    min_cc: str | None = None  # the oldest GPU architecture this major still supports
    min_cc_note: str = ""


class Toolkit(NamedTuple):
    version: str
    source: str
    min_driver: str | None = None


class TorchBuild(NamedTuple):
    variant: str
    cuda: str
    status: str  # "stable" | "experimental"
    sass: list[str]
    source: str
    cxx11abi: bool | None = None  # where it differs from its release's
    sass_aarch64: list[str] | None = None  # the linux aarch64 wheel's arch list; None: no aarch64 build recorded


class TorchRelease(NamedTuple):
    version: str
    python: str  # a PEP 440 specifier, e.g. ">=3.10,<3.15"
    triton: str | None
    cxx11abi: bool
    source: str
    build: list[TorchBuild] = []
    triton_python: str | None = None  # the python_version marker of its triton requirement (None: all)
    triton_platforms: list[str] = ["x86_64", "aarch64"]  # the platform_machine marker of it


class AttentionBackend(NamedTuple):
    """attention.toml: a backend a plan can name, what transformers runs for it, and the GPUs it runs on."""

    name: str  # the plan's attention value
    transformers: str  # attn_implementation
    auto: bool  # picked without being asked for
    source: str
    module: str | None = None  # must import for the backend to run
    min_cc: str | None = None  # None: any device, CPU included
    max_cc: str | None = None
    note: str = ""
    packing: str = "bool_mask"  # how the trainer keeps packed sequences apart (see attention.toml's header)
    auto_when_final: bool = False  # picked on its own once its [[impl]] has a final release recorded (beta before)


class FlashAttnImpl(NamedTuple):
    name: str  # "fa2", "fa3"
    attention: str  # the attention.toml backend its wheels provide, e.g. "flash_attention_2"
    package: str
    source: str
    min_cuda: str | None = None
    handles: list[str] = []  # what its varlen kernel does that torch's varlen_attn cannot (the trainer's words)
    owns: list[str] = []  # import paths its wheels install (flash_attn/cute): two owners never share an environment
    owns_source: str = ""
    min_transformers: str | None = None  # the first transformers that runs its backend (flash_attention_4: 5.4.0)


class FlashAttnRelease(NamedTuple):
    """A release's prebuilt wheels: at a URL (wheel_url, one per torch/CUDA/Python/ABI/platform), or on the
    PyTorch index (`index = "torch"`: in the folder of the torch build's variant, one abi3 wheel per platform
    for every torch from `min_torch` on)."""

    version: str
    impl: str
    filename: str  # template: {version} {cuda} {torch} {abi} {py} {platform} {platform_tag}
    cxx11abi: list[bool]
    platforms: list[str]
    source: str
    torch: list[str] = []  # major.minor
    cuda: dict[str, str] = {}  # CUDA major of the torch build -> its tag in the filename ("12" -> "12")
    python: list[str] = []  # "3.11"
    exclude: list[str] = []  # "torch2.4-py3.13" combinations without a wheel
    min_torch: str | None = None  # every torch from this major.minor on (a libtorch-stable-ABI wheel)
    min_python: str | None = None  # every Python from this one on (an abi3 wheel)
    index: str | None = None  # "torch": on the PyTorch index of the torch build's variant; "pypi": on PyPI
    variants: list[str] = []  # index rows: the torch variants whose index folder holds the wheel
    platform_tags: dict[str, str] = {}  # platform -> the wheel's platform tag ({platform_tag})


class VarlenKernel(NamedTuple):
    """torch.toml [[varlen]]: a kernel built into torch that keeps packed sequences apart without a mask."""

    name: str
    function: str  # what the trainer calls
    torch: str  # the torch releases that have it (a range)
    min_cc: str
    attention: str  # the plan's attention when packing goes through it
    counts_as: str  # the attention.toml backend whose kernels it runs (its speed class)
    source: str
    note: str = ""


class CudnnSdpa(NamedTuple):
    """torch.toml [[cudnn_sdpa]]: builds whose SDPA puts cuDNN attention first on these GPUs."""

    torch: str  # range
    cuda: str  # range over the build's CUDA version
    min_cc: str
    max_cc: str
    bugs: str
    source: str


class KernelsRequirement(NamedTuple):
    """packages.toml: the `kernels` range a transformers release requires (Hub kernels load through it)."""

    transformers: str
    kernels: str  # range
    source: str


class KernelsRelease(NamedTuple):
    version: str
    source: str


class Package(NamedTuple):
    """A package a config's feature imports beyond the stack (trainer/features.py reads the same rows: `pin`)."""

    name: str
    version: str
    backends: list[str]  # torch backends a plan installs it for: cpu, cuda, rocm, xpu, mps
    source: str
    python: str | None = None  # range; None: any
    torch: str | None = None  # range; None: any
    extras: list[str] = []
    not_on: dict[str, str] = {}  # backend -> why it is left out
    requires: dict[str, str] = {}  # a stack package -> the range this release requires of it (vllm: transformers)
    cuda: str | None = None  # the CUDA major of the torch build it needs (vllm's kernels: "13"); None: any


class Xformers(NamedTuple):
    version: str
    torch: str  # the torch releases it accepts, e.g. "==2.8.0"
    min_cc: str
    source: str
    python: str | None = None  # the Pythons its wheels install on (None: unrecorded, not checked)
    platforms: list[str] = ["x86_64"]  # PyPI publishes linux wheels for x86_64 only
    cuda: str | None = None  # the CUDA major of the torch build its PyPI wheel is compiled against


class Stack(NamedTuple):
    torch: str  # specifier
    python: str  # specifier
    packages: dict[str, str]
    source: str
    # The pins a Hub-kernel plan takes instead, where the row's own transformers admits no `kernels` release on
    # PyPI (5.23.0 needs kernels>=0.18.2): an older transformers whose range one fits, installing with the rest.
    hub_kernels: dict[str, str] = {}
    hub_kernels_source: str | None = None
    # Upper bounds a human keeps on the row's packages although newer releases install with the rest (envtool's own
    # `train` extra bounds transformers): `envtool matrix update` never moves a package past its hold, and reports
    # the release held with hold_source.
    hold: dict[str, str] = {}
    hold_source: str | None = None

    def packages_for(self, attention: str | None) -> dict[str, str]:
        """The row's pins for a plan with this attention: a Hub kernel (a name with a slash) takes hub_kernels."""
        if attention and "/" in attention and self.hub_kernels:
            return {**self.packages, **self.hub_kernels}
        return dict(self.packages)


class GpuRequirement(NamedTuple):
    package: str
    min_cc: str
    reason: str
    source: str


class Feature(NamedTuple):
    """A library feature whose hardware floor differs within its package (bitsandbytes 4-bit vs int8)."""

    name: str
    package: str
    config: str  # the config keys that use it
    min_cc: str
    cpu: bool  # runs without a GPU
    reason: str
    source: str


class BaseImage(NamedTuple):
    variant_prefix: str
    image: str  # template: {python}, {rocm}
    reason: str
    source: str
    python: str | None = None  # the base's own interpreter, where it brings one


class TritonSupport(NamedTuple):
    triton: str  # specifier over triton versions
    min_cc: str
    reason: str
    source: str


class TritonRelease(NamedTuple):
    """Where triton's own wheels exist: a plan names a triton pin only where one installs."""

    version: str
    python: str  # specifier
    platforms: list[str]
    source: str


class Matrix(NamedTuple):
    version: str
    archs: list[Arch]
    gpus: list[Gpu]
    cuda_majors: list[CudaMajor]
    toolkits: list[Toolkit]
    assumed_driver: str  # what plans assume when the run host's driver is unknown
    torch: list[TorchRelease]
    torch_index_url: str
    attention: list[AttentionBackend]
    flash_attn_impls: list[FlashAttnImpl]
    flash_attn_releases: list[FlashAttnRelease]
    flash_attn_url: str
    xformers: list[Xformers]
    stacks: list[Stack]
    no_build: list[str]
    gpu_requirements: list[GpuRequirement]
    triton_support: list[TritonSupport]
    features: list[Feature]
    base_images: list[BaseImage]
    triton_releases: list[TritonRelease] = []
    varlen: list[VarlenKernel] = []
    cudnn_sdpa: list[CudnnSdpa] = []
    kernels_requirements: list[KernelsRequirement] = []
    kernels_releases: list[KernelsRelease] = []
    packages: list[Package] = []
    flash_attn_reviewed: list[str] = []  # releases looked at and deliberately not recorded

    # Queries used by the solver; kept here so the data's shape stays in one file.
    def gpu_rows(self, name: str, cc: str | None) -> list[Gpu]:
        """The catalog rows a target is: its own row by name, else (named by compute capability, `--gpu sm_110`)
        every row of that compute capability."""
        own = [g for g in self.gpus if g.name == name]
        return own or [g for g in self.gpus if cc is not None and g.compute_capability == cc]

    def arch_for(self, cc: str) -> Arch | None:
        """The row for `cc`, else the nearest lower minor of the same major (sm_XZ runs sm_XY code)."""
        return catalog.arch_for(cc, self.archs)

    def toolkit(self, version: str) -> Toolkit:
        return next(t for t in self.toolkits if t.version == version)

    def cuda_major(self, major: int) -> CudaMajor | None:
        return next((m for m in self.cuda_majors if m.major == major), None)

    def flash_attn_impl(self, name: str) -> FlashAttnImpl:
        return next(i for i in self.flash_attn_impls if i.name == name)

    def backend(self, name: str) -> AttentionBackend:
        return next(b for b in self.attention if b.name == name)

    def attention_name(self, name: str | None) -> str | None:
        """A backend as `--attention` names it: its attention.toml name, or its flash_attn.toml [[impl]] name
        (fa2, fa3, fa4) for the backend that implementation's wheels provide."""
        return next((i.attention for i in self.flash_attn_impls if i.name == name), name)

    def newest_flash_attn(self, impl: str) -> FlashAttnRelease | None:
        """The newest recorded release of a flash-attn implementation (pre-releases included)."""
        rows = [r for r in self.flash_attn_releases if r.impl == impl]
        return max(rows, key=lambda r: Version(r.version), default=None)

    def beta(self, backend: AttentionBackend) -> FlashAttnRelease | None:
        """The pre-release a backend waits on: for an `auto_when_final` backend whose implementation has no final
        release recorded, its newest (beta) release; None for every other backend."""
        newest = self._newest_for(backend)
        return newest if newest is not None and Version(newest.version).is_prerelease else None

    def _newest_for(self, backend: AttentionBackend) -> FlashAttnRelease | None:
        if not backend.auto_when_final:
            return None
        impl = next((i for i in self.flash_attn_impls if i.attention == backend.name), None)
        return self.newest_flash_attn(impl.name) if impl else None

    def is_auto(self, backend: AttentionBackend) -> bool:
        """Whether a plan picks the backend without being asked: `auto`, or `auto_when_final` once its
        implementation has a final release recorded."""
        newest = self._newest_for(backend)
        return backend.auto or (newest is not None and not Version(newest.version).is_prerelease)

    def runs_as(self, attention: str, packing: str, torch_version: str) -> str:
        """The attention the trainer runs for a plan's `attention` and `packing`, as the plan table, the docs'
        tables and the dry run's `trainer:` line name it: where the plan packs through torch's own varlen kernel
        (packing varlen, the [[varlen]] row's `attention`, its torch), that kernel, which the trainer registers with
        transformers under its name (trainer/model/attention.py choose_packing) and runs for every row; else the
        plan's backend. The plan's JSON keeps the backend (`--attention` takes it back)."""
        if packing == "varlen":
            kernel = next((v for v in self.varlen if v.attention == attention and in_range(torch_version, v.torch)),
                          None)
            if kernel is not None:
                return kernel.name
        return attention

    def triton_release(self, version: str) -> TritonRelease | None:
        return next((t for t in self.triton_releases if t.version == version), None)




RANGE_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
             "!=": operator.ne}
RANGE_RE = re.compile(r"^(>=|<=|==|!=|>|<)\s*(\S+)$")


PYTHON_RE = re.compile(r"^3\.\d{1,2}$")  # what --python takes
# Mirrors and air-gapped sites: URL templates that replace the matrix's (same placeholders).
TORCH_INDEX_ENV = "ENVTOOL_TORCH_INDEX_URL"  # {variant}
FLASH_ATTN_URL_ENV = "ENVTOOL_FLASH_ATTN_URL"  # {version} {filename}


def prefix_match(pin: str, version: str) -> bool:
    """Whether a pin like --torch 2.8 admits 2.8.0 (the pin's release parts are the version's first ones)."""
    pin_release = Version(pin).release
    return Version(version).release[: len(pin_release)] == pin_release


def stack_for(m: "Matrix", torch_version: str, python: str):
    """The packages.toml [[stack]] row (newest first) whose torch and Python ranges admit these, else None."""
    return next((s for s in m.stacks
                 if in_range(torch_version, s.torch) and in_range(python, s.python)), None)


def in_range(version: str, spec: str) -> bool:
    """Whether `version` satisfies a matrix range such as ">=3.10,<3.15".

    Matrix ranges use only these six comparisons (the loader rejects anything else), so this agrees with
    packaging.specifiers.SpecifierSet on them; importing that module costs ~15 ms of `envtool resolve`'s
    start-up, which must stay fast.
    """
    v = _version(version)
    return all(compare(v, bound) for compare, bound in _clauses(spec))


# A plan asks ~300 ranges about a few dozen versions: each text is parsed once.
@lru_cache(maxsize=1024)
def _version(text: str) -> Version:
    return Version(text)


@lru_cache(maxsize=1024)
def _clauses(spec: str) -> tuple:
    return tuple((RANGE_OPS[op], _version(bound))
                 for op, bound in (RANGE_RE.match(clause.strip()).groups() for clause in spec.split(",")))


# ---------------------------------------------------------------------------- loading


FILES = ("meta", "attention", "archs", "gpus", "cuda", "torch", "flash_attn", "xformers", "packages", "images")


@lru_cache(maxsize=4)
def load(directory: Path | None = None) -> Matrix:
    """The checked matrix. Parsing and checking every row costs ~10 ms of `resolve`'s start-up, so the result
    is kept as JSON under ~/.cache/envtool (`cached`)."""
    directory = Path(directory) if directory else matrix_dir()
    return cached("matrix", Matrix, directory, FILES, (__file__,), lambda: _load(directory))


def cached(kind: str, cls: type, directory: Path, files: tuple, code: tuple, make):
    """`make()` (a row of type `cls` read from `directory`'s TOML files), kept as JSON under ~/.cache/envtool,
    keyed by the files' paths, sizes and mtimes, the code that reads them and envtool's version. The cache is
    data, never code (no pickle): it is read back through the same typed rows as the TOML (`_build`), so a
    cache that does not have their shape, whatever it holds, is ignored and rebuilt."""
    key = _cache_key(directory, files, code)
    cache = _cache_path(directory, key, kind)
    if cache is not None and cache.is_file():
        value = _read_cache(cache, key, cls)
        if value is not None:
            return value
    value = make()
    if cache is not None:
        _write_cache(cache, value, key)
    return value


def _cache_key(directory: Path, files: tuple = FILES, code: tuple = (__file__,)) -> str | None:
    """What a cached reading depends on: the files' paths, sizes and mtimes, the code and envtool's version."""
    try:
        stats = [(name, (directory / f"{name}.toml").stat()) for name in files]
    except OSError:
        return None  # a missing file: _load names it
    codes = [(c.st_size, c.st_mtime_ns) for c in map(os.stat, code)]  # the row classes are part of what it holds
    return repr((str(directory.resolve()), __version__, codes, [(n, s.st_size, s.st_mtime_ns) for n, s in stats]))


def _cache_path(directory: Path, key: str | None = None, kind: str = "matrix") -> Path | None:
    """The cache file for `directory`'s matrix (or another `kind` of reading): named by a 64-bit FNV-1a hash of
    its key (hashlib's import alone cost `resolve` ~3 ms); the key itself is stored in the file and compared on
    reading, so two keys of one name only take turns."""
    key = key or _cache_key(directory)
    if key is None:
        return None
    digest = 0xCBF29CE484222325
    for byte in key.encode():
        digest = ((digest ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "envtool"
    return base / f"{kind}-{digest:016x}.json"


def _plain(value):
    if hasattr(value, "_fields"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


CACHE_KEY = "_cache_key"  # the cache file's entry holding its key


def _read_cache(cache: Path, key: str, cls: type = None):
    """The cached reading, or None when the file is not one in this envtool's shape (another version, another
    key, truncated, or written by something else): then it is rebuilt from the TOML."""
    cls = cls or Matrix
    try:
        data = json.loads(cache.read_text())
        if not isinstance(data, dict) or data.pop(CACHE_KEY, None) != key or set(data) - set(cls._fields):
            return None
        return _build(cls, data, cache.name, cache)
    except (OSError, ValueError, MatrixError, TypeError, RecursionError):
        return None


def _write_cache(cache: Path, value, key: str) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({CACHE_KEY: key, **_plain(value)}, separators=(",", ":")))
        tmp.replace(cache)
    except OSError:
        pass  # a read-only home: no cache, same answers


def _load(directory: Path) -> Matrix:
    files = {name: _read(directory / f"{name}.toml") for name in FILES}
    meta = files["meta"]
    if not isinstance(meta.get("version"), str):
        raise MatrixError(f"{directory / 'meta.toml'}: missing string 'version'")
    m = Matrix(
        version=meta["version"],
        archs=_rows(files["archs"], "arch", Arch, directory / "archs.toml"),
        gpus=_rows(files["gpus"], "gpu", Gpu, directory / "gpus.toml"),
        cuda_majors=_rows(files["cuda"], "major", CudaMajor, directory / "cuda.toml"),
        toolkits=_rows(files["cuda"], "toolkit", Toolkit, directory / "cuda.toml"),
        assumed_driver=_scalar(files["cuda"], "assumed_driver", directory / "cuda.toml"),
        torch=_rows(files["torch"], "release", TorchRelease, directory / "torch.toml"),
        torch_index_url=_scalar(files["torch"], "index_url", directory / "torch.toml"),
        attention=_rows(files["attention"], "backend", AttentionBackend, directory / "attention.toml"),
        flash_attn_impls=_rows(files["flash_attn"], "impl", FlashAttnImpl, directory / "flash_attn.toml"),
        flash_attn_releases=_rows(files["flash_attn"], "release", FlashAttnRelease,
                                  directory / "flash_attn.toml"),
        flash_attn_url=_scalar(files["flash_attn"], "wheel_url", directory / "flash_attn.toml"),
        xformers=_rows(files["xformers"], "release", Xformers, directory / "xformers.toml"),
        stacks=_rows(files["packages"], "stack", Stack, directory / "packages.toml"),
        no_build=_typed(list[str], files["packages"].get("no_build"), "packages.toml: no_build",
                        directory / "packages.toml"),
        gpu_requirements=_rows(files["packages"], "gpu_requirement", GpuRequirement,
                               directory / "packages.toml"),
        triton_support=_rows(files["packages"], "triton_support", TritonSupport,
                             directory / "packages.toml"),
        features=_rows(files["packages"], "feature", Feature, directory / "packages.toml"),
        base_images=_rows(files["images"], "base", BaseImage, directory / "images.toml"),
        triton_releases=_optional_rows(files["packages"], "triton_release", TritonRelease, directory / "packages.toml"),
        varlen=_optional_rows(files["torch"], "varlen", VarlenKernel, directory / "torch.toml"),
        cudnn_sdpa=_optional_rows(files["torch"], "cudnn_sdpa", CudnnSdpa, directory / "torch.toml"),
        kernels_requirements=_optional_rows(files["packages"], "kernels_requirement", KernelsRequirement,
                                            directory / "packages.toml"),
        kernels_releases=_optional_rows(files["packages"], "kernels_release", KernelsRelease,
                                        directory / "packages.toml"),
        packages=_optional_rows(files["packages"], "package", Package, directory / "packages.toml"),
        flash_attn_reviewed=_typed(list[str], files["flash_attn"].get("reviewed", []), "flash_attn.toml: reviewed",
                                   directory / "flash_attn.toml"),
    )
    _check_facts(m, directory)
    return m


def _read(path: Path) -> dict:
    # start-up: tomllib imported only when this runs (a cached matrix is read without it)
    if sys.version_info >= (3, 11):
        import tomllib  # start-up
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib  # start-up
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise MatrixError(f"{path}: matrix file missing") from None
    except tomllib.TOMLDecodeError as e:
        raise MatrixError(f"{path}: not valid TOML: {e}") from None


def _scalar(data: dict, key: str, path: Path) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise MatrixError(f"{path}: missing string '{key}'")
    return value


def _rows(data: dict, table: str, cls: type, path: Path) -> list:
    rows = data.get(table)
    if not isinstance(rows, list) or not rows:
        raise MatrixError(f"{path}: no [[{table}]] rows")
    return [_build(cls, row, f"{path.name} [[{table}]] #{i + 1}{_label(row)}", path) for i, row in enumerate(rows)]


def _optional_rows(data: dict, table: str, cls: type, path: Path) -> list:
    """Rows of a table a matrix may leave out (older matrices, the tests' synthetic ones)."""
    return _rows(data, table, cls, path) if table in data else []


def _label(row: object) -> str:
    if isinstance(row, dict):
        for key in ("version", "name", "variant", "package", "compute_capability", "major", "torch"):
            if key in row:
                return f" ({key}={row[key]})"
    return ""


@lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[dict, dict, frozenset]:
    hints = cls.__annotations__  # the types themselves (this module has no `from __future__ import annotations`)
    if any(isinstance(h, str) for h in hints.values()):
        hints = typing.get_type_hints(cls)  # annotations kept as text: evaluated (~0.3 ms a class)
    return hints, cls._field_defaults, frozenset(cls._fields)


@lru_cache(maxsize=None)
def _shape(hint) -> tuple:
    return typing.get_origin(hint), typing.get_args(hint)


def _text(where) -> str:
    """A row's location: its text, or a function that gives it. Reading the cached matrix checks ~2,500 values;
    building each one's location up front (a path and an f-string) cost more than the checks, so it is built
    only for an error message."""
    return where() if callable(where) else where


def _build(cls: type, row: object, where, path: Path):
    if not isinstance(row, dict):
        raise MatrixError(f"{path.parent / _text(where)}: a row must be a table")
    hints, defaults, fields = _schema(cls)
    unknown = sorted(row.keys() - fields)
    if unknown:
        raise MatrixError(f"{path.parent / _text(where)}: unknown field {unknown[0]!r}")
    values = {}
    for name in cls._fields:
        if name not in row:
            if name not in defaults:
                raise MatrixError(f"{path.parent / _text(where)}: missing field {name!r}")
            continue
        if type(row[name]) is hints[name]:  # most fields: a str, bool or float of its own type, nothing to build
            values[name] = row[name]
            continue
        values[name] = _typed(hints[name], row[name], lambda n=name: f"{path.parent / _text(where)}: field {n!r}",
                              path)
    return cls(**values)


def _typed(hint, value, where, path: Path):
    origin, args = _shape(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = next(a for a in args if a is not type(None))
        return value if type(value) is inner else _typed(inner, value, where, path)
    if origin is list:
        if not isinstance(value, list):
            raise MatrixError(f"{_text(where)} must be a list")
        (item,) = args
        if hasattr(item, "_fields"):
            return [_build(item, v, lambda i=i: f"{_text(where).split(': ')[0]}.{i + 1}", path)
                    for i, v in enumerate(value)]
        if all(type(v) is item for v in value):  # a list of strings: nothing to build
            return list(value)
        return [_typed(item, v, lambda i=i: f"{_text(where)}[{i}]", path) for i, v in enumerate(value)]
    if hasattr(hint, "_fields"):  # a row of its own (vendors' [container] table)
        return _build(hint, value, lambda: _text(where).split(": ")[0], path)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise MatrixError(f"{_text(where)} must be a table of strings")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise MatrixError(f"{_text(where)} must be {hint.__name__}, not {type(value).__name__} ({value!r})")
    return value


class _Rules:
    """The checks a row's values pass (a compute capability, a version, a range, a platform), each failing with
    one MatrixError naming the file, the row and the value."""

    def __init__(self, directory: Path):
        self.directory = directory

    def fail(self, msg: str):
        raise MatrixError(f"{self.directory}/{msg}")

    def cc(self, value: str, where: str):
        if not CC_RE.match(value):
            self.fail(f"{where}: compute capability {value!r} is not of the form '8.0'")

    def version(self, value: str, where: str):
        try:
            Version(value)
        except InvalidVersion:
            self.fail(f"{where}: {value!r} is not a version")

    def platforms(self, values: list[str], where: str):
        for p in values:
            if p not in PLATFORMS:
                self.fail(f"{where}: platform {p!r} is not one of {', '.join(PLATFORMS)}")

    def spec(self, value: str, where: str):
        clauses = [RANGE_RE.match(c.strip()) for c in value.split(",")]
        if not all(clauses):
            self.fail(f"{where}: {value!r} is not a version range like '>=3.10,<3.15'")
        for clause in clauses:
            self.version(clause.group(2), where)


def _check_facts(m: Matrix, directory: Path) -> None:
    """Cross-row checks: what a type alone cannot say. One section per group of files, in this order."""
    rule = _Rules(directory)
    for section in (_check_gpus, _check_torch, _check_attention, _check_varlen, _check_packages):
        section(m, rule)


def _check_gpus(m: Matrix, rule: _Rules) -> None:
    """archs.toml, gpus.toml, cuda.toml's toolkits."""
    for a in m.archs:
        where = f"archs.toml [[arch]] ({a.compute_capability})"
        rule.cc(a.compute_capability, where)
        if a.min_driver:
            rule.version(a.min_driver, where)
        if (a.min_driver or a.max_driver_branch) and not a.driver_note:
            rule.fail(f"{where}: a driver limit needs a driver_note saying why")
    aliases: dict[str, str] = {}
    pci: dict[str, str] = {}
    for g in m.gpus:
        where = f"gpus.toml [[gpu]] ({g.name})"
        rule.cc(g.compute_capability, where)
        for device in g.pci_ids:
            if not re.fullmatch(r"[0-9a-f]{4}", device):
                rule.fail(f"{where}: pci_ids {device!r} is not a PCI device id (4 lowercase hex digits)")
            if device in pci:
                rule.fail(f"{where}: PCI id {device} also names {pci[device]}")
            pci[device] = g.name
        if g.pci_ids and "pci.ids" not in g.source:
            rule.fail(f"{where}: pci_ids without pci.ids named in its source")
        if m.arch_for(g.compute_capability) is None:
            rule.fail(f"{where}: no archs.toml row covers compute capability {g.compute_capability}")
        for alias in g.aliases:
            key = normalize_name(alias)
            if key in aliases:
                rule.fail(f"{where}: alias {alias!r} also names {aliases[key]}")
            aliases[key] = g.name
        rule.platforms(g.platforms, where)
        if g.p2p not in (None, "none"):
            rule.fail(f"{where}: p2p {g.p2p!r}: give \"none\" or leave it out")
        if (g.p2p or g.p2p_hang_below_driver) and not g.p2p_source:
            rule.fail(f"{where}: a p2p fact needs a p2p_source")
        if g.p2p_hang_below_driver:
            rule.version(g.p2p_hang_below_driver, where)
    rule.version(m.assumed_driver, "cuda.toml assumed_driver")
    for t in m.toolkits:
        rule.version(t.version, f"cuda.toml [[toolkit]] ({t.version})")
        if m.cuda_major(int(t.version.split(".")[0])) is None:
            rule.fail(f"cuda.toml [[toolkit]] ({t.version}): no [[major]] row for its major")


def _check_torch(m: Matrix, rule: _Rules) -> None:
    """torch.toml's releases and their builds."""
    toolkits = {t.version for t in m.toolkits}
    for r in m.torch:
        where = f"torch.toml [[release]] (version={r.version})"
        rule.version(r.version, where)
        rule.spec(r.python, where)
        rule.platforms(r.triton_platforms, where)
        if r.triton_python is not None:
            rule.spec(r.triton_python, where)
        if r.triton is not None:
            rule.version(r.triton, where)
            if m.triton_releases:
                _check_triton_wheels(r, m, where, rule.fail)
        for b in r.build:
            bwhere = f"{where} build {b.variant}"
            if b.cuda not in toolkits:
                rule.fail(f"{bwhere}: CUDA {b.cuda} has no cuda.toml [[toolkit]] row")
            if b.status not in ("stable", "experimental"):
                rule.fail(f"{bwhere}: status must be 'stable' or 'experimental', not {b.status!r}")
            if not b.sass:
                rule.fail(f"{bwhere}: empty sass list")
            for s in b.sass + (b.sass_aarch64 or []):
                rule.cc(s, bwhere)
            if b.sass_aarch64 == []:
                rule.fail(f"{bwhere}: empty sass_aarch64 list (leave it out where there is no aarch64 build)")


def _check_attention(m: Matrix, rule: _Rules) -> None:
    """cuda.toml's majors, attention.toml, flash_attn.toml."""
    impls = {i.name for i in m.flash_attn_impls}
    for c in m.cuda_majors:
        if c.min_cc:
            rule.cc(c.min_cc, f"cuda.toml [[major]] ({c.major})")
    backends = {b.name for b in m.attention}
    for b in m.attention:
        for value in (b.min_cc, b.max_cc):
            if value:
                rule.cc(value, f"attention.toml [[backend]] ({b.name})")
        if b.packing not in ("position_ids", "row_position_ids", "bool_mask", "float_mask"):
            rule.fail(f"attention.toml [[backend]] ({b.name}): packing {b.packing!r} is not position_ids, "
                 "row_position_ids, bool_mask or float_mask")
    for i in m.flash_attn_impls:
        if i.attention not in backends:
            rule.fail(f"flash_attn.toml [[impl]] ({i.name}): attention {i.attention!r} has no attention.toml row")
        if i.owns and not i.owns_source:
            rule.fail(f"flash_attn.toml [[impl]] ({i.name}): `owns` needs `owns_source` (where the file list was read)")
    for fa in m.flash_attn_releases:
        where = f"flash_attn.toml [[release]] (version={fa.version})"
        rule.version(fa.version, where)
        if fa.impl not in impls:
            rule.fail(f"{where}: impl {fa.impl!r} has no [[impl]] row")
        rule.platforms(fa.platforms, where)
        if bool(fa.torch) == bool(fa.min_torch) and not (fa.index == "pypi" and not fa.torch):
            rule.fail(f"{where}: give either `torch` (the releases with a wheel) or `min_torch` (every one from it on)")
        if bool(fa.python) == bool(fa.min_python):
            rule.fail(f"{where}: give either `python` or `min_python`")
        for value in filter(None, (fa.min_torch, fa.min_python)):
            rule.version(value, where)
        if fa.index is None or fa.index == "pypi":
            if not fa.cuda or fa.variants:
                rule.fail(f"{where}: a wheel at a URL or on PyPI needs `cuda` (CUDA major -> filename tag or extra) "
                          "and no `variants`")
        else:
            if fa.index != "torch":
                rule.fail(f"{where}: index {fa.index!r}: a release row names index \"torch\" or \"pypi\"")
            if not fa.variants or fa.cuda:
                rule.fail(f"{where}: a wheel on the PyTorch index needs `variants` (the index folders) and no `cuda`")
        if "{platform_tag}" in fa.filename:
            missing = [p for p in fa.platforms if p not in fa.platform_tags]
            if missing:
                rule.fail(f"{where}: platform_tags has no tag for {missing[0]}")


def _check_varlen(m: Matrix, rule: _Rules) -> None:
    """torch.toml's varlen kernels and cuDNN SDPA rows."""
    backends = {b.name for b in m.attention}
    for v in m.varlen:
        where = f"torch.toml [[varlen]] ({v.name})"
        rule.spec(v.torch, where)
        rule.cc(v.min_cc, where)
        for name in (v.attention, v.counts_as):
            if name not in backends:
                rule.fail(f"{where}: {name!r} has no attention.toml row")
    for c in m.cudnn_sdpa:
        where = f"torch.toml [[cudnn_sdpa]] (torch{c.torch})"
        rule.spec(c.torch, where)
        rule.spec(c.cuda, where)
        rule.cc(c.min_cc, where)
        rule.cc(c.max_cc, where)


def _check_packages(m: Matrix, rule: _Rules) -> None:
    """packages.toml and xformers.toml."""
    for k in m.kernels_requirements:
        where = f"packages.toml [[kernels_requirement]] (transformers={k.transformers})"
        rule.version(k.transformers, where)
        rule.spec(k.kernels, where)
    for k in m.kernels_releases:
        rule.version(k.version, f"packages.toml [[kernels_release]] (version={k.version})")
    for s in m.stacks:
        if s.hub_kernels and not s.hub_kernels_source:
            rule.fail(f"packages.toml [[stack]] (python{s.python}): hub_kernels without hub_kernels_source")
        if s.hold and not s.hold_source:
            rule.fail(f"packages.toml [[stack]] (python{s.python}): hold without hold_source")
        for name, spec in s.hold.items():
            if name not in s.packages:
                rule.fail(f"packages.toml [[stack]] (python{s.python}): hold.{name} is not one of its packages")
            rule.spec(spec, f"packages.toml [[stack]] (python{s.python}) hold.{name}")
            if name in s.packages and all(RANGE_RE.match(c.strip()) for c in spec.split(",")) \
                    and not in_range(s.packages[name], spec):
                rule.fail(f"packages.toml [[stack]] (python{s.python}): hold.{name} {spec} excludes its own pin "
                          f"{s.packages[name]}")
        for name, v in s.hub_kernels.items():
            if name not in s.packages:
                rule.fail(f"packages.toml [[stack]] (python{s.python}): hub_kernels.{name} is not one of its packages")
            rule.version(v, f"packages.toml [[stack]] (python{s.python}) hub_kernels.{name}")
    for p in m.packages:
        where = f"packages.toml [[package]] (name={p.name}, version={p.version})"
        rule.version(p.version, where)
        for r in (p.python, p.torch):
            if r is not None:
                rule.spec(r, where)
        unknown = sorted({*p.backends, *p.not_on} - {"cpu", "cuda", "rocm", "xpu", "mps"})
        if unknown:
            raise MatrixError(f"{where}: unknown backend {unknown[0]!r} (cpu, cuda, rocm, xpu, mps)")
    for x in m.xformers:
        where = f"xformers.toml [[release]] (version={x.version})"
        rule.version(x.version, where)
        rule.spec(x.torch, where)
        rule.cc(x.min_cc, where)
        if x.python is not None:
            rule.spec(x.python, where)
        rule.platforms(x.platforms, where)
    for t in m.triton_releases:
        where = f"packages.toml [[triton_release]] (version={t.version})"
        rule.version(t.version, where)
        rule.spec(t.python, where)
        rule.platforms(t.platforms, where)
    for s in m.stacks:
        where = f"packages.toml [[stack]] (torch={s.torch})"
        rule.spec(s.torch, where)
        rule.spec(s.python, where)
        for name, v in s.packages.items():
            rule.version(v, f"{where} package {name}")
    for req in m.gpu_requirements:
        rule.cc(req.min_cc, f"packages.toml [[gpu_requirement]] ({req.package})")
    for f in m.features:
        rule.cc(f.min_cc, f"packages.toml [[feature]] ({f.name})")
    for t in m.triton_support:
        rule.spec(t.triton, f"packages.toml [[triton_support]] ({t.triton})")
        rule.cc(t.min_cc, f"packages.toml [[triton_support]] ({t.triton})")


def _check_triton_wheels(r: TorchRelease, m: Matrix, where: str, fail) -> None:
    """A torch release's triton requirement must be installable wherever its marker applies: the matrix
    records the marker and triton's wheels, and a plan names the pin only where both hold, so a gap means
    one of the two rows is wrong."""
    t = m.triton_release(r.triton)
    if t is None:
        fail(f"{where}: triton {r.triton} has no packages.toml [[triton_release]] row")
    missing = [p for p in r.triton_platforms if p not in t.platforms]
    if missing:
        fail(f"{where}: its wheel requires triton {r.triton} on {missing[0]}, where triton publishes no wheel")
    # the lowest and highest Python the torch release supports, within the marker's range
    for py in pythons(r.python):
        if (r.triton_python is None or in_range(py, r.triton_python)) and not in_range(py, t.python):
            fail(f"{where}: its wheel requires triton {r.triton} on Python {py}, where triton publishes no wheel")


def pythons(spec: str) -> list[str]:
    """The 3.x minors a range admits (3.6 .. 3.39)."""
    return [f"3.{n}" for n in range(6, 40) if in_range(f"3.{n}", spec)]
