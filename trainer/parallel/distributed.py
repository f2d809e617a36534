"""Sharded training backends: FSDP (through accelerate's FullyShardedDataParallelPlugin) and DeepSpeed.

FSDP is configured as Axolotl configures it: `fsdp_version` (1 or 2), `fsdp_config` with Axolotl's keys,
with or without the `fsdp_` prefix, and the legacy `fsdp:` list (full_shard, auto_wrap, offload, ...).
FSDP2 runs on CPU over gloo as well as on GPUs over NCCL.

`deepspeed:` is a JSON file. Axolotl's configs name its own deepspeed_configs/*.json relative to Axolotl's
checkout; when such a path does not exist here, the copy bundled in trainer/deepspeed_configs/ (same file,
source in its SOURCES.toml) is used, with a note.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

from trainer.config.parallel import deepspeed_path, fsdp_settings  # noqa: F401 (how the config reads them)
from trainer.config.parallel import fsdp_enabled as enabled  # noqa: F401
from trainer.errors import ConfigError

CPU_FSDP1_NOTE = ("fsdp_version: 1 runs as FSDP2 on CPU (accelerate's FSDP1 needs a GPU device; FSDP2 shards "
                  "parameters, gradients and optimizer state the same way)")


def fsdp_plugin(cfg, runtime):
    """accelerate's FullyShardedDataParallelPlugin for the config."""
    # heavy: accelerate loads only when this runs
    from accelerate.utils import FullyShardedDataParallelPlugin

    settings = fsdp_settings(cfg, cpu=runtime.device == "cpu")
    if cfg.gradient_checkpointing:
        settings.pop("activation_checkpointing", None)  # the model's own checkpointing is on already
    if settings.get("auto_wrap_policy") == "transformer_based_wrap" and not settings.get("transformer_cls_names_to_wrap"):
        settings.pop("transformer_cls_names_to_wrap", None)  # accelerate reads the model's _no_split_modules
    settings.setdefault("state_dict_type", "FULL_STATE_DICT")
    try:
        return FullyShardedDataParallelPlugin(**settings)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"fsdp_config: {str(err).splitlines()[0]}") from None


def keep_quantized_experts_whole(accelerator, model) -> int:
    """FSDP2 with quantize_moe_experts: the experts' quantized storage is left out of sharding (accelerate's
    ignored_modules), as accelerate leaves bitsandbytes' non-float 4-bit weights out: sharded, the packed storage
    would be split apart from its quantization state (absmax, block layout), and bitsandbytes' dequantize then mixes
    DTensors and tensors (measured: FSDP2 over 2 CPU processes stopped at the first forward). Each rank holds the
    frozen quantized experts whole, as Axolotl's FSDP2 runs hold them (its README: GLM-4.7-Flash QLoRA 24 GiB on one
    GPU, 29 GiB per GPU on two). Returns how many expert tensors are kept whole."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        return 0
    # heavy: torch loads only when this runs
    import torch.nn.utils.parametrize as P

    chains = [module.parametrizations[name] for module in model.modules() if P.is_parametrized(module)
              for name in module.parametrizations if not module.parametrizations[name].original.is_floating_point()]
    if chains:
        plugin.ignored_modules = [*(plugin.ignored_modules or []), *chains]
    return len(chains)


def use_fsdp_on_cpu(accelerator, plugin) -> None:
    """accelerate switches to FSDP only for GPU-like backends; torch's FSDP2 itself runs on CPU over gloo, so on
    CPU the accelerator's state is pointed at the plugin here (everything else is accelerate's own FSDP2 path)."""
    # heavy: accelerate loads only when this runs
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if accelerator.num_processes > 1 and accelerator.distributed_type == DistributedType.MULTI_CPU:
        state = AcceleratorState()
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin


def is_sharded(model) -> bool:
    """FSDP2 shards parameters as DTensors."""
    # heavy: torch loads only when this runs
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _options(**kwargs):
    # heavy: torch loads only when this runs
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model) -> dict | None:
    """The whole model's state dict on CPU (a collective: every rank calls it); None when not sharded."""
    if not is_sharded(model):
        return None
    # heavy: torch loads only when this runs
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with _quant_state_unserialized(model):
        return get_model_state_dict(model, options=_options(cpu_offload=True))


@contextmanager
def _quant_state_unserialized(model):
    """Without bitsandbytes' state-dict hook on parametrized (quantized) expert tensors while torch's
    get_model_state_dict runs: the hook adds the quantization state under keys such as `experts.gate_up_proj.absmax`,
    which torch then resolves as attributes ('Tensor' object has no attribute 'absmax', measured under FSDP2 with
    quantize_moe_experts). The state then holds the packed storage under its own name
    (`parametrizations.gate_up_proj.original`); the frozen experts are never saved from it (adapters only)."""
    removed = []
    for module in model.modules():
        hooks = module.__dict__.get("_state_dict_hooks") or {}
        for key, hook in list(hooks.items()):
            func = getattr(hook, "func", hook)
            if getattr(func, "__name__", "") == "_parametrized_state_dict_post_hook":
                removed.append((hooks, key, hooks.pop(key)))
    try:
        yield
    finally:
        for hooks, key, hook in removed:
            hooks[key] = hook


def full_optimizer_state(model, optimizer) -> dict | None:
    if not is_sharded(model):
        return None
    # heavy: torch loads only when this runs
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=_options(cpu_offload=True))


def load_full_model_state(model, state: dict) -> None:
    # heavy: torch loads only when this runs
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=False))


def load_full_optimizer_state(model, optimizer, state: dict) -> None:
    # heavy: torch loads only when this runs
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), state, options=_options())


def is_deepspeed(engine) -> bool:
    return type(engine).__name__ == "DeepSpeedEngine"


def import_deepspeed_only_when_used() -> None:
    """accelerate's extract_model_from_parallel (accelerator.unwrap_model, and transformers' save_pretrained through
    it) imports deepspeed wherever the package is installed, to test whether the model is DeepSpeed's engine: about
    1.5 s of a run's start without `deepspeed:`. A model is that engine only where deepspeed is already imported, so
    accelerate's `is_deepspeed_available` there asks that first: the same answer for every model, without the import."""
    from accelerate.utils import other  # heavy: accelerate loads with the run's accelerator

    available = getattr(other, "is_deepspeed_available", None)
    if available is None or getattr(available, "imported_first", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and available()

    is_deepspeed_available.imported_first = True
    other.is_deepspeed_available = is_deepspeed_available


def register_lora_weights(engine) -> int:
    """ZeRO-3 with LoRA: declare each adapter's lora_A/lora_B weights as parameters of the peft layer that holds
    them (DeepSpeed's register_external_parameter); return how many. peft's layer reads lora_A.weight (its dtype)
    before lora_A runs. Undeclared, DeepSpeed registers it on the fly whenever that read finds it partitioned,
    which depends on what ran before: right after engine.load_checkpoint (whose epilogue gathers the persistent
    parameters) the micro-batch DeepSpeed records its fetch trace on finds it gathered, the next one finds it
    released by that recording, and its fetches then depart from the trace ("tracing error at step N" on resume
    with gradient accumulation). Declared up front, every micro-batch fetches the same parameters."""
    if not is_deepspeed(engine) or engine.zero_optimization_stage() != 3:
        return 0
    # heavy: torch and deepspeed load only when this runs
    import torch
    from deepspeed.runtime.zero import register_external_parameter

    count = 0
    for module in engine.module.modules():
        for attr in ("lora_A", "lora_B"):
            adapters = getattr(module, attr, None)
            if not isinstance(adapters, torch.nn.ModuleDict):
                continue
            for child in adapters.values():
                weight = getattr(child, "weight", None)
                if weight is not None and hasattr(weight, "ds_id"):
                    register_external_parameter(module, weight)
                    count += 1
    return count


def gathered_model_state(engine, model) -> dict | None:
    """The full weights for save_pretrained where they are sharded (FSDP2, DeepSpeed ZeRO-3); None otherwise.
    A collective: every rank calls it."""
    if is_sharded(model):
        return full_model_state(model)
    if is_deepspeed(engine) and engine.zero_optimization_stage() == 3:
        # gathers ZeRO-3's partitions, as accelerate's get_state_dict does (gather_16bit_weights_on_model_save)
        state = engine._zero3_consolidated_16bit_state_dict()
        return {k: v.float() for k, v in state.items()} if state is not None else None
    return None


def as_one_process_launch() -> None:
    """DeepSpeed trains only inside a process group, which accelerate makes only under a launcher (LOCAL_RANK set):
    one process started without one (`python -m trainer train`, `envtool train` on one device) gets what torchrun
    gives a single process -- rank 0 of 1, meeting itself at 127.0.0.1 on a free port. Before, such a run stopped
    with "Default process group has not been initialized"."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def deepspeed_stage(cfg) -> int | None:
    """The ZeRO stage of the config's DeepSpeed JSON (None: no deepspeed, or a file that says none)."""
    if not cfg.deepspeed:
        return None

    path = Path(deepspeed_path(cfg.deepspeed))
    try:
        stage = json.loads(path.read_text()).get("zero_optimization", {}).get("stage")
    except (OSError, ValueError) as err:
        raise ConfigError(f"deepspeed: cannot read {path}: {err}") from None
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None
