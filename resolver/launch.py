"""The training launch, `envtool train`: from a trainer config to a running trainer (or a launcher file).

1. **Read the config once**, through the trainer's own reader (`trainer.config.load_config`; pydantic and pyyaml,
   no torch): an unknown key, a bad value or a missing file is refused here, in one line, before anything slow.
2. **Plan for it** (`plan_for_config`), by one rule shared with `python -m trainer validate`: the attention the
   config asks for is asked of the solver and, where the GPU cannot run it, adapted to the fastest one that runs
   (a reason in the plan); `flash_attention: false` means no flash-attn; a command-line `--attention` /
   `--no-flash-attn` wins over the config, with a reason, and is recorded in the plan (`pinned`) so the trainer
   follows it too. Then the trainer's own adaptation runs against that plan (`trainer.setup.for_plan`): an
   explicit pin that would change the result (`bf16: true` below sm_80, `fp16: true` on the CPU, a library
   feature below its floor) is refused with the trainer's message, everything else is adapted with its note.
   The libraries the config's choices need (`trainer.setup.needs`) are checked against the plan's packages.
3. **Where it runs and how** (`plan_launch`): the active environment, a venv, the environment cached for the
   plan or the plan's image; `python -m trainer train` or torchrun; `--emit` writes a launcher (resolver/emit.py).
4. **Build what is missing and run** (`prepare`, `run`) through pipeline.py's stages. Under torchrun every rank
   leaves its error line and exit code in a per-run folder (trainer/errors.py `record`); the first failure's
   line is printed once and its exit code returned, instead of torchrun's report and exit 1.

Nothing here prints except through the `say` callback the CLI passes (stderr), so `--json` output stays clean.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from packaging.version import Version

from .errors import BadInput, EnvtoolError, Unsatisfiable
from .files import one_writer
from .files import write_atomic
from .pipeline import ImageOptions, PlanOptions, build, command_line_pins, lock, one_plan
from .pipeline import base_python
from .plan import PLAN_FILE, Plan
from .plan import image_tag

# the credentials a run reads from its environment (the Hub, wandb): passed by name into a container, taken from a
# Secret by --emit k8s; their values are never written anywhere
SECRET_KEYS = ("HF_TOKEN", "WANDB_API_KEY")

# ---------------------------------------------------------------------------- the config, read once


def read_config(config: Path):
    """(cfg, notes) from the trainer's own reader; its refusal becomes envtool's one line, same exit code."""
    # start-up: trainer.config imported only when this runs
    from trainer.config import load_config

    return _trainer_call(config, load_config, config)


def _trainer_call(config: Path, function, *args):
    # start-up: trainer.errors imported only when this runs
    from trainer.errors import TrainerError, capped

    try:
        return function(*args)
    except TrainerError as e:
        def named(text: str) -> str:
            return text if str(config) in text else f"{config}: {text}"

        error = BadInput(named(str(e))) if e.exit_code == 2 else EnvtoolError(named(str(e)))
        error.exit_code = e.exit_code
        if len(e.problems) > 1:  # several problems found in one pass: the CLI prints one line each
            error.lines = capped([named(line) for _, line in e.problems], f"{config}: ")
        raise error from None


def attention_key(cfg) -> str | None:
    """The config key that asks for an attention backend, as the user wrote it ("flash_attention: true")."""
    if cfg.attn_implementation:
        return f"attn_implementation: {cfg.attn_implementation}"
    flags = [name for name in cfg.model_fields_set if name.endswith("_attention") and getattr(cfg, name) is True]
    if flags:
        return f"{sorted(flags)[0]}: true"
    return "flash_attention: false" if cfg.flash_attention is False else None


# ---------------------------------------------------------------------------- the plan for a config


class Fitted(NamedTuple):
    """A plan for a config, what envtool says about it, and what the trainer will do under it."""

    plan: Plan
    notes: list[str]  # envtool's: the libraries the config needs, the launcher (printed as `config: ...`)
    trainer: dict  # attention, precision, tf32, packing (+ isolation: how, why) as the trainer will run them, and its notes
    runtime: Any = None  # the trainer's judgement of the config against the plan (trainer.setup.for_plan), made once


def plan_for_config(cfg, load_notes: list[str], config: Path, opts: PlanOptions) -> Fitted:
    """The plan for training `cfg` (read from `config`) with the command line's `opts`, checked by the trainer's own
    rule against that plan. Raises BadInput/Unsatisfiable, one line each, for what cannot run."""
    plan = _attention_plan(cfg, config, opts)
    plan = _join_server(cfg, config, opts, plan)
    runtime = _trainer_call(config, _fit, cfg, plan)
    if runtime.precision != plan.precision:  # the config pins it (bf16: false, fp16: true): the plan says so too
        key = "fp16: true" if cfg.fp16 else f"bf16: {str(cfg.bf16).lower()}"
        plan = plan._replace(precision=runtime.precision, reasons=[
            *plan.reasons, f"precision {runtime.precision}: {key} in {config} (the plan's default is {plan.precision})"])
    plan, notes = _needs(cfg, config, plan)
    if cfg.use_ray:
        notes.append(f"use_ray: one trainer process, which starts {cfg.ray_num_workers} Ray Train worker(s) on a "
                     "local Ray cluster (no torchrun)")
    trainer = {"attention": runtime.attention, "precision": runtime.precision, "tf32": runtime.tf32,
               "packing": runtime.packing, "isolation": runtime.isolation, "notes": [*runtime.changes, *load_notes]}
    return Fitted(plan, notes, trainer, runtime)


def _fit(cfg, plan: Plan):
    # start-up: trainer.setup imported only when this runs
    from trainer.setup import for_plan

    return for_plan(cfg, plan.to_dict(), "envtool train's plan")


def _attention_plan(cfg, config: Path, opts: PlanOptions) -> Plan:
    """Solve with the config's attention request merged into the command line's: the command line wins; the
    config's backend is asked for where the plan can install it and adapted to the solver's best where the GPU
    cannot run it; `flash_attention: false` is --no-flash-attn. The plan's reasons say which key decided."""
    # start-up: matrices.catalog, resolver.matrix imported only when this runs
    from matrices.catalog import backend_range, backend_runs_on

    from .matrix import load

    m = load()
    flash = {impl.attention for impl in m.flash_attn_impls}
    asked, key = cfg.requested_attention, attention_key(cfg)
    off = cfg.flash_attention is False
    pins = command_line_pins(opts)
    why = None  # a reason to add: which of the config and the command line decided
    ask = None  # the config's backend, asked of the solver
    if opts.attention:
        if asked and asked != opts.attention:
            why = f"{opts.attention}: --attention {opts.attention} wins over {key} in {config}"
        elif off and opts.attention in flash:
            why = f"{opts.attention}: --attention {opts.attention} wins over flash_attention: false in {config}"
    elif opts.no_flash_attn and asked in flash:
        why = f"--no-flash-attn wins over {key} in {config}"
    elif cfg.asks_flash_kernels and (flash_plan := _flash_kernels_plan(cfg, config, opts, m, key)) is not None:
        return flash_plan
    elif asked:
        backend = m.backend(asked) if asked in {b.name for b in m.attention} else None
        if backend is not None:  # the backend transformers will run for it (xformers: sdpa, nothing to install)
            ask = backend.transformers if backend.transformers in {b.name for b in m.attention} else asked
    elif off:
        opts = opts._replace(no_flash_attn=True)
        why = f"no flash-attn: flash_attention: false in {config}"
    if ask is None:
        plan = one_plan(opts)
    else:
        try:
            plan = one_plan(opts._replace(attention=ask))
            why = f"as {key} in {config} asks" + (f"; transformers runs {ask} for {asked}" if ask != asked else "")
        except Unsatisfiable as e:
            plan = one_plan(opts)  # the request was the obstacle, or this raises the real one
            backend = m.backend(ask)
            gpu = plan.gpu
            nvidia_or_cpu = gpu.get("vendor") in (None, "nvidia", "cpu")
            if nvidia_or_cpu and not backend_runs_on(backend, gpu["compute_capability"]):
                where = "the CPU" if gpu["compute_capability"] is None else \
                    f"{gpu['name']} (sm_{gpu['compute_capability'].replace('.', '')})"
                cause = f"{ask} needs {backend_range(backend)}; {where} is outside that"
            else:  # the solver's words, less its command-line framing ("--attention X with GPU: ...; use ...")
                cause = re.sub(r"; use --attention \S+$", "", re.sub(r"^(?:--\S+ \S+ )*--attention \S+ with [^:]+: ", "",
                                                                 str(e)))
            why = f"{key} in {config} -> {plan.attention}: {cause}; the fastest attention that runs here"
    reasons = list(plan.reasons)
    if ask is not None and why.startswith("as "):  # the solver's other reasons (a torch held back for the wheel) too
        reasons = [r.replace(f"--attention {ask}", f"{key} in {config}") if not r.startswith(
            (f"{plan.attention}:", f"{plan.attention} (")) else r for r in reasons]
    if why:  # the solver's attention reason speaks of the command line: say what the config did, in it or beside it
        at = next((i for i, r in enumerate(reasons) if r.startswith((f"{plan.attention}:", f"{plan.attention} ("))),
                  None)
        said = reasons[at] if at is not None else ""
        if why.startswith("as ") and f"(--attention {plan.attention}" in said:
            reasons[at] = said.replace(f"(--attention {plan.attention}", f"({why}")
        else:
            if at is not None and not pins:
                reasons[at] = said.replace("turned off by --no-flash-attn",
                                           f"turned off by flash_attention: false in {config}")
            reasons.insert(len(reasons) if at is None else at + 1,
                           f"{plan.attention}: {why}" if why.startswith("as ") else why)
    return plan._replace(reasons=reasons, pinned=pins)


def _flash_kernels_plan(cfg, config: Path, opts: PlanOptions, m, key: str) -> Plan | None:
    """`flash_attention: true` asks for FlashAttention kernels, not for one package: the plan `envtool resolve` makes
    for the same command line serves them where its packing is varlen (FA3 on Hopper, torch's own varlen_attn -- FA2's
    kernels inside torch -- or a flash-attn 2 wheel where only that runs), on the newest torch the driver allows. The
    flash-attn 2 wheel is asked for instead only where the config's model needs what torch's kernel cannot do and
    the wheel does (trainer/model/attention.py `varlen_limit`, flash_attn.toml `handles`: soft-capped logits,
    attention dropout, a sliding window on torch 2.10), and the plan says so. None where the plain plan runs no
    FlashAttention kernel (a T4; a --torch pin with neither a wheel nor varlen_attn): the caller asks for
    flash_attention_2 then, and says why it does not run."""
    # start-up: trainer.setup imported only when this runs
    from trainer.setup import varlen_limit

    plan = one_plan(opts)
    if plan.packing != "varlen":
        return None
    fa2 = m.flash_attn_impl("fa2")
    varlen = next((v for v in m.varlen if v.attention == plan.attention), None)
    limit = None
    if plan.flash_attn is None and varlen is not None:  # served by torch's own kernel: can it run this model?
        limit = _trainer_call(config, varlen_limit, cfg, plan.torch.version)
    if limit is not None and limit[0] in fa2.handles:
        try:
            held = one_plan(opts._replace(attention=fa2.attention))
        except Unsatisfiable as e:
            return _with_reason(plan, (
                f"{plan.attention}: {key} in {config} asks for FlashAttention kernels, and base_model "
                f"{cfg.base_model}: {limit[1]}; no {fa2.package} wheel installs here either ({e}), so the trainer keeps "
                f"packed rows apart by a mask"))
        reasons = [r.replace(f"--attention {fa2.attention}", f"{key} in {config}, for base_model {cfg.base_model}")
                   for r in held.reasons]
        held = held._replace(reasons=reasons, pinned=command_line_pins(opts))
        return _with_reason(held, (
            f"{fa2.attention}: {key} in {config} asks for FlashAttention kernels, and base_model {cfg.base_model} "
            f"needs what torch {plan.torch.version}'s own {varlen.name} cannot do: {limit[1]}; the {fa2.package} "
            f"wheel's kernel does ({limit[0]}), so the plan takes it and the torch it needs"))
    if plan.flash_attn is not None:
        served = f"the {plan.flash_attn.package} {plan.flash_attn.version} wheel"
    elif varlen is not None:
        served = f"torch {plan.torch.version}'s own {varlen.name} ({varlen.counts_as}'s kernels built into torch)"
    else:
        served = plan.attention
    why = (f"{plan.attention}: {key} in {config} asks for FlashAttention kernels: served by {served}, the fastest "
           f"that runs here on torch {plan.torch.version}; attn_implementation: {fa2.attention} would ask for the "
           f"{fa2.package} wheel itself")
    return _with_reason(plan, why)


def _join_server(cfg, config: Path, opts: PlanOptions, plan: Plan) -> Plan:
    """A package of a server the config runs beside training (vllm for trl.use_vllm; trainer/features.py step
    "serve") pins its torch exactly (vLLM's Requires-Dist torch==X, its kernels built for PyPI's CUDA 13 torch):
    where no recorded release fits the plan, the plan is made again on the newest torch (and CUDA major) a release
    pins whose stack and Python fit, and says so; the plan as it was where none runs here or the command line pins
    torch or CUDA (`_needs` then says which pins clash, in one line)."""
    # start-up: trainer.setup imported only when this runs
    from trainer.setup import needs, pin

    wanted = [n for n in _trainer_call(config, needs, cfg, plan.to_dict()) if n.step == "serve"]
    if not wanted or opts.torch or opts.cuda or not plan.on_gpu or plan.torch.backend != "cuda":
        return plan
    need = wanted[0]
    found = pin(need.package, plan.to_dict())
    if found is None or found.version is not None:
        return plan
    # start-up: trainer.facts imported only when this runs
    from trainer import facts

    rows = sorted((r for r in facts.rows("packages", "package") if r["name"] == need.package and r.get("torch")
                   and "cuda" in r["backends"]), key=lambda r: Version(r["version"]), reverse=True)
    tried = set()
    for row in rows:
        torch = row["torch"].lstrip("=")
        key = (torch, row.get("cuda"))
        if key in tried or not re.fullmatch(r"\d+(\.\d+)*", torch):
            continue
        tried.add(key)
        try:
            again = _attention_plan(cfg, config, opts._replace(torch=torch, cuda=row.get("cuda")))
        except EnvtoolError:
            continue
        took = pin(need.package, again.to_dict())
        if took is None or took.version is None:
            continue
        held = (f"torch {again.torch.version}+{again.torch.variant}: for {need.package} {took.version}, which "
                f"{need.key} in {config} needs (its Requires-Dist pins torch{row['torch']}"
                f"{', built for CUDA ' + row['cuda'] if row.get('cuda') else ''}); the plan without it takes torch "
                f"{plan.torch.version}+{plan.torch.variant}, which no recorded {need.package} release fits")
        mine = f"{need.package} {took.version}'s torch{row['torch']}"  # the pins were the package's, not the user's
        reasons = [r.replace(f"--torch {torch}", mine).replace(f"--cuda {row.get('cuda')}", mine)
                   for r in again.reasons]
        return again._replace(pinned=plan.pinned, reasons=[*reasons, held])
    return plan


def _with_reason(plan: Plan, why: str) -> Plan:
    """The plan with `why` after its attention reason (or at the end)."""
    reasons = list(plan.reasons)
    at = next((i for i, r in enumerate(reasons) if r.startswith((f"{plan.attention}:", f"{plan.attention} ("))), None)
    reasons.insert(len(reasons) if at is None else at + 1, why)
    return plan._replace(reasons=reasons)


def _needs(cfg, config: Path, plan: Plan) -> tuple[Plan, list[str]]:
    """The packages the config's features import (trainer/features.py, through `trainer.setup.needs`), against the
    plan's packages: noted with the version the plan installs; one of matrices/packages.toml's [[package]] rows
    (trackers, liger-kernel, torchao, gguf for the export step ...) added at the version its row gives for this
    target, or refused in one line naming the key where no row installs here; a stack package the plan left out
    for this target added back where the trainer found the config runs (DeepSpeed's ZeRO over gloo on the CPU)."""
    # start-up: trainer.setup, resolver.matrix imported only when this runs
    from trainer.setup import needs, pin

    from .matrix import load
    from .solve import hub_kernels_release, stack_for

    m = load()
    notes = []
    packages = dict(plan.packages)
    target = f"{plan.gpu['name'] if plan.on_gpu else 'the CPU'} ({plan.target_label})"
    vendor = plan.on_gpu and plan.gpu.get("compute_capability") is None  # AMD, Intel, Apple
    facts = plan.to_dict()
    for need in _trainer_call(config, needs, cfg, facts):
        feature = next((f for f in m.features if f.name == need.feature), None)
        what = f" ({feature.reason})" if feature else ""
        if vendor and need.feature:
            from .vendors.solve import feature_refusal

            refused = feature_refusal(plan, need.feature)
            if refused:
                raise Unsatisfiable(f"{config}: {need.key} does not run on {plan.gpu['name']}: {refused}")
        if need.package in packages:
            notes.append(f"{need.key}: {need.package} {packages[need.package]}{what}")
            continue
        if need.package == "kernels":  # the Hub kernels loader: the release the plan's transformers admits
            release, why = hub_kernels_release(m, packages.get("transformers"))
            if release is None:
                raise Unsatisfiable(f"{config}: {need.key} needs the kernels package: {why}")
            packages["kernels"] = release.version
            notes.append(f"{need.key}: kernels {release.version}{what}, added to the plan for this config")
            continue
        row = pin(need.package, facts)
        if row is not None:  # a [[package]] row: the plan installs it for this config, where a release installs here
            if row.version is None and need.step == "serve":  # a server beside training: the trainer runs without it
                notes.append(f"{need.key}: {need.package} not in the plan for {target}: {row.why}; the trainer "
                             f"talks to a server started elsewhere (its own environment)")
                continue
            if row.version is None and need.step != "train":  # a command after training: not offered, not refused
                notes.append(f"{need.key}: not offered, {need.package} does not install here: {row.why}")
                continue
            if row.version is None:
                raise Unsatisfiable(f"{config}: {need.key} needs {need.package}, which no plan installs for {target}: "
                                    f"{row.why}")
            packages[need.package] = row.version
            notes.append(f"{need.key}: {need.package} {row.version}{what}, added to the plan for this config")
            continue
        if vendor:
            left_out = next((r for r in plan.reasons if r.startswith(f"{need.package} left out:")), None)
            why = left_out.split(": ", 1)[1] if left_out else "envtool's plans do not install it"
            raise Unsatisfiable(f"{config}: {need.key} needs {need.package}, which the plan for "
                                f"{plan.gpu['name']} ({plan.target_label}) leaves out: {why}")
        stack = stack_for(m, plan.torch.version, plan.python)
        version = stack.packages.get(need.package) if stack else None
        if version is None:
            raise Unsatisfiable(f"{config}: {need.key} needs {need.package}, which no plan installs for {target} "
                                "(no row in matrices/packages.toml names it for this torch and Python)")
        floor = next((r for r in m.gpu_requirements if r.package == need.package), None)
        cc = plan.gpu["compute_capability"]
        if floor is not None and cc is not None:  # the plan left it out: this GPU is below the package's floor
            raise Unsatisfiable(f"{config}: {need.key} needs {need.package}, which needs sm_"
                                f"{floor.min_cc.replace('.', '')}+ ({floor.reason}); {plan.gpu['name']} is below")
        if floor is None and cc is not None:  # left out as below every floor of its features: the trainer refused
            raise Unsatisfiable(f"{config}: {need.key} needs {need.package}, which the plan for {plan.gpu['name']} "
                                "leaves out (see its reasons)")
        packages[need.package] = version  # the CPU: plans leave it out, and the trainer runs it there (ZeRO on gloo)
        notes.append(f"{need.key}: {need.package} {version}, added to the plan for this config (CPU plans leave it "
                     f"out{': ' + floor.reason if floor else ''})")
    if packages != plan.packages:
        added = [name for name in packages if name not in plan.packages]
        plan = plan._replace(packages=packages, reasons=[
            *plan.reasons, f"{', '.join(added)} added: {config} needs {'it' if len(added) == 1 else 'them'}"])
    return plan, notes


# ---------------------------------------------------------------------------- where it runs, and how


def cache_dir() -> Path:
    if os.environ.get("ENVTOOL_CACHE_DIR"):
        return Path(os.environ["ENVTOOL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "envtool"


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def env_key(plan: Plan) -> str:
    """What an environment built for `plan` holds: its packages, where torch and flash-attn come from, the
    Python and platform, and envtool's own code (the trainer inside it). Two plans with the same key share
    one environment; the GPU name, the reasons, the detection details and the index (a mirror) do not change
    what is installed."""
    # start-up: resolver.selfwheel imported only when this runs
    from .selfwheel import PACKAGES, _package_files

    code = hashlib.sha256()
    for name in PACKAGES:
        for arcname, path in _package_files(name):
            code.update(arcname.encode())
            code.update(path.read_bytes())
    return _digest({"python": plan.python, "platform": plan.platform,  # not where from: a mirror serves the same
                    "torch": [plan.torch.version, plan.torch.variant],
                    "flash_attn": plan.flash_attn.filename if plan.flash_attn else None,
                    "packages": plan.packages, "envtool": code.hexdigest()})


def write_plan(plan: Plan) -> Path:
    """This run's plan where the trainer is pointed at it (ENVTOOL_PLAN), atomically; named by its content."""
    text = plan.to_json() + "\n"
    path = cache_dir() / "plans" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}" / PLAN_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    return path


class Launch(NamedTuple):
    """Where and how the trainer runs: the environment, the exact command, its environment variables."""

    kind: str  # "active" | "venv" | "cached" | "image"
    path: str | None  # the environment's prefix (venv, cached) or the image tag
    ready: bool  # False: it will be built first
    python: str
    command: list[str]
    env: dict[str, str]
    why: str
    mounts: tuple = ()  # image: (host path, path inside, read-only) per bind mount

    def to_dict(self) -> dict:
        return self._asdict()


def _installed(package: str) -> bool:
    # start-up: importlib imported only when this runs
    import importlib.metadata as md

    try:
        return bool(md.version(package))
    except md.PackageNotFoundError:
        return False


def active_env_runs(plan: Plan, opts: PlanOptions, required: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Does the interpreter running envtool run the plan's choices? doctor finds nothing wrong for the plan's
    GPU, the training stack imports, the plan's flash-attn is there, explicit pins match, and the packages the
    config needs that the plan installs (`required`: bitsandbytes, deepspeed) are there."""
    # start-up: resolver.doctor, resolver.hardware imported only when this runs
    from .doctor import diagnose, probe
    from .hardware import targets
    from .matrix import load

    m = load()
    target = targets(opts.gpu or "auto", m, opts.driver)[0]
    info = probe(None, quick=True)
    packages = info.get("packages") or {}
    missing = [n for n in ("torch", "transformers", "envtool") if not packages.get(n)]
    missing += [n for n in required if not packages.get(n) and not _installed(n)]  # (the probe lists a few; the
    # active environment is this interpreter's, so the rest are looked up here)
    if missing:
        return False, f"the active environment lacks {', '.join(missing)}"
    if info.get("python") != plan.python:
        return False, f"the active environment runs Python {info.get('python')}, the plan is for {plan.python}"
    errors = [f for f in diagnose(info, target.gpu, target.driver, m, sys.prefix) if f.level == "error"]
    if errors:
        return False, f"doctor finds the active environment wrong for this plan: {errors[0].message}"
    if plan.flash_attn and not packages.get(plan.flash_attn.package):
        return False, f"the plan uses {plan.attention} and the active environment has no {plan.flash_attn.package}"
    torch_version = (info.get("torch") or {}).get("version", "").split("+")[0]
    if opts.torch and not (torch_version == opts.torch or torch_version.startswith(opts.torch + ".")):
        return False, f"--torch {opts.torch} and the active environment has torch {torch_version}"
    return True, f"the active environment ({sys.prefix}, torch {torch_version}) runs this plan's choices"


def launch_command(python: str, config: str, dist: Distribution, *, rdzv_id: str = "envtool",
                   trainer_args: list[str] | None = None, loopback: bool = False) -> list[str]:
    """One process for one device; torchrun (as `python -m torch.distributed.run`, the environment's own)
    for several (`dist.nproc` per machine, given), with a c10d rendezvous across machines. `trainer_args`: another `python -m trainer` command
    than `train CONFIG` (doctor --multi-gpu's `preflight ...`). `loopback` (one machine, in a container): the
    ranks meet at 127.0.0.1, not at the name torchrun finds for the host (socket.getfqdn()), which a container
    without a network (or DNS) cannot resolve (pytorch/pytorch#150532; --local-addr is pytorch#88922's)."""
    train = ["-m", "trainer", *(trainer_args or ["train", config])]
    nproc, nnodes = dist.nproc, dist.nnodes
    if nproc == 1 and nnodes == 1:
        return [python, *train]
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if nnodes == 1:
        cmd += ["--standalone", *(["--local-addr=127.0.0.1"] if loopback else [])]
    else:
        cmd += [f"--node-rank={dist.node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={dist.rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    return [*cmd, *train]


class Distribution(NamedTuple):
    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    def check(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise BadInput(f"--nproc {self.nproc}: give 1 or more processes")
        if self.nnodes < 1:
            raise BadInput(f"--nnodes {self.nnodes}: give 1 or more machines")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise BadInput(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every machine)")
        if not 0 <= self.node_rank < self.nnodes:
            raise BadInput(f"--node-rank {self.node_rank}: give 0 to {self.nnodes - 1}")
        if self.rdzv_endpoint and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", self.rdzv_endpoint):
            raise BadInput(f"--rdzv-endpoint {self.rdzv_endpoint}: use HOST:PORT")


def default_nproc(plan: Plan, dist: Distribution) -> int:
    """All the GPUs the plan counts (detected with --gpu auto), one process on the CPU."""
    if dist.nproc:
        return dist.nproc
    if not plan.on_gpu:
        return 1
    return max(int(plan.gpu.get("count") or 1), 1)


def more_processes_than_gpus(plan: Plan, dist: Distribution) -> str | None:
    """A warning for --nproc above the GPUs the plan counts on one machine (None: as many or fewer, or the CPU)."""
    gpus = max(int(plan.gpu.get("count") or 1), 1)
    if not plan.on_gpu or not dist.nproc or dist.nproc <= gpus:
        return None
    # start-up: resolver.hardware imported only when this runs
    from .hardware import NAMED_SOURCES

    named = plan.gpu.get("source") in NAMED_SOURCES
    return (f"warning: --nproc {dist.nproc} starts more processes than the {gpus} × {plan.gpu['name']} "
            f"{'named' if named else 'on this machine'}: ranks would share a GPU, which NCCL refuses (\"Duplicate GPU "
            f"detected\"); give --nproc {gpus} or fewer" + ("" if not named else
                                                           f", or name the count (--gpu \"{plan.target} x{dist.nproc}\")"))


def launcher_nproc(plan: Plan, cfg, config: Path, dist: Distribution) -> int:
    """Processes to start: default_nproc, or one for a use_ray config, whose trainer starts its Ray Train
    workers itself (torchrun around it would start that many Ray clusters)."""
    if not cfg.use_ray:
        return default_nproc(plan, dist)
    if (dist.nproc or 1) > 1 or dist.nnodes > 1:
        raise BadInput(f"{config} sets use_ray: the trainer starts its ray_num_workers Ray Train workers itself, on "
                       "this machine; drop --nproc/--nnodes (or set use_ray: false to launch with torchrun)")
    return 1


class Where(NamedTuple):
    """Where `envtool train` was asked to run the trainer: in `venv` (--venv), in the plan's `image` (--image;
    `mounted`: with the working directory at /work, so the config must be under it; k8s carries it in a ConfigMap),
    or, `isolated`, never in the active environment."""

    venv: Path | None = None
    image: bool = False
    isolated: bool = False
    mounted: bool = True


def plan_launch(plan: Plan, cfg, config: Path, opts: PlanOptions, dist: Distribution, where: Where) -> Launch:
    """Decide where the trainer runs and the command that starts it (nothing is built or run here)."""
    venv, image, isolated, mounted = where
    dist = dist._replace(nproc=launcher_nproc(plan, cfg, config, dist))
    plan_path = write_plan(plan)
    args = dict(dist=dist, rdzv_id=f"envtool-{_digest(plan.to_dict())[:8]}")
    env = {**plan.env, "ENVTOOL_PLAN": str(plan_path)}  # plan.env: what the run needs (images carry it as ENV)
    if image:
        tag = image_tag(plan)
        cwd = Path.cwd().resolve()
        if config.resolve().is_relative_to(cwd):
            inside = str(config.resolve().relative_to(cwd))
        elif mounted:
            raise BadInput(f"--image: {config} must be under the working directory (it is mounted at /work)")
        else:
            inside = str(config.resolve())
        return Launch("image", tag, _image_exists(tag, plan, _after_only(cfg, plan)), "python", launch_command("python", inside, loopback=True,
                                                                                 **args), {},
                      f"the plan's image {tag}", image_mounts(cfg, cwd) if mounted else ())
    if venv is not None:
        venv = Path(os.path.abspath(venv))
        ready = (venv / "bin" / "python").exists() and venv_runs(venv, plan, opts)
        python = str(venv / "bin" / "python")
        return Launch("venv", str(venv), ready, python, launch_command(python, str(config), **args), env,
                      f"--venv {venv}" + ("" if ready else " (built for the plan first)"))
    if not isolated:
        # start-up: trainer.setup imported only when this runs
        from trainer.setup import needs

        required = tuple(dict.fromkeys(n.package for n in needs(cfg, plan.to_dict())  # (training's; a step after
                                       if n.step == "train" and n.package in plan.packages))  # it: next_commands)
        ok, why = active_env_runs(plan, opts, required)
        if ok:
            python = sys.executable
            return Launch("active", sys.prefix, True, python, launch_command(python, str(config), **args), env, why)
    else:
        why = "--isolated"
    cached = cache_dir() / "envs" / env_key(plan)
    python = str(cached / "bin" / "python")
    ready = (cached / "bin" / "python").exists()
    return Launch("cached", str(cached), ready, python, launch_command(python, str(config), **args), env,
                  f"{why}; {'reusing' if ready else 'building'} the environment cached for this plan")


def venv_runs(venv: Path, plan: Plan, opts: PlanOptions) -> bool:
    # start-up: resolver.doctor, resolver.hardware imported only when this runs
    from .doctor import diagnose, probe
    from .hardware import targets
    from .matrix import load

    m = load()
    target = targets(opts.gpu or "auto", m, opts.driver)[0]
    try:
        info = probe(venv, quick=True)
    except EnvtoolError:
        return False
    if not (info.get("packages") or {}).get("transformers") or info.get("python") != plan.python:
        return False
    return not any(f.level == "error" for f in diagnose(info, target.gpu, target.driver, m, str(venv)))


WORKDIR = "/work"  # where `--image` mounts the working directory


def image_mounts(cfg, cwd: Path) -> tuple:
    """What `train --image` mounts: the working directory read-only at /work (the config, the data, a local model),
    and read-write only where the run writes: its output_dir and dataset_prepared_path (an absolute one outside the
    working directory at the same path). Never the home directory or a directory above it (~/.ssh, ~/.netrc, a
    docker socket would be in reach): one line before anything is built."""
    home = Path.home().resolve()
    if home == cwd or home.is_relative_to(cwd):
        raise BadInput(f"--image mounts the working directory {cwd} into the container, and it holds your home "
                       f"directory: run from the project's directory")
    mounts = [(str(cwd), WORKDIR, True)]
    for key in ("output_dir", "dataset_prepared_path"):
        value = getattr(cfg, key, None)
        if not value:
            continue
        host = (cwd / value).resolve()
        if host == cwd or home.is_relative_to(host):
            raise BadInput(f"--image: {key} {value!r} is {'the working directory' if host == cwd else 'above your home'}"
                           f"; the container may write only there: name a directory of its own")
        inside = f"{WORKDIR}/{host.relative_to(cwd)}" if host.is_relative_to(cwd) else str(host)
        mounts.append((str(host), inside, False))
    return tuple(mounts)


def _after_only(cfg, plan: Plan) -> set[str]:
    """Packages the plan carries only for a step after training (gguf for `export`): an image without them still
    trains the config."""
    # start-up: trainer.setup imported only when this runs
    from trainer.setup import needs

    found = needs(cfg, plan.to_dict())
    return {n.package for n in found if n.step != "train"} - {n.package for n in found if n.step == "train"}


def _image_exists(tag: str, plan: Plan | None = None, after_only: set[str] = frozenset()) -> bool:
    """Whether the image `tag` is there and, given `plan`, carries every package it pins for training (its
    io.envtool.plan label): an image built for another config under the same tag (without the wandb this one
    needs) is built again; one without a package only a later step uses (`after_only`: gguf) is used as it is."""
    try:
        # start-up: resolver.docker imported only when this runs
        from .docker import client, image_plan

        image = client().images.get(tag)
    except Exception:  # no engine or no image: it will be built (and a missing engine named) when needed
        return False
    if plan is None:
        return True
    built = (image_plan(image) or {}).get("packages") or {}
    return all(built.get(name) == version for name, version in plan.packages.items() if name not in after_only)


def image_line(plan: Plan, opts: PlanOptions) -> str:
    """For `train --dry-run`: the image `--image` would train in (its tag and base), or why there is none."""
    # start-up: resolver.docker, resolver.matrix imported only when this runs
    from .docker import NO_IMAGE, base_image
    from .matrix import load

    if plan.torch.backend in NO_IMAGE:
        return f"none: {NO_IMAGE[plan.torch.backend]}"
    python = base_python(plan)
    target = plan
    if python and python != plan.python and not opts.python:
        target = one_plan(opts._replace(gpu=plan.target, python=python))
    try:
        base, _ = base_image(target, load(), None)
    except BadInput as e:
        return f"none: {e}"
    return f"{image_tag(target)} (base {base}, Python {target.python}; `--image` trains in it)"


# ---------------------------------------------------------------------------- envtool train, start to end


class Training(NamedTuple):
    """Everything `envtool train` decided before building or running anything."""

    config: Path
    cfg: Any  # the trainer's Config, read once
    plan: Plan
    notes: list[str]
    trainer: dict
    launch: Launch
    fit: Any = None  # trainer.fit.memory.Report on the plan's GPU; None on the CPU

    def summary(self) -> dict:
        """The --json object (README, "Training"): plan, config, notes, trainer, environment, command, env, fit."""
        return {"plan": self.plan.to_dict(), "config": str(self.config), "notes": self.notes,
                "trainer": self.trainer, "environment": {"kind": self.launch.kind, "path": self.launch.path,
                                                         "ready": self.launch.ready, "why": self.launch.why,
                                                         **({"mounts": [{"host": h, "container": c, "read_only": r}
                                                                        for h, c, r in self.launch.mounts]}
                                                            if self.launch.kind == "image" else {})},
                "command": self.launch.command, "env": self.launch.env,
                "fit": self.fit.result if self.fit is not None else None}


def check_claim(name: str, option: str = "--pvc", kind: str = "PersistentVolumeClaim") -> str:
    """A Kubernetes object name (DNS-1123 subdomain)."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", name):
        raise BadInput(f"{option} {name!r}: a {kind} name is lower-case letters, digits, '-' and '.'")
    return name


def check_places(*, venv: Path | None, image: bool, emit: str | None, output: Path | None, pvc: str | None,
                 secret: str | None) -> None:
    """`envtool train`'s options that name where it trains or what it writes, checked together: one line for a pair
    that does not go together, before the config is read."""
    if venv is not None and image:
        raise BadInput("--venv and --image are two places to train: give one")
    if emit not in (None, "slurm", "k8s"):
        raise BadInput(f"--emit {emit!r}: choose slurm or k8s")
    if output is not None and emit is None:
        raise BadInput("-o/--output goes with --emit")
    if pvc is not None and emit != "k8s":
        raise BadInput("--pvc goes with --emit k8s (a Slurm job uses the filesystem its nodes share)")
    if secret is not None:
        if emit != "k8s":
            raise BadInput("--secret goes with --emit k8s (an sbatch script takes tokens from the environment it is "
                           "submitted from)")
        check_claim(secret, "--secret", "Secret")
    if pvc is not None:
        check_claim(pvc)


class Starting(NamedTuple):
    """What follows the plan: `fit_check` stops (exit 2) where the estimate says the run does not fit the plan's GPU
    (resolver/fit.py `check`); `starting`: the run starts next, not a dry run (`--gpu cpu` then trains on this
    machine: its model must be found here, as for a detected GPU)."""

    fit_check: bool = False
    starting: bool = False


def plan_training(config: Path, opts: PlanOptions, dist: Distribution, *, venv: Path | None = None,
                  image: bool = False, isolated: bool = False, emit: str | None = None,
                  then: Starting = Starting()) -> Training:
    """Read the config, plan for it, check it against the plan and decide where and how it runs: everything that
    can refuse, in seconds, before anything is built, pulled or started (also what --dry-run shows). The config is
    judged against the plan once (`plan_for_config`, the trainer's `for_plan`): the dry run's report, the memory
    estimate and the launch all read that one judgement. `then`: what follows (Starting)."""
    if emit is None:
        dist.check()
    cfg, load_notes = read_config(config)
    if emit and cfg.use_ray:
        raise BadInput(f"--emit {emit}: {config} sets use_ray, which starts its workers through a local Ray cluster; "
                       "these launchers run torchrun: set use_ray: false for them")
    fitted = plan_for_config(cfg, load_notes, config, opts)
    if emit is None:  # what the run reads first, found here; the model only for this machine's plan (no GPU named)
        # start-up: matrices.catalog, trainer.setup imported only when this runs
        from matrices.catalog import NAMED_GPU_SOURCES
        from trainer.setup import check_inputs

        here = ((opts.gpu or "auto") == "auto" and fitted.plan.gpu.get("source") not in NAMED_GPU_SOURCES) \
            or (then.starting and (opts.gpu or "").strip().lower() == "cpu" and not image)  # a CPU run starting here
        _trainer_call(config, check_inputs, cfg, here)
    if (image or emit == "k8s") and not opts.python:  # in the plan's image: the Python of its base, where it has one

        python = base_python(fitted.plan)
        if python and python != fitted.plan.python:
            fitted = plan_for_config(cfg, load_notes, config, opts._replace(python=python))
            fitted = fitted._replace(notes=[f"python {python}: the Python of the {fitted.plan.torch.variant} base "
                                            f"image (--python overrides)", *fitted.notes])
    launch = plan_launch(fitted.plan, cfg, config, opts, dist, Where(venv, image or emit == "k8s", isolated,
                                                                     mounted=emit != "k8s"))  # k8s: in a ConfigMap
    if launch.kind in ("venv", "cached") and not launch.ready:  # no interpreter for the plan's Python: one line
        from .install import find_python                       # now (also --dry-run), not after "training in"

        find_python(fitted.plan.python)
    crowded = more_processes_than_gpus(fitted.plan, dist)
    if crowded:
        fitted = fitted._replace(notes=[*fitted.notes, crowded])
    if emit is None:  # checkpoints of an earlier run in output_dir: continued when the config says so, else refused
        from trainer.setup import check_earlier_run

        earlier = _trainer_call(config, check_earlier_run, cfg)
        if earlier:
            fitted = fitted._replace(notes=[*fitted.notes, earlier])
    fit = None
    if fitted.plan.on_gpu:  # the memory estimate on the plan's GPU (resolver/fit.py; `envtool train` stops on it)
        from .fit import on_plan

        fit = _trainer_call(config, on_plan, cfg, fitted.runtime, config, fitted.plan,
                            launcher_nproc(fitted.plan, cfg, config, dist) * dist.nnodes)  # the trainer's refusals
    training = Training(config, cfg, fitted.plan, fitted.notes, fitted.trainer, launch, fit)
    if then.fit_check:
        from .fit import check

        check(training)  # does_not_fit: exit 2 before anything is built or started
    return training


def train_in(training: Training, sources, *, hf_cache: Path | None = None, quiet: bool = False,
             say: Callable[[str], None] = lambda s: None) -> tuple[int, list[dict]]:
    """Build what the launch needs and run the trainer: (its exit code, the next commands for a finished run). The
    next commands are said too, unless `quiet` (--json: the caller prints them in its result)."""
    # start-up: shlex imported only when this runs
    import shlex

    launch = training.launch
    for note in training.notes:
        say(f"config: {note}")
    say(f"envtool: training in {launch.kind} environment {launch.path or ''} ({launch.why})")
    prepare(launch, training.plan, sources, quiet=quiet, say=say)
    say(f"envtool: {shlex.join(launch.command)}")
    code = run(launch, training.plan, hf_cache=hf_cache, stdout_to_stderr=quiet)
    steps = next_commands(training) if code == 0 else []
    if steps and not quiet:
        say("envtool: next, for this run (docs/guides/after-training.md):")
        for step in steps:
            say(f"  {shlex.join(step['command'])}    # {step['what']}")
    return code, steps


def prepare(launch: Launch, plan: Plan, sources, *, quiet: bool = False,
            say: Callable[[str], None] = lambda s: None) -> None:
    """Build what `launch` needs and does not have yet: the cached or named venv, or the image."""
    if launch.ready:
        return
    if launch.kind == "image":
        build([plan], sources, ImageOptions(tag=launch.path), quiet=quiet, say=say)
        return
    venv = Path(launch.path)
    if launch.kind == "cached":
        # one build per key, however many launchers start at once; the others wait, naming the builder's pid
        with one_writer(venv, "the environment cached for this plan", suffix="building"):  # (on stderr, even --json)
            if (venv / "bin" / "python").exists():
                return  # another launcher built it while this one waited
            say(f"building the environment for this plan in {venv} (once; later runs reuse it)")
            _lock_and_install(plan, venv, sources, quiet)
        return
    say(f"installing the plan into {venv}")
    _lock_and_install(plan, venv, sources, quiet)


def _lock_and_install(plan: Plan, venv: Path, sources, quiet: bool) -> None:
    # start-up: resolver.install imported only when this runs
    from .install import install as do_install

    env_dir = Path(lock(plan, venv.parent / f"{venv.name}.lock", sources, quiet=quiet)["out"])
    do_install(env_dir, venv, ca_bundle=sources.ca_bundle, quiet=quiet)


def run(launch: Launch, plan: Plan, *, hf_cache: Path | None = None, shm_size: str = "8g",
        stdout_to_stderr: bool = False) -> int:
    """Start the trainer; its exit code is the result (its errors are already one line on stderr).
    `stdout_to_stderr` keeps envtool's stdout for its own --json result."""
    # start-up: subprocess, trainer.errors imported only when this runs
    import subprocess

    from trainer.errors import ERROR_DIR_ENV

    if launch.kind == "image":
        import tempfile

        from .docker import RunOptions
        from .docker import run as docker_run

        for host, _, read_only in launch.mounts:
            if not read_only:
                Path(host).mkdir(parents=True, exist_ok=True)  # the user's own, before docker would make it root's
        options = RunOptions(
            gpus="all" if plan.on_gpu else None,  # the image's plan says which devices (NVIDIA, AMD, Intel)
            shm_size=shm_size, hf_cache=hf_cache, workdir=WORKDIR, mounts=launch.mounts,
            env_names=tuple(name for name in SECRET_KEYS if os.environ.get(name)),  # by name: docker reads the values
            network_mode="host" if "--rdzv-backend=c10d" in launch.command else None)
        if "torch.distributed.run" not in launch.command:
            return docker_run(launch.path, launch.command, options)
        # several processes in the container: their error lines come back through a mounted folder (HeldReport)
        with tempfile.TemporaryDirectory(prefix="envtool-run-") as folder:
            report = HeldReport(folder, sys.stdout)
            code = docker_run(launch.path, launch.command, replace(
                options, mounts=(*launch.mounts, (folder, ERRORS_AT, False)), environment={ERROR_DIR_ENV: ERRORS_AT}),
                output=report.line)
            return report.result(code)

    env = {k: v for k, v in {**os.environ, **launch.env}.items() if k != ERROR_DIR_ENV}  # one process prints its own
    stdout = sys.stderr if stdout_to_stderr else None
    try:
        if "torch.distributed.run" in launch.command:
            return run_torchrun(launch.command, env, stdout)
        proc = subprocess.Popen(launch.command, env=env, stdout=stdout, start_new_session=True)
        with forwarding_to(proc, workers=False):
            return died_of_a_signal(proc.wait())
    except FileNotFoundError:
        raise EnvtoolError(f"cannot start {launch.command[0]}: the environment is gone; run again to rebuild it") from None


def next_commands(training: Training) -> list[dict]:
    """What to run after a finished run (README, "After training"), as commands for where it trained: the
    environment's own python, or `envtool run` in the plan's image with the working directory at /work. Each
    {"what", "command"}; [] when this machine holds no output_dir/final (a failed run, another node's disk)."""
    # start-up: trainer.setup imported only when this runs
    from trainer.setup import needs, next_steps

    launch = training.launch
    config = launch.command[launch.command.index("train") + 1]  # the config as the trainer was given it
    steps = _trainer_call(training.config, next_steps, training.cfg, config)
    # a step whose packages (trainer/features.py: gguf for `export`) the plan does not install is not printed: it
    # would exit 2 in this environment ("gguf package is not installed")
    after = [n for n in _trainer_call(training.config, needs, training.cfg, training.plan.to_dict()) if n.step != "train"]
    lacking = {n.step for n in after if n.package not in training.plan.packages}
    steps = [step for step in steps if step.args[0] not in lacking]
    if launch.kind == "active":  # the active environment was judged on training's packages only: say what to add
        missing = {}
        for n in after:  # (a package the plan leaves out: its step is not printed, above; vllm's server is no step)
            if n.package in training.plan.packages and not _installed(n.package):
                missing.setdefault(n.step, []).append(f"{n.package}=={training.plan.packages[n.package]}")
        steps = [step._replace(what=f"{step.what} (this environment lacks {', '.join(missing[step.args[0]])}: "
                                    f"pip install {' '.join(missing[step.args[0]])} first)")
                 if step.args[0] in missing else step for step in steps]
    if launch.kind == "image":
        prefix = ["envtool", "run", "--image", launch.path, "-v", f"{Path.cwd().resolve()}:/work", "-w", "/work",
                  "--", "python"]
    else:
        prefix = [launch.python]
    return [{"what": step.what, "command": [*prefix, "-m", "trainer", *step.args]} for step in steps]


ERRORS_AT = "/envtool-errors"  # in the container: where its ranks record their error lines
# What a scheduler or a user sends to stop a run; forwarded to every trainer process (trainer/runtime/stop.py).
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
# torchrun's own handling, for when it is signalled itself (Slurm signals a job step's processes; `kill` on it):
# SIGUSR1 forwarded too (not in its default list: it would die of it and orphan its workers), and time to save.
TORCHRUN_ENV = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "PET_SHUTDOWN_TIMEOUT": "600"}


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; empty elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and int(fields[1]) == pid:
            found.append(int(entry.parent.name))
    return found


def _is_worker(pid: int) -> bool:
    try:
        return any(v.startswith(b"LOCAL_RANK=") for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return False


SIGNAL_WHY = {"SIGKILL": "the kernel's out-of-memory killer sends it when the machine runs out of memory (`dmesg` "
                         "says; a smaller micro_batch_size or sequence_len, or `envtool fit CONFIG`, helps), as does "
                         "a scheduler past its time limit",
              "SIGBUS": "a file mapped into memory was cut short or its disk went away (a truncated compiled "
                        "extension, e.g. a DeepSpeed op: delete its build folder and run again)",
              "SIGSEGV": "a crash in compiled code (a library built for another torch or CPU)",
              "SIGABRT": "a library aborted (its own message is above)"}


def died_of_a_signal(code: int) -> int:
    """A trainer process's exit status as a scheduler reads it: a death by signal N (Popen's -N) becomes 128 + N, as
    a shell reports it (137 for SIGKILL), with one line naming the signal and its likely cause; other codes pass."""
    if code >= 0:
        return code
    # start-up: signal imported only when this runs
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = SIGNAL_WHY.get(name, "sent by another process or the system")
    print(f"envtool: error: the trainer was killed by {name} ({why}); exit {128 - code}", file=sys.stderr, flush=True)
    return 128 - code


def forwarding_to(proc, workers: bool):
    """While the trainer runs: SIGTERM, SIGUSR1 and SIGINT to envtool go to every trainer process, never orphaning
    them (resolver/forwarding.py, the one forwarder; docker.py's container runs use it too). The trainer runs in its
    own session, so a Ctrl-C at the terminal reaches it once, through here (the terminal's SIGINT would otherwise
    reach it too, and a second SIGINT means "stop at once"); a SIGHUP (the terminal closed) is passed on as SIGTERM,
    as the session no longer carries it. Under torchrun (`workers`) the signal goes to its workers directly -- each
    rank stops after the same step, saves and exits 138/130, and torchrun ends when they have -- or to torchrun
    itself before they exist (it forwards it)."""
    # start-up: resolver.forwarding imported only when this runs
    from .forwarding import forwarding

    def send(number: int) -> None:
        # start-up: signal imported only when this runs
        import signal

        if number == signal.SIGHUP:  # the terminal went away: the trainer (in its own session) stops as on SIGTERM
            number = signal.SIGTERM
        targets = [pid for pid in _children(proc.pid) if _is_worker(pid)] if workers else []
        for pid in targets or [proc.pid]:
            try:
                os.kill(pid, number)
            except ProcessLookupError:
                pass

    return forwarding((*STOP_SIGNALS, "SIGHUP"), send)


# torchrun's own log lines (glog format: level, date, time, pid, file:line]).
TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


class HeldReport:
    """The output of a multi-process run, line by line, so that a trainer's failure reads as it does in one
    process: every rank records its error line and exit code in `folder` (ENVTOOL_ERROR_DIR, trainer/errors.py)
    instead of printing it; once one has, torchrun's own lines (its failure report: a log line, a traceback, a
    ChildFailedError table) are held back. `result` prints the first failure's line once and returns its exit code;
    a failure no rank recorded (a crash, a signal) shows torchrun's report as it was, with torchrun's exit code."""

    def __init__(self, folder: str | Path, out=None):
        self.folder, self.out, self.held = Path(folder), out or sys.stderr, []

    def line(self, line: str) -> None:
        if self.held or (TORCHRUN_LOG.match(line) and any(self.folder.iterdir())):
            self.held.append(line)  # after a rank reported its error, the rest is torchrun's report
            return
        self.out.write(line)
        self.out.flush()

    def result(self, code: int) -> int:
        records = []
        for path in self.folder.glob("rank-*.json"):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        if code != 0 and records:
            first = min(records, key=lambda r: (r.get("time", 0), r.get("rank", 0)))
            print(first["line"], file=sys.stderr, flush=True)
            return int(first["exit_code"])
        self.out.writelines(self.held)
        self.out.flush()
        return code


def run_torchrun(command: list[str], env: dict, stdout) -> int:
    """Run torchrun here with its output through HeldReport: the first failing rank's line and exit code."""
    # start-up: subprocess, tempfile imported only when this runs
    import subprocess
    import tempfile

    from trainer.errors import ERROR_DIR_ENV

    # torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset, with a 3-line banner saying so: the same, quietly
    env = {"OMP_NUM_THREADS": "1", **TORCHRUN_ENV, **env}
    with tempfile.TemporaryDirectory(prefix="envtool-run-") as folder:
        report = HeldReport(folder)
        proc = subprocess.Popen(command, env={**env, ERROR_DIR_ENV: folder}, stdout=stdout, stderr=subprocess.PIPE,
                                start_new_session=True)
        with forwarding_to(proc, workers=True):
            try:
                # newline="": a progress bar's \r-ended updates pass at once, as lines of their own
                for line in io.TextIOWrapper(proc.stderr, errors="replace", newline=""):
                    report.line(line)
            finally:
                code = proc.wait()
        return report.result(died_of_a_signal(code))
