"""CI strategy matrices: one entry per target GPU, for `strategy.matrix` in a workflow."""

from __future__ import annotations

import json

from .plan import Plan, image_tag


def github_matrix(plans: list[Plan]) -> str:
    """`{"include": [...]}` for `strategy: matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}`."""
    include = [
        {
            "target": p.target,
            "gpu": p.gpu["name"],
            "compute_capability": p.gpu["compute_capability"],
            "arch": p.gpu["arch"],
            "python": p.python,
            "torch": p.torch.version,
            "variant": p.torch.variant,
            "attention": p.attention,
            "precision": p.precision,
            "image": image_tag(p),
        }
        for p in plans
    ]
    return json.dumps({"include": include}, separators=(",", ":"))
