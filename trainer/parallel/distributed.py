"""Sharded training backends: FSDP (through accelerate's FullyShardedDataParallelPlugin) and DeepSpeed.

FSDP is configured as Axolotl configures it: `fsdp_version` (1 or 2), `fsdp_config` with Axolotl's keys,
with or without the `fsdp_` prefix, and the legacy `fsdp:` list (full_shard, auto_wrap, offload, ...).
FSDP2 runs on CPU over gloo as well as on GPUs over NCCL.

`deepspeed:` is a JSON file. Axolotl's configs name its own deepspeed_configs/*.json relative to Axolotl's
checkout; when such a path does not exist here, the copy bundled in trainer/deepspeed_configs/ (same file,
source in its SOURCES.toml) is used, with a note.
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import ConfigError

BUNDLED_DS = Path(__file__).parents[1] / "deepspeed_configs"

# Axolotl's fsdp_config keys (prefix removed) -> accelerate's FullyShardedDataParallelPlugin argument.
FSDP_KEYS = {
    "version": "fsdp_version",
    "sharding_strategy": "sharding_strategy",
    "reshard_after_forward": "reshard_after_forward",
    "offload_params": "cpu_offload",
    "auto_wrap_policy": "auto_wrap_policy",
    "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
    "state_dict_type": "state_dict_type",
    "backward_prefetch": "backward_prefetch",
    "forward_prefetch": "forward_prefetch",
    "use_orig_params": "use_orig_params",
    "sync_module_states": "sync_module_states",
    "cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "limit_all_gathers": "limit_all_gathers",
    "activation_checkpointing": "activation_checkpointing",
    "min_num_params": "min_num_params",
}
# The legacy `fsdp:` list.
FSDP_LIST = {"full_shard": ("sharding_strategy", "FULL_SHARD"), "shard_grad_op": ("sharding_strategy", "SHARD_GRAD_OP"),
             "hybrid_shard": ("sharding_strategy", "HYBRID_SHARD"), "no_shard": ("sharding_strategy", "NO_SHARD"),
             "offload": ("cpu_offload", True), "auto_wrap": ("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")}


def enabled(cfg) -> bool:
    return bool(cfg.fsdp or cfg.fsdp_config or cfg.fsdp_version)


CPU_FSDP1_NOTE = ("fsdp_version: 1 runs as FSDP2 on CPU (accelerate's FSDP1 needs a GPU device; FSDP2 shards "
                  "parameters, gradients and optimizer state the same way)")


def fsdp_settings(cfg, cpu: bool = False) -> dict:
    """The FSDP settings as accelerate's plugin arguments (raises ConfigError naming a bad key). cpu: FSDP1
    configs become FSDP2, which runs over gloo."""
    settings: dict = {}
    items = cfg.fsdp if isinstance(cfg.fsdp, list) else (cfg.fsdp or "").split()
    for item in items:
        if item not in FSDP_LIST:
            raise ConfigError(f"fsdp: unknown option '{item}' (known: {', '.join(FSDP_LIST)})")
        key, value = FSDP_LIST[item]
        settings[key] = value
    for raw_key, value in (cfg.fsdp_config or {}).items():
        key = raw_key.removeprefix("fsdp_")
        if key not in FSDP_KEYS:
            raise ConfigError(f"fsdp_config.{raw_key}: unknown FSDP setting (known: {', '.join(sorted(FSDP_KEYS))}, "
                              "each also with an fsdp_ prefix)")
        if value is not None:
            settings[FSDP_KEYS[key]] = value
    if cfg.fsdp_version:
        settings["fsdp_version"] = cfg.fsdp_version
    settings.setdefault("fsdp_version", 1)
    if cpu:
        settings["fsdp_version"] = 2
    names = settings.get("transformer_cls_names_to_wrap")
    if isinstance(names, str):
        settings["transformer_cls_names_to_wrap"] = [n.strip() for n in names.split(",") if n.strip()]
    if isinstance(settings.get("auto_wrap_policy"), str):
        settings["auto_wrap_policy"] = settings["auto_wrap_policy"].lower()
    if settings["fsdp_version"] == 2:
        # FSDP2 has no sharding strategies: FULL_SHARD is reshard_after_forward=True, SHARD_GRAD_OP False.
        strategy = str(settings.pop("sharding_strategy", "") or "").upper()
        if strategy and "reshard_after_forward" not in settings:
            settings["reshard_after_forward"] = strategy != "SHARD_GRAD_OP"
        for legacy in ("use_orig_params", "sync_module_states", "limit_all_gathers", "forward_prefetch",
                       "backward_prefetch"):
            settings.pop(legacy, None)  # FSDP1-only; FSDP2 always behaves as these ask
    return settings


def check(cfg) -> list[str]:
    """Config-time checks of the distributed backend; returns notes."""
    notes = []
    if enabled(cfg):
        if cfg.deepspeed:
            raise ConfigError("deepspeed and fsdp/fsdp_config are both set; choose one sharding backend")
        settings = fsdp_settings(cfg)
        if settings["fsdp_version"] == 1:
            notes.append("fsdp_version: 1 (FSDP1, as accelerate runs it); fsdp_version: 2 is the newer API")
        if settings.get("activation_checkpointing") and cfg.gradient_checkpointing:
            notes.append("fsdp_config.activation_checkpointing and gradient_checkpointing are both on: "
                         "the model's own gradient checkpointing is used")
    if cfg.deepspeed:
        resolved = deepspeed_path(cfg.deepspeed)
        if resolved != cfg.deepspeed:
            notes.append(f"deepspeed: {cfg.deepspeed} not found here; using the bundled copy of Axolotl's {resolved.name}")
    return notes


def deepspeed_path(path: str):
    """The DeepSpeed JSON to use: the path as given, else Axolotl's file of that name bundled here."""
    given = Path(path).expanduser()
    if given.exists():
        return path
    bundled = BUNDLED_DS / given.name
    if bundled.exists() and given.parent.name == "deepspeed_configs":
        return bundled
    return path


def fsdp_plugin(cfg, runtime):
    """accelerate's FullyShardedDataParallelPlugin for the config."""
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


def use_fsdp_on_cpu(accelerator, plugin) -> None:
    """accelerate switches to FSDP only for GPU-like backends; torch's FSDP2 itself runs on CPU over gloo, so on
    CPU the accelerator's state is pointed at the plugin here (everything else is accelerate's own FSDP2 path)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if accelerator.num_processes > 1 and accelerator.distributed_type == DistributedType.MULTI_CPU:
        state = AcceleratorState()
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin


def is_sharded(model) -> bool:
    """FSDP2 shards parameters as DTensors."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model) -> dict | None:
    """The whole model's state dict on CPU (a collective: every rank calls it); None when not sharded."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state(model, optimizer) -> dict | None:
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=_options(cpu_offload=True))


def load_full_model_state(model, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=False))


def load_full_optimizer_state(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), state, options=_options())


def is_deepspeed(engine) -> bool:
    return type(engine).__name__ == "DeepSpeedEngine"


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


def deepspeed_stage(cfg) -> int | None:
    """The ZeRO stage of the config's DeepSpeed JSON (None: no deepspeed, or a file that says none)."""
    if not cfg.deepspeed:
        return None
    import json

    path = Path(deepspeed_path(cfg.deepspeed))
    try:
        stage = json.loads(path.read_text()).get("zero_optimization", {}).get("stage")
    except (OSError, ValueError) as err:
        raise ConfigError(f"deepspeed: cannot read {path}: {err}") from None
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None
