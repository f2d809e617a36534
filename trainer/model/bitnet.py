"""use_onebitllms: Falcon-E's BitNet b1.58 training through the onebitllms package, as Axolotl does it.

Axolotl (src/axolotl/loaders/model.py) calls onebitllms.replace_linear_with_bitnet_linear(model) right after
the model is loaded: every nn.Linear but lm_head becomes onebitllms' BitNetLinear, whose forward quantizes the
activations (int8, absmax per token) and the weights (ternary, absmean) with a straight-through estimator. The
trained parameters stay the full-precision `weight`/`bias` of nn.Linear, under the same names, so checkpoints and
the final model are ordinary checkpoints (what Falcon-E's "-prequantized" models are), and resuming loads them
into the swapped layers again; Axolotl does nothing else at save time. Axolotl refuses LoRA/QLoRA with it.

onebitllms 0.0.4's quantizers are triton kernels only (no torch fallback), so this runs on a GPU where triton's
kernels run (matrices/packages.toml [[feature]] onebitllms_bitnet, and the plan's triton verdict), never on CPU.
"""

from __future__ import annotations

import importlib.util

from trainer import facts
from trainer.errors import ConfigError, HardwareError

FEATURE = "onebitllms_bitnet"


def hardware_notes(cfg, gpu, plan: dict | None) -> list[str]:
    """Refuse use_onebitllms where its kernels cannot run (or with an adapter); a note where it runs."""
    if not cfg.use_onebitllms:
        return []
    if cfg.adapter:
        raise ConfigError(f"use_onebitllms: not with adapter: {cfg.adapter} (BitNet training is a full fine-tune of "
                          "the linear layers; Axolotl refuses LoRA/QLoRA with it too), remove adapter")
    # start-up: trainer.model.kernels imported only when this runs
    from trainer.model import kernels

    feat = facts.feature(FEATURE)
    where = f"({feat['reason']}; source: {feat['source']})"
    if gpu.cc is None:
        raise HardwareError(f"use_onebitllms: cannot run on the CPU {where}, remove use_onebitllms or train on a GPU")
    ok, why = kernels.triton_runs(gpu, plan)
    floor = tuple(int(x) for x in feat["min_cc"].split("."))
    if gpu.cc < floor:
        ok, why = False, f"triton's kernels need sm_{floor[0]}{floor[1]}+ and {gpu.describe()} is below"
    if not ok:
        raise HardwareError(f"use_onebitllms: {why} {where}, remove use_onebitllms")
    return ["use_onebitllms: every linear layer but lm_head becomes onebitllms' BitNetLinear (ternary weights, "
            "int8 activations, triton kernels); the saved weights stay full precision, as Axolotl saves them"]


def apply(model) -> int:
    """Swap the model's linear layers (all but lm_head) for onebitllms' BitNetLinear; return how many."""
    if importlib.util.find_spec("onebitllms") is None:
        raise ConfigError("use_onebitllms: needs the onebitllms package, which is not installed (install envtool's "
                          "`bitnet` extra: pip install 'envtool-llm[bitnet]')")
    # heavy: torch loads only when this runs
    import torch

    try:
        from onebitllms import BitNetLinear, replace_linear_with_bitnet_linear
    except ImportError as err:  # e.g. no triton: a CPU build of torch
        raise ConfigError(f"use_onebitllms: onebitllms cannot be imported here ({err})") from None

    default = torch.get_default_dtype()
    try:
        replace_linear_with_bitnet_linear(model)
    finally:
        torch.set_default_dtype(default)  # onebitllms sets the model's dtype as torch's default and leaves it there
    return sum(isinstance(m, BitNetLinear) for m in model.modules())
