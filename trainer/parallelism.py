"""Axolotl's N-D parallelism sizes -> accelerate's ParallelismConfig (a device mesh that FSDP2 shards over).

Axolotl's keys: `dp_shard_size` (ranks one copy of the model is sharded over, FSDP), `dp_replicate_size`
(copies of that sharded model: with both, HSDP -- shard within a group, replicate across groups),
`tensor_parallel_size`, `context_parallel_size`, `expert_parallel_size`.

The sizes fill the world as Axolotl fills them (axolotl/utils/distributed.py, `_get_parallel_config_kwargs`):
a size left unset -- or 1, for dp_shard_size -- takes what the others leave: under FSDP the leftover ranks
shard (dp_shard_size: 1 with 4 processes shards over 4), and when dp_shard_size leaves ranks over and
dp_replicate_size is unset, they replicate. What does not divide the world evenly is an error naming the
sizes and the number of processes, before any work.

Supported here: dp_shard_size and dp_replicate_size (FSDP and HSDP; HSDP through accelerate's device mesh,
FSDP2 only), on GPUs and on CPU over gloo. tensor_parallel_size and context_parallel_size above 1 are refused
(REFUSED below says why); a size of 1 means "none" and is accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.errors import ConfigError

SIZE_KEYS = ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size")

# Sizes above 1 that this trainer refuses, with the reason (a size of 1 is "none" and accepted).
REFUSED = {
    "tensor_parallel_size": (
        "tensor parallelism is not supported: ranks of one tensor-parallel group must share batches, counts and "
        "checkpoints, which this loop does not arrange, so use dp_shard_size (FSDP) to fit a large model"),
    "context_parallel_size": (
        "context parallelism is not supported: Axolotl splits sequences over ranks with ring-flash-attn (flash-"
        "attention varlen kernels, GPUs only), and torch's context parallel needs CUDA SDPA kernels and a plain "
        "causal mask, which packed sequences do not have, so use dp_shard_size (FSDP) with gradient_checkpointing"),
}


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int
    dp_shard: int

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def describe(self) -> str:
        if self.hybrid:
            return (f"HSDP: {self.dp_replicate} replicas x {self.dp_shard}-way FSDP shards "
                    f"({self.world} processes)")
        if self.dp_shard > 1:
            return f"FSDP over {self.dp_shard} processes"
        return f"data parallel over {self.dp_replicate} process(es)"


def given(cfg) -> dict[str, int]:
    """The size keys the config sets (to any value)."""
    return {k: getattr(cfg, k) for k in SIZE_KEYS if getattr(cfg, k) is not None}


def check(cfg, fsdp: bool) -> list[str]:
    """Config-time checks (the world size is not known yet); returns notes."""
    sync_each_batch(cfg)
    sizes = given(cfg)
    if not sizes:
        return []
    problems = [f"{key}: {sizes[key]} ({reason})" for key, reason in REFUSED.items() if sizes.get(key, 1) > 1]
    shard, replicate = sizes.get("dp_shard_size", 1), sizes.get("dp_replicate_size", 1)
    if shard > 1 and not fsdp:
        problems.append(f"dp_shard_size: {shard} shards the model with FSDP, so it needs fsdp_version: 2 and "
                        "fsdp_config (as Axolotl requires)" + (", not deepspeed (which shards by its ZeRO stage)" if cfg.deepspeed else ""))
    if fsdp and replicate > 1 and (cfg.fsdp_version or (cfg.fsdp_config or {}).get("fsdp_version")
                                   or (cfg.fsdp_config or {}).get("version") or 1) != 2:
        problems.append(f"dp_replicate_size: {replicate} with FSDP (HSDP) needs fsdp_version: 2 (accelerate "
                        "builds HSDP on FSDP2's device mesh)")
    if problems:
        raise ConfigError("; ".join(problems))
    fixed = (shard if shard > 1 else 1) * replicate
    if fsdp:
        kind = (f"HSDP, {replicate} replicas of the sharded model" if replicate > 1 else "FSDP")
        shard_text = f"{shard}-way shards" if shard > 1 else "shards over the processes the other sizes leave"
        return [f"parallelism: {kind}, {shard_text}; needs a multiple of {fixed} processes, checked at launch"
                if fixed > 1 else f"parallelism: sizes of 1 mean none; FSDP {shard_text}"]
    return [f"parallelism: data parallel (DDP), dp_replicate_size {replicate} must equal the number of processes, "
            "checked at launch" if replicate > 1 else "parallelism: sizes of 1 mean none"]


def mesh_for(cfg, world: int, fsdp: bool) -> Mesh | None:
    """The data-parallel mesh for `world` processes (None when no size key is set). Raises ConfigError naming
    the sizes when they do not fit the number of processes."""
    sizes = given(cfg)
    if not sizes:
        return None
    check(cfg, fsdp)
    shard = sizes.get("dp_shard_size") or 1
    replicate = sizes.get("dp_replicate_size")
    asked = " x ".join(f"{k} {v}" for k, v in sizes.items() if k in ("dp_shard_size", "dp_replicate_size") and v > 1)

    def mismatch() -> ConfigError:
        both = shard > 1 and replicate and replicate > 1
        fixed = shard * (replicate or 1)
        need = f"= {fixed} processes" if both or not fsdp else f"needs a multiple of {fixed} processes"
        return ConfigError(f"{asked} {need}, but this run has {world} (WORLD_SIZE): launch that many processes "
                           "(torchrun --nproc-per-node, times the nodes) or change the sizes")

    rest = world
    if replicate and replicate > 1:
        if rest % replicate:
            raise mismatch()
        rest //= replicate
    if shard > 1:
        if rest % shard:
            raise mismatch()
        left = rest // shard
        if left > 1:  # ranks over: they replicate, unless dp_replicate_size was given (then it is a mismatch)
            if replicate and replicate > 1:
                raise mismatch()
            replicate = left
        return Mesh(dp_replicate=replicate or 1, dp_shard=shard)
    # dp_shard_size unset or 1: under FSDP the ranks left shard (Axolotl's fill); without FSDP they are DDP
    # replicas, and dp_replicate_size, when given, must account for all of them
    if fsdp:
        return Mesh(dp_replicate=replicate or 1, dp_shard=rest)
    if replicate and replicate > 1 and rest != 1:
        raise mismatch()
    return Mesh(dp_replicate=world, dp_shard=1)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parallelism_config(mesh: Mesh | None):
    """accelerate's ParallelismConfig for an HSDP mesh; None where plain FSDP/DDP over all ranks is the same."""
    if mesh is None or not mesh.hybrid:
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard)


def attach(accelerator, config) -> None:
    """On CPU, accelerate's constructor would refuse a ParallelismConfig (it accepts one only for GPU-like
    devices, FSDP2 or DeepSpeed, and the CPU run becomes FSDP2 only after construction, in
    trainer.distributed.use_fsdp_on_cpu): the config and its gloo device mesh are set on the state here, then
    checked by accelerate's own validation. accelerate's FSDP2 preparation reads the mesh from the state."""
    state = accelerator.state
    state.parallelism_config = config
    state.device_mesh = config.get_device_mesh(accelerator.device.type)
    config._validate_accelerator(accelerator)


def placement(model) -> str | None:
    """How the prepared model's parameters are really laid out: the device mesh and placements of its first
    sharded (DTensor) parameter, e.g. 'mesh dp_replicate=2 x dp_shard_cp=2, placements Replicate(), Shard(dim=0)'."""
    from torch.distributed.tensor import DTensor

    param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if param is None:
        return None
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f"mesh {dims}, placements {', '.join(repr(p) for p in param.placements)}"


def sync_each_batch(cfg) -> bool:
    """accelerator_config.gradient_accumulation_kwargs.sync_each_batch: reduce gradients after every micro-batch
    instead of once per step (FSDP then keeps only sharded gradients between micro-batches: less memory, the same
    sums). The rest of accelerate's AcceleratorConfig concerns accelerate's data loaders and accumulation, which
    this loop does not use: refused with the reason."""
    options = dict(cfg.accelerator_config or {})
    accumulation = options.pop("gradient_accumulation_kwargs", None) or {}
    if not isinstance(accumulation, dict):
        raise ConfigError("accelerator_config.gradient_accumulation_kwargs: must be a mapping")
    accumulation = dict(accumulation)
    value = accumulation.pop("sync_each_batch", False)
    unknown = [f"accelerator_config.{k}" for k in options] + [
        f"accelerator_config.gradient_accumulation_kwargs.{k}" for k in accumulation]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not supported (this trainer shards, batches and accumulates "
                          "itself; only gradient_accumulation_kwargs.sync_each_batch applies)")
    if not isinstance(value, bool):
        raise ConfigError("accelerator_config.gradient_accumulation_kwargs.sync_each_batch: must be true or false")
    return value
