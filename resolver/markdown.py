"""Plans as a Markdown table (`envtool resolve --format markdown`): the README's plan tables are this output,
and a test keeps them in step with the matrices."""

from __future__ import annotations

from matrices.catalog import backend_range, backend_runs_on

from .matrix import Matrix
from .plan import Plan

HEADER = ("| GPU | arch | torch | attention | packing | precision | triton (kernels) | flash-attn wheel |\n"
          "|---|---|---|---|---|---|---|---|")


def plans_markdown(plans: list[Plan], m: Matrix) -> str:
    return "\n".join([HEADER, *(_row(p, m) for p in plans)])


def _row(plan: Plan, m: Matrix) -> str:
    gpu = plan.gpu
    cc = gpu["compute_capability"]
    if not plan.on_gpu:
        arch = "CPU"
    elif plan.device == "mps":
        arch = "MPS"
    elif cc is None:  # AMD, Intel: the target and the family as the vendor writes it
        arch = f"{plan.target_label} {gpu['arch']}"
    else:
        arch = f"sm_{cc.replace('.', '')} {gpu['arch'].capitalize()}"
    kernels = "on" if plan.features["torch_compile"] else "off"
    triton = f"{plan.triton} ({kernels})" if plan.triton else "—"
    fa2 = m.backend(m.flash_attn_impl("fa2").attention)
    if plan.flash_attn:
        where = " (PyTorch index)" if plan.flash_attn.index_url else ""
        wheel = f"`{plan.flash_attn.filename}`{where}"
    elif plan.on_gpu and cc is None:
        wheel = f"— (none for {'ROCm' if plan.torch.backend == 'rocm' else plan.device.upper()})"
    elif not backend_runs_on(fa2, cc) or cc is None:
        wheel = f"— (needs {'a CUDA GPU' if cc is None else backend_range(fa2)})"
    elif plan.packing == "varlen":
        wheel = "— (not needed: torch's own varlen_attn)"
    else:
        wheel = "— (no prebuilt wheel for this torch)"
    torch = f"{plan.torch.version}" + ("" if plan.torch.backend == "mps" else f"+{plan.torch.variant}")
    attention = m.runs_as(plan.attention, plan.packing, plan.torch.version)  # what the trainer runs
    return (f"| {gpu['name']} | {arch} | {torch} | {attention} | {plan.packing} | {plan.precision} | {triton} "
            f"| {wheel} |")
