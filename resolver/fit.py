"""`envtool fit CONFIG --gpu NAME`: will this training config fit the GPU's memory, and what to change if not.

The GPU comes from the resolver (a catalog name, a compute capability, or this machine's with `auto`); the config
is read by the trainer's own reader (trainer/setup.py: the same checks `python -m trainer validate` makes, and the
attention and precision the run would use on that GPU); the model's shape from its config.json only
(trainer/fit/memory_model.py); the estimate is trainer/fit/memory.py's. Nothing is downloaded but the
model's config.json, and torch is imported only to count the parameters exactly where it is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BadInput
from .errors import Unsatisfiable


@dataclass
class FitResult:
    result: dict  # the JSON object (README: `envtool fit --json`)
    model: str
    notes: list[str] = field(default_factory=list)  # what the estimate assumed or could not count
    config_notes: list[str] = field(default_factory=list)  # the config reader's notes (inert keys, changes)
    estimate: object = None  # trainer.fit.memory.Estimate, None when unknown
    reason: str | None = None  # why the verdict is unknown


def resolve_gpu(text: str, nproc: int | None):
    """(name, memory_gb, count, trainer's --gpu value) for `--gpu`."""
    # start-up: resolver.hardware, resolver.matrix imported only when this runs
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
    try:
        # start-up: trainer.config, trainer.errors imported only when this runs
        import trainer.config  # noqa: F401 (pydantic, pyyaml: the trainer's config reader)
        from trainer.errors import TrainerError
        from trainer.setup import start
    except ImportError as err:  # the trainer's config reader needs pydantic and pyyaml
        raise BadInput(f"fit reads the config with the trainer's reader, which needs {err.name} "
                       "(pip install 'envtool-llm[train]')") from None

    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(count)  # the config's parallelism sizes are checked against the processes
    from trainer.fit import memory, memory_model

    try:
        with memory_model.quiet_imports():  # the config reader may import transformers' model modules
            cfg, config_notes, runtime = start(config, gpu=trainer_gpu)

    except TrainerError as err:
        raise BadInput(str(err)) from None
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous
    try:
        found = memory.report(cfg, runtime, memory.Gpu(name, memory_gb, count))
    except memory_model.ModelConfigError as err:  # a base_model that does not exist
        raise BadInput(str(err)) from None
    except TrainerError as err:  # the parallel layout against the processes (trainer/config/parallel.py)
        raise BadInput(str(err)) from None
    from trainer.config.load import memory_options_ignored

    found.result["ignored_memory_options"] = memory_options_ignored(config_notes)  # not counted: not implemented
    return FitResult(found.result, found.model, found.notes, config_notes + list(runtime.changes), found.estimate,
                     found.reason)


# ---------------------------------------------------------------------------- where `envtool train` starts


def on_plan(cfg, runtime, config: Path, plan, processes: int):
    """The memory estimate (trainer.fit.memory.Report, the one `envtool fit` prints) for the trainer's Config
    `cfg` as it runs under `plan` (`runtime`: the trainer's adaptation to it) on the plan's GPU over `processes`
    processes. config.json from the model directory or a cache only (no network: `envtool fit` fetches it)."""
    # start-up: trainer.fit.memory_model imported only when this runs
    from trainer.fit import memory, memory_model

    gpu = memory.Gpu(plan.gpu.get("name") or plan.target, plan.gpu.get("memory_gb"), processes)
    try:
        return memory.report(cfg, runtime, gpu, local_only=True)
    except memory_model.ModelConfigError as err:  # the model is the trainer's to refuse when it loads it
        if err.bad_input:  # a config.json no model can have: bad input now, not at load time
            raise BadInput(str(err)) from None
        reason = f"the model's shape is unknown: {err}"
        return memory.Report(memory.unknown(gpu, reason), cfg.base_model, [reason], None, reason)


def loss_line(cfg) -> str:
    """`envtool train --dry-run`'s loss line: the trainer's own words (trainer/fit/memory.py loss_line)."""
    # start-up: trainer.fit.memory imported only when this runs
    from trainer.fit.memory import loss_line as trainer_loss_line

    return trainer_loss_line(cfg)


def lines(found) -> list[str]:
    """`envtool train --dry-run`'s fit lines."""
    # start-up: trainer.fit.memory imported only when this runs
    from trainer.fit.memory import cheapest, one_line

    out = [f"fit: {one_line(found)}"]
    if found.experts:  # a k-bit MoE: what its experts are stored in, and what that costs
        out.append(f"fit: {found.experts}")
    out += [f"fit: {o['text']}" for o in found.result.get("options", []) if o["on"]]  # the options this run uses
    change = cheapest(found) if found.result["verdict"] != "fits" else None
    if change:
        out.append(f"fit: cheapest change that fits: {change['text']} -> {change['peak_gb']:.1f} GB")
    if found.result["verdict"] == "does_not_fit":
        out.append("fit: `envtool train` stops here without --no-fit-check")
    return out


def check(training) -> None:
    """`envtool train` stops here, before anything is built or started, when the estimate's whole band is above
    the GPU's memory (verdict does_not_fit): one line (exit 2) with the estimate and the cheapest change that fits."""
    found = training.fit
    if found is None or found.result["verdict"] != "does_not_fit":
        return
    # start-up: trainer.fit.memory imported only when this runs
    from trainer.fit.memory import cheapest, one_line

    change = cheapest(found)
    fix = (f"cheapest change that fits: {change['text']} (-> {change['peak_gb']:.1f} GB)" if change
           else "no single change found to fit it")
    raise Unsatisfiable(f"{training.config} does not fit: {one_line(found)}; {fix}; `envtool fit "
                        f"{training.config} --gpu {training.plan.target}` shows every term; --no-fit-check trains "
                        "anyway")
