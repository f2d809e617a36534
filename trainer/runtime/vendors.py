"""AMD (ROCm), Intel (XPU) and Apple silicon (MPS) GPUs as the trainer sees them: named (`--gpu mi300x`,
`gfx942`, `max1550`, `xpu`, `mps`), read from a plan (its gpu.vendor / target), or probed through torch (a HIP
build's `torch.version.hip` and `gcnArchName`, `torch.xpu`, `torch.backends.mps`). The facts are the resolver's
matrices/amd.toml, rocm.toml, intel.toml and apple.toml, read with tomllib (trainer/facts.py): one copy.

torch's device type follows the backend: "cuda" under HIP (ROCm answers to torch.cuda), "xpu", "mps".
"""

from __future__ import annotations

import re

from matrices import catalog
from trainer import facts

DEVICE = {"nvidia": "cuda", "amd": "cuda", "intel": "xpu", "apple": "mps", "cpu": "cpu"}
APPLE_NAMES = ("mps", "apple", "applesilicon", "metal")
APPLE_CHIP = re.compile(r"^(?:apple)?m([1-9])(pro|max|ultra)?$")


def amd_target(gfx: str | None) -> dict | None:
    return catalog.find_target(gfx, facts.rows("amd", "target")) if gfx else None


def lookup(name: str) -> tuple[str, str, str | None] | None:
    """(vendor, display name, target) for a `--gpu` name that is not NVIDIA's, else None."""
    key = catalog.normalize_name(name)
    gfx = catalog.gfx_from_text(key)
    if gfx:
        return "amd", f"AMD {gfx} GPU", gfx
    if key in ("xpu", "intel", "intelgpu"):
        return "intel", "Intel GPU", None
    if key in APPLE_NAMES or APPLE_CHIP.match(key):
        return "apple", "Apple silicon", "mps"
    row = catalog.find_gpu(name, facts.rows("amd", "gpu"))
    if row is not None:
        return "amd", row["name"], row["gfx"]
    row = catalog.find_gpu(name, facts.rows("intel", "gpu"))
    if row is not None:
        return "intel", row["name"], row["aot"]
    return None


def family(vendor: str, target: str | None) -> str:
    if vendor == "amd":
        row = amd_target(target)
        return row["family"] if row else (target or "AMD GPU")
    if vendor == "intel":
        row = next((t for t in facts.rows("intel", "target") if t["aot"] == target), None)
        return row["family"] if row else "Intel GPU"
    return "Apple silicon"


def bf16(vendor: str, target: str | None) -> bool | None:
    """bf16 on the matrix cores as the facts say (AMD: amd.toml per target); None where the device decides at run
    time (Intel: torch.xpu.is_bf16_supported(); Apple: the macOS version)."""
    if vendor == "amd":
        row = amd_target(target)
        return bool(row["bf16"]) if row else None
    return None


def probe() -> tuple[str, str, str | None, int] | None:
    """(vendor, name, target, count) of the devices this torch build sees beyond CUDA's, else None. A HIP build
    answers to torch.cuda: its target is the device's gcnArchName ('gfx942:sramecc+:xnack-')."""
    # heavy: torch loads only when this runs
    import torch

    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gfx = catalog.gfx_from_text(getattr(props, "gcnArchName", "") or "")
        return "amd", torch.cuda.get_device_name(0), gfx, torch.cuda.device_count()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "intel", xpu.get_device_name(0), None, xpu.device_count()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "apple", "Apple silicon", "mps", 1
    return None


def limits(vendor: str) -> list[dict]:
    """What runs or does not run beyond torch on the vendor's GPUs ([[limit]] rows)."""
    name = {"amd": "rocm", "intel": "intel", "apple": "apple"}.get(vendor)
    return facts.rows(name, "limit") if name else []


def feature_refusal(vendor: str, feature: str | None) -> str | None:
    """Why a packages.toml [[feature]] (bnb_8bit_optimizer, ...) does not run on this vendor's GPUs, else None."""
    if not feature:
        return None
    row = next((r for r in limits(vendor) if feature in r.get("features", []) and not r["runs"]), None)
    return f"{row['feature']}: {row['reason']}" if row else None


def package_refusal(vendor: str, package: str) -> str | None:
    """Why a stack package (deepspeed, ...) does not run on this vendor's GPUs, else None."""
    row = next((r for r in limits(vendor) if r.get("package") == package and not r["runs"]), None)
    return row["reason"] if row else None


def bitsandbytes_covers(target: str | None, rocm: str | None, version: str | None) -> tuple[bool, str]:
    """Whether the ROCm library bitsandbytes `version` loads beside torch's ROCm `rocm` carries `target`'s code
    (rocm.toml [[bitsandbytes]], bitsandbytes' own pick: the highest packaged ROCm <= torch's of the same major,
    else the lowest higher one); (ok, why not)."""
    # start-up: packaging imported only when this runs
    from packaging.version import Version

    rows = [r for r in facts.rows("rocm", "bitsandbytes") if version is None or r["version"] == version]
    if not rows:
        return False, f"bitsandbytes {version} carries no ROCm library (rocm.toml [[bitsandbytes]])"
    if rocm is None:
        covered = any(target in r["gfx"] for r in rows)
        return covered, "" if covered else f"no ROCm library of bitsandbytes carries {target} code"
    want = Version(rocm)
    same = [r for r in rows if Version(r["rocm"]) <= want and Version(r["rocm"]).major == want.major]
    higher = [r for r in rows if Version(r["rocm"]) > want]
    lib = max(same, key=lambda r: Version(r["rocm"])) if same else min(higher, key=lambda r: Version(r["rocm"]),
                                                                          default=None)
    if lib is None or target not in lib["gfx"]:
        return False, (f"the ROCm {lib['rocm'] if lib else '?'} library bitsandbytes loads beside torch's ROCm {rocm} "
                       f"carries no {target} code")
    return True, ""
