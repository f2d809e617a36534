"""What GPU the plan is for: a name the user typed, or this machine's GPUs and driver.

Detection is an ordered list of sources, each a small function that returns what it saw or says why it
saw nothing: the ENVTOOL_GPU / ENVTOOL_DRIVER_VERSION overrides, NVML (nvidia-ml-py), `nvidia-smi`, and
/proc/driver/nvidia/version for the driver alone; with no NVIDIA GPU, AMD's, Intel's and Apple's sources
(resolver/vendors: amd-smi, rocminfo, the KFD topology, rocm-smi; xpu-smi, PCI sysfs; the platform). No GPU
found means a CPU plan.

A GpuSpec names its vendor and what a torch build must carry code for: NVIDIA's compute capability, AMD's gfx
target, Intel's AOT family, or "mps"; `backend` is torch's (cuda, rocm, xpu, mps, cpu).
"""

import os
import re
from typing import NamedTuple

from .errors import BadInput
from matrices import catalog

from .matrix import Matrix, cc_tuple, normalize_name

GPU_ENV = "ENVTOOL_GPU"
DRIVER_ENV = "ENVTOOL_DRIVER_VERSION"
PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"
DRIVER_RE = re.compile(r"^\d{2,4}(\.\d{1,3}){1,2}$")


class GpuSpec(NamedTuple):
    """The target the plan is for. `compute_capability` is NVIDIA's (None for a CPU plan and for other vendors'
    GPUs, which name their `target` instead)."""

    name: str
    compute_capability: str | None
    arch: str  # NVIDIA: turing, ampere, ...; AMD: CDNA3, RDNA3, ...; Intel: its family; "cpu"
    memory_gb: float | None
    source: str  # catalog | catalog-family | compute-capability | nvml | nvidia-smi | ENVTOOL_GPU | none | gfx-target | amd-smi ...
    bf16: bool | None = False  # None: decided at run time (Intel XPU)
    fp8: bool = False
    count: int = 1
    vendor: str = "nvidia"  # nvidia | amd | intel | apple | cpu
    target: str | None = None  # gfx942 | pvc (Intel's AOT family; None: not in the catalog) | mps; NVIDIA: None
    backend: str = "cuda"  # torch's: cuda | rocm (torch.version.hip, device "cuda") | xpu | mps | cpu
    fp8_format: str = ""  # AMD: "fnuz" (CDNA3) | "ocp"
    macos: str | None = None  # Apple: the macOS version detected (None: a named Mac)
    also: tuple[str, ...] = ()  # other GPUs detection found and the plan is not for (said in the reasons)
    note: str = ""  # said after the target (a GPU planned by its family's compute capability)

    @property
    def is_cpu(self) -> bool:
        return self.vendor == "cpu"

    @property
    def named(self) -> bool:
        """Named by the user (--gpu, ENVTOOL_GPU), not found on this machine: said as "named", never "this machine
        has"."""
        return self.source in NAMED_SOURCES

    @property
    def is_nvidia(self) -> bool:
        return self.vendor == "nvidia"

    @property
    def sm(self) -> str:
        """What a build must carry code for, as the plans write it: sm_80, gfx942, pvc, mps, cpu."""
        if self.is_cpu:
            return "cpu"
        if self.is_nvidia:
            return "sm_" + self.compute_capability.replace(".", "")
        return self.target or self.backend

    def target_reason(self) -> str:
        """The plan's first reason: what the plan is for, and where that was found."""
        if self.is_cpu:
            return "target: CPU (no CUDA): torch's CPU build"
        memory = f", {self.memory_gb:g} GB" if self.memory_gb else ""
        count = f"{self.count} × " if self.count > 1 else ""
        if not self.is_nvidia:
            device = {"rocm": "torch device 'cuda' under HIP", "xpu": "torch device 'xpu'", "mps": "torch device 'mps'"}
            return f"target: {count}{self.describe()}{memory}, {device[self.backend]} (from {self.source})"
        note = f"; {self.note}" if self.note else ""
        return (f"target: {count}{self.describe()}, compute capability {self.compute_capability}{memory} "
                f"(from {self.source}){note}")

    def describe(self) -> str:
        if self.is_cpu:
            return "CPU"
        if self.is_nvidia:
            return f"{self.name} ({self.sm}, {self.arch.capitalize()})"
        detail = ", ".join(x for x in (self.target, self.arch) if x and x not in self.name and x != "mps")
        return f"{self.name} ({detail})" if detail else self.name


CPU = GpuSpec(name="CPU", compute_capability=None, arch="cpu", memory_gb=None, source="none", vendor="cpu",
              backend="cpu")


class Detection(NamedTuple):
    """What `--gpu auto` found: the GPU to plan for, the driver, and what each source said."""

    gpu: GpuSpec
    driver: str | None
    notes: list[str]


class Seen(NamedTuple):
    """One GPU as a detection source reports it."""

    name: str
    compute_capability: str
    memory_gb: float | None
    pci_id: str | None = None  # the PCI device id ("2c05", vendor 10de) where the source reports it (NVML)


# ---------------------------------------------------------------------------- named GPUs


NAMED_SOURCES = catalog.NAMED_GPU_SOURCES  # GpuSpec.source of a named GPU
# A count with a name: "T4 x2", "t4 × 2", "t4x2", "2x T4", "8xH100". Read as a count only where the text is not a
# name the catalogs know exactly ("6800xt", "max1550") and the part left is a GPU (else the text is looked up whole).
COUNTED = (re.compile(r"^(?P<name>.*?\S)\s*[x×]\s*(?P<count>\d+)$", re.IGNORECASE),
           re.compile(r"^(?P<count>\d+)\s*[x×]\s*(?P<name>\S.*)$", re.IGNORECASE))
NOT_A_TARGET = ("none", "null", "nil", "undefined")  # what a script's unset variable prints as
# The longest GPU name a user types is ~40 characters ("NVIDIA GeForce RTX 4090 Laptop GPU x8"); a longer --gpu
# is a pasted paragraph or a script's mistake, refused before any matching work.
MAX_NAME_CHARS = 100


def check_target_text(text: str | None, where: str = "--gpu") -> None:
    """An empty --gpu / ENVTOOL_GPU, or None printed by a script, is an error rather than a CPU plan: exit 2."""
    if text is None:
        return
    if not text.strip():
        if where == GPU_ENV:
            raise BadInput(f"{GPU_ENV} is set but empty: unset it to detect this machine's GPU, or give one (t4, "
                           f"sm_80, cpu)")
        raise BadInput(f"{where} is empty: give a GPU name or alias (t4, a100), a compute capability (sm_80), "
                       f"'cpu' or 'auto'")
    if any(not c.isprintable() for c in text):  # a name is never a line break: it would reach Dockerfiles, scripts
        raise BadInput(f"{where} {text!r}: a GPU name is one line of printable characters")
    for name in text.split(","):
        if len(name.strip()) > MAX_NAME_CHARS:
            raise BadInput(f"{where} {name.strip()[:40]!r}... ({len(name.strip()):,} characters): a GPU name is at "
                           f"most {MAX_NAME_CHARS} characters (`envtool gpus` lists the known ones)")
        if normalize_name(name) in NOT_A_TARGET:
            raise BadInput(f"{where} {name.strip()!r} is not a GPU (a script's unset variable?): give a GPU name, a "
                           f"compute capability (sm_80), or 'cpu' for a CPU plan")


def lookup(text: str, m: Matrix, source: str = "catalog", *, counts: bool = True) -> GpuSpec:
    """A GPU by alias ("t4"), full name ("Tesla T4"), or compute capability ("sm_75", "7.5"), or "cpu"; with
    `counts`, a name with a count ("T4 x2")."""
    where = GPU_ENV if source == GPU_ENV else "--gpu"
    check_target_text(text, where)
    counted = _counted(text, m, source) if counts else None
    if counted is not None:  # "T4 x2": that GPU, that many (the plan's count: torchrun's processes, the estimate)
        gpu, count = counted
        if gpu.is_cpu:
            raise BadInput(f"{where} {text!r}: a CPU plan has no GPU count (give --nproc for its processes)")
        if not 1 <= count <= 1024:
            raise BadInput(f"{where} {text!r}: give 1 or more GPUs (a count of {count} is not a machine)")
        return gpu._replace(count=count)
    key = normalize_name(text)
    if key == "cpu":
        return CPU
    cc = catalog.cc_from_text(key) if key not in _catalog_names(m) else None  # "980" is the GTX 980, not sm_980
    if cc:
        return from_cc(cc, m, name=f"sm_{cc.replace('.', '')} GPU", memory_gb=None, source="compute-capability")
    family = catalog.gpu_family(text, m.gpus)
    if family is not None:  # the row's product, or another of its line (same compute capability, its own memory)
        g, memory_gb, same = family
        return from_cc(g.compute_capability, m, name=g.name if same else text.strip(), memory_gb=memory_gb,
                       source=source)
    # start-up: resolver.vendors, difflib imported only when this runs
    from . import vendors

    other = vendors.lookup(text)
    if other is not None:
        return from_accelerator(other, source=source if source == GPU_ENV else None)
    by_family = catalog.family_cc(text, m.gpus)
    if by_family is not None:  # "NVIDIA L20": not a row, but every L4x row is 8.9
        cc, members = by_family
        gpu = from_cc(cc, m, name=text.strip(), memory_gb=catalog.memory_in_name(text),
                      source="catalog-family" if source == "catalog" else source)
        return gpu._replace(note=catalog.family_note(text, cc, members))
    hint = vendors.backend_hint(text)
    if hint:
        raise BadInput(hint)
    close = _suggestions(key, m)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise BadInput(f"unknown GPU {text!r}{hint} (`envtool gpus` lists the known ones; `--gpu sm_XY` names any "
                   f"NVIDIA GPU by compute capability, `--gpu gfxNNNN` any AMD GPU by its target)")


def _suggestions(key: str, m: Matrix, most: int = 3) -> list[str]:
    """Up to `most` names close to the normalized `key`, as a user types them (the matrices' aliases: "a100-80gb",
    "tesla-t4"; not the tools' long names with spaces), one per GPU, closest first."""
    # start-up: resolver.vendors, difflib imported only when this runs
    import difflib

    from . import vendors

    typed: dict[str, tuple[str, int]] = {}  # normalized -> (as written, which GPU)
    groups = [list(g.aliases) for g in m.gpus] + [["cpu"]] + [[n] for n in vendors.names()]
    for i, aliases in enumerate(groups):
        for alias in aliases:
            if " " not in alias.strip():
                typed.setdefault(normalize_name(alias), (alias.strip(), i))
    out, seen = [], set()
    for name in difflib.get_close_matches(key, list(typed), n=len(typed), cutoff=0.5):
        alias, group = typed[name]
        if group not in seen:
            seen.add(group)
            out.append(alias)
    return out[:most]


def _catalog_names(m: Matrix) -> set[str]:
    return {normalize_name(a) for g in m.gpus for a in (g.name, *g.aliases)}


def _counted(text: str, m: Matrix, source: str) -> tuple[GpuSpec, int] | None:
    """(the GPU, the count) for a name with a count (see COUNTED); None for a plain name."""
    key = normalize_name(text)
    if key in _catalog_names(m) or catalog.cc_from_text(key):
        return None
    # start-up: resolver.vendors imported only when this runs (not for a name the catalog knows)
    from . import vendors

    if key in {normalize_name(n) for n in vendors.names()}:
        return None
    for pattern in COUNTED:
        found = pattern.match(text.strip())
        if found is None:
            continue
        try:
            # the name part without counts of its own: "2x2x2x..." was tried every way, 2^n lookups
            return lookup(found["name"], m, source, counts=False), int(found["count"])
        except BadInput:
            continue  # not a GPU with a count: the text as one name
    return None


def from_accelerator(a, source: str | None = None, count: int | None = None, also: tuple[str, ...] = (),
                     macos: str | None = None) -> GpuSpec:
    """An AMD, Intel or Apple GPU (resolver/vendors' Accelerator) as the plan's GpuSpec."""
    return GpuSpec(name=a.name, compute_capability=None, arch=a.family or a.target or a.vendor,
                   memory_gb=a.memory_gb, source=source or a.source, bf16=a.bf16, fp8=bool(a.fp8),
                   count=count or a.count, vendor=a.vendor, target=a.target, backend=a.backend,
                   fp8_format=a.fp8, macos=macos, also=also)


def from_cc(cc: str, m: Matrix, *, name: str, memory_gb: float | None, source: str,
            count: int = 1) -> GpuSpec:
    arch = m.arch_for(cc)
    if arch is None:
        known = ", ".join(a.compute_capability for a in m.archs)
        raise BadInput(f"compute capability {cc} of {name} is not in the matrix (known: {known})")
    return GpuSpec(name=name, compute_capability=cc, arch=arch.name, memory_gb=memory_gb, source=source,
                   bf16=arch.bf16, fp8=arch.fp8, count=count)


def check_driver(version: str, where: str = "--driver") -> str:
    version = version.strip()
    if not DRIVER_RE.match(version):
        raise BadInput(f"{where} {version!r} is not an NVIDIA driver version like 550.54.14")
    return version


# ---------------------------------------------------------------------------- detection


def detect(m: Matrix) -> Detection:
    """Find this machine's GPUs and driver; plan for the lowest compute capability among several."""
    notes: list[str] = []
    driver_override = os.environ.get(DRIVER_ENV)
    override = os.environ.get(GPU_ENV)
    if override is not None:
        check_target_text(override, GPU_ENV)
        gpu = lookup(override, m, source=GPU_ENV)
        driver = check_driver(driver_override, DRIVER_ENV) if driver_override else None
        return Detection(gpu, driver, [f"GPU from {GPU_ENV}={override} (detection skipped)"])

    seen: list[Seen] = []
    driver = None
    for probe in (probe_nvml, probe_nvidia_smi):
        gpus, driver, note = probe(m)
        notes.append(note)
        if gpus:
            seen = gpus
            source = probe.__name__.removeprefix("probe_").replace("_", "-")
            break
    if driver is None:
        driver, note = probe_proc_driver()
        notes.append(note)
    if driver_override:
        driver = check_driver(driver_override, DRIVER_ENV)
        notes.append(f"driver from {DRIVER_ENV}={driver}")

    if not seen:
        other = detect_other_vendors(notes)
        if other is not None:
            return other
        notes.append("no NVIDIA, AMD, Intel or Apple GPU found: planning for CPU")
        return Detection(CPU, driver, notes)
    lowest = min(seen, key=lambda s: cc_tuple(s.compute_capability))
    name, memory_gb = lowest.name, lowest.memory_gb
    row = catalog.find_by_pci_id(lowest.pci_id, m.gpus)
    if row is not None:  # the PCI id names the product; the device's own memory stays what it reports
        if catalog.find_gpu(name, m.gpus) is not row:  # the name alone would have named another, or none
            notes.append(f"{name!r} is PCI device 10de:{lowest.pci_id}: {row.name} in the catalog")
        name, memory_gb = row.name, memory_gb if memory_gb is not None else row.memory_gb
    gpu = from_cc(lowest.compute_capability, m, name=name, memory_gb=memory_gb, source=source, count=len(seen))
    if len({s.compute_capability for s in seen}) > 1:
        mix = ", ".join(f"{s.name} (sm_{s.compute_capability.replace('.', '')})" for s in seen)
        notes.append(f"{len(seen)} GPUs of different compute capability ({mix}): planning for the lowest, "
                     f"{gpu.describe()}, so one environment runs on all of them")
    elif len(seen) > 1:
        notes.append(f"{len(seen)} × {gpu.name} detected")
    return Detection(gpu, driver, notes)


def detect_other_vendors(notes: list[str]) -> Detection | None:
    """With no NVIDIA GPU: AMD's, then Intel's, then Apple's sources (resolver/vendors.detect). Where several
    kinds of GPU are found (an AMD dGPU beside an APU's iGPU, an Intel iGPU beside an AMD card), the plan is for
    the first vendor in that order, and within it for the target some torch build covers, then the most
    devices, then the most memory; the others are named in the reasons."""
    # start-up: resolver.vendors, resolver.vendors.apple imported only when this runs
    from . import vendors

    found = vendors.detect()
    notes.extend(found.notes)
    if not found.gpus:
        return None
    order = {"amd": 0, "intel": 1, "apple": 2}
    v = vendors.load()

    def rank(a):
        covered = a.vendor != "amd" or bool(a.target and v.rocm_builds_for(a.target))
        return (order[a.vendor], not covered, -a.count, -(a.memory_gb or 0))

    chosen, *others = sorted(found.gpus, key=rank)
    also = tuple(f"{o.count} × {o.describe()}" for o in others)
    if others:
        hint = " (HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES keep them out of the job)" if chosen.vendor == "amd" \
            else ""
        notes.append(f"planning for {chosen.count} × {chosen.describe()}; also found: {', '.join(also)}{hint}")
    elif chosen.count > 1:
        notes.append(f"{chosen.count} × {chosen.name} detected")
    macos = None
    if chosen.vendor == "apple":
        from .vendors import apple

        probe = apple.probe_platform(v)
        macos = probe.seen.macos if probe.seen else None
    gpu = from_accelerator(chosen, also=also, macos=macos)
    if found.driver and chosen.vendor == "amd":
        notes.append(f"amdgpu kernel module {found.driver}")
    return Detection(gpu, None, notes)


def probe_nvml(m: Matrix) -> tuple[list[Seen], str | None, str]:
    try:
        # optional: pynvml is imported only where it is used
        import pynvml
    except ImportError:
        return [], None, "NVML: nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], None, f"NVML: {e}"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        seen = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            seen.append(Seen(_text(pynvml.nvmlDeviceGetName(handle)), f"{major}.{minor}", round(memory, 1),
                             _pci_device(handle)))
        return seen, driver, f"NVML: {len(seen)} GPU(s), driver {driver}"
    except pynvml.NVMLError as e:
        return [], None, f"NVML: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _pci_device(handle) -> str | None:
    """The GPU's PCI device id from NVML's pciDeviceId (device << 16 | vendor 0x10de), as "2c05"; None where NVML
    does not say (then the GPU is named by its name)."""
    # optional: pynvml is imported only where it is used
    import pynvml

    try:
        value = pynvml.nvmlDeviceGetPciInfo(handle).pciDeviceId
    except (pynvml.NVMLError, AttributeError):
        return None
    if not isinstance(value, int) or value & 0xFFFF != 0x10DE:
        return None
    return f"{(value >> 16) & 0xFFFF:04x}"


NVIDIA_SMI_QUERY = ["--query-gpu=name,compute_cap,memory.total,driver_version", "--format=csv,noheader"]
# Drivers before R510 know no `compute_cap` field: then the name is asked for, and the catalog gives the CC.
NVIDIA_SMI_OLD_QUERY = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]


def probe_nvidia_smi(m: Matrix) -> tuple[list[Seen], str | None, str]:
    # start-up: shutil, subprocess imported only when this runs
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], None, "nvidia-smi: not on PATH"
    try:
        # errors="replace": a name with invalid UTF-8 is read, never a UnicodeDecodeError out of --gpu auto
        out = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, errors="replace",
                             timeout=30)
        if out.returncode != 0 and "compute_cap" in out.stdout + out.stderr:
            old = subprocess.run([exe, *NVIDIA_SMI_OLD_QUERY], capture_output=True, text=True, errors="replace",
                                 timeout=30)
            if old.returncode == 0:
                seen, driver, unknown = parse_old_nvidia_smi(old.stdout, m)
                note = f"nvidia-smi (a driver without compute_cap; CC from the GPU names): {len(seen)} GPU(s), " \
                       f"driver {driver}" + (f"; not in the catalog: {', '.join(unknown)}" if unknown else "")
                return seen, driver, note
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], None, f"nvidia-smi: {e}"
    if out.returncode != 0:
        first = (out.stderr or out.stdout).strip().splitlines()[:1]
        return [], None, f"nvidia-smi: exit {out.returncode}: {first[0] if first else ''}".rstrip(": ")
    seen, driver = parse_nvidia_smi(out.stdout)
    return seen, driver, f"nvidia-smi: {len(seen)} GPU(s), driver {driver}"


# ASCII digits, bounded: `\d+` also takes other scripts' digits and numbers int() refuses past 4,300 digits
MIB = re.compile(r"^([0-9]{1,12})\s*MiB$")
CC_FIELD = re.compile(r"^[0-9]{1,2}\.[0-9]{1,2}$")


def parse_old_nvidia_smi(text: str, m: Matrix) -> tuple[list[Seen], str | None, list[str]]:
    """`Tesla V100-SXM2-16GB, 16160 MiB, 470.82.01` lines; the compute capability comes from the catalog."""
    seen, driver, unknown = [], None, []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        name, memory, driver = parts
        cc = cc_from_name(name, m)
        if cc is None:
            unknown.append(name)
            continue
        mib = MIB.match(memory)
        seen.append(Seen(name, cc, round(int(mib.group(1)) / 1024, 1) if mib else None))
    return seen, driver, unknown


def cc_from_name(name: str, m: Matrix) -> str | None:
    """The compute capability of the catalog GPU whose longest name or alias appears in `name` (a variant of its
    line, "RTX 5070 Ti", shares it)."""
    family = catalog.gpu_family(name, m.gpus)
    return family[0].compute_capability if family else None


def parse_nvidia_smi(text: str) -> tuple[list[Seen], str | None]:
    """Parse `nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader`.

    A line looks like `Tesla T4, 7.5, 15360 MiB, 535.104.05`.
    """
    seen, driver = [], None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not CC_FIELD.match(parts[1]):
            continue
        name, cc, memory, driver = parts
        mib = MIB.match(memory)
        seen.append(Seen(name, cc, round(int(mib.group(1)) / 1024, 1) if mib else None))
    return seen, driver


def probe_proc_driver(path: str | None = None) -> tuple[str | None, str]:
    """The kernel module's version line: `NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  ...`."""
    path = path or PROC_DRIVER_VERSION
    try:
        with open(path, errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return None, f"{path}: not present"
    match = re.search(r"Kernel Module(?: for \w+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    if not match:
        return None, f"{path}: no driver version in it"
    return match.group(1), f"{path}: driver {match.group(1)}"


def _text(value) -> str:
    """NVML's strings (bytes in older nvidia-ml-py): a name with invalid UTF-8 is still a name."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Target(NamedTuple):
    """One plan to make: what the user typed, the GPU it names, the driver, and how they were found."""

    label: str
    gpu: GpuSpec
    driver: str | None
    notes: list[str]


def targets(text: str, m: Matrix, driver: str | None) -> list[Target]:
    """`--gpu auto`, `--gpu t4` or `--gpu t4,v100,a100` (one plan each)."""
    check_target_text(text)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if driver is not None:
        driver = check_driver(driver)
    if "auto" in (n.lower() for n in names):
        if len(names) > 1:
            raise BadInput("--gpu auto cannot be combined with other targets")
        found = detect(m)
        if driver and found.gpu.is_nvidia:
            found.notes.append(f"driver from --driver {driver}")
        check_driver_vendor(found.gpu, driver or found.driver)
        return [Target("auto", found.gpu, driver or found.driver, found.notes)]
    found = [Target(n, lookup(n, m), driver, []) for n in names]
    for t in found:
        check_driver_vendor(t.gpu, driver)
    return found


def check_driver_vendor(gpu: GpuSpec, driver: str | None) -> None:
    """--driver is NVIDIA's: for another vendor's GPU it means nothing, and is refused rather than ignored."""
    if driver and not (gpu.is_nvidia or gpu.is_cpu):
        raise BadInput(f"--driver {driver} is an NVIDIA driver version; {gpu.describe()} runs torch's "
                       f"{gpu.backend.upper() if gpu.backend != 'rocm' else 'ROCm'} builds, whose plans do not take "
                       f"one: drop --driver")
