"""A config's features and the packages they import: one ordered list, `FEATURES`.

Each `Feature` names the config keys that turn it on, the distributions the trainer imports for it (`packages`,
the modules in `imports`), a one-line description, its hardware notes and the step that imports it (training, or
a command run after it such as `export --format gguf`). `uses(cfg, plan)` says which keys of a config use it, as
a user reads them. Whatever reads "what does this config need installed" iterates this list:

- `trainer.setup.needs` (validate, the trainer's start, the resolver's plan for a config);
- the plan (resolver/launch.py `_needs`): each package is pinned in the plan, so the lock (resolver/lock.py),
  the environment it installs and the image built from it (dockerfiles/) carry it;
- the printed next steps (resolver/launch.py `next_commands`): a step whose packages the plan lacks says so.

The versions and where each package installs are facts, in matrices/packages.toml: a [[stack]] row (packages
every plan installs beside torch where their floors allow: bitsandbytes, deepspeed) or a [[package]] row (the
rest: trackers, liger-kernel, torchao, gguf ...). `pin` is the one rule that picks a [[package]] row for a plan.

The list itself is trainer/config/features.py (the config's schema and resume table read the keys its features
declare; the config's wing cannot import this module); its entries name the functions below (and functions of the
features' own modules) by `Ref`, imported when called. The same list is the trainer's one seam for a feature
(issue 30); each field is read by one place, with one signature:

- `notes(cfg, runtime, plan) -> list[str]`: what the feature becomes on this GPU (trainer.setup.feature_notes);
  raises HardwareError where the GPU cannot run it;
- `line(cfg) -> str | None`: validate's line about it (trainer/cli.py `cmd_validate`), "label: text";
- `hook(training) -> Hook | None`: its part in the training loop (trainer.hooks; trainer.train `feature_hooks`),
  None where the config does not use it; `training` is the Training: its `context` (trainer.hooks.Run: cfg, ranks,
  device, timeout, output_dir, say) and what it built (unwrapped, optimizer, tokenizer, data, runtime, sharded,
  tp); the hooks made in this list's order;
- `config`: the config keys the feature declares (name -> Key): fields of Config and rows of the resume table.

Adding a feature: its module, and one entry on the list in trainer/config/features.py (its config keys declared
there), with its row in matrices/axolotl_keys.toml where Axolotl has the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from trainer import facts
from trainer.config.features import FEATURES, Feature  # (the one list, and the type of its entries)


class Use(NamedTuple):
    """One way a config uses a feature."""

    key: str  # the config key as a user reads it ("optimizer: paged_adamw_8bit", "wandb_project: demo")
    floor: str | None = None  # its matrices/packages.toml [[feature]] row (a hardware floor), None when none


# ---------------------------------------------------------------------------- how each feature reads a config
# (imports inside these functions: the resolver reads configs where torch and most of the trainer are not
# imported, and each feature's module is imported only when asked)


def _quantized(cfg, plan) -> list[Use]:
    # start-up: trainer.model.quantization imported only when this runs
    from trainer.model import quantization

    mode = quantization.mode(cfg)
    if not mode:
        return []
    return [Use(f"{mode} (adapter: qlora)" if cfg.adapter == "qlora" else mode, quantization.MODES[mode])]


def _optimizer_of(library: str):
    def uses(cfg, plan) -> list[Use]:
        # start-up: trainer.config.training imported only when this runs
        from trainer.config.training import check_optimizer

        row = check_optimizer(cfg.optimizer)
        return [Use(f"optimizer: {cfg.optimizer}", row.get("feature"))] if row["library"] == library else []
    return uses


_bnb_optimizer, _torchao_optimizer = _optimizer_of("bitsandbytes"), _optimizer_of("torchao")


def _qat(cfg, plan) -> list[Use]:
    return [Use(f"qat ({cfg.qat.describe()})", cfg.qat.feature)] if cfg.qat is not None else []


def _bitnet(cfg, plan) -> list[Use]:
    # start-up: trainer.model.bitnet imported only when this runs
    from trainer.model import bitnet

    return [Use("use_onebitllms", bitnet.FEATURE)] if cfg.use_onebitllms else []


def _deepspeed(cfg, plan) -> list[Use]:
    return [Use(f"deepspeed: {cfg.deepspeed}")] if cfg.deepspeed else []


def _ray(cfg, plan) -> list[Use]:
    return [Use("use_ray")] if cfg.use_ray else []


def _liger(cfg, plan) -> list[Use]:
    """The liger_* keys the trainer runs through liger-kernel (trainer/model/kernels.py `plan_notes`): none where
    the plan switches triton kernels off (the CPU, AMD/Intel/Apple GPUs, GPUs below triton's floor)."""
    # start-up: trainer.model.kernels imported only when this runs
    from trainer.model import kernels

    if plan is not None and not (plan.get("features") or {}).get("liger"):
        return []
    return [Use(f"{key}: true") for key in kernels.liger_on(cfg)]


def _expert_kernels(cfg, plan) -> list[Use]:
    """SonicMoE's packages, where the plan is for a CUDA GPU its floor admits (trainer/model/expert_kernels.py);
    nothing elsewhere (the experts run grouped_mm there, with a note), nor without a plan's GPU."""
    # start-up: trainer.model.expert_kernels imported only when this runs
    from trainer.model import expert_kernels

    name, key = expert_kernels.asked(cfg)
    gpu = (plan or {}).get("gpu") or {}
    cc = gpu.get("compute_capability")
    if name != "sonicmoe" or cc is None or (plan.get("torch") or {}).get("backend", "cuda") != "cuda":
        return []
    major, minor = (int(x) for x in str(cc).split("."))
    return [Use(key, "sonicmoe_experts")] if (major, minor) >= expert_kernels.SONICMOE_FLOOR else []


def _tracker(name: str):
    def uses(cfg, plan) -> list[Use]:
        # start-up: trainer.outputs.loggers imported only when this runs
        from trainer.outputs import loggers

        return [Use(loggers.asked_by(cfg, name))] if name in loggers.wanted(cfg) else []
    return uses


_wandb, _tensorboard, _mlflow = _tracker("wandb"), _tracker("tensorboard"), _tracker("mlflow")


def _mistral(cfg, plan) -> list[Use]:
    return [Use("tokenizer_use_mistral_common: true")] if cfg.tokenizer_use_mistral_common else []


def _vllm(cfg, plan) -> list[Use]:
    """GRPO/GDPO with trl.use_vllm: true asks for a vLLM server; the plan carries vllm for it."""
    # start-up: trainer.config.grpo imported only when this runs
    from trainer.config.grpo import GENERATING_METHODS

    return [Use("trl.use_vllm: true")] if cfg.rl in GENERATING_METHODS and cfg.trl and cfg.trl.use_vllm else []


def _causal_lm_eval(cfg, plan) -> list[Use]:
    # start-up: trainer.config.training imported only when this runs
    from trainer.config.training import CAUSAL_LM_DEFAULT, SACREBLEU_METRICS

    scored = [m for m in cfg.eval_causal_lm_metrics or CAUSAL_LM_DEFAULT if m in SACREBLEU_METRICS]
    return [Use(f"do_causal_lm_eval: {', '.join(scored)}")] if cfg.do_causal_lm_eval and scored else []


def _gguf(cfg, plan) -> list[Use]:
    """The export step `next_steps` offers after a run (trainer/setup.py): every model that generates, unless its
    local config.json names a family the exporter does not write (a hub model: offered, the exporter decides)."""
    # start-up: trainer.outputs.gguf imported only when this runs
    from trainer.outputs.gguf import FAMILIES

    if cfg.objective in ("reward", "prm"):
        return []
    try:
        model_type = json.loads((Path(cfg.base_model).expanduser() / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, TypeError):
        model_type = None
    return [Use("export --format gguf (after training)")] if model_type in (None, *FAMILIES) else []


# ---------------------------------------------------------------------------- what each feature becomes on this GPU


def _quantized_notes(cfg, runtime, plan) -> list[str]:
    # start-up: trainer.model.quantization imported only when this runs
    from trainer.model import quantization

    return quantization.hardware_notes(cfg, runtime.gpu)


def _optimizer_notes(cfg, runtime, plan) -> list[str]:
    """The optimizer's [[feature]] floor (bitsandbytes' 8-bit and paged optimizers: optimizers.toml)."""
    # start-up: trainer.optim.optimizers imported only when this runs
    from trainer.optim import optimizers

    return optimizers.hardware_notes(cfg.optimizer, runtime.gpu)


def _qat_notes(cfg, runtime, plan) -> list[str]:
    # start-up: trainer.model.qat imported only when this runs
    from trainer.model import qat

    return qat.hardware_notes(cfg, runtime.gpu)  # qat dtypes' and fp8's floors


def _bitnet_notes(cfg, runtime, plan) -> list[str]:
    # start-up: trainer.model.bitnet imported only when this runs
    from trainer.model import bitnet

    return bitnet.hardware_notes(cfg, runtime.gpu, plan)  # use_onebitllms: triton kernels, so a GPU


def _fsdp_notes(cfg, runtime, plan) -> list[str]:
    # start-up: trainer.parallel.distributed imported only when this runs
    from trainer.parallel import distributed

    cpu_fsdp1 = (distributed.enabled(cfg) and runtime.device == "cpu"
                 and distributed.fsdp_settings(cfg)["fsdp_version"] == 1)
    return [distributed.CPU_FSDP1_NOTE] if cpu_fsdp1 else []


def _liger_notes(cfg, runtime, plan) -> list[str]:
    """Sets runtime.kernels: whether liger's kernels run."""
    # start-up: trainer.model.kernels imported only when this runs
    from trainer.model import kernels

    runtime.kernels, notes = kernels.plan_notes(cfg, runtime.gpu, plan)
    return notes


def _expert_kernels_notes(cfg, runtime, plan) -> list[str]:
    # start-up: trainer.model.expert_kernels imported only when this runs
    from trainer.model import expert_kernels

    note = expert_kernels.choose(cfg, runtime.gpu).note
    return [note] if note else []


# ---------------------------------------------------------------------------- validate's line about each feature


def _qat_line(cfg) -> str | None:
    return (f"qat: {cfg.qat.describe()} (torchao fake quantization; plain layers again at the end)"
            if cfg.qat is not None else None)


def _deepspeed_line(cfg) -> str | None:
    # start-up: trainer.parallel.distributed imported only when this runs
    from trainer.parallel import distributed

    return f"sharding: deepspeed {distributed.deepspeed_path(cfg.deepspeed)}" if cfg.deepspeed else None


def _fsdp_line(cfg) -> str | None:
    # start-up: trainer.parallel.distributed imported only when this runs
    from trainer.parallel import distributed

    return (f"sharding: FSDP{distributed.fsdp_settings(cfg)['fsdp_version']}"
            if distributed.enabled(cfg) and not cfg.deepspeed else None)


# ---------------------------------------------------------------------------- each feature's part in the loop


def _qat_hook(training):
    # start-up: trainer.model.qat imported only when this runs
    from trainer.model import qat

    return qat.hook(training.cfg, training.unwrapped, training.say)  # fake quantization off until N steps


def _lisa_hook(training):
    # heavy: numpy loads only when this runs
    from trainer.optim import lisa

    return lisa.hook(training.cfg, training.unwrapped, training.say)  # after the optimizer: all but a few frozen


def _relora_hook(training):
    # heavy: torch loads only when this runs
    from trainer.model import relora
    from trainer.model.load import DTYPES

    return relora.hook(training.cfg, training.unwrapped, training.optimizer, DTYPES[training.runtime.precision],
                       training.say)


def _sparsity_hook(training):
    # start-up: trainer.model.sparsity imported only when this runs
    from trainer.model import sparsity

    return sparsity.hook(training.cfg, training.unwrapped, training.say)  # the zeros kept after every step


def _diffusion_hook(training):
    # heavy: torch loads only when this runs
    from trainer.objectives import diffusion_steps

    return diffusion_steps.hook(training.context, training.unwrapped, training.tokenizer, training.data,
                                training.runtime.attention, training.sharded or training.tp > 1)


def _early_stopping_hook(training):
    # start-up: trainer.outputs.early_stopping imported only when this runs
    from trainer.outputs import early_stopping

    return early_stopping.hook(training.cfg, training.unwrapped, training.output_dir, training.say)


def _neftune_hook(training):
    # start-up: trainer.model.neftune imported only when this runs
    from trainer.model import neftune

    return neftune.hook(training.cfg, training.unwrapped)  # noise on the input embeddings while training


def _memory_options():
    # start-up: trainer.model.memory_options imported only when this runs
    from trainer.model import memory_options

    return memory_options


def _memory_notes(cfg, runtime, plan) -> list[str]:
    """Sets runtime.compile: whether torch.compile runs (raises HardwareError for torch_compile: true where the
    plan has no triton for the GPU)."""
    options = _memory_options()
    runtime.compile = bool(cfg.torch_compile) and options.compile_runs(runtime.gpu, plan)[0]
    return options.notes(cfg, runtime, plan)


def _memory_hook(training):
    return _memory_options().offload_hook(training.context)


def _memory_line(cfg) -> str | None:
    return _memory_options().line(cfg)


def _empty_cache():
    # start-up: trainer.runtime.empty_cache imported only when this runs
    from trainer.runtime import empty_cache

    return empty_cache


def _empty_cache_hook(training):
    return _empty_cache().hook(training.context)


def _empty_cache_line(cfg) -> str | None:
    return _empty_cache().line(cfg)


def hooks(training) -> list:
    """Each feature's part in the loop, in FEATURES' order (None where the config does not use it)."""
    return [f.hook(training) for f in FEATURES if f.hook is not None]


def notes(cfg, runtime, plan) -> list[str]:
    """What each feature becomes on this GPU, in FEATURES' order (raises HardwareError where it cannot run)."""
    return [note for f in FEATURES if f.notes is not None for note in f.notes(cfg, runtime, plan)]


def lines(cfg) -> list[tuple[str, str]]:
    """Validate's (label, text) for each feature the config uses."""
    found = (f.line(cfg) for f in FEATURES if f.line is not None)
    return [tuple(text.split(": ", 1)) for text in found if text]


class Need(NamedTuple):
    """A package a config's feature imports, beyond torch and the training stack's transformers."""

    key: str  # the config key that asks for it, as a user reads it ("optimizer: paged_adamw_8bit")
    package: str  # the distribution the environment must carry
    feature: str | None  # its matrices/packages.toml [[feature]] row (the hardware floor), None when it has none
    step: str = "train"  # when it is imported: "train", or "export" (a command run after training)
    name: str = ""  # the Feature's name


def needs(cfg, plan: dict | None = None) -> list[Need]:
    """Every package `cfg`'s features import, in FEATURES' order. `plan` (a plan dict): judged under it (liger
    only where the plan runs triton kernels); None: every feature the config asks for."""
    return [Need(use.key, package, use.floor, f.step, f.name)
            for f in FEATURES for use in f.uses(cfg, plan) for package in f.packages]


def used(cfg, plan: dict | None = None) -> list[tuple[Feature, list[Use]]]:
    """The features `cfg` uses, with how (for validate's report)."""
    return [(f, uses) for f in FEATURES if (uses := f.uses(cfg, plan))]


# ---------------------------------------------------------------------------- which version a plan installs


class Pin(NamedTuple):
    version: str | None  # None: no plan installs it for this target
    why: str  # the row's source, or why there is none
    extras: tuple[str, ...] = ()


def _admits(version: str, spec: str | None) -> bool:
    if not spec:
        return True
    # start-up: packaging imported only when this runs
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


BACKENDS = {"nvidia": "cuda", "amd": "rocm", "intel": "xpu", "apple": "mps", "cpu": "cpu"}  # GPU kind -> torch's


def backend_refusal(package: str, kind: str) -> str | None:
    """Why no plan installs `package` for a GPU of `kind` (nvidia, amd, intel, apple, cpu) whatever its torch and
    Python, else None (validate's check without a plan; `pin` is the plan's)."""
    rows = [r for r in facts.rows("packages", "package") if r["name"] == package]
    backend = BACKENDS[kind]
    if not rows or any(backend in r["backends"] for r in rows):
        return None
    why = rows[0].get("not_on", {}).get(backend) or f"no recorded {package} release runs on {backend}"
    return f"{package} does not install on {backend} ({why})"


def pin(package: str, plan: dict) -> Pin | None:
    """The packages.toml [[package]] row a plan takes for `package`: the newest whose `torch`, `python`, `backends`,
    `requires` (what it requires of the plan's stack: vllm's transformers range) and `cuda` (the torch build's
    CUDA major) admit the plan's. None when the package has no [[package]] rows (a [[stack]] package: the plan's
    stack row decides). Pin(None, why) when it has rows and none admits this plan: the one line the dry-run
    refuses (or, for a package of a later step, notes) with."""
    # start-up: packaging imported only when this runs
    from packaging.version import Version

    rows = sorted((r for r in facts.rows("packages", "package") if r["name"] == package),
                  key=lambda r: Version(r["version"]), reverse=True)
    if not rows:
        return None
    torch = plan["torch"]
    backend = torch.get("backend") or ("cpu" if torch.get("cuda") is None else "cuda")
    version = str(torch["version"]).split("+")[0]
    stack = plan.get("packages") or {}
    cuda = str(torch.get("cuda") or "").split(".")[0] or None
    for row in rows:
        if (backend in row["backends"] and _admits(version, row.get("torch"))
                and _admits(plan["python"], row.get("python"))
                and all(name in stack and _admits(stack[name], spec) for name, spec in row.get("requires", {}).items())
                and (row.get("cuda") is None or row["cuda"] == cuda)):
            return Pin(row["version"], row["source"], tuple(row.get("extras", ())))
    newest = rows[0]
    if backend not in newest["backends"]:
        why = newest.get("not_on", {}).get(backend) or f"no recorded {package} release runs on {backend}"
        return Pin(None, f"{package} does not install on {backend} ({why})")
    ranges = "; ".join(_row_range(r) for r in rows[:4]) + (f"; {len(rows) - 4} older" if len(rows) > 4 else "")
    needs = sorted({n for r in rows for n in r.get("requires", {})})
    beside = ", ".join([f"torch {version}" + (f" (CUDA {torch.get('cuda')})" if torch.get("cuda") else ""),
                        *(f"{n} {stack.get(n, '(none)')}" for n in needs)])
    return Pin(None, f"no recorded {package} release installs beside {beside} and Python {plan['python']} "
                     f"({ranges})")


def _row_range(row: dict) -> str:
    parts = [f"torch {row.get('torch') or 'any'}", *(f"{n}{spec}" for n, spec in row.get("requires", {}).items()),
             *([f"CUDA {row['cuda']}"] if row.get("cuda") else []), f"Python {row.get('python') or 'any'}"]
    return f"{row['version']}: {', '.join(parts)}"
