"""GPUs beyond NVIDIA: AMD (ROCm), Intel (XPU) and Apple silicon (MPS), named or detected.

`lookup(text)` is what `--gpu` means when the text is not an NVIDIA name or compute capability: a gfx target
(`gfx942`), a catalog name or alias from matrices/amd.toml or intel.toml (`mi300x`, `rx7900xtx`, `max1550`), a
backend name (`rocm`, `xpu`, `mps`) or an Apple chip (`m2-max`). `detect()` runs each vendor's ordered sources
(amd.PROBES, intel.PROBES, apple.probe_platform) and says what each saw.

The result is an `Accelerator`: the vendor, the target a build must carry code for (AMD's gfx target, Intel's AOT
family, "mps"), and what the facts say about it (bf16, fp8). resolver/hardware.py turns it into the plan's
GpuSpec (from_accelerator); vendors/solve.py plans for it.
"""

from typing import NamedTuple

from matrices import catalog
from matrices.catalog import normalize_name

from . import amd, apple, intel
from .facts import Vendors, load


class Accelerator(NamedTuple):
    vendor: str  # "amd" | "intel" | "apple"
    name: str
    target: str | None  # gfx942 | pvc (Intel's AOT family; None: not in the catalog) | mps
    memory_gb: float | None  # per device
    source: str  # catalog | gfx-target | amd-smi | rocminfo | kfd | rocm-smi | xpu-smi | pci | platform
    bf16: bool | None  # None: decided at run time (Intel: torch.xpu.is_bf16_supported(); MPS: the macOS)
    fp8: str = ""  # "" | "fnuz" | "ocp"
    count: int = 1
    family: str = ""  # CDNA3, RDNA3, Xe-HPC, ...
    backend: str = ""  # torch's: "rocm" (torch.version.hip, device "cuda") | "xpu" | "mps"

    def describe(self) -> str:
        detail = ", ".join(x for x in (self.target, self.family) if x and x != self.name)
        return f"{self.name} ({detail})" if detail else self.name


class Detection(NamedTuple):
    gpus: list[Accelerator]  # one per distinct (vendor, target), counted
    driver: str | None  # AMD: the amdgpu module version, where a source tells
    notes: list[str]


# ---------------------------------------------------------------------------- naming


def lookup(text: str, v: Vendors | None = None) -> Accelerator | None:
    """The accelerator `--gpu TEXT` names, or None when TEXT names none of these vendors' GPUs."""
    v = v or load()
    key = normalize_name(text)
    gfx = catalog.gfx_from_text(key)
    if gfx:
        return _amd(gfx, f"AMD {gfx} GPU", None, "gfx-target", v)
    if key in BACKENDS_WITHOUT_TARGET:
        return None  # a backend, not a GPU: see backend_hint
    if key in ("xpu", "intel", "intelgpu"):
        return Accelerator("intel", "Intel GPU", None, None, "catalog", None, backend="xpu")
    chip = apple.names(text)
    if chip:
        return _apple(chip, None, None, "catalog", v)
    row = amd.find(text, v)
    if row is not None:
        return _amd(row.gfx, row.name, row.memory_gb / row.devices if row.memory_gb else None, "catalog", v)
    row = intel.find(text, v)
    if row is not None:
        return _intel(row.name, row.aot, None, "catalog", v)
    return None


BACKENDS_WITHOUT_TARGET = ("rocm", "amd", "hip")


def backend_hint(text: str) -> str | None:
    """The one line to say when `--gpu` names ROCm itself: a ROCm plan depends on the gfx target."""
    if normalize_name(text) in BACKENDS_WITHOUT_TARGET:
        return (f"--gpu {text} names a backend, not a GPU: ROCm builds carry code for some gfx targets only, so "
                "name the GPU (mi300x, rx7900xtx) or its target (gfx942), or use --gpu auto on the machine")
    return None


def names(v: Vendors | None = None) -> list[str]:
    """Every alias `--gpu` accepts here, as written in the matrices (for 'did you mean'; compare normalized)."""
    v = v or load()
    out = {a for g in (*v.amd_gpus, *v.intel_gpus) for a in g.aliases}
    out |= {t.gfx for t in v.amd_targets} | set(apple.NAMES) | {"xpu"}
    return sorted(out)


def _amd(gfx: str, name: str, memory: float | None, source: str, v: Vendors, count: int = 1) -> Accelerator:
    t = v.amd_target(gfx)
    return Accelerator("amd", name, gfx, memory, source, t.bf16 if t else None, t.fp8 if t else "", count,
                       t.family if t else "", "rocm")


def _intel(name: str, aot: str | None, memory: float | None, source: str, v: Vendors,
           count: int = 1) -> Accelerator:
    t = v.intel_target(aot) if aot else None
    return Accelerator("intel", name, aot, memory, source, None, "", count, t.family if t else "", "xpu")


def _apple(name: str, memory: float | None, macos: str | None, source: str, v: Vendors) -> Accelerator:
    bf16 = apple.macos_at_least(macos, v.bf16_min_macos)
    return Accelerator("apple", name, "mps", memory, source, bf16, "", 1, "Apple silicon", "mps")


# ---------------------------------------------------------------------------- detection


def detect(v: Vendors | None = None) -> Detection:
    """This machine's AMD, Intel and Apple GPUs: each vendor's sources in order, the first that sees a GPU
    winning for that vendor; every source's word kept in `notes`."""
    v = v or load()
    notes: list[str] = []
    gpus: list[Accelerator] = []
    driver = None
    for probe in amd.PROBES:
        result = _guarded(probe, v, amd.Probe([], None, ""))
        notes.append(result.note)
        driver = driver or result.driver
        if result.seen:
            gpus += _count_amd(result.seen, probe.__name__.removeprefix("probe_").replace("_", "-"), v, notes)
            break
    for probe in intel.PROBES:
        result = _guarded(probe, v, intel.Probe([], ""))
        notes.append(result.note)
        if result.seen:
            gpus += _count_intel(result.seen, probe.__name__.removeprefix("probe_").replace("_", "-"), v, notes)
            break
    result = apple.probe_platform(v)
    notes.append(result.note)
    if result.seen:
        s = result.seen
        gpus.append(_apple(s.chip or "Apple silicon", s.memory_gb, s.macos, "platform", v))
        if apple.macos_at_least(s.macos, v.mps_min_macos) is False:
            notes.append(f"macOS {s.macos} is older than {v.mps_min_macos}, which torch's MPS support needs")
    return Detection(gpus, driver, notes)


def _guarded(probe, v: Vendors, empty):
    """A probe's result; where its parser still meets output it cannot read (the parsers drop what they cannot
    use, and tests/resolver/vendors/test_vendor_parsers.py fuzzes them: this is the last line), that source saw nothing,
    and a note says why, instead of a traceback out of every `--gpu auto`."""
    try:
        return probe(v)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        source = probe.__name__.removeprefix("probe_").replace("_", "-")
        return empty._replace(note=f"{source}: its output could not be read ({type(e).__name__}: {str(e)[:120]}); "
                                   "skipped")


def _count_amd(seen: list[amd.Seen], source: str, v: Vendors, notes: list[str]) -> list[Accelerator]:
    groups: dict[tuple, list] = {}
    for s in seen:
        name, gfx, how = amd.identify(s, v)
        if gfx is None:
            _note(notes, f"{source}: {name}: it reports no gfx target and the catalog does not know it")
            continue
        if how != "reported":
            _note(notes, f"{source}: {name}: gfx target {gfx} {how} (the source reports none)")
        groups.setdefault((gfx, name), []).append(s.memory_gb)
    out = []
    for (gfx, name), memories in groups.items():
        memory = min((m for m in memories if m), default=None)
        out.append(_amd(gfx, name, memory, source, v, count=len(memories)))
    return out


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _count_intel(seen: list[intel.Seen], source: str, v: Vendors,
                 notes: list[str] | None = None) -> list[Accelerator]:
    notes = [] if notes is None else notes
    groups: dict[tuple, int] = {}
    for s in seen:
        if s.name is None and s.pci_id is None:
            _note(notes, f"{source}: a device with neither a name nor a PCI device ID it could read: ignored")
            continue
        key = intel.identify(s, v)
        groups[key] = groups.get(key, 0) + 1
    return [_intel(name, aot, None, source, v, count=n) for (name, aot), n in groups.items()]


__all__ = ["Accelerator", "Detection", "Vendors", "detect", "load", "lookup", "names"]
