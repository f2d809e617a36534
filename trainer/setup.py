"""A run's start: load the config, run every feature's check, adapt it to the GPU.

One entry point for everything that begins a run or judges a config: ``python -m trainer validate|train|evaluate``,
the Ray Train workers (trainer/ray_launch.py) and the resolver's ``envtool train`` (which reads a config through
this reader, never a second one). It imports no torch, transformers or peft unless asked to probe the GPU with
torch (no ``gpu`` and no plan), so the resolver can judge a config in an environment without the training stack.
"""

from __future__ import annotations

import os
from pathlib import Path


def start(config: str | Path, gpu: str | None = None, plan: str | None = None):
    """(cfg, notes, runtime) for `config` on `gpu` (a catalog name, sm_XY or cpu), else the plan at `plan`, else the
    plan found by trainer/runtime/planfile.py's rule, else torch's probe. Raises the trainer's typed errors (ConfigError,
    HardwareError, ...) for what the config or GPU cannot do."""
    from trainer.config import load_config
    from trainer.config.training import one_process_only
    from trainer.runtime.hardware import adapt, detect

    cfg, notes = load_config(config)
    one_process_only(cfg, processes(cfg))  # before the model loads (minutes on a real one), not after
    found_gpu, found_plan = detect(gpu, plan)
    runtime = adapt(cfg, found_gpu, found_plan)
    from trainer.model.attention import for_model

    for_model(cfg, runtime, local_only=True)  # the backend the model's class accepts, where its config is at hand
    runtime.changes += feature_notes(cfg, runtime, found_plan)
    return cfg, notes, runtime


def processes(cfg) -> int:
    """How many processes the run trains on: torchrun's WORLD_SIZE, or the Ray Train workers use_ray starts."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(world, cfg.ray_num_workers) if cfg.use_ray else world


def feature_notes(cfg, runtime, plan) -> list[str]:
    """What quantized loading, the optimizer and the kernels become on this GPU (each floor from matrices/).
    Raises HardwareError where the GPU cannot do what the config asks. Sets runtime.kernels (liger on?)."""
    from trainer.model import bitnet, kernels, qat, quantization
    from trainer.optim import optimizers
    from trainer.parallel import distributed

    notes = quantization.hardware_notes(cfg, runtime.gpu) + optimizers.hardware_notes(cfg.optimizer, runtime.gpu)
    notes += qat.hardware_notes(cfg, runtime.gpu)  # qat dtypes' and fp8's floors
    notes += bitnet.hardware_notes(cfg, runtime.gpu, plan)  # use_onebitllms: triton kernels, so a GPU
    runtime.kernels, kernel_notes = kernels.plan_notes(cfg, runtime.gpu, plan)
    if distributed.enabled(cfg) and runtime.device == "cpu" and distributed.fsdp_settings(cfg)["fsdp_version"] == 1:
        notes.append(distributed.CPU_FSDP1_NOTE)
    return notes + kernel_notes
