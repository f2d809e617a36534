"""CI strategy matrices: one entry per target GPU, for `strategy.matrix` in a workflow."""

from __future__ import annotations

import json

from .plan import Plan, image_tag

IMAGE_BACKENDS = ("cuda", "rocm", "cpu")  # the plans `envtool build` makes images for


def github_matrix(plans: list[Plan]) -> str:
    """`{"include": [...]}` for `strategy: matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}`. Plans for
    several vendors mix: `vendor` and `gpu_target` (sm_75, gfx942, pvc, mps) pick the runner, `device` is
    torch's, `image` is null where no image is made (XPU, Apple silicon)."""
    include = [
        {
            "target": p.target,
            "gpu": p.gpu["name"],
            "vendor": p.gpu.get("vendor"),
            "gpu_target": p.target_label,
            "compute_capability": p.gpu["compute_capability"],
            "arch": p.gpu["arch"],
            "device": p.device,
            "python": p.python,
            "platform": p.platform,
            "torch": p.torch.version,
            "variant": p.torch.variant,
            "attention": p.attention,
            "precision": p.precision,
            "image": image_tag(p) if p.torch.backend in IMAGE_BACKENDS else None,
        }
        for p in plans
    ]
    return json.dumps({"include": include}, separators=(",", ":"))
