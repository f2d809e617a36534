"""`envtool fit CONFIG --gpu NAME`: will this training config fit the GPU's memory, and what to change if not.

The GPU comes from the resolver (a catalog name, a compute capability, or this machine's with `auto`); the config
is read by the trainer's own reader (trainer/setup.py: the same checks `python -m trainer validate` makes, and the
attention and precision the run would use on that GPU); the model's shape from its config.json only
(trainer/runtime/memory_model.py); the estimate is trainer/runtime/memory.py's. Nothing is downloaded but the
model's config.json, and torch is imported only to count the parameters exactly where it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import BadInput


@dataclass
class FitResult:
    result: dict  # the JSON object (README: `envtool fit --json`)
    model: str
    notes: list[str] = field(default_factory=list)  # what the estimate assumed or could not count
    config_notes: list[str] = field(default_factory=list)  # the config reader's notes (inert keys, changes)
    estimate: object = None  # trainer.runtime.memory.Estimate, None when unknown
    reason: str | None = None  # why the verdict is unknown


def unknown(gpu: dict, reason: str) -> dict:
    return {"gpu": gpu, "unit": "GB", "peak_gb": None, "low_gb": None, "high_gb": None, "fits": None,
            "verdict": "unknown", "breakdown": {}, "suggestions": []}


def resolve_gpu(text: str, nproc: int | None):
    """(name, memory_gb, count, trainer's --gpu value) for `--gpu`."""
    from .hardware import targets
    from .matrix import load

    m = load()
    found = targets(text, m, None)
    if len(found) != 1:
        raise BadInput("fit estimates for one GPU: give --gpu a single name")
    gpu = found[0].gpu
    if gpu.is_cpu:
        raise BadInput("fit estimates GPU memory: no GPU found here; name the GPU to train on, e.g. --gpu a100-80gb"
                       if text.strip().lower() == "auto" else "fit estimates GPU memory: name a GPU, not the CPU")
    if nproc is not None and nproc < 1:
        raise BadInput("--nproc must be at least 1")
    count = nproc or (gpu.count if text.strip().lower() == "auto" else 1)
    from matrices import catalog

    row = catalog.find_gpu(gpu.name, m.gpus)
    trainer_gpu = row.name if row is not None else gpu.sm
    return gpu.name, gpu.memory_gb, count, trainer_gpu


def fit(config: Path, gpu: str = "auto", nproc: int | None = None) -> FitResult:
    name, memory_gb, count, trainer_gpu = resolve_gpu(gpu, nproc)
    gpu_json = {"name": name, "memory_gb": memory_gb, "count": count}
    try:
        import trainer.config  # noqa: F401 (pydantic, pyyaml: the trainer's config reader)
        from trainer.errors import TrainerError
        from trainer.setup import start
    except ImportError as err:  # the trainer's config reader needs pydantic and pyyaml
        raise BadInput(f"fit reads the config with the trainer's reader, which needs {err.name} "
                       "(pip install 'envtool-llm[train]')") from None
    import os

    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(count)  # the config's parallelism sizes are checked against the processes
    from trainer.runtime import memory, memory_model

    try:
        with memory_model.quiet_imports():  # the config reader may import transformers' model modules
            cfg, config_notes, runtime = start(config, gpu=trainer_gpu)

        setup = memory.setup_from(cfg, runtime, count)
    except TrainerError as err:
        raise BadInput(str(err)) from None
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous
    try:
        shape = memory_model.model_shape(cfg.base_model, revision=cfg.revision_of_model,
                                         trust_remote_code=cfg.trust_remote_code,
                                         overrides=cfg.model_config_overrides)
    except memory_model.ModelConfigError as err:
        if err.bad_input:
            raise BadInput(str(err)) from None
        reason = f"the model's shape is unknown: {err}"
        return FitResult(unknown(gpu_json, reason), cfg.base_model, [reason], config_notes, None, reason)
    est = memory.estimate(shape, setup, memory.Gpu(name, memory_gb, count))
    notes = list(est.notes)
    reason = None
    if memory_gb is None:
        reason = f"{name}'s memory is not in matrices/gpus.toml: name the GPU (e.g. --gpu a100-80gb)"
        notes.append(reason)
    return FitResult(est.to_json(), cfg.base_model, notes, config_notes + list(runtime.changes), est, reason)
