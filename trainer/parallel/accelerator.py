"""accelerate's Accelerator for a run: processes, mixed precision, timeouts, FSDP/DeepSpeed, the device mesh.

The loop accumulates gradients itself (normalising by the step's token count), so accelerate's
gradient_accumulation_steps stays 1; DeepSpeed, which owns accumulation, clipping and stepping, gets the config's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from datetime import timedelta

import torch

from trainer.config import Config
from trainer.config.parallel import mesh_for
from trainer.errors import ConfigError, TrainingError
from trainer.parallel import distributed
from trainer.parallel import mesh as parallelism
from trainer.runtime.hardware import Runtime

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def make_accelerator(cfg: Config, runtime: Runtime):
    """The run's processes: accelerate's Accelerator with the precision, the sharding backend (FSDP, DeepSpeed),
    the device mesh and the collective timeout the config asks for; `.mesh` is the N-D mesh (None without sizes)."""
    # heavy: accelerate loads only when this runs
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    check_device(runtime)
    distributed.import_deepspeed_only_when_used()  # (unwrapping a model imports deepspeed otherwise: start-up time)
    # under torchrun, before any process group: every rank joins, an all-reduce, /dev/shm, ulimit -l, shared storage
    # (a rank that never comes is named in seconds, not found by the first collective after ddp_timeout)
    from trainer.parallel.preflight import check_before_training

    check_before_training(cfg, runtime.device, log=lambda line: print(line, file=sys.stderr, flush=True))
    deepspeed = None
    if cfg.deepspeed:  # passed through to accelerate; DeepSpeed then owns accumulation, clipping and stepping
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("deepspeed: the deepspeed package is not installed in this environment")
        distributed.as_one_process_launch()
        deepspeed = DeepSpeedPlugin(hf_ds_config=str(distributed.deepspeed_path(cfg.deepspeed)),
                                    gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                    gradient_clipping=cfg.max_grad_norm or 0.0)
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        world = int(os.environ.get("WORLD_SIZE", "1"))  # "auto" in Axolotl's files; DeepSpeed checks the product
        deepspeed.deepspeed_config["train_batch_size"] = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:  # once per machine, before any rank builds an op
            from trainer.parallel import ds_ops

            ds_ops.prepare(deepspeed.deepspeed_config, say=lambda line: print(line, file=sys.stderr, flush=True),
                           device=runtime.device)
    # gradient_accumulation_steps stays 1: the loop accumulates itself, normalising by the step's token count
    mesh = mesh_for(cfg, parallelism.world_size(), distributed.enabled(cfg))  # sizes vs processes
    mesh_config = parallelism.parallelism_config(mesh)
    # with tensor or expert parallelism transformers shards the model as it loads (FSDP included): accelerate wraps
    # nothing
    fsdp = None if parallelism.by_transformers(mesh) else fsdp_plugin(cfg, runtime)
    if deepspeed is not None and runtime.device == "cpu":
        # DeepSpeed's CPU accelerator over gloo: accelerate skips DeepSpeed when told cpu=True, and with no GPU
        # and no backend named it would count one process; name gloo and the DeepSpeed launch path
        from accelerate.state import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(cpu=False, backend="gloo", timeout=timedelta(seconds=cfg.ddp_timeout))
    accelerator = Accelerator(
        mixed_precision=MIXED_PRECISION[runtime.precision],
        # accelerate ignores DeepSpeed when told cpu=True; without a GPU it still runs on the CPU (over gloo)
        cpu=runtime.device == "cpu" and deepspeed is None,
        deepspeed_plugin=deepspeed,
        fsdp_plugin=fsdp,
        parallelism_config=mesh_config if runtime.device in ("cuda", "xpu") else None,  # CPU: attached below
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout))] + ddp_kwargs(cfg),
    )
    if fsdp is not None and runtime.device == "cpu":
        distributed.use_fsdp_on_cpu(accelerator, fsdp)
        if mesh_config is not None:
            parallelism.attach(accelerator, mesh_config)
    accelerator.mesh = mesh
    return accelerator


DEVICE_NAMES = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}


def device_available(device: str) -> bool:
    """Whether torch sees a device of this type: cuda (NVIDIA, or AMD through a HIP build), xpu, mps."""
    if device == "cuda":
        return torch.cuda.is_available()
    if device == "xpu":
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    if device == "mps":
        return torch.backends.mps.is_available()
    return True


def check_device(runtime: Runtime) -> None:
    """The plan's device must be there (a ROCm plan needs a HIP torch that sees the GPU); on XPU, bf16 needs the
    device's word (torch.xpu.is_bf16_supported()), else the run trains in fp32 and says so."""
    if runtime.device == "cpu":
        return
    if not device_available(runtime.device):
        build = {"amd": "a ROCm (HIP) build of torch", "intel": "torch's xpu build", "apple": "torch on macOS"}.get(
            runtime.gpu.kind, "a CUDA build of torch")
        raise TrainingError(f"the plan is for {runtime.gpu.describe()} but torch sees no {DEVICE_NAMES[runtime.device]} "
                            f"device here (it needs {build} and the GPU's driver)")
    if runtime.device == "xpu" and runtime.precision == "bf16" and not torch.xpu.is_bf16_supported():
        runtime.precision = "fp32"
        runtime.changes.append(f"precision: bf16 -> fp32 ({runtime.gpu.describe()}: torch.xpu.is_bf16_supported() "
                               "says no)")


def ddp_kwargs(cfg: Config) -> list:
    """ddp_find_unused_parameters, as in Axolotl/HF (only where set: DDP's default is False)."""
    # heavy: accelerate loads only when this runs
    from accelerate.utils import DistributedDataParallelKwargs

    if cfg.ddp_find_unused_parameters is None:
        return []
    return [DistributedDataParallelKwargs(find_unused_parameters=cfg.ddp_find_unused_parameters)]


def fsdp_plugin(cfg: Config, runtime: Runtime):
    return distributed.fsdp_plugin(cfg, runtime) if distributed.enabled(cfg) else None
