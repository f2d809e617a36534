"""Kernels and plugins: Axolotl's `plugins:` paths, the liger_* keys, cut_cross_entropy and lora_*_kernel.

These are speed/memory options (the diffusion plugin, which changes the objective, is trainer/config/diffusion.py).
Liger's kernels are triton kernels, so they run only where the plan says triton kernels do (plan feature
`liger`: a GPU the installed triton compiles for, from matrices/packages.toml [[triton_support]]); elsewhere (CPU included) they are switched off with one note.
Where they run, they are applied through the real liger-kernel package to the loaded model.

An unknown plugin, or one whose feature changes the training and is not implemented, is an error that names it
(trainer/config/hardware.py checks the plugin paths with the config).
"""

from __future__ import annotations

import importlib.util

from trainer import facts

LIGER_KEYS = {  # config key -> liger-kernel's _apply_liger_kernel_to_instance argument
    "liger_rope": "rope", "liger_rms_norm": "rms_norm", "liger_layer_norm": "layer_norm",
    "liger_glu_activation": "swiglu", "liger_swiglu": "swiglu", "liger_cross_entropy": "cross_entropy",
    "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy", "liger_rms_norm_gated": None,
}
LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")


# the keys that ask for a fused loss: the trainer's chunked cross-entropy serves them (trainer/objectives/chunked_loss.py)
LOSS_KEYS = ("cut_cross_entropy", "liger_fused_linear_cross_entropy", "liger_cross_entropy")


def requested(cfg) -> list[str]:
    keys = [k for k in LIGER_KEYS if getattr(cfg, k)]
    # listing Axolotl's Cut Cross Entropy plugin turns it on there (its CutCrossEntropyArgs default is true)
    cce_listed = any(p.rstrip(".").endswith("CutCrossEntropyPlugin") for p in cfg.plugins or [])
    if cfg.cut_cross_entropy or (cce_listed and "cut_cross_entropy" not in cfg.model_fields_set):
        keys.append("cut_cross_entropy")
    return keys


def liger_on(cfg) -> list[str]:
    """The liger_* keys the trainer runs through liger-kernel where triton kernels run (the loss keys are served by
    the trainer's chunked cross-entropy instead)."""
    return [k for k in requested(cfg) if k not in LOSS_KEYS and LIGER_KEYS.get(k)]


def triton_runs(gpu, plan: dict | None) -> tuple[bool, str]:
    """Whether triton kernels run here, and why not."""
    if gpu.cc is None:
        return False, "triton kernels need a GPU; running on CPU"
    if plan is not None and "features" in plan:
        ok = bool(plan["features"].get("liger"))
        return ok, "" if ok else "the plan switches triton kernels off for this GPU"
    floor = max((tuple(int(x) for x in r["min_cc"].split(".")) for r in facts.rows("packages", "triton_support")),
                default=(0, 0))
    if gpu.cc < floor:
        return False, f"triton's kernels need sm_{floor[0]}{floor[1]}+ and {gpu.describe()} is below"
    return True, ""


def plan_notes(cfg, gpu, plan: dict | None) -> tuple[bool, list[str]]:
    """(apply liger kernels?, notes for validate/train)."""
    notes = []
    lora_kernels = [k for k in LORA_KERNEL_KEYS if getattr(cfg, k)]
    if lora_kernels:
        notes.append(f"{', '.join(lora_kernels)}: off (Axolotl's own LoRA triton kernels are not part of this "
                     "trainer; same training, slower)")
    keys = requested(cfg)
    losses = [k for k in keys if k in LOSS_KEYS]
    if losses:
        notes.append(f"{', '.join(losses)}: served by the trainer's own chunked cross-entropy, on by default "
                     "wherever the model allows it (the logits never whole, the same loss summed over the step's "
                     "tokens; the first step says whether it runs), not by that kernel")
    keys = [k for k in keys if k not in LOSS_KEYS]
    if not keys:
        return False, notes
    ok, why = triton_runs(gpu, plan)
    if not ok:
        notes.append(f"{', '.join(keys)}: off ({why}; same training, slower)")
        return False, notes
    on = liger_on(cfg)
    if on:
        notes.append(f"{', '.join(on)}: on (liger-kernel's triton kernels)")
    return bool(on), notes


def apply(cfg, model, enabled: bool, log) -> None:
    """Patch the loaded model with liger's kernels where they run (enabled: plan_notes' verdict)."""
    if not enabled:
        return
    if importlib.util.find_spec("liger_kernel") is None:
        log("note: liger kernels: off (the liger-kernel package is not installed; the plan installs it on GPUs "
            "where triton runs)")
        return
    # optional: liger_kernel is imported only where it is used
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    wanted = {LIGER_KEYS[k]: True for k in requested(cfg) if LIGER_KEYS.get(k) in ("rope", "rms_norm", "swiglu",
                                                                                 "layer_norm")}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        _apply_liger_kernel_to_instance(model=base, cross_entropy=False, fused_linear_cross_entropy=False, **wanted)
    except TypeError:  # an argument this model type's liger function does not take
        wanted.pop("layer_norm", None)
        _apply_liger_kernel_to_instance(model=base, cross_entropy=False, fused_linear_cross_entropy=False, **wanted)
    log(f"liger kernels applied: {', '.join(sorted(wanted))}")
