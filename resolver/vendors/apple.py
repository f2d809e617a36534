"""Apple silicon: an arm64 Mac trains on torch's MPS device. Detection is the platform itself (macOS on arm64),
the chip's name from `sysctl -n machdep.cpu.brand_string` ("Apple M2 Max"), its memory (unified, shared with the
CPU) from `sysctl -n hw.memsize`, and the macOS version, which decides MPS (14+) and bf16 (14+).
"""

import re
from typing import NamedTuple

from packaging.version import Version

from matrices.catalog import normalize_name

from .amd import _run
from .facts import Vendors

NAMES = ("mps", "apple", "applesilicon", "metal")
CHIP_RE = re.compile(r"^(?:apple)?m([1-9])(pro|max|ultra)?$")


class Seen(NamedTuple):
    chip: str | None  # "Apple M2 Max"
    memory_gb: float | None
    macos: str | None  # "14.5"


class Probe(NamedTuple):
    seen: Seen | None
    note: str


def names(text: str) -> str | None:
    """The display name `--gpu` text means on Apple silicon ('mps', 'apple', 'm2-max' -> 'Apple M2 Max'), else
    None. Chips are named by pattern: every M-series chip runs the same MPS backend."""
    key = normalize_name(text)
    if key in NAMES:
        return "Apple silicon"
    m = CHIP_RE.match(key)
    if m:
        return f"Apple M{m.group(1)}" + (f" {m.group(2).capitalize()}" if m.group(2) else "")
    return None


def parse_sysctl(brand: str, memsize: str) -> tuple[str | None, float | None]:
    chip = brand.strip() or None
    try:
        memory = round(int(memsize.strip()) / 2**30, 1)
    except ValueError:
        memory = None
    return chip, memory


def probe_platform(v: Vendors, system: str | None = None, machine: str | None = None) -> Probe:
    # start-up: platform imported only when this runs
    import platform

    system = system or platform.system()
    machine = machine or platform.machine()
    if system != "Darwin":
        return Probe(None, f"platform: {system}, not macOS")
    if machine != "arm64":
        return Probe(None, f"platform: macOS on {machine}: no MPS, and no torch wheels for Intel Macs after 2.2.2")

    brand, memsize = _run("sysctl", ["-n", "machdep.cpu.brand_string"]), _run("sysctl", ["-n", "hw.memsize"])
    chip, memory = parse_sysctl("" if brand.startswith("sysctl:") else brand,
                                "" if memsize.startswith("sysctl:") else memsize)
    macos = platform.mac_ver()[0] or None
    return Probe(Seen(chip, memory, macos), f"platform: macOS {macos or '?'} on arm64 ({chip or 'Apple silicon'})")


def macos_at_least(macos: str | None, floor: str) -> bool | None:
    """None when the macOS version is unknown (a plan made elsewhere)."""
    if not macos:
        return None

    return Version(macos) >= Version(floor)
