"""The Plan: the contract between every stage (lock, docker, ci, trainer). Plain data, JSON-serialisable.

The JSON field names are a public contract documented in the README ("The --json contract"). One class
writes a plan and reads it back (`to_json` / `from_json`); `plan_version` is MAJOR.MINOR: a reader accepts
any minor of the major it knows (new fields are ignored) and refuses another major in one line.
It is written as `plan.json` everywhere: beside a lock, into every environment's prefix, into images.
NamedTuples rather than dataclasses: they cost a tenth as much to define, and `resolve` must start fast.
"""

import json
from pathlib import Path
from typing import NamedTuple

PLAN_FILE = "plan.json"  # the one name of a plan on disk: lock directories, environments, images
PLAN_VERSION = "1.2"  # 1.1: packing, mask_without_cudnn, flash_attn.index_url, pinned (command-line choices);
#   1.2: device, env, gpu.vendor/target, torch.backend/rocm (AMD, Intel and Apple plans)


class TorchChoice(NamedTuple):
    version: str
    cuda: str | None  # "12.6"; None for the CPU build and every non-CUDA build
    variant: str  # "cu126" | "rocm7.2" | "xpu" | "macos" | "cpu"
    index_url: str  # the PyTorch index of the variant; macOS: PyPI (torch's default wheels are the MPS build)
    min_driver: str | None  # the NVIDIA driver this build needs at full feature level; None otherwise
    backend: str = "cuda"  # cuda | rocm | xpu | mps | cpu
    rocm: str | None = None  # the ROCm release a ROCm build bundles ("7.2")


PYPI_SIMPLE = "https://pypi.org/simple/"  # a FlashAttnChoice.index_url for a wheel on PyPI (flash-attn-4): the lock
# takes it from the environment's package index, as the rest of the stack (PyPI, or the --index-url replacing it)


class FlashAttnChoice(NamedTuple):
    version: str
    package: str
    filename: str
    wheel_url: str
    index_url: str | None = None  # on a package index (flash-attn-3: the torch build's PyTorch index); None: the URL


class Rejected(NamedTuple):
    """A candidate torch build the solver did not take, and the rule that rejected it."""

    torch: str
    variant: str
    rule: str  # e.g. "sass", "driver", "torch_pin"
    reason: str


class Plan(NamedTuple):
    gpu: dict  # name, compute_capability, arch, count, memory_gb, source, bf16, vendor, target
    driver: dict  # version, max_cuda
    python: str
    platform: str
    torch: TorchChoice
    attention: str
    flash_attn: FlashAttnChoice | None
    precision: str
    triton: str | None
    features: dict  # torch_compile, liger: whether triton-based kernels may be used
    packages: dict[str, str]
    reasons: list[str]
    matrix_version: str
    target: str  # what the user asked for: "t4", "auto", "sm_80"
    packing: str = "mask"  # how packed rows are kept apart: "varlen" (cu_seqlens, no mask) | "mask"
    mask_without_cudnn: bool = False  # masked SDPA calls must run with cuDNN attention switched off
    rejected: list[Rejected] = []
    # Choices set on the command line, each with the option that set it ({"attention": "--attention sdpa"}): the
    # trainer follows them over its config, as a command-line option wins. Written only when there is one.
    pinned: dict[str, str] = {}
    device: str = "cuda"  # torch's device type: cuda (NVIDIA, and AMD under HIP) | xpu | mps | cpu
    env: dict[str, str] = {}  # environment the run needs (TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1)
    plan_version: str = PLAN_VERSION

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def target_label(self) -> str:
        """What the build carries code for, as people write it: sm_80, gfx942, pvc, mps, cpu."""
        return target_label(self.gpu)

    def to_dict(self, explain: bool = False) -> dict:
        data = _plain(self)
        if not explain:
            data.pop("rejected")
        if not data["pinned"]:
            data.pop("pinned")
        return data

    def to_json(self, explain: bool = False) -> str:
        return json.dumps(self.to_dict(explain), indent=2)

    @classmethod
    def from_dict(cls, data: dict, where: str = "the plan") -> "Plan":
        """The inverse of to_dict; a plan without `plan_version` is a 1.0 plan (written before the field)."""
        # start-up: resolver.errors imported only when this runs
        from .errors import BadInput

        if not isinstance(data, dict):
            raise BadInput(f"{where} is not a JSON object; was it written by envtool?")
        check_version(data.get("plan_version", "1.0"), where)
        known = set(cls._fields)
        missing = [f for f in cls._fields if f not in data and f not in cls._field_defaults]
        if missing:
            raise BadInput(f"{where} lacks {', '.join(missing)}; was it written by envtool?")
        values = {k: v for k, v in data.items() if k in known}
        if "packing" not in values:  # a 1.0 plan: flash-attn packed by cu_seqlens, everything else by a mask
            values["packing"] = "varlen" if str(values.get("attention", "")).startswith("flash_attention") else "mask"
        gpu = values.get("gpu")
        if isinstance(gpu, dict) and "vendor" not in gpu:  # a 1.0/1.1 plan: NVIDIA or CPU
            cc = gpu.get("compute_capability")
            values["gpu"] = {**gpu, "vendor": "nvidia" if cc else "cpu",
                             "target": f"sm_{cc.replace('.', '')}" if cc else None}
        if "device" not in values and isinstance(values.get("gpu"), dict):
            values["device"] = "cpu" if values["gpu"].get("compute_capability") is None else "cuda"
        if isinstance(values.get("torch"), dict) and "backend" not in values["torch"]:
            values["torch"] = {**values["torch"], "backend": "cpu" if values["torch"].get("cuda") is None else "cuda"}
        try:
            values["torch"] = TorchChoice(**_known(TorchChoice, values["torch"]))
            if values.get("flash_attn"):
                values["flash_attn"] = FlashAttnChoice(**_known(FlashAttnChoice, values["flash_attn"]))
            values["rejected"] = [Rejected(**_known(Rejected, r)) for r in values.get("rejected") or []]
        except TypeError as e:
            raise BadInput(f"{where}: malformed field ({e}); was it written by envtool?") from None
        values["plan_version"] = PLAN_VERSION
        return cls(**values)

    @classmethod
    def from_json(cls, text: str, where: str = "the plan") -> "Plan":
        # start-up: resolver.errors imported only when this runs
        from .errors import BadInput

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadInput(f"{where} is not valid JSON: {e}") from None
        return cls.from_dict(data, where)

    @classmethod
    def read(cls, path: Path) -> "Plan":
        # start-up: resolver.errors imported only when this runs
        from .errors import BadInput

        try:
            return cls.from_json(Path(path).read_text(), str(path))
        except FileNotFoundError:
            raise BadInput(f"{path}: no such plan file") from None


def _known(kind, data: dict) -> dict:
    """The fields `kind` has: a newer minor version may add fields, which an older reader ignores."""
    return {k: v for k, v in data.items() if k in kind._fields}


def check_version(version, where: str = "the plan") -> None:
    """Refuse a plan whose major version this envtool does not know (a minor difference is fine)."""
    # start-up: resolver.errors imported only when this runs
    from .errors import BadInput

    major = str(version).split(".")[0]
    if major != PLAN_VERSION.split(".")[0]:
        raise BadInput(f"{where} has plan_version {version}; this envtool reads {PLAN_VERSION.split('.')[0]}.x plans: "
                       f"make it again with this envtool (`envtool resolve`) or use the envtool that wrote it")


def _plain(value):
    """NamedTuples to dicts, recursively, for JSON."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def target_label(gpu: dict) -> str:
    """sm_80 (NVIDIA), gfx942 (AMD), pvc (Intel's AOT family; xpu where not in the catalog), mps, cpu."""
    cc = gpu.get("compute_capability")
    if cc:
        return "sm_" + cc.replace(".", "")
    vendor = gpu.get("vendor") or "cpu"
    if vendor == "cpu":
        return "cpu"
    return gpu.get("target") or {"intel": "xpu", "apple": "mps"}.get(vendor, vendor)


def image_tag(plan: Plan, repository: str = "envtool-trainer") -> str:
    """`envtool-trainer:sm75-cu126-torch2.9-py3.11`, `envtool-trainer:gfx942-rocm7.2-torch2.13-py3.12`: the
    architecture and the stack, readable at a glance."""
    arch = target_label(plan.gpu).replace("_", "")
    torch_mm = ".".join(plan.torch.version.split(".")[:2])
    return f"{repository}:{arch}-{plan.torch.variant}-torch{torch_mm}-py{plan.python}"
