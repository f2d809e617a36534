"""Axolotl's N-D parallelism sizes -> accelerate's ParallelismConfig (a device mesh that FSDP2 shards over).

Axolotl's keys: `dp_shard_size` (ranks one copy of the model is sharded over, FSDP), `dp_replicate_size`
(copies of that sharded model: with both, HSDP -- shard within a group, replicate across groups),
`tensor_parallel_size`, `context_parallel_size`, `expert_parallel_size`.

The sizes fill the world as Axolotl fills them (axolotl/utils/distributed.py, `_get_parallel_config_kwargs`):
a size left unset -- or 1, for dp_shard_size -- takes what the others leave: under FSDP the leftover ranks
shard (dp_shard_size: 1 with 4 processes shards over 4), and when dp_shard_size leaves ranks over and
dp_replicate_size is unset, they replicate. What does not divide the world evenly is an error naming the
sizes and the number of processes, before any work.

Supported here: dp_shard_size and dp_replicate_size (FSDP, and HSDP through accelerate's device mesh, FSDP2
only), and tensor_parallel_size (transformers loads the model sharded by its tp_plan, with FSDP2/HSDP over the
ranks TP leaves), on GPUs and on CPU over gloo, and context_parallel_size (trainer/parallel/context_parallel.py: the
ranks of one CP group read the same batches and split each sequence; under FSDP they shard with the data
ranks). A size of 1 means "none" and is accepted. expert_parallel_size stays in trainer/config/keys.py UNSUPPORTED_KEYS.
The sizes' rules are checked with the config (trainer/config/parallel.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.config.parallel import check_sizes, given  # the size keys the config sets, and their rules
from trainer.errors import ConfigError


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    cp: int = 1  # context parallel (trainer/parallel/context_parallel.py): between the data ranks and tp

    @property
    def data_world(self) -> int:
        """Ranks that see different batches (the ranks of one tensor-parallel group share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.data_world * self.cp * self.tp

    def data_rank(self, rank: int) -> int:
        """tp is the innermost mesh dimension (accelerate's and transformers' order): consecutive ranks form
        one tensor-parallel group; cp comes next (the ranks of a CP group read the same batches)."""
        return rank // (self.tp * self.cp)

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def describe(self) -> str:
        if self.cp > 1:
            rest = Mesh(self.dp_replicate, self.dp_shard, self.tp).describe()
            return f"{self.cp}-way context parallel x {rest.rsplit(' (', 1)[0]} ({self.world} processes)"
        if self.tp > 1:
            dp = (f"{self.dp_replicate} replicas x {self.dp_shard}-way FSDP shards" if self.hybrid else
                  f"{self.dp_shard}-way FSDP shards" if self.dp_shard > 1 else "no data parallelism")
            return f"{self.tp}-way tensor parallel x {dp} ({self.world} processes)"
        if self.hybrid:
            return (f"HSDP: {self.dp_replicate} replicas x {self.dp_shard}-way FSDP shards "
                    f"({self.world} processes)")
        if self.dp_shard > 1:
            return f"FSDP over {self.dp_shard} processes"
        return f"data parallel over {self.dp_replicate} process(es)"


def mesh_for(cfg, world: int, fsdp: bool) -> Mesh | None:
    """The mesh for `world` processes (None when no size key is set). Raises ConfigError naming the sizes when
    they do not fit the number of processes."""
    sizes = given(cfg)
    if not sizes:
        return None
    check_sizes(cfg, fsdp)
    shard = sizes.get("dp_shard_size") or 1
    replicate = sizes.get("dp_replicate_size")
    tp = sizes.get("tensor_parallel_size") or 1
    cp = sizes.get("context_parallel_size") or 1
    asked = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)

    def mismatch() -> ConfigError:
        fixed = shard * (replicate or 1) * tp * cp
        exact = (shard > 1 and replicate and replicate > 1) or (not fsdp and cp == 1)
        need = f"= {fixed} processes" if exact else f"needs a multiple of {fixed} processes"
        return ConfigError(f"{asked} {need}, but this run has {world} (WORLD_SIZE): launch that many processes "
                           "(torchrun --nproc-per-node, times the nodes) or change the sizes")

    if world % (tp * cp):
        raise mismatch()
    rest = world // (tp * cp)  # the ranks of a CP x TP block share their batches
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
        return Mesh(dp_replicate=replicate or 1, dp_shard=shard, tp=tp, cp=cp)
    # dp_shard_size unset or 1: under FSDP the ranks left shard (Axolotl's fill); without FSDP they are DDP
    # replicas, and dp_replicate_size, when given, must account for all of them; tensor parallelism without
    # FSDP takes every rank (accelerate does not compose DDP replicas with it)
    if fsdp:
        return Mesh(dp_replicate=replicate or 1, dp_shard=rest, tp=tp, cp=cp)
    if (replicate and replicate > 1 or tp > 1) and rest != 1:
        raise mismatch()
    return Mesh(dp_replicate=world // (tp * cp), dp_shard=1, tp=tp, cp=cp)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parallelism_config(mesh: Mesh | None):
    """accelerate's ParallelismConfig for an HSDP mesh; None where plain FSDP/DDP over all ranks is the same,
    and with tensor parallelism, where transformers shards the model itself (load_kwargs)."""
    if mesh is None or not mesh.hybrid or mesh.tp > 1:
        return None  # (context parallel ranks shard with the data ranks: FSDP over all ranks is the same)
    try:
        from accelerate import ParallelismConfig
    except ImportError:
        import accelerate

        raise ConfigError(f"dp_replicate_size: HSDP needs accelerate's ParallelismConfig (accelerate >= 1.10; "
                          f"installed: {accelerate.__version__})") from None
    # CP ranks shard with the data ranks (torchtitan's dp_shard_cp), flattened into dp_shard
    return ParallelismConfig(dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard * mesh.cp)


def attach(accelerator, config) -> None:
    """On CPU, accelerate's constructor would refuse a ParallelismConfig (it accepts one only for GPU-like
    devices, FSDP2 or DeepSpeed, and the CPU run becomes FSDP2 only after construction, in
    trainer.parallel.distributed.use_fsdp_on_cpu): the config and its gloo device mesh are set on the state here, then
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


def load_kwargs(mesh: Mesh | None) -> dict:
    """from_pretrained arguments: with tensor parallelism, transformers' DistributedConfig loads the model already
    sharded on its (dp_replicate, fsdp, tp) mesh -- tp by the model's tp_plan, FSDP2 over the data ranks."""
    if mesh is None or mesh.tp == 1:
        return {}
    import dataclasses

    import transformers

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        DistributedConfig = None
    fields = {f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig) else set()
    if not {"tp_size", "fsdp_size", "dp_replicate_size"} <= fields:
        raise ConfigError(f"tensor_parallel_size: needs transformers' DistributedConfig with tp_size, fsdp_size and "
                          f"dp_replicate_size (transformers 5.2x; installed: {transformers.__version__})")
    return {"distributed_config": DistributedConfig(tp_size=mesh.tp, fsdp_size=mesh.dp_shard * mesh.cp,
                                                    dp_replicate_size=mesh.dp_replicate)}


def after_load(model, mesh: Mesh | None) -> None:
    """The trainer gathers and writes checkpoints itself (trainer.parallel.distributed): drop the training mesh from the
    model's config, or save_pretrained on rank 0 alone would enter transformers' distributed save (a collective)."""
    if mesh is not None and mesh.tp > 1 and hasattr(model.config, "distributed_config"):
        del model.config.distributed_config


def autocast(model, accelerator):
    """The model's forward under the run's mixed precision, as accelerate's prepare would wrap it (the tensor-
    parallel model is not passed through prepare). fp32 (CPU) runs unchanged."""
    if accelerator.mixed_precision == "no":
        return model
    import functools

    forward = model.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = wrapped
    return model
