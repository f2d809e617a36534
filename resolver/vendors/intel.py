"""Intel GPUs (torch's XPU backend): naming (`--gpu max1550`, `--gpu xpu`) and detection.

Sources, in order: `xpu-smi discovery -j` (Intel's XPU Manager, JSON), `xpu-smi discovery` (its table), and the
PCI devices in sysfs (vendor 0x8086). uv's detection counts any Intel display-class PCI device, which an
Intel desktop's integrated graphics also is; here only the data-center class (0x0380, "Display controller",
which the Max series reports) plans for XPU from sysfs alone, and an Intel VGA controller (0x0300) is named
in a note: integrated graphics train no model worth an XPU plan unless asked for with `--gpu xpu`.
"""

import json
import os
import re
from pathlib import Path
from typing import NamedTuple

from matrices import catalog

from . import amd
from .amd import _run
from .facts import IntelGpu, Vendors

PCI_DEVICES = "/sys/bus/pci/devices"
INTEL_VENDOR = 0x8086
CLASS_VGA = 0x0300
CLASS_DISPLAY_OTHER = 0x0380  # "Display controller": GPUs without display outputs (Data Center GPU Max)


class Seen(NamedTuple):
    name: str | None
    pci_id: str | None  # "0x0bd5"
    memory_gb: float | None = None


class Probe(NamedTuple):
    seen: list[Seen]
    note: str


def find(text: str, v: Vendors) -> IntelGpu | None:
    return catalog.find_gpu(text, v.intel_gpus)


def by_pci_id(pci_id: str, v: Vendors) -> IntelGpu | None:
    if _pci(pci_id) is None:
        return None
    want = int(pci_id, 16)
    return next((g for g in v.intel_gpus if any(int(p, 16) == want for p in g.pci_ids)), None)


def identify(s: Seen, v: Vendors) -> tuple[str, str | None]:
    """(name, AOT target) for a device a source saw: the catalog's row for its name or PCI ID, else the
    tool's name (the driver names unknown devices 'Intel(R) Graphics [0x020a]')."""
    row = (find(s.name, v) if s.name else None) or (by_pci_id(s.pci_id, v) if s.pci_id else None)
    if row is not None:
        return row.name, row.aot
    return s.name or (f"Intel GPU {s.pci_id}" if s.pci_id else "Intel GPU"), None


def parse_xpu_smi_json(text: str) -> list[Seen]:
    """`xpu-smi discovery -j`: {"device_list": [{"device_name", "pci_device_id", "device_type", ...}]}."""
    data = json.loads(text)
    seen = []
    devices = data.get("device_list") if isinstance(data, dict) else None
    for d in devices if isinstance(devices, list) else []:
        if not isinstance(d, dict) or d.get("device_type", "GPU") != "GPU":
            continue
        name = d.get("device_name")
        seen.append(Seen(name.strip() or None if isinstance(name, str) else None, _pci(d.get("pci_device_id"))))
    return seen


def parse_xpu_smi_table(text: str) -> list[Seen]:
    """`xpu-smi discovery`: a table with one `| <id> | Device Name: ... |` cell per device, continued by
    `|     | Key: value |` lines."""
    seen = []
    for line in text.splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|\s*Device Name:\s*(.*?)\s*\|\s*$", line)
        if m:
            name = m.group(2)
            pci = re.search(r"\[(0x[0-9a-fA-F]+)\]\s*$", name)
            seen.append(Seen(name, _pci(pci.group(1)) if pci else None))
    return seen


def parse_pci(devices: Path) -> tuple[list[Seen], list[str]]:
    """Intel devices in /sys/bus/pci/devices: `vendor` 0x8086, `class` 0x0380xx (planned for) or 0x0300xx
    (named in a note). Returns (data-center GPUs, VGA controllers as 'BDF 0xDEVICE')."""
    gpus, vga = [], []
    for dev in sorted(devices.iterdir()):
        try:
            vendor = int(_read(dev / "vendor"), 16)
            klass = int(_read(dev / "class"), 16) >> 8
            device = _read(dev / "device").lower()
        except (OSError, ValueError):  # ValueError: not hex (a damaged or odd file): not a device to plan for
            continue
        if vendor != INTEL_VENDOR:
            continue
        if klass == CLASS_DISPLAY_OTHER:
            gpus.append(Seen(None, _pci(device)))
        elif klass == CLASS_VGA:
            vga.append(f"{dev.name} {device}")
    return gpus, vga


def _read(path: Path) -> str:
    with path.open("rb") as f:
        return amd.decode(f.read(64)).strip()  # sysfs's vendor, device and class are one short hex line


def _pci(value) -> str | None:
    """'0x0BD5' -> '0x0bd5'; anything that is not a 16-bit hex PCI ID (a number, '0xzz') -> None."""
    if not isinstance(value, str) or not amd.PCI_ID.fullmatch(value.strip()):
        return None
    return f"0x{int(value, 16):04x}"


def probe_xpu_smi(v: Vendors) -> Probe:
    out = _run("xpu-smi", ["discovery", "-j"])
    if out.startswith("xpu-smi:"):
        return Probe([], out)
    try:
        seen = parse_xpu_smi_json(out)
    except (ValueError, RecursionError):  # not JSON (an older xpu-smi): its table
        seen = parse_xpu_smi_table(_run("xpu-smi", ["discovery"]))
    return Probe(seen, f"xpu-smi: {len(seen)} GPU(s)")


def probe_pci(v: Vendors, root: str | None = None) -> Probe:
    devices = Path(root or os.environ.get("ENVTOOL_PCI_DEVICES") or PCI_DEVICES)
    if not devices.is_dir():
        return Probe([], f"{devices}: not present")
    gpus, vga = parse_pci(devices)
    note = f"{devices}: {len(gpus)} Intel data-center GPU(s)"
    if vga:
        note += (f"; Intel VGA controller(s) {', '.join(vga)} (integrated graphics, or an Arc card: "
                 "not planned for without xpu-smi; `--gpu xpu` plans for it)")
    return Probe(gpus, note)


PROBES = (probe_xpu_smi, probe_pci)
