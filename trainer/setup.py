"""A run's start: load the config, run every feature's check, adapt it to the GPU.

One entry point for everything that begins a run or judges a config: ``python -m trainer validate|train|evaluate``,
the Ray Train workers (trainer/ray_launch.py) and the resolver's ``envtool train`` (which reads a config through
this reader, never a second one: ``load_config`` once, then ``fit`` against the plan it made, and ``needs`` for the
libraries the plan must carry). It imports no torch, transformers or peft unless asked to probe the GPU with
torch (no ``gpu`` and no plan), so the resolver can judge a config in an environment without the training stack.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import NamedTuple


def start(config: str | Path, gpu: str | None = None, plan: str | None = None):
    """(cfg, notes, runtime) for `config` on `gpu` (a catalog name, sm_XY or cpu), else the plan at `plan`, else the
    plan found by trainer/runtime/planfile.py's rule, else torch's probe. Raises the trainer's typed errors (ConfigError,
    HardwareError, ...) for what the config or GPU cannot do."""
    # start-up: trainer.config, trainer.config.training imported only when this runs
    from trainer.config import load_config
    from trainer.config.training import one_process_only
    from trainer.errors import ConfigError, HardwareError, TrainerError, several
    from trainer.runtime.hardware import detect

    problems: list[tuple[str, str]] = []  # every problem found, reported together (key, value, file, GPU, model)
    try:
        cfg, notes = load_config(config)
    except ConfigError as err:
        if err.config is None:  # not even read (no file, not YAML, not a mapping)
            raise
        cfg, notes, problems = err.config, [], list(err.problems)
    runtime = None
    try:
        one_process_only(cfg, processes(cfg))  # before the model loads (minutes on a real one), not after
        found_gpu, found_plan = detect(gpu, plan)
        runtime = fit(cfg, found_gpu, found_plan)
    except Exception as err:
        if not problems:
            raise
        if isinstance(err, TrainerError) and err.problems:
            problems += err.problems
        elif isinstance(err, TrainerError):
            problems.append(("hardware" if isinstance(err, HardwareError) else "config", str(err)))
        # (anything else comes from reading a config whose own problems are listed: those are the ones to fix)
    if problems:
        raise several(problems, cfg)
    return cfg, notes, runtime


def fit(cfg, gpu, plan: dict | None, model_class: bool = True):
    """The Runtime `cfg` trains with on `gpu` under `plan` (a plan dict, or None): attention, precision and tf32
    adapted with a reason for each change, the model class's attention, every feature's floor. Raises
    HardwareError where the GPU cannot do what the config pins. `model_class=False` leaves out the model class's
    attention (it imports transformers when the model's config is on this machine, and never refuses anything):
    the trainer fits it at start."""
    # start-up: trainer.model.attention, trainer.runtime.hardware imported only when this runs
    from trainer.model.attention import choose_packing
    from trainer.runtime.hardware import adapt

    runtime = adapt(cfg, gpu, plan)
    choose_packing(cfg, runtime, plan)  # varlen (cu_seqlens, no mask) or a mask, as the plan's `packing` says
    if model_class:
        from trainer.model.attention import for_model

        for_model(cfg, runtime, local_only=True)  # the backend the model's class accepts, where its config is at hand
    runtime.changes += feature_notes(cfg, runtime, plan)
    return runtime


def for_plan(cfg, plan: dict, source: str = "the plan"):
    """`fit` on the GPU a plan names, without the model class (what ``envtool train`` checks before it builds or
    starts anything, in an environment that may have no torch or transformers)."""
    # start-up: trainer.runtime.hardware imported only when this runs
    from trainer.runtime.hardware import gpu_from_plan

    return fit(cfg, gpu_from_plan(plan, source), plan, model_class=False)


def varlen_limit(cfg, torch_version: str) -> tuple[str, str] | None:
    """What torch's own varlen kernel cannot do that the config's model needs, under a plan's torch, as (what, why)
    (trainer.model.attention.varlen_limit; the model's config read from this machine's files only, None where it is
    not here): envtool's plan takes the flash-attn 2 wheel for `flash_attention: true` where that wheel does it."""
    # start-up: trainer.model.attention imported only when this runs
    from trainer.model.attention import model_varlen_limit

    return model_varlen_limit(cfg, torch_version)


def processes(cfg) -> int:
    """How many processes the run trains on: torchrun's WORLD_SIZE, or the Ray Train workers use_ray starts."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(world, cfg.ray_num_workers) if cfg.use_ray else world


def feature_notes(cfg, runtime, plan) -> list[str]:
    """What each feature (trainer/features.py `notes`: quantized loading, the optimizer, the kernels ...) becomes on
    this GPU (each floor from matrices/). Raises HardwareError where the GPU cannot do what the config asks. Sets
    runtime.kernels (liger on?)."""
    # start-up: trainer.features imported only when this runs
    from trainer import features

    notes = vendor_feature_notes(cfg, runtime, plan) if runtime.gpu.other_vendor else features.notes(cfg, runtime, plan)
    refuse_uninstallable(cfg, runtime.gpu, plan)  # (after each feature's own, more specific, refusal)
    return notes


def refuse_uninstallable(cfg, gpu, plan) -> None:
    """HardwareError naming the key where a package a feature of the config imports installs for no plan on this
    GPU's backend (matrices/packages.toml [[package]] `backends`): what `envtool train --dry-run` refuses, refused
    by validate too. Liger's kernels are left out: off where triton does not run, not refused."""
    # start-up: trainer.errors, trainer.features imported only when this runs
    from trainer.errors import HardwareError
    from trainer.features import backend_refusal, pin

    for need in needs(cfg, plan if plan is not None else {"features": {"liger": False}}):
        if need.step != "train" or (plan is not None and need.package in (plan.get("packages") or {})):
            continue
        found = pin(need.package, plan) if plan is not None and "torch" in plan else None
        why = found.why if found is not None and found.version is None else backend_refusal(need.package, gpu.kind)
        if why:
            raise HardwareError(f"{need.key} needs {need.package}, which no plan installs for {gpu.describe()}: {why}")


def vendor_feature_notes(cfg, runtime, plan) -> list[str]:
    """The libraries a config needs (`needs`) on an AMD, Intel or Apple GPU, judged by their facts rather than NVIDIA's
    compute-capability floors: a [[limit]] row that refuses the feature (bitsandbytes' 8-bit optimizers on MPS), a
    package the plan left out or the vendor cannot run (DeepSpeed on XPU), bitsandbytes without a ROCm library for
    the target; fp8, use_onebitllms (triton kernels, unverified there) refused; liger kernels off."""
    # start-up: trainer.errors, trainer.model.kernels imported only when this runs
    from trainer.errors import HardwareError
    from trainer.model import kernels
    from trainer.runtime import vendors

    gpu = runtime.gpu
    runtime.kernels = False
    notes = []
    if cfg.fp8:
        raise HardwareError(f"fp8: this trainer's float8 training path (torchao float8 linears) is not implemented "
                            f"for {gpu.describe()}, remove fp8 to train in bf16")
    if cfg.use_onebitllms:
        raise HardwareError(f"use_onebitllms: onebitllms' triton kernels are unverified on {gpu.describe()}, remove "
                            "use_onebitllms")
    packages = (plan or {}).get("packages")
    for need in (n for n in needs(cfg, plan) if n.name != "liger"):  # (liger's kernels are off here)
        refused = vendors.feature_refusal(gpu.kind, need.feature) or vendors.package_refusal(gpu.kind, need.package)
        if refused:
            raise HardwareError(f"{need.key} does not run on {gpu.describe()}: {refused}")
        if packages is not None and need.package not in packages:
            found = pin(need.package, plan)  # a [[package]] row: the plan for the config adds it, where one installs
            if found is not None and found.version is None:
                raise HardwareError(f"{need.key} needs {need.package}, which no plan installs for {gpu.describe()}: "
                                    f"{found.why}")
            if found is None:
                left = next((r for r in plan.get("reasons", []) if r.startswith(f"{need.package} left out:")), None)
                raise HardwareError(f"{need.key} needs {need.package}, which the plan for {gpu.describe()} leaves out"
                                    + (f": {left.split(': ', 1)[1]}" if left else ""))
        if need.package == "bitsandbytes" and gpu.kind == "amd":
            import importlib.metadata as md

            try:
                version = md.version("bitsandbytes")
            except md.PackageNotFoundError:
                version = (packages or {}).get("bitsandbytes")
            ok, why = vendors.bitsandbytes_covers(gpu.target, gpu.rocm, version)
            if not ok:
                raise HardwareError(f"{need.key} needs bitsandbytes' ROCm kernels, and {why}")
        notes.append(f"{need.key}: {need.package} on {gpu.describe()}")
    asked = kernels.requested(cfg)
    if asked:
        notes.append(f"{', '.join(asked)}: off on {gpu.describe()} (liger's triton kernels are unverified there; "
                     "the plan keeps them off)")
    return notes


def needs(cfg, plan: dict | None = None):
    """The packages `cfg`'s features import (trainer/features.py, one list of features; each Need has the key
    that asks, the package, its [[feature]] floor and the step that imports it). `plan`: judged under that plan
    (liger only where it runs triton kernels). The resolver asks this rather than reading the config's keys
    itself, so the plan carries what the trainer will import."""
    # start-up: trainer.features imported only when this runs
    from trainer.features import needs as feature_needs

    return feature_needs(cfg, plan)


def pin(package: str, plan: dict):
    """The version a plan installs `package` at, from matrices/packages.toml [[package]] (trainer/features.py
    `pin`); None for a [[stack]] package."""
    # start-up: trainer.features imported only when this runs
    from trainer.features import pin as feature_pin

    return feature_pin(package, plan)


CHECKPOINT_STATE = "trainer_state.json"  # trainer/outputs/checkpoint.py's STATE_FILE: a complete checkpoint has it
STOPPED = "stopped.json"  # trainer/train.py's STOPPED: left by a run a stop request ended


def earlier_checkpoints(output_dir) -> list[Path]:
    """output_dir's complete checkpoint-N directories, oldest first (the rule of trainer/outputs/checkpoint.py's
    list_checkpoints, without its torch import: the resolver asks this too)."""
    found = [p for p in Path(output_dir).glob("checkpoint-*")
             if re.fullmatch(r"checkpoint-\d+", p.name) and (p / CHECKPOINT_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def check_earlier_run(cfg) -> str | None:
    """A run into an output_dir that holds an earlier run's checkpoints continues it when the config says so
    (resume_from_checkpoint, or auto_resume_from_checkpoints: true, as Axolotl), and is refused otherwise
    (ConfigError: the newest checkpoint and the two ways forward), never started over silently beside them.
    A torchrun elastic restart (TORCHELASTIC_RESTART_COUNT above 0) and a run a signal stopped (output_dir/
    stopped.json: the same command resumes it) are the same run: not refused. Returns a note
    when output_dir holds an earlier final/ (and no checkpoint) that this run replaces."""
    # start-up: trainer.errors imported only when this runs
    from trainer.errors import ConfigError

    if cfg.resume_from_checkpoint or cfg.auto_resume_from_checkpoints:
        return None
    if (Path(cfg.output_dir) / STOPPED).exists():  # a run a signal stopped: the same command resumes it (train.py)
        return None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    found = earlier_checkpoints(cfg.output_dir)
    if found:
        newest = found[-1]
        raise ConfigError(f"output_dir {cfg.output_dir} holds {newest.name} from an earlier run, which this one would "
                          "silently start over beside: to continue it, set auto_resume_from_checkpoints: true (or "
                          f"resume_from_checkpoint: {newest}); to start over, set a new output_dir (or delete "
                          f"{cfg.output_dir})")
    if (Path(cfg.output_dir) / "final").is_dir():
        return f"output_dir {cfg.output_dir} holds final/ from an earlier run: this run replaces it at its end"
    return None


def check_inputs(cfg, model: bool = True) -> None:
    """What the run reads before it trains, checked in seconds (trainer/data/inputs.py): each dataset's file and
    first rows against its `type`, and (`model`) the hub model found here or on the Hub. Raises one error with a
    line per problem (DataError / ConfigError, exit 2). `validate` and `envtool train` (also --dry-run) call it
    before anything is built."""
    # start-up: trainer.data.inputs, trainer.errors imported only when this runs
    from trainer.data.inputs import model_problems, row_problems
    from trainer.errors import several

    problems = [("model", line) for line in (model_problems(cfg) if model else [])]
    problems += [("file", line) for line in row_problems(cfg)]
    if problems:
        raise several(problems, cfg)


class Step(NamedTuple):
    """A command to run after training, as `python -m trainer ARGS`."""

    what: str
    args: list[str]


def next_steps(cfg, config: str | Path) -> list[Step]:
    """What to run next on the run that wrote output_dir/final (README, "After training"): merge-lora for an
    adapter, export to GGUF for the families the exporter writes, chat-check where the tokenizer has a chat
    template; [] when there is no final/ here (a failed run, or another node's disk) or the model does not
    generate (a reward model)."""
    # start-up: trainer.outputs.gguf imported only when this runs
    from trainer.outputs.gguf import FAMILIES

    final = Path(cfg.output_dir) / "final"
    if not final.is_dir() or cfg.objective in ("reward", "prm"):
        return []
    config = str(config)
    steps = []
    adapter = (final / "adapter_config.json").is_file()
    if adapter:
        steps.append(Step(f"merge the adapter into {cfg.base_model}: a full model in "
                          f"{Path(cfg.output_dir) / 'merged'}", ["merge-lora", config]))
        model_config = Path(cfg.base_model).expanduser() / "config.json"
    else:
        model_config = final / "config.json"
    try:
        model_type = json.loads(model_config.read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None  # a hub base: the exporter says in one line if it does not write it
    if model_type is None or model_type in FAMILIES:
        steps.append(Step("export one GGUF file for llama.cpp / Ollama" + (" (after merge-lora)" if adapter else ""),
                          ["export", config, "--format", "gguf"]))
    template = (final / "chat_template.jinja").is_file()
    try:
        template = template or "chat_template" in json.loads((final / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        pass
    if template:
        steps.append(Step("check that the model stops at the end of a chat turn", ["chat-check", config]))
    return steps
