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
ranks), and expert_parallel_size (transformers' own expert parallelism, load_kwargs below: the experts split over
the ranks, tokens exchanged with all-to-all, the rest FSDP2-sharded; Axolotl's rule: expert_parallel_size x
context_parallel_size x dp_shard_size = the world). A size of 1 means "none" and is accepted. The sizes' rules are
checked with the config (trainer/config/parallel.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

from trainer.config.parallel import Mesh  # the sizes laid over the world (mesh_for), read with the config
from trainer.errors import ConfigError


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parallelism_config(mesh: Mesh | None):
    """accelerate's ParallelismConfig for an HSDP mesh; None where plain FSDP/DDP over all ranks is the same,
    and with tensor parallelism, where transformers shards the model itself (load_kwargs)."""
    if mesh is None or not mesh.hybrid or mesh.tp > 1:
        return None  # (context parallel ranks shard with the data ranks: FSDP over all ranks is the same)
    try:
        # heavy: accelerate loads only when this runs
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
    # heavy: torch loads only when this runs
    from torch.distributed.tensor import DTensor

    param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if param is None:
        return None
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f"mesh {dims}, placements {', '.join(repr(p) for p in param.placements)}"


def by_transformers(mesh: Mesh | None) -> bool:
    """Whether transformers shards the model as it loads (tensor or expert parallelism): accelerate then wraps
    nothing, and the optimizer alone is prepared."""
    return mesh is not None and (mesh.tp > 1 or mesh.ep > 1)


def load_kwargs(mesh: Mesh | None) -> dict:
    """from_pretrained arguments: with tensor or expert parallelism, transformers' DistributedConfig loads the model
    already sharded on its (dp_replicate, fsdp, tp) mesh -- tp by the model's tp_plan, FSDP2 over the data ranks --
    and, with expert_parallel_size, the experts split by the model's ep_plan: each rank holds num_experts / ep of
    every MoE layer (`grouped_gemm`: Shard(0) of the fused [experts, ...] tensors), and its `ep_dispatch_experts`
    forward sends each (token, expert) pair to the expert's rank with torch.distributed's all-to-all (gloo has it:
    the CPU runs use it) and the results back with a second one, both differentiable. Ranks that hold the same
    experts (efsdp = world / ep) shard them with FSDP2, whose gradient reduction divides by all data ranks."""
    if not by_transformers(mesh):
        return {}

    # heavy: transformers loads only when this runs
    import transformers

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        DistributedConfig = None
    fields = {f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig) else set()
    key, needed = (("expert_parallel_size", {"ep_size", "fsdp_size"}) if mesh.ep > 1 else
                   ("tensor_parallel_size", {"tp_size", "fsdp_size", "dp_replicate_size"}))
    if not needed <= fields:
        raise ConfigError(f"{key}: needs transformers' DistributedConfig with {', '.join(sorted(needed))} "
                          f"(transformers 5.2x; installed: {transformers.__version__})")
    if mesh.ep > 1:
        # CP ranks shard with the data ranks, as with TP below; the experts split over ep of them
        return {"distributed_config": DistributedConfig(fsdp_size=mesh.dp_shard * mesh.cp, ep_size=mesh.ep)}
    return {"distributed_config": DistributedConfig(tp_size=mesh.tp, fsdp_size=mesh.dp_shard * mesh.cp,
                                                    dp_replicate_size=mesh.dp_replicate)}


def average_plain_gradients(model, mesh: Mesh | None, world: int, rank: int, timeout_s: float) -> int:
    """Expert parallelism with an adapter: transformers' FSDP2 manages the weights it loaded (DTensors), not the LoRA
    weights peft adds afterwards, whose gradients are each rank's own. Average those over the ranks, as DDP would
    (the loss scale assumes it), in one all-reduce of one flat buffer; every rank sends the same parameters in the
    same order, a missing gradient as zeros, with a count of the ranks that had one (none anywhere: it stays None,
    and the optimizer skips it as one process would). Returns how many were averaged."""
    if mesh is None or mesh.ep == 1 or world == 1:
        return 0
    # heavy: torch loads only when this runs
    import torch
    from torch.distributed.tensor import DTensor

    from trainer.parallel.collective import reduce_sum

    params = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if not params:
        return 0
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params], dtype=params[0].dtype,
                                     device=params[0].device)])
    flat = reduce_sum(flat, "averaging the adapter's gradients (expert parallel)", rank, timeout_s)
    had = flat[-len(params):]
    offset = 0
    for p, count in zip(params, had.tolist()):
        n = p.numel()
        p.grad = (flat[offset:offset + n] / world).view_as(p).to(p.dtype).clone() if count else None
        offset += n
    return len(params)


def after_load(model, mesh: Mesh | None) -> None:
    """The trainer gathers and writes checkpoints itself (trainer.parallel.distributed): drop the training mesh from the
    model's config, or save_pretrained on rank 0 alone would enter transformers' distributed save (a collective)."""
    if by_transformers(mesh) and hasattr(model.config, "distributed_config"):
        del model.config.distributed_config
    if mesh is not None and mesh.ep > 1:
        # the experts' and the other weights' gradients live on two meshes (efsdp x ep, fsdp): DTensor says at the
        # first clip, on every rank, that their norm takes two all-reduces instead of one (speed, not results)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def autocast(model, accelerator):
    """The model's forward under the run's mixed precision, as accelerate's prepare would wrap it (the tensor- and
    expert-parallel model is not passed through prepare). fp32 (CPU) runs unchanged."""
    if accelerator.mixed_precision == "no":
        return model

    forward = model.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = wrapped
    return model
