"""AMD GPUs: naming (`--gpu mi300x`, `--gpu gfx942`) and detection.

Detection is an ordered list of sources, each a small parser over what one tool or file says, like the NVIDIA
path in resolver/hardware.py: `amd-smi static` (ROCm 6+), `rocminfo`, the KFD topology in sysfs (no ROCm
tools needed: what a bare container with /sys sees), and `rocm-smi --showproductname` (the deprecated
tool, last). The first source that reports a GPU wins; each says why it saw nothing.

What a plan needs from an AMD GPU is its gfx target (which code objects a torch build must carry); the name is
for people, the memory for sizing. Sources that report only a name or a PCI device ID get the target from the
catalog (matrices/amd.toml).
"""

import io
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

from matrices import catalog

from .facts import AmdGpu, Vendors

KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
AMDGPU_VERSION = "/sys/module/amdgpu/version"
AMD_SMI_ARGS = ["static", "--asic", "--vram", "--driver"]
ROCM_SMI_ARGS = ["--showproductname", "--json"]


# What a parser keeps of a tool's value, else None: a PCI device ID is 16 bits in hex; a number is ASCII digits,
# bounded (int() refuses past 4,300 digits; no GPU's memory in KB needs 20)
PCI_ID = re.compile(r"0x[0-9a-fA-F]{1,4}")
NUMBER = r"[0-9]{1,20}"
MAX_TEXT = 1 << 22  # 4 MiB: rocminfo on 8 GPUs and 2 CPUs prints ~40 KB; more is not a tool's output


def decode(data: bytes) -> str:
    """A tool's or sysfs file's bytes as text: invalid UTF-8 becomes U+FFFD (the field that holds it then matches
    nothing), never a UnicodeDecodeError out of `--gpu auto`; past MAX_TEXT it is cut."""
    return data[:MAX_TEXT].decode("utf-8", errors="replace")


class Seen(NamedTuple):
    """One GPU as a source reports it; any field may be missing."""

    name: str | None
    gfx: str | None
    memory_gb: float | None
    pci_id: str | None = None  # "0x74a1"


class Probe(NamedTuple):
    seen: list[Seen]
    driver: str | None  # the amdgpu kernel module version, where the source tells
    note: str


# ---------------------------------------------------------------------------- naming


def find(text: str, v: Vendors) -> AmdGpu | None:
    """The amd.toml GPU a user's or a tool's name means ("mi300x", "AMD Instinct MI250X/MI250"), else None."""
    return catalog.find_gpu(text, v.amd_gpus)


def by_pci_id(pci_id: str, v: Vendors) -> AmdGpu | None:
    if not PCI_ID.fullmatch(pci_id):
        return None
    want = int(pci_id, 16)
    return next((g for g in v.amd_gpus if any(int(p, 16) == want for p in g.pci_ids)), None)


def identify(s: Seen, v: Vendors) -> tuple[str, str | None, str]:
    """(name, gfx, how) for what a source saw: its own target where it reports one, else the catalog's for
    its name or PCI ID; the catalog's name where the tool's is generic ("AMD Radeon Graphics") or missing.
    Memory is what the source reported, never the catalog's: a partitioned MI300X (CPX) is eight devices of
    a fraction of the package's memory each."""
    by_name = find(s.name, v) if s.name else None
    row = by_name or (by_pci_id(s.pci_id, v) if s.pci_id else None)
    if row is not None and s.gfx and row.gfx != s.gfx:
        row = None  # a name that says one target while the GPU reports another: trust the target
    gfx = s.gfx or (row.gfx if row else None)
    fallback = f"AMD {gfx} GPU" if gfx else f"AMD GPU {s.pci_id}" if s.pci_id else "AMD GPU"
    name = row.name if row else (s.name or fallback)
    how = ("reported" if s.gfx else "from its name" if by_name else "from its PCI ID" if row else "unknown")
    return name, gfx, how


# ---------------------------------------------------------------------------- amd-smi


def parse_amd_smi(text: str) -> tuple[list[Seen], str | None]:
    """`amd-smi static --asic --vram --driver`: a `GPU: N` block per GPU with indented sections; ASIC gives
    MARKET_NAME, DEVICE_ID and TARGET_GRAPHICS_VERSION (ROCm 6.2+), VRAM gives `SIZE: 196592 MB`, DRIVER gives
    VERSION (the amdgpu module's). The text form is read because it is the one captured from real machines;
    the tool prints the same fields with --json."""
    seen, driver = [], None
    for block in re.split(r"^GPU:\s*\d+\s*$", text, flags=re.M)[1:]:
        sections: dict[str, dict[str, str]] = {}
        current = None
        for line in block.splitlines():
            head = re.match(r"^\s{2,6}([A-Z_]+):\s*$", line)
            if head:
                current = sections.setdefault(head.group(1), {})
                continue
            field = re.match(r"^\s+([A-Z_]+):\s*(.*?)\s*$", line)
            if field and current is not None:
                current[field.group(1)] = field.group(2)
        asic, vram, drv = (sections.get(k, {}) for k in ("ASIC", "VRAM", "DRIVER"))
        name = _value(asic.get("MARKET_NAME"))
        gfx = catalog.gfx_from_text(asic.get("TARGET_GRAPHICS_VERSION", ""))
        pci = _value(asic.get("DEVICE_ID"))
        size = re.match(rf"^({NUMBER})\s*MB$", vram.get("SIZE", ""))
        driver = _value(drv.get("VERSION")) or driver
        seen.append(Seen(name, gfx, round(int(size.group(1)) / 1024, 1) if size else None,
                         pci.lower() if pci and PCI_ID.fullmatch(pci) else None))
    return seen, driver


def _value(x: str | None) -> str | None:
    if not x or x.strip().upper() == "N/A":
        return None
    return x.strip()


# ---------------------------------------------------------------------------- rocminfo

AGENT_SPLIT = re.compile(r"^\*+\s*\n\s*Agent \d+\s*\n\*+\s*$", re.M)


def parse_rocminfo(text: str) -> tuple[list[Seen], str | None]:
    """`rocminfo`: one block per HSA agent; the GPUs are those with `Device Type: GPU`, `Name: gfx942`,
    `Marketing Name`, `Chip ID: 29857(0x74a1)` and their first GLOBAL COARSE GRAINED pool's size in KB.
    The header's `ROCk module version 6.10.5 is loaded` is the kernel driver's version."""
    driver = re.search(r"ROCk module version (\S+) is loaded", text)
    seen = []
    for block in AGENT_SPLIT.split(text)[1:]:
        fields = dict(_field(line) for line in block.splitlines() if ":" in line)
        if fields.get("Device Type") != "GPU":
            continue
        gfx = catalog.gfx_from_text(fields.get("Name", ""))
        chip = re.search(r"\((0x[0-9a-fA-F]{1,4})\)", fields.get("Chip ID", ""))
        name = fields.get("Marketing Name") or None
        memory = None
        pools = re.search(rf"Segment:\s*GLOBAL; FLAGS: COARSE GRAINED\s*\n\s*Size:\s*({NUMBER})\(0x[0-9a-f]+\) KB",
                          block)
        if pools:
            memory = round(int(pools.group(1)) / 2**20, 1)
        seen.append(Seen(name, gfx, memory, chip.group(1).lower() if chip else None))
    return seen, driver.group(1) if driver else None


def _field(line: str) -> tuple[str, str]:
    key, _, value = line.partition(":")
    return key.strip(), value.strip()


# ---------------------------------------------------------------------------- KFD topology (sysfs)


def parse_kfd_properties(text: str) -> dict[str, int]:
    """A KFD node's `properties` file: `name value` lines (kfd_topology.c prints each with %s %llu)."""
    props = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(NUMBER, parts[1]):  # not str.isdigit(): it takes '²', int() does not
            props[parts[0]] = int(parts[1])
    return props


def parse_kfd(nodes: Path) -> tuple[list[Seen], list[str]]:
    """The GPUs in a KFD topology (/sys/class/kfd/kfd/topology/nodes): nodes with SIMDs. The target is
    `gfx_target_version` (kernels before it existed report none); memory is `local_mem_size`, else the sum of
    the node's frame-buffer memory banks (heap_type 1 public, 2 private). Returns what it saw and what it
    could not use."""
    seen, skipped = [], []
    for node in sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30):
        try:
            props = parse_kfd_properties(_read(node / "properties"))
        except OSError:
            continue
        if props.get("simd_count", 0) == 0:
            continue  # a CPU node
        gfx = catalog.gfx_from_kfd(props.get("gfx_target_version", 0))
        device = props.get("device_id")
        pci = f"0x{device:04x}" if device and device < 1 << 16 else None
        memory = props.get("local_mem_size") or _bank_bytes(node)
        if gfx is None and pci is None:
            skipped.append(f"node {node.name}: no gfx_target_version or device_id")
            continue
        seen.append(Seen(None, gfx, round(memory / 2**30, 1) if memory else None, pci))
    return seen, skipped


def _read(path: Path) -> str:
    with path.open("rb") as f:
        return decode(f.read(MAX_TEXT))


def _bank_bytes(node: Path) -> int:
    total = 0
    for bank in sorted((node / "mem_banks").glob("*/properties")):
        try:
            props = parse_kfd_properties(_read(bank))
        except OSError:
            continue
        if props.get("heap_type") in (1, 2):
            total += props.get("size_in_bytes", 0)
    return total


# ---------------------------------------------------------------------------- rocm-smi


def gfx_from_rocm_smi(text: str) -> str | None:
    """rocm-smi's `GFX Version` prints the stepping in decimal: 'gfx9010' is gfx90a (ROCm/rocm_smi_lib issue
    #159); targets without a letter read the same either way ('gfx942')."""
    gfx = catalog.gfx_from_text(text)
    if gfx:
        return gfx
    m = re.fullmatch(r"gfx([6-9]|1[0-2])(\d)(\d{1,2})", text.strip().lower())
    if not m or int(m.group(3)) > 15:
        return None
    return catalog.gfx_from_text(f"gfx{m.group(1)}{m.group(2)}{int(m.group(3)):x}")


def parse_rocm_smi(text: str) -> list[Seen]:
    """`rocm-smi --showproductname`, as --json ({"card0": {"Card Series", "Card Model", "GFX Version", ...}})
    or --csv (`device,Card series,Card model,Card vendor,Card SKU`, older releases). The series carries the
    name ("Arcturus GL-XL [AMD Instinct MI100]", or on ROCm 4.0 only a PCI ID, "0x738c"); the model is the
    PCI device ID on newer releases ("0x7408"); newer releases add the GFX Version."""
    text = text.strip()
    if text.startswith("{"):
        data = json.loads(text)
        cards = [c for k, c in data.items() if k.startswith("card") and isinstance(c, dict)] \
            if isinstance(data, dict) else []
    else:
        # start-up: csv imported only when this runs
        import csv

        # newline="" lets csv see a lone \r in a field (damaged output) as text, not as csv.Error
        try:
            cards = [r for r in csv.DictReader(io.StringIO(text, newline=""))
                     if isinstance(r.get("device"), str) and r["device"].startswith("card")]
        except csv.Error:  # output csv cannot read: no card from rocm-smi (the caller notes an empty answer)
            cards = []
    seen = []
    for card in cards:
        # a value that is not text (a number where a name goes; csv's list for a row with extra fields) is dropped
        card = {k.strip().lower(): v.strip() for k, v in card.items() if isinstance(k, str) and isinstance(v, str)}
        series, model = card.get("card series", ""), card.get("card model", "")
        hexid = re.compile(r"0x[0-9a-fA-F]{1,4}")
        # Releases that print a Subsystem ID print the PCI device ID as the model; older ones print the
        # subsystem as the model and, when they lack a name, the device ID as the series.
        pci = model if "subsystem id" in card and hexid.fullmatch(model) else series if hexid.fullmatch(series) else None
        name = None
        if series and not hexid.fullmatch(series):
            bracket = re.search(r"\[([^\]]+)\]\s*$", series)
            name = bracket.group(1) if bracket else series
        seen.append(Seen(name, gfx_from_rocm_smi(card.get("gfx version", "")), None,
                         f"0x{int(pci, 16):04x}" if pci else None))
    return seen


# ---------------------------------------------------------------------------- probes (in order)


def probe_amd_smi(v: Vendors) -> Probe:
    out = _run("amd-smi", AMD_SMI_ARGS)
    if out.startswith("amd-smi:"):
        return Probe([], None, out)
    seen, driver = parse_amd_smi(out)
    return Probe(seen, driver, f"amd-smi: {len(seen)} GPU(s)" + (f", amdgpu {driver}" if driver else ""))


def probe_rocminfo(v: Vendors) -> Probe:
    out = _run("rocminfo", [])
    if out.startswith("rocminfo:"):
        return Probe([], None, out)
    seen, driver = parse_rocminfo(out)
    return Probe(seen, driver, f"rocminfo: {len(seen)} GPU agent(s)" + (f", ROCk module {driver}" if driver else ""))


def probe_kfd(v: Vendors, root: str | None = None) -> Probe:
    nodes = Path(root or os.environ.get("ENVTOOL_KFD_NODES") or KFD_NODES)
    if not nodes.is_dir():
        return Probe([], None, f"{nodes}: not present (no amdgpu driver with KFD)")
    seen, skipped = parse_kfd(nodes)
    driver = _module_version()
    note = f"{nodes}: {len(seen)} GPU node(s)" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
    return Probe(seen, driver, note)


def probe_rocm_smi(v: Vendors) -> Probe:
    out = _run("rocm-smi", ROCM_SMI_ARGS)
    if out.startswith("rocm-smi:"):
        return Probe([], None, out)
    try:
        seen = parse_rocm_smi(out)
    except (ValueError, RecursionError):  # not JSON; or JSON nested past the parser's depth
        return Probe([], None, "rocm-smi: --showproductname --json printed no JSON")
    return Probe(seen, None, f"rocm-smi: {len(seen)} GPU(s)")


PROBES = (probe_amd_smi, probe_rocminfo, probe_kfd, probe_rocm_smi)


def _module_version(path: str = AMDGPU_VERSION) -> str | None:
    """The out-of-tree (DKMS) amdgpu module's version; the distribution kernel's inbox driver has none."""
    try:
        return _read(Path(path)).strip() or None
    except OSError:
        return None


def _run(tool: str, args: list[str]) -> str:
    """The tool's stdout, or one line starting '<tool>:' saying why there is none."""
    # start-up: shutil, subprocess imported only when this runs
    import shutil
    import subprocess

    exe = shutil.which(tool)
    if exe is None:
        return f"{tool}: not on PATH"
    try:
        out = subprocess.run([exe, *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{tool}: {e}"
    stdout, stderr = decode(out.stdout), decode(out.stderr)
    if out.returncode != 0:
        first = (stderr or stdout).strip().splitlines()[:1]
        return f"{tool}: exit {out.returncode}" + (f": {first[0][:200]}" if first else "")
    return stdout
