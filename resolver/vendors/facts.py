"""The AMD, Intel and Apple facts (matrices/amd.toml, rocm.toml, intel.toml, apple.toml) as checked, typed rows.

The row classes are the schema, read by matrix.py's own row builder (every field without a default required, no
unknown field, values of the annotated types); `load()` then checks what a type cannot say: targets are real
gfx names, every GPU's target has a [[target]] row, every build names a torch release torch.toml knows, no
alias names two GPUs across vendors (NVIDIA's gpus.toml included).
"""

from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from packaging.version import InvalidVersion, Version

from matrices import catalog
from matrices.catalog import matrix_dir, normalize_name

from ..errors import MatrixError
from .. import matrix
from ..matrix import _build, _read, _rows, _scalar, load as load_matrix
from ..matrix import in_range

FILES = ("amd", "rocm", "intel", "apple")


# ---------------------------------------------------------------------------- AMD (amd.toml, rocm.toml)


class AmdTarget(NamedTuple):
    gfx: str
    family: str
    bf16: bool
    fp8: str  # "" | "fnuz" | "ocp"
    wavefront: int
    source: str
    shared_memory: bool = False  # an APU: GPU memory is system memory


class AmdGpu(NamedTuple):
    name: str
    aliases: list[str]
    gfx: str
    source: str
    memory_gb: float | None = None  # None: an APU (system memory)
    devices: int = 1  # devices torch sees per package (MI250/MI250X: 2 GCDs)
    pci_ids: list[str] = []


class Kmd(NamedTuple):
    rocm: str  # the ROCm release the kernel driver came with
    user_space: list[str]  # ROCm user-space releases AMD tested with it
    source: str


class RocmBuild(NamedTuple):
    torch: str
    variant: str  # index name: rocm6.4
    rocm: str
    status: str  # "stable" | "also"
    gfx: list[str]
    source: str


class Aotriton(NamedTuple):
    gfx: str
    status: str  # "supported" | "experimental" (TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1)
    source: str


class BnbRocm(NamedTuple):
    version: str
    rocm: str
    gfx: list[str]
    source: str


class Container(NamedTuple):
    """How a container reaches the GPUs ([container] of rocm.toml / intel.toml)."""

    devices: list[str]
    groups: list[str]  # host groups owning the device nodes, added to the container user by GID
    k8s_resource: str
    source: str
    security_opt: list[str] = []


# ---------------------------------------------------------------------------- Intel (intel.toml)


class IntelTarget(NamedTuple):
    aot: str
    family: str
    source: str


class IntelGpu(NamedTuple):
    name: str
    aliases: list[str]
    aot: str
    source: str
    pci_ids: list[str] = []


class XpuBuild(NamedTuple):
    torch: str  # a range: ">=2.5"
    source: str


class BnbXpu(NamedTuple):
    version: str
    libraries: list[str]
    source: str


# ---------------------------------------------------------------------------- Apple (apple.toml)


class MacBuild(NamedTuple):
    torch: str
    macos: str  # the arm64 wheel's platform tag floor
    python: list[str]
    source: str


class Limit(NamedTuple):
    """What runs or does not run on a vendor's GPUs beyond torch ([[limit]] of rocm.toml, intel.toml,
    apple.toml): a stack `package` left out (runs = false) or needed at `min_version`, config `features`
    (packages.toml [[feature]] names) refused."""

    feature: str
    runs: bool
    reason: str
    source: str
    package: str | None = None
    min_version: str | None = None
    features: list[str] = []


class VendorTriton(NamedTuple):
    """The triton distribution torch's ROCm / XPU wheels require, by torch release range."""

    torch: str  # a range: "<2.10"
    package: str
    source: str


class Vendors(NamedTuple):
    amd_targets: list[AmdTarget]
    amd_gpus: list[AmdGpu]
    kmd: list[Kmd]
    rocm_index_url: str
    rocm_builds: list[RocmBuild]
    aotriton: list[Aotriton]
    bnb_rocm: list[BnbRocm]
    rocm_container: Container
    intel_targets: list[IntelTarget]
    intel_gpus: list[IntelGpu]
    xpu_index_url: str
    xpu_builds: list[XpuBuild]
    bnb_xpu: list[BnbXpu]
    xpu_container: Container
    mps_min_macos: str
    bf16_min_macos: str
    mac_builds: list[MacBuild]
    mps_limits: list[Limit]
    rocm_limits: list[Limit]
    xpu_limits: list[Limit]
    rocm_triton: list[VendorTriton]
    xpu_triton: list[VendorTriton]

    def amd_target(self, gfx: str) -> AmdTarget | None:
        return catalog.find_target(gfx, self.amd_targets)

    def rocm_builds_for(self, gfx: str) -> list[RocmBuild]:
        """The recorded torch ROCm builds that carry code objects for `gfx`, in file order (oldest first)."""
        return [b for b in self.rocm_builds if gfx in b.gfx]

    def aotriton_for(self, gfx: str) -> Aotriton | None:
        return next((a for a in self.aotriton if a.gfx == gfx), None)

    def intel_target(self, aot: str) -> IntelTarget | None:
        return next((t for t in self.intel_targets if t.aot == aot), None)

    def limits(self, vendor: str) -> list[Limit]:
        return {"amd": self.rocm_limits, "intel": self.xpu_limits, "apple": self.mps_limits}.get(vendor, [])

    def triton_package(self, vendor: str, torch: str) -> VendorTriton | None:
        """The triton distribution torch `torch`'s ROCm / XPU wheel requires, else None."""
        rows = {"amd": self.rocm_triton, "intel": self.xpu_triton}.get(vendor, [])
        return next((r for r in rows if in_range(torch, r.torch)), None)


@lru_cache(maxsize=4)
def load(directory: Path | None = None) -> Vendors:
    """The checked vendor facts, kept as JSON under ~/.cache/envtool like the matrix (matrix.cached): reading the
    four TOML files cost `resolve --gpu auto` ~15 ms. The checks also read torch.toml, so the key covers the
    matrix's files too."""
    directory = Path(directory) if directory else matrix_dir()
    return matrix.cached("vendors", Vendors, directory, FILES + matrix.FILES, (__file__, matrix.__file__),
                         lambda: _load(directory))


def _load(directory: Path) -> Vendors:
    files = {name: _read(directory / f"{name}.toml") for name in FILES}
    amd, rocm, intel, apple = (files[n] for n in FILES)
    v = Vendors(
        amd_targets=_rows(amd, "target", AmdTarget, directory / "amd.toml"),
        amd_gpus=_rows(amd, "gpu", AmdGpu, directory / "amd.toml"),
        kmd=_rows(amd, "kmd", Kmd, directory / "amd.toml"),
        rocm_index_url=_scalar(rocm, "index_url", directory / "rocm.toml"),
        rocm_builds=_rows(rocm, "build", RocmBuild, directory / "rocm.toml"),
        aotriton=_rows(rocm, "aotriton", Aotriton, directory / "rocm.toml"),
        bnb_rocm=_rows(rocm, "bitsandbytes", BnbRocm, directory / "rocm.toml"),
        rocm_container=_build(Container, rocm.get("container"), "rocm.toml [container]", directory / "rocm.toml"),
        intel_targets=_rows(intel, "target", IntelTarget, directory / "intel.toml"),
        intel_gpus=_rows(intel, "gpu", IntelGpu, directory / "intel.toml"),
        xpu_index_url=_scalar(intel, "index_url", directory / "intel.toml"),
        xpu_builds=_rows(intel, "build", XpuBuild, directory / "intel.toml"),
        bnb_xpu=_rows(intel, "bitsandbytes", BnbXpu, directory / "intel.toml"),
        xpu_container=_build(Container, intel.get("container"), "intel.toml [container]", directory / "intel.toml"),
        mps_min_macos=_scalar(apple, "mps_min_macos", directory / "apple.toml"),
        bf16_min_macos=_scalar(apple, "bf16_min_macos", directory / "apple.toml"),
        mac_builds=_rows(apple, "build", MacBuild, directory / "apple.toml"),
        mps_limits=_rows(apple, "limit", Limit, directory / "apple.toml"),
        rocm_limits=_rows(rocm, "limit", Limit, directory / "rocm.toml"),
        xpu_limits=_rows(intel, "limit", Limit, directory / "intel.toml"),
        rocm_triton=_rows(rocm, "triton", VendorTriton, directory / "rocm.toml"),
        xpu_triton=_rows(intel, "triton", VendorTriton, directory / "intel.toml"),
    )
    _check(v, directory)
    return v


class _Rules:
    """The checks a vendor row's values pass, each failing with one MatrixError naming the file, row and value."""

    def __init__(self, directory: Path):
        self.directory = directory

    def fail(self, msg: str):
        raise MatrixError(f"{self.directory}/{msg}")

    def gfx(self, value: str, where: str):
        if catalog.gfx_from_text(value) != value:
            self.fail(f"{where}: {value!r} is not a gfx target like 'gfx942'")

    def version(self, value: str, where: str):
        try:
            Version(value)
        except InvalidVersion:
            self.fail(f"{where}: {value!r} is not a version")


def _check(v: Vendors, directory: Path) -> None:
    """Cross-row checks of the vendors' files, in this order: AMD's catalog, ROCm's builds, the limits and the
    Intel and Apple rows, one alias per GPU across every vendor."""
    rule = _Rules(directory)
    for section in (_check_amd, _check_rocm, _check_limits, _check_aliases):
        section(v, rule)


def _check_amd(v: Vendors, rule: _Rules) -> None:
    for t in v.amd_targets:
        rule.gfx(t.gfx, f"amd.toml [[target]] ({t.gfx})")
        if t.fp8 not in ("", "fnuz", "ocp"):
            rule.fail(f"amd.toml [[target]] ({t.gfx}): fp8 {t.fp8!r} is not '', 'fnuz' or 'ocp'")
        if t.wavefront not in (32, 64):
            rule.fail(f"amd.toml [[target]] ({t.gfx}): wavefront must be 32 or 64")
    if len({t.gfx for t in v.amd_targets}) != len(v.amd_targets):
        rule.fail("amd.toml: a gfx target has two [[target]] rows")
    for g in v.amd_gpus:
        where = f"amd.toml [[gpu]] ({g.name})"
        if v.amd_target(g.gfx) is None:
            rule.fail(f"{where}: no [[target]] row for {g.gfx}")
        if g.memory_gb is None and not v.amd_target(g.gfx).shared_memory:
            rule.fail(f"{where}: memory_gb is left out, but {g.gfx} is not an APU (shared_memory)")
        for pci in g.pci_ids:
            if not pci.startswith("0x") or int(pci, 16) > 0xFFFF:
                rule.fail(f"{where}: pci id {pci!r} is not of the form '0x74a1'")
    for k in v.kmd:
        for r in (k.rocm, *k.user_space):
            rule.version(r, f"amd.toml [[kmd]] ({k.rocm})")


def _check_rocm(v: Vendors, rule: _Rules) -> None:
    torch_releases = {r.version for r in load_matrix(rule.directory).torch}
    for b in v.rocm_builds:
        where = f"rocm.toml [[build]] ({b.torch} {b.variant})"
        if b.torch not in torch_releases:
            rule.fail(f"{where}: torch {b.torch} has no torch.toml [[release]] row")
        rule.version(b.rocm, where)
        if b.variant != f"rocm{b.rocm}":
            rule.fail(f"{where}: variant must be 'rocm' + its rocm version")
        if b.status not in ("stable", "also"):
            rule.fail(f"{where}: status must be 'stable' or 'also', not {b.status!r}")
        for t in b.gfx:
            rule.gfx(t, where)
    for a in v.aotriton:
        rule.gfx(a.gfx, f"rocm.toml [[aotriton]] ({a.gfx})")
        if a.status not in ("supported", "experimental"):
            rule.fail(f"rocm.toml [[aotriton]] ({a.gfx}): status must be 'supported' or 'experimental'")
    for b in v.bnb_rocm:
        where = f"rocm.toml [[bitsandbytes]] ({b.version} rocm{b.rocm})"
        rule.version(b.version, where)
        rule.version(b.rocm, where)
        for t in b.gfx:
            rule.gfx(t, where)
    # start-up: packaging imported only when this runs
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    for file, rows in (("rocm.toml", v.rocm_triton), ("intel.toml", v.xpu_triton)):
        for r in rows:
            try:
                SpecifierSet(r.torch)
            except InvalidSpecifier:
                rule.fail(f"{file} [[triton]] ({r.package}): torch {r.torch!r} is not a version range")


def _check_limits(v: Vendors, rule: _Rules) -> None:
    torch_releases = {r.version for r in load_matrix(rule.directory).torch}
    stack_packages = {name for s in load_matrix(rule.directory).stacks for name in s.packages} | {"triton"}
    feature_names = {f.name for f in load_matrix(rule.directory).features}
    for file, rows in (("rocm.toml", v.rocm_limits), ("intel.toml", v.xpu_limits), ("apple.toml", v.mps_limits)):
        for r in rows:
            where = f"{file} [[limit]] ({r.feature})"
            if r.package is not None and r.package not in stack_packages:
                rule.fail(f"{where}: package {r.package!r} is not a training-stack package (packages.toml [[stack]])")
            if r.min_version is not None:
                rule.version(r.min_version, where)
            for name in r.features:
                if name not in feature_names:
                    rule.fail(f"{where}: feature {name!r} has no packages.toml [[feature]] row")
    aots = {t.aot for t in v.intel_targets}
    for g in v.intel_gpus:
        if g.aot not in aots:
            rule.fail(f"intel.toml [[gpu]] ({g.name}): no [[target]] row for {g.aot}")
    for value in (v.mps_min_macos, v.bf16_min_macos):
        rule.version(value, "apple.toml")
    for b in v.mac_builds:
        where = f"apple.toml [[build]] ({b.torch})"
        if b.torch not in torch_releases:
            rule.fail(f"{where}: torch {b.torch} has no torch.toml [[release]] row")
        rule.version(b.macos, where)


def _check_aliases(v: Vendors, rule: _Rules) -> None:
    # one alias, one GPU, across every vendor's catalog
    seen: dict[str, str] = {}
    for g in load_matrix(rule.directory).gpus:
        for label in (g.name, *g.aliases):
            seen[normalize_name(label)] = g.name
    for file, rows in (("amd.toml", v.amd_gpus), ("intel.toml", v.intel_gpus)):
        for g in rows:
            for label in (g.name, *g.aliases):
                key = normalize_name(label)
                if seen.get(key, g.name) != g.name:
                    rule.fail(f"{file} [[gpu]] ({g.name}): alias {label!r} also names {seen[key]}")
                seen[key] = g.name
