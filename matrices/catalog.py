"""Queries over the matrices' rows that the resolver and the trainer share.

The trainer runs in images without the resolver, and both must answer "which GPU is this name" and "which
architecture row covers this compute capability" the same way, so the lookups live here, beside the data,
as plain functions over rows (the resolver's NamedTuples or the trainer's tomllib dicts). Standard library
only: `envtool resolve` imports this on its fast path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable

MATRIX_DIR_ENV = "ENVTOOL_MATRIX_DIR"

SM_RE = re.compile(r"^(?:sm_?|cc)?(\d{1,2})\.?(\d)$")


def matrix_dir() -> Path:
    """Where the TOML files are: $ENVTOOL_MATRIX_DIR (a refreshed or air-gapped copy), else this package."""
    override = os.environ.get(MATRIX_DIR_ENV)
    return Path(override) if override else Path(__file__).parent


def _get(row: Any, key: str):
    return row.get(key) if isinstance(row, dict) else getattr(row, key, None)


def normalize_name(text: str) -> str:
    """How GPU names and aliases are compared: case, spaces, '-' and '_' do not matter."""
    return re.sub(r"[\s_\-]+", "", text.strip().lower())


def cc_tuple(cc: str) -> tuple[int, int]:
    major, minor = cc.split(".")
    return int(major), int(minor)


# A plan's gpu.source when the GPU was named (--gpu, ENVTOOL_GPU) rather than found on the machine: such a plan is
# for another machine, and what it says of "this machine" it says of the GPU named.
NAMED_GPU_SOURCES = ("catalog", "catalog-family", "compute-capability", "gfx-target", "ENVTOOL_GPU")


def cc_from_text(text: str) -> str | None:
    """'sm_75', 'sm75', '7.5', '75' -> '7.5'; anything else None."""
    match = SM_RE.match(normalize_name(text))
    return f"{int(match.group(1))}.{match.group(2)}" if match else None


# Words after a product's name that make it another product of the same line: NVIDIA's Ti and Super (and AMD's XT,
# XTX) share the chip generation, so the compute capability, but not the memory ("RTX 5070 Ti" has 16 GB, the RTX
# 5070 12 GB).
VARIANT_WORDS = frozenset({"ti", "super", "xt", "xtx"})
MEMORY_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*(?:g|gb|gib)(?![a-z])", re.I)


def memory_in_name(text: str) -> float | None:
    """The memory a GPU's name states ("NVIDIA H100 80GB HBM3" -> 80, "NVIDIA GH200 144G HBM3e" -> 144), or None."""
    found = MEMORY_IN_NAME.search(text) if isinstance(text, str) else None
    return float(found.group(1)) if found else None


def find_by_pci_id(pci_id: str | None, gpus: Iterable[Any]):
    """The catalog row whose pci_ids hold this NVIDIA device id ("2c05", "0x2C05", or NVML's 32-bit pciDeviceId
    as hex "0x2c0510de"), else None."""
    if not isinstance(pci_id, str):
        return None
    text = pci_id.strip().lower().removeprefix("0x")
    if len(text) == 8 and text.endswith("10de"):  # NVML and nvidia-smi: device id, then vendor id
        text = text[:4]
    if not re.fullmatch(r"[0-9a-f]{4}", text):
        return None
    return next((row for row in gpus if text in (_get(row, "pci_ids") or [])), None)


def find_gpu(text: str, gpus: Iterable[Any]):
    """The catalog row a user's or nvidia-smi's name means: an exact name or alias first ("t4", "Tesla T4"),
    else the row with the longest name or alias spelled by whole words of it ("NVIDIA H100 80GB HBM3" -> H100,
    "NVIDIA GeForce RTX 4090" -> rtx4090; "a101" is not "a10"), else None. Never another product of the row's line:
    a name with a variant word after the row's ("RTX 5070 Ti") or a memory size the row does not have ("GH200
    144G") is not that row (gpu_family says what such a name shares with it)."""
    found = gpu_family(text, gpus)
    return found[0] if found is not None and found[2] else None


def gpu_family(text: str, gpus: Iterable[Any]):
    """(row, memory in GB, same product) for a GPU's name: the row whose name or alias the text spells (as
    find_gpu), the memory the text states (else the row's, for the same product; None for a variant whose memory
    the catalog does not know), and whether it is the row's own product rather than a variant of its line (same
    compute capability: see VARIANT_WORDS) or another memory size. None when no row matches."""
    if not isinstance(text, str):
        return None  # a number where a tool prints a name
    key = normalize_name(text)
    rows = list(gpus)
    labels = [(row, {normalize_name(a) for a in (_get(row, "name"), *_get(row, "aliases"))}) for row in rows]
    stated = memory_in_name(text)
    for row, names in labels:
        if key in names:
            return row, stated if stated is not None else _get(row, "memory_gb"), True
    # Runs of consecutive words no longer than the longest label: a run longer than every label matches none, and
    # bounding them keeps this linear in the text's length (a 1,500-word name built ~10^6 runs of ~10^4
    # characters each when every run was formed).
    longest = max((len(n) for _, names in labels for n in names), default=0)
    words = [w for w in re.split(r"[\s_\-/,()]+", text.strip().lower()) if w]
    runs: dict[str, str | None] = {}  # run -> the word after it
    for i in range(len(words)):
        run = ""
        for j, word in enumerate(words[i:], start=i):
            run += word
            if len(run) > longest:
                break
            runs.setdefault(run, words[j + 1] if j + 1 < len(words) else None)
    best, best_len = None, 0
    for row in rows:
        for label in (_get(row, "name"), *_get(row, "aliases")):
            label = normalize_name(label)
            if label in runs and len(label) > best_len:
                best, best_len = row, len(label)
    if best is None:
        return None
    after = {runs[n] for n in (normalize_name(a) for a in (_get(best, "name"), *_get(best, "aliases"))) if n in runs}
    own = _get(best, "memory_gb")
    variant = bool(after & VARIANT_WORDS)
    other_size = stated is not None and own is not None and abs(stated - own) > max(1.0, 0.05 * own)
    same = not variant and not other_size
    return best, (stated if stated is not None else (own if same else None)), same


# ---------------------------------------------------------------------------- families of NVIDIA names

MODEL_TOKEN = re.compile(r"([a-z]*)(\d+)[a-z]*")


def _family_keys(text: str) -> tuple[tuple, tuple] | None:
    """(narrow, wide) family keys of a GPU's name, from its first word with a digit (its model number) and the words
    before it (less "nvidia"): "GeForce RTX 5050" -> ((geforce, rtx), "", 4, "50") and ((geforce, rtx), "", 4);
    "NVIDIA L40S" -> ((), "l", 2, "") and ((), "l", 2). None when the name has no model number."""
    words = [w for w in re.split(r"[\s_\-/,()]+", text.strip().lower()) if w]
    at = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)), None)
    found = MODEL_TOKEN.fullmatch(words[at]) if at is not None else None
    if found is None:
        return None
    letters, digits = found.groups()
    wide = (tuple(w for w in words[:at] if w != "nvidia"), letters, len(digits))
    return (*wide, digits[:-2] if len(digits) >= 3 else ""), wide


def family_cc(text: str, gpus: Iterable[Any]) -> tuple[str, list[str]] | None:
    """(compute capability, the catalog names it comes from) for an NVIDIA name the catalog lacks whose family the
    catalog knows, else None. A family is the rows whose names share the words before the model number and the
    model number's letters, length and leading digits ("GeForce RTX 50xx": every one is 12.0, so "GeForce RTX 5055"
    is); where those leading digits match no row, a model number with letters is taken by letters and length alone
    ("NVIDIA A800" -> the A100s' 8.0, "NVIDIA L20" -> the L40s' 8.9; not "GeForce GTX 1650", whose 16xx the catalog
    lacks and whose 10xx are another architecture). Only when the family has two rows or more, all of one compute
    capability (the B200 and B300 differ: "NVIDIA B100" is no family), and the model number two digits or more
    ("Tesla T5" is no family of the T4); a bare model number ("A800") needs "NVIDIA" or the
    family's series words, so another vendor's name is never taken. The families are the catalog's rows, which
    scripts/gen_gpu_catalog.py keeps to NVIDIA's CUDA GPU tables: no family is typed."""
    keys = _family_keys(text) if isinstance(text, str) else None
    if keys is None or keys[1][2] < 2 or not (keys[1][0] or "nvidia" in text.lower().split()):
        return None  # "Tesla T5": a one-digit model number is a product, not a line of them
    rows = [(row, _family_keys(_get(row, "name"))) for row in gpus]
    for level in (0, 1):
        if level == 1 and not keys[1][1]:
            break
        members = [row for row, k in rows if k is not None and k[level] == keys[level]]
        if members:
            ccs = {_get(row, "compute_capability") for row in members}
            return (ccs.pop(), [_get(row, "name") for row in members]) if len(ccs) == 1 and len(members) > 1 \
                else None
    return None


def family_note(text: str, cc: str, members: list[str]) -> str:
    """What a plan says of a GPU planned by its family."""
    shown = ", ".join(members[:3]) + (f" and {len(members) - 3} more" if len(members) > 3 else "")
    memory = "its memory as its name states it" if memory_in_name(text) is not None else "its memory is unknown"
    return (f"{text.strip()!r} is not in the catalog: planned as compute capability {cc}, that of every catalog GPU "
            f"of its family ({shown}); {memory}")


def arch_for(cc: str, archs: Iterable[Any]):
    """The architecture row for `cc`, else the nearest lower minor of the same major (sm_XZ runs sm_XY
    code); None when no row shares its major."""
    want = cc_tuple(cc)
    fitting = [a for a in archs if cc_tuple(_get(a, "compute_capability"))[0] == want[0]
               and cc_tuple(_get(a, "compute_capability")) <= want]
    return max(fitting, key=lambda a: cc_tuple(_get(a, "compute_capability")), default=None)


def backend_runs_on(backend: Any, cc: str | None) -> bool:
    """Whether an attention backend row (attention.toml) runs on a GPU of compute capability `cc`
    (None: CPU)."""
    min_cc, max_cc = _get(backend, "min_cc"), _get(backend, "max_cc")
    if min_cc is None:
        return True
    if cc is None:
        return False
    return cc_tuple(min_cc) <= cc_tuple(cc) and (max_cc is None or cc_tuple(cc) <= cc_tuple(max_cc))


def backend_range(backend: Any) -> str:
    """'sm_80+', 'sm_90 only', 'any device'."""
    min_cc, max_cc = _get(backend, "min_cc"), _get(backend, "max_cc")
    if min_cc is None:
        return "any device"
    low = "sm_" + min_cc.replace(".", "")
    if max_cc is None:
        return f"{low}+"
    if max_cc == min_cc:
        return f"{low} only"
    return f"{low} to sm_{max_cc.replace('.', '')}"


# ---------------------------------------------------------------------------- AMD gfx targets

GFX_RE = re.compile(r"^gfx([6-9]|1[0-2])([0-9a-f])([0-9a-f])$")  # GFXIP majors 6 (GCN1) .. 12 (RDNA4, gfx1250)


def gfx_from_text(text: str) -> str | None:
    """The LLVM target a tool or user names: 'gfx942', 'GFX90A', 'gfx942:sramecc+:xnack-' (rocminfo, torch's
    gcnArchName) and 'amdgcn-amd-amdhsa--gfx90a:xnack-' (rocminfo's ISA name) -> 'gfx942' / 'gfx90a'; None for
    anything else ('sm_80', 'mi300x', 'gfx000', rocm_agent_enumerator's name for a CPU agent)."""
    key = text.strip().lower().rsplit("--", 1)[-1].split(":", 1)[0]
    match = GFX_RE.match(key)
    if not match or key == "gfx000":
        return None
    return key


def gfx_from_kfd(version: int) -> str | None:
    """The target the kernel's KFD topology reports as `gfx_target_version` (major*10000 + minor*100 + stepping,
    decimal): 90402 -> 'gfx942', 90010 -> 'gfx90a', 110501 -> 'gfx1151'; 0 (a CPU node) -> None."""
    if version <= 0:
        return None
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    if minor > 15 or stepping > 15:
        return None
    return gfx_from_text(f"gfx{major}{minor:x}{stepping:x}")  # a major no GPU has (a damaged file): None


def find_target(gfx: str, targets: Iterable[Any]):
    """The amd.toml [[target]] row for a gfx target, else None (code objects are per target: no nearest
    lower match as for CUDA's compute capabilities)."""
    return next((t for t in targets if _get(t, "gfx") == gfx), None)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def p2p_advice(row: Any, driver: str | None) -> tuple[str, str, str | None] | None:
    """What gpus.toml's p2p columns say for several of this GPU in one machine, as (level, message, fix):
    "error" when the driver is one that claims peer-to-peer the card does not have (NCCL's first collective
    hangs), "warning" when that cannot be ruled out (driver unknown), "ok" for a card without P2P on a driver
    that says so (NCCL goes through host memory by itself); None when the row records nothing."""
    if row is None or _get(row, "p2p") != "none":
        return None
    name, below = _get(row, "name"), _get(row, "p2p_hang_below_driver")
    via_host = (f"{name} has no GPU peer-to-peer: NCCL moves data between two of them through host memory "
                "(/dev/shm must be large, and it is slower than P2P)")
    fix = "export NCCL_P2P_DISABLE=1" + (f" (or a driver {below} or newer)" if below else "")
    if below and driver and _version_tuple(driver) < _version_tuple(below):
        return ("error", f"{via_host}; driver {driver} is older than {below} and claims P2P anyway, so NCCL tries "
                "it and its first collective hangs or returns garbage", fix)
    if below and not driver:
        return ("warning", f"{via_host}; drivers older than {below} claim P2P anyway and NCCL then hangs in its "
                "first collective (driver unknown here: give --driver)", fix)
    return ("ok", f"{via_host}; NCCL finds that itself{' on driver ' + driver if driver else ''} "
            "(NCCL_P2P_DISABLE=1 makes it explicit)", None)
