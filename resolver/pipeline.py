"""The pipelines, in one place: resolve → lock → wheelhouse → install | build | train.

The CLI parses options into `PlanOptions` / `Sources` and calls one function here; every stage below is a
module of its own (solve, lock, wheelhouse, install, docker, launch). Nothing here prints except through
the `say` callback the CLI passes (stderr), so `--json` output stays clean.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from .errors import BadInput, EnvtoolError, Unsatisfiable
from .files import write_atomic
from .plan import PLAN_FILE, Plan


class PlanOptions(NamedTuple):
    """What every plan-making command accepts (declared once, as CLI options, in cli.py)."""

    gpu: str | None = "auto"
    driver: str | None = None
    python: str | None = None  # a version "3.11" (a path means an interpreter: see install_system)
    torch: str | None = None
    cuda: str | None = None
    flash_attn: str | None = None
    no_flash_attn: bool = False
    attention: str | None = None
    platform: str | None = None


def host_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def host_platform() -> str:
    machine = os.uname().machine.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


# ---------------------------------------------------------------------------- resolve


def make_plans(opts: PlanOptions) -> list[Plan]:
    from .hardware import targets
    from .matrix import load
    from .solve import Request, solve

    m = load()
    plans = []
    for t in targets(opts.gpu or "auto", m, opts.driver):
        platform, notes = opts.platform or host_platform(), list(t.notes)
        if t.gpu.vendor == "apple":  # a Mac is macOS on arm64 whatever Linux host --platform names
            if opts.platform:
                notes.append(f"platform: macOS arm64 (--platform {opts.platform} names the Linux hosts of other "
                             f"targets)")
            platform = "arm64"
        req = Request(gpu=t.gpu, driver=t.driver, python=opts.python or host_python(),
                      platform=platform, torch=opts.torch, cuda=opts.cuda,
                      flash_attn=opts.flash_attn, no_flash_attn=opts.no_flash_attn, attention=opts.attention,
                      target=t.label, notes=notes)
        plans.append(solve(req, m))
    return plans


def one_plan(opts: PlanOptions) -> Plan:
    plans = make_plans(opts)
    if len(plans) != 1:
        raise BadInput("this command makes one environment: give --gpu a single target")
    return plans[0]


def base_python(plan: Plan) -> str | None:
    """The Python the plan's base image brings, where it brings its own (images.toml `python`: ROCm's)."""
    from .matrix import load

    row = next((b for b in load().base_images if plan.torch.variant.startswith(b.variant_prefix)), None)
    return row.python if row is not None else None


def image_plans(opts: PlanOptions, base_override: str | None = None) -> list[Plan]:
    """Plans for images: where the base image brings its own Python and --python was not given, the plan is made
    for that Python (and says so) rather than for this machine's."""
    plans = make_plans(opts)
    if opts.python or base_override:
        return plans
    out = []
    for plan in plans:
        python = base_python(plan)
        if python and python != plan.python:
            again = one_plan(opts._replace(gpu=plan.target, python=python))
            plan = again._replace(reasons=[f"python {python}: the Python of the {plan.torch.variant} base image "
                                           f"(images.toml; --python overrides)", *again.reasons])
        out.append(plan)
    return out


# ---------------------------------------------------------------------------- lock, install


def lock(plan: Plan, out: Path, sources, *, wheelhouse: Path | None = None, quiet: bool = False) -> dict:
    from .lock import lock as do_lock
    from .matrix import load

    env_dir = do_lock(plan, out, sources, load(), quiet=quiet)
    result = {"out": str(env_dir), "plan": plan.to_dict()}
    if wheelhouse:
        from .wheelhouse import fill

        wheels = fill(env_dir, wheelhouse, plan.python, plan.platform, sources.ca_bundle, quiet=quiet)
        result["wheelhouse"] = {"path": str(wheelhouse.resolve()), "wheels": len(wheels)}
    return result


def install(env_dir: Path | None, venv: Path, opts: PlanOptions, sources, *, offline: bool = False,
            wheelhouse: Path | None = None, quiet: bool = False, check_imports: bool = False) -> dict:
    """Install a lock directory into a venv; without one, resolve and lock first into <venv>.lock/."""
    from .install import install as do_install

    if env_dir is None:
        if opts.gpu is None:
            raise BadInput("give a lock directory (from `envtool lock`) or --gpu to resolve and lock first")
        env_dir = Path(lock(one_plan(opts), venv.parent / f"{venv.name}.lock", sources, quiet=quiet)["out"])
    return do_install(env_dir, venv, offline=offline, wheelhouse=wheelhouse, ca_bundle=sources.ca_bundle,
                      quiet=quiet, check_imports=check_imports)


def is_interpreter_path(python: str | None) -> bool:
    """`--python 3.11` is a version; `--python /usr/bin/python3` or `--python python3` an interpreter."""
    return bool(python) and not re.fullmatch(r"\d+(\.\d+)*", python)


def install_system(python: str, env_dir: Path | None, opts: PlanOptions, sources, *, work: Path,
                   quiet: bool = False, check_imports: bool = False,
                   say: Callable[[str], None] = lambda s: None) -> dict:
    """Install a plan into an existing interpreter (a notebook's, a system Python), keeping its torch when
    doctor finds that torch right for the GPU: the plan is then made for that torch."""
    from .doctor import diagnose, probe_python
    from .hardware import targets
    from .install import install_into
    from .matrix import load

    m = load()
    info = probe_python(python)
    kept: tuple[str, ...] = ()
    if env_dir is None:
        found = targets(opts.gpu or "auto", m, opts.driver)
        if len(found) != 1:
            raise BadInput("this command makes one environment: give --gpu a single target")
        target = found[0]
        opts = opts._replace(python=info["python"])
        torch = info.get("torch") or {}
        findings = diagnose(info, target.gpu, target.driver, m, python) if "version" in torch else []
        torch_ok = bool(findings) and not any(f.level == "error" and f.check in ("torch", "torch-cuda", "torch-backend", "arch", "driver")
                                              for f in findings)
        plan = None
        if torch_ok and not opts.torch:
            version = torch["version"].split("+")[0]
            try:
                plan = one_plan(opts._replace(torch=version, cuda=torch.get("cuda")))
                kept = ("torch",)
                say(f"keeping the installed torch {torch['version']}: doctor finds it right for {target.gpu.describe()}")
            except Unsatisfiable as e:
                say(f"not keeping torch {torch['version']}: {e}")
        elif "version" in torch:
            why = "; ".join(f.message for f in findings if f.level == "error") or "--torch was given"
            say(f"replacing the installed torch {torch['version']}: {why}")
        if plan is None:
            plan = one_plan(opts)
        env_dir = Path(lock(plan, work / "lock", sources, quiet=quiet)["out"])
    result = install_into(env_dir, python, keep=kept, no_build=m.no_build, ca_bundle=sources.ca_bundle, quiet=quiet,
                          check_imports=check_imports)
    return {**result, "lock": str(env_dir)}


# ---------------------------------------------------------------------------- build


def build(plans: list[Plan], sources, *, tag: str | None = None, push: bool = False, base_image: str | None = None,
          wheelhouse: Path | None = None, network: str | None = None, quiet: bool = False,
          say: Callable[[str], None] = lambda s: None) -> list[dict]:
    import tempfile

    from . import docker as images
    from .matrix import load
    from .plan import image_tag
    from .wheelhouse import fill

    m = load()
    if tag and len(plans) > 1:
        raise BadInput("--tag names one image: build several targets without it (tags name the architecture)")
    for plan in plans:
        images.base_image(plan, m, base_image)  # no image for this plan (XPU, MPS; a Python the base lacks): now
    images.client()  # fail now, in one line, if no engine answers
    built = []
    for plan in plans:
        name = tag or image_tag(plan)
        with tempfile.TemporaryDirectory(prefix="envtool-build-") as tmp:
            env_dir = Path(lock(plan, Path(tmp) / "env", sources, quiet=quiet)["out"])
            house = wheelhouse or Path(tmp) / "wheelhouse"
            fill(env_dir, house, plan.python, plan.platform, sources.ca_bundle, quiet=quiet)
            images.prepare_context(plan, m, env_dir, house, Path(tmp) / "context", base_image)
            image_id = images.build(Path(tmp) / "context", name, network=network, quiet=quiet)
        if push:
            images.push(name)
        built.append({"target": plan.target, "tag": name, "id": image_id, "pushed": push})
        say(f"built {name} ({image_id[:19]}) for {plan.target}")
    return built


# ---------------------------------------------------------------------------- train


def cache_dir() -> Path:
    if os.environ.get("ENVTOOL_CACHE_DIR"):
        return Path(os.environ["ENVTOOL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "envtool"


def _digest(data) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def env_key(plan: Plan) -> str:
    """What an environment built for `plan` holds: its packages, where torch and flash-attn come from, the
    Python and platform, and envtool's own code (the trainer inside it). Two plans with the same key share
    one environment; the GPU name, the reasons, the detection details and the index (a mirror) do not change
    what is installed."""
    import hashlib

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
    import hashlib

    text = plan.to_json() + "\n"
    path = cache_dir() / "plans" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}" / PLAN_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    return path


class ConfigPins(NamedTuple):
    attention: str | None  # what the config asks for, as a plan attention
    attention_key: str | None  # the config key that asked, for messages
    precision: str | None  # "bf16" | "fp16" when the config insists
    features: list[tuple[str, str]]  # (packages.toml [[feature]] name, the config key that needs it)
    ray_workers: int | None = None  # use_ray: the Ray Train workers the trainer starts itself (ray_num_workers)


ATTENTION_KEYS = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager"}
EIGHT_BIT_OPTIMIZERS = re.compile(r"(paged_)?adamw_(bnb_)?8bit|paged_adamw_32bit|.*_8bit$")


def config_pins(path: Path) -> ConfigPins:
    """What a trainer config (Axolotl keys) pins that the plan must honour: attention, precision, quantization.
    Only the keys that decide the environment are read here; the trainer validates the whole config."""
    import yaml

    if not path.is_file():
        raise BadInput(f"config file not found: {path}")
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise BadInput(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"{path}: a config is a mapping of keys (Axolotl names)")
    attention, key = None, None
    if cfg.get("attn_implementation"):
        attention, key = str(cfg["attn_implementation"]), "attn_implementation"
    else:
        for name, backend in ATTENTION_KEYS.items():
            if cfg.get(name) is True:
                attention, key = backend, name
                break
    precision = "bf16" if cfg.get("bf16") is True else "fp16" if cfg.get("fp16") is True else None
    features = []
    if cfg.get("load_in_4bit") or cfg.get("adapter") == "qlora":
        features.append(("bnb_4bit", "load_in_4bit" if cfg.get("load_in_4bit") else "adapter: qlora"))
    if cfg.get("load_in_8bit"):
        features.append(("bnb_int8_loading", "load_in_8bit"))
    if EIGHT_BIT_OPTIMIZERS.fullmatch(str(cfg.get("optimizer") or "")):
        features.append(("bnb_8bit_optimizer", f"optimizer: {cfg['optimizer']}"))
    ray_workers = None
    if cfg.get("use_ray") is True:
        workers = cfg.get("ray_num_workers")
        ray_workers = workers if isinstance(workers, int) and workers >= 1 else 1  # the trainer refuses bad counts
    return ConfigPins(attention, key, precision, features, ray_workers)


def plan_for_config(config: Path, opts: PlanOptions, for_image: bool = False) -> tuple[Plan, list[str]]:
    """The plan for training `config`: its attention, precision and quantization honoured, or refused with
    the reason. Returns the plan and one note per pin honoured. `for_image`: the run is in the plan's image, so
    the Python is the base image's where it brings its own (image_plans)."""
    from .matrix import cc_tuple, load

    pins = config_pins(config)
    notes = []
    if pins.attention and pins.attention != "xformers":  # the trainer runs xformers requests as sdpa
        if opts.attention and opts.attention != pins.attention:
            raise BadInput(f"--attention {opts.attention} contradicts {config}'s {pins.attention_key}: "
                           f"{pins.attention}; drop one")
        if pins.attention.startswith("flash_attention") and opts.no_flash_attn:
            raise BadInput(f"--no-flash-attn contradicts {config}'s {pins.attention_key}: {pins.attention}")
        opts = opts._replace(attention=pins.attention)
    try:
        plan = one_plan(opts)
        if for_image and not opts.python and base_python(plan) not in (None, plan.python):
            python = base_python(plan)
            plan = one_plan(opts._replace(python=python))
            notes.append(f"python {python}: the Python of the {plan.torch.variant} base image (--python overrides)")
    except Unsatisfiable as e:
        if pins.attention and opts.attention == pins.attention:
            raise Unsatisfiable(f"{config} asks for {pins.attention_key}: {pins.attention}, which cannot run "
                                f"here: {e}") from None
        raise
    if pins.attention:
        notes.append(f"attention {plan.attention}: as {config} asks ({pins.attention_key})")
    if pins.ray_workers:
        notes.append(f"use_ray: one trainer process, which starts {pins.ray_workers} Ray Train worker(s) on a local "
                     "Ray cluster (no torchrun; the environment needs the trainer's ray extra)")
    gpu = plan.gpu
    on_cpu = not plan.on_gpu
    nvidia = gpu.get("compute_capability") is not None
    where = "CPU" if on_cpu else f"{gpu['name']} ({plan.target_label})"
    if pins.precision == "bf16" and not on_cpu and gpu.get("bf16") is False:
        floor = "sm_80+; it only emulates it" if nvidia else "no bf16 on its matrix cores"
        raise BadInput(f"{config} sets bf16: true, but {where} has no native bf16 ({floor}): set bf16: auto "
                       f"(fp16 with loss scaling) or fp16: true")
    if pins.precision == "fp16" and on_cpu:
        raise BadInput(f"{config} sets fp16: true, which needs a CUDA GPU (fp16 autocast with loss scaling); "
                       f"the plan is for the CPU: use bf16: auto (fp32)")
    if pins.precision:
        notes.append(f"precision {pins.precision}: as {config} asks (the plan's default is {plan.precision})")
        plan = plan._replace(precision=pins.precision,
                             reasons=[*plan.reasons, f"precision {pins.precision}: set by {config}"])
    m = load()
    for name, key in pins.features:
        feature = next((f for f in m.features if f.name == name), None)
        if feature is None:
            continue
        if on_cpu and not feature.cpu:
            raise BadInput(f"{config}: {key} ({feature.reason}) needs a CUDA GPU; the plan is for the CPU")
        if nvidia and cc_tuple(gpu["compute_capability"]) < cc_tuple(feature.min_cc):
            raise BadInput(f"{config}: {key} ({feature.reason}) needs sm_{feature.min_cc.replace('.', '')}+; "
                           f"{where} is below")
        if not on_cpu and not nvidia:
            from .vendors.solve import feature_refusal

            refused = feature_refusal(plan, feature.name)
            if refused:
                raise BadInput(f"{config}: {key} does not run on {where}: {refused}")
        if feature.package not in plan.packages:
            left_out = next((r for r in plan.reasons if r.startswith(f"{feature.package} left out:")), None)
            why = left_out.split(": ", 1)[1] if left_out else f"no wheel for Python {plan.python} on {plan.platform}"
            raise Unsatisfiable(f"{config}: {key} needs {feature.package}, which the plan for {where} does not "
                                f"install ({why})")
        notes.append(f"{key}: {feature.package} {plan.packages[feature.package]} ({feature.reason})")
    return plan, notes


class Launch(NamedTuple):
    """Where and how the trainer runs: the environment, the exact command, its environment variables."""

    kind: str  # "active" | "venv" | "cached" | "image"
    path: str | None  # the environment's prefix (venv, cached) or the image tag
    ready: bool  # False: it will be built first
    python: str
    command: list[str]
    env: dict[str, str]
    why: str

    def to_dict(self) -> dict:
        return self._asdict()


def active_env_runs(plan: Plan, opts: PlanOptions) -> tuple[bool, str]:
    """Does the interpreter running envtool run the plan's choices? doctor finds nothing wrong for the plan's
    GPU, the training stack imports, the plan's flash-attn is there, and explicit pins match."""
    from .doctor import diagnose, probe
    from .hardware import targets
    from .matrix import load

    m = load()
    target = targets(opts.gpu or "auto", m, opts.driver)[0]
    info = probe(None)
    packages = info.get("packages") or {}
    missing = [n for n in ("torch", "transformers", "envtool") if not packages.get(n)]
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


def image_line(plan: Plan, opts: PlanOptions) -> str:
    """For `train --dry-run`: the image `--image` would train in (its tag and base), or why there is none."""
    from .docker import NO_IMAGE, base_image
    from .matrix import load
    from .plan import image_tag

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


def launch_command(python: str, config: str, *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                   rdzv_endpoint: str | None = None, rdzv_id: str = "envtool") -> list[str]:
    """One process for one device; torchrun (as `python -m torch.distributed.run`, the environment's own)
    for several, with a c10d rendezvous across machines."""
    train = ["-m", "trainer", "train", config]
    if nproc == 1 and nnodes == 1:
        return [python, *train]
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
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


def launcher_nproc(plan: Plan, config: Path, dist: Distribution) -> int:
    """Processes to start: default_nproc, or one for a use_ray config, whose trainer starts its Ray Train
    workers itself (torchrun around it would start that many Ray clusters)."""
    if config_pins(config).ray_workers is None:
        return default_nproc(plan, dist)
    if (dist.nproc or 1) > 1 or dist.nnodes > 1:
        raise BadInput(f"{config} sets use_ray: the trainer starts its ray_num_workers Ray Train workers itself, on "
                       "this machine; drop --nproc/--nnodes (or set use_ray: false to launch with torchrun)")
    return 1


def plan_launch(plan: Plan, config: Path, opts: PlanOptions, dist: Distribution, *, venv: Path | None,
                image: bool, isolated: bool, mounted: bool = True) -> Launch:
    """Decide where the trainer runs and the command that starts it (nothing is built or run here).
    `mounted`: the image gets the working directory at /work, so the config must be under it."""
    from .plan import image_tag

    nproc = launcher_nproc(plan, config, dist)
    rdzv_id = f"envtool-{_digest(plan.to_dict())[:8]}"
    plan_path = write_plan(plan)
    args = dict(nproc=nproc, nnodes=dist.nnodes, node_rank=dist.node_rank, rdzv_endpoint=dist.rdzv_endpoint,
                rdzv_id=rdzv_id)
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
        return Launch("image", tag, _image_exists(tag), "python", launch_command("python", inside, **args), {},
                      f"the plan's image {tag}")
    if venv is not None:
        venv = Path(os.path.abspath(venv))
        ready = (venv / "bin" / "python").exists() and venv_runs(venv, plan, opts)
        python = str(venv / "bin" / "python")
        return Launch("venv", str(venv), ready, python, launch_command(python, str(config), **args), env,
                      f"--venv {venv}" + ("" if ready else " (built for the plan first)"))
    if not isolated:
        ok, why = active_env_runs(plan, opts)
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
    from .doctor import diagnose, probe
    from .hardware import targets
    from .matrix import load

    m = load()
    target = targets(opts.gpu or "auto", m, opts.driver)[0]
    try:
        info = probe(venv)
    except EnvtoolError:
        return False
    if not (info.get("packages") or {}).get("transformers") or info.get("python") != plan.python:
        return False
    return not any(f.level == "error" for f in diagnose(info, target.gpu, target.driver, m, str(venv)))


def _image_exists(tag: str) -> bool:
    try:
        from .docker import client

        client().images.get(tag)
        return True
    except Exception:  # no engine or no image: it will be built (and a missing engine named) when needed
        return False


def prepare(launch: Launch, plan: Plan, sources, *, quiet: bool = False,
            say: Callable[[str], None] = lambda s: None) -> None:
    """Build what `launch` needs and does not have yet: the cached or named venv, or the image."""
    if launch.ready:
        return
    if launch.kind != "image":
        from .install import find_python

        find_python(plan.python)  # no interpreter for the plan's Python: one line now, not after the lock
    if launch.kind == "image":
        build([plan], sources, tag=launch.path, quiet=quiet, say=say)
        return
    venv = Path(launch.path)
    if launch.kind == "cached":
        import fcntl

        venv.parent.mkdir(parents=True, exist_ok=True)
        with open(venv.parent / f".{venv.name}.building", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # one build per key, however many launchers start at once
            if (venv / "bin" / "python").exists():
                return  # another launcher built it while this one waited
            say(f"building the environment for this plan in {venv} (once; later runs reuse it)")
            _lock_and_install(plan, venv, sources, quiet)
        return
    say(f"installing the plan into {venv}")
    _lock_and_install(plan, venv, sources, quiet)


def _lock_and_install(plan: Plan, venv: Path, sources, quiet: bool) -> None:
    from .install import install as do_install

    env_dir = Path(lock(plan, venv.parent / f"{venv.name}.lock", sources, quiet=quiet)["out"])
    do_install(env_dir, venv, ca_bundle=sources.ca_bundle, quiet=quiet)


def run(launch: Launch, plan: Plan, *, hf_cache: Path | None = None, shm_size: str = "8g",
        stdout_to_stderr: bool = False) -> int:
    """Start the trainer; its exit code is the result (its errors are already one line on stderr).
    `stdout_to_stderr` keeps envtool's stdout for its own --json result."""
    import subprocess

    if launch.kind == "image":
        from .docker import run as docker_run

        gpus = "all" if plan.on_gpu else None  # the image's plan says which devices (NVIDIA, AMD, Intel)
        return docker_run(launch.path, launch.command, gpus=gpus, shm_size=shm_size, hf_cache=hf_cache,
                          env_names=[], volumes=[f"{Path.cwd()}:/work"], workdir="/work",
                          network_mode="host" if "--rdzv-backend=c10d" in launch.command else None)
    env = {**os.environ, **launch.env}
    try:
        return subprocess.run(launch.command, env=env, stdout=sys.stderr if stdout_to_stderr else None).returncode
    except FileNotFoundError:
        raise EnvtoolError(f"cannot start {launch.command[0]}: the environment is gone; run again to rebuild it") from None
