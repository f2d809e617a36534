"""The Plan: the contract between every stage (lock, docker, ci, trainer). Plain data, JSON-serialisable.

The JSON field names are a public contract documented in the README ("The --json contract").
NamedTuples rather than dataclasses: they cost a tenth as much to define, and `resolve` must start fast.
"""

from __future__ import annotations

import json
from typing import NamedTuple


class TorchChoice(NamedTuple):
    version: str
    cuda: str | None  # "12.6"; None for the CPU build
    variant: str  # "cu126" | "cpu"
    index_url: str
    min_driver: str | None  # the driver this build needs at full feature level; None for CPU


class FlashAttnChoice(NamedTuple):
    version: str
    package: str
    filename: str
    wheel_url: str


class Rejected(NamedTuple):
    """A candidate torch build the solver did not take, and the rule that rejected it."""

    torch: str
    variant: str
    rule: str  # e.g. "sass", "driver", "torch_pin"
    reason: str


class Plan(NamedTuple):
    gpu: dict  # name, compute_capability, arch, count, memory_gb, source, bf16
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
    rejected: list[Rejected] = []

    def to_dict(self, explain: bool = False) -> dict:
        data = _plain(self)
        if not explain:
            data.pop("rejected")
        return data

    def to_json(self, explain: bool = False) -> str:
        return json.dumps(self.to_dict(explain), indent=2)


def _plain(value):
    """NamedTuples to dicts, recursively, for JSON."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def image_tag(plan: Plan, repository: str = "envtool-trainer") -> str:
    """`envtool-trainer:sm75-cu126-torch2.9-py3.11`: the architecture and the stack, readable at a glance."""
    cc = plan.gpu["compute_capability"]
    arch = "cpu" if cc is None else "sm" + cc.replace(".", "")
    torch_mm = ".".join(plan.torch.version.split(".")[:2])
    return f"{repository}:{arch}-{plan.torch.variant}-torch{torch_mm}-py{plan.python}"
