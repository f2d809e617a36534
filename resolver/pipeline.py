"""The environment pipelines, in one place: resolve → lock → wheelhouse → install | build.

The CLI parses options into `PlanOptions` / `Sources` and calls one function here; every stage below is a
module of its own (solve, lock, wheelhouse, install, docker). The training launch (`envtool train`: reading
the config, where it runs, the launcher command, `--emit`) is resolver/launch.py, which builds its
environments through these stages. Nothing here prints except through the `say` callback the CLI passes
(stderr), so `--json` output stays clean.
"""

import os
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from .errors import BadInput, Unsatisfiable
from .plan import Plan
from .plan import image_tag


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
    # start-up: resolver.hardware, resolver.matrix imported only when this runs
    from .hardware import targets
    from .matrix import load
    from .solve import Request, solve

    m = load()
    plans = []
    for t in targets(opts.gpu or "auto", m, opts.driver):
        platform, notes = target_platform(t.gpu, t.driver, opts.platform, m), list(t.notes)
        if not opts.platform and platform != host_platform() and t.gpu.vendor != "apple":
            notes.append(f"platform: {platform} (implied: {t.gpu.describe()} comes only with an {platform} host CPU)")
        if t.gpu.vendor == "apple":  # a Mac is macOS on arm64 whatever Linux host --platform names
            if opts.platform:
                notes.append(f"platform: macOS arm64 (--platform {opts.platform} names the Linux hosts of other "
                             f"targets)")
            platform = "arm64"
        req = Request(gpu=t.gpu, driver=t.driver, python=opts.python or host_python(),
                      platform=platform, torch=opts.torch, cuda=opts.cuda,
                      flash_attn=opts.flash_attn, no_flash_attn=opts.no_flash_attn,
                      attention=m.attention_name(opts.attention),
                      target=t.label, notes=notes)
        plans.append(solve(req, m))
    pins = command_line_pins(opts)
    return [plan._replace(pinned=pins) for plan in plans] if pins else plans


def target_platform(gpu, driver: str | None, explicit: str | None, m) -> str:
    """The Linux host CPU a plan is for: --platform, else the one every catalog row of the GPU comes with (GH200,
    GB200/GB300, GB10 and Jetson come only on aarch64 hosts), else this machine's. A --platform such a GPU never
    comes with is refused, as is a Jetson on L4T (its CUDA stack runs no PyPI/PyTorch-index wheel)."""
    rows = m.gpu_rows(gpu.name, gpu.compute_capability) if gpu.is_nvidia else []
    sole = {p for g in rows for p in g.platforms}
    platform = explicit or (next(iter(sole)) if len(sole) == 1 else host_platform())
    if rows and platform not in sole:
        what = rows[0].name if len(rows) == 1 else f"every {gpu.sm} GPU ({', '.join(g.name for g in rows)})"
        raise Unsatisfiable(f"--platform {platform} with {gpu.describe()}: {what} comes only with an "
                            f"{'/'.join(sorted(sole))} host CPU (a Grace superchip or a Jetson/Spark SoC); "
                            f"leave --platform out or pass --platform {'/'.join(sorted(sole))}")
    l4t = [g for g in rows if g.l4t]
    if rows and len(l4t) == len(rows) and (driver is None or int(driver.split(".")[0]) < 580):
        raise Unsatisfiable(f"{gpu.describe()}: {l4t[0].l4t_note}")
    return platform


def command_line_pins(opts: PlanOptions) -> dict[str, str]:
    """The plan's `pinned`: the attention set on the command line, with the option that set it. The trainer then
    follows the plan's attention over its config's (a command-line option wins)."""
    if opts.attention:
        return {"attention": f"--attention {opts.attention}"}
    if opts.no_flash_attn:
        return {"attention": "--no-flash-attn"}
    return {}


def one_plan(opts: PlanOptions) -> Plan:
    plans = make_plans(opts)
    if len(plans) != 1:
        raise BadInput("this command makes one environment: give --gpu a single target")
    return plans[0]


def base_python(plan: Plan) -> str | None:
    """The Python the plan's base image brings, where it brings its own (images.toml `python`: ROCm's)."""
    # start-up: resolver.matrix imported only when this runs
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


def secrets_of(sources) -> dict:
    """The index credentials given with `sources` or in the environment (never written: see credentials.py)."""
    # start-up: resolver.credentials, resolver.lock imported only when this runs
    from .credentials import given
    from .lock import source_urls

    return given(source_urls(sources))


def lock(plan: Plan, out: Path, sources, *, wheelhouse: Path | None = None, quiet: bool = False) -> dict:
    # start-up: resolver.lock, resolver.matrix imported only when this runs
    from .lock import lock as do_lock
    from .matrix import load

    env_dir = do_lock(plan, out, sources, load(), quiet=quiet)
    result = {"out": str(env_dir), "plan": plan.to_dict()}
    if wheelhouse:
        from .wheelhouse import fill

        wheels = fill(env_dir, wheelhouse, plan.python, plan.platform, sources.ca_bundle, quiet=quiet,
                      secrets=secrets_of(sources))
        result["wheelhouse"] = {"path": str(wheelhouse.resolve()), "wheels": len(wheels)}
    return result


def install(env_dir: Path | None, venv: Path, opts: PlanOptions, sources, *, offline: bool = False,
            wheelhouse: Path | None = None, quiet: bool = False, check_imports: bool = False) -> dict:
    """Install a lock directory into a venv; without one, resolve and lock first into <venv>.lock/."""
    # start-up: resolver.install imported only when this runs
    from .install import install as do_install

    if env_dir is None:
        if opts.gpu is None:
            raise BadInput("give a lock directory (from `envtool lock`) or --gpu to resolve and lock first")
        env_dir = Path(lock(one_plan(opts), venv.parent / f"{venv.name}.lock", sources, quiet=quiet)["out"])
    return do_install(env_dir, venv, offline=offline, wheelhouse=wheelhouse, ca_bundle=sources.ca_bundle,
                      quiet=quiet, check_imports=check_imports, secrets=secrets_of(sources))


def is_interpreter_path(python: str | None) -> bool:
    """`--python 3.11` is a version; `--python /usr/bin/python3` or `--python python3` an interpreter."""
    return bool(python) and not re.fullmatch(r"\d+(\.\d+)*", python)


def install_system(python: str, env_dir: Path | None, opts: PlanOptions, sources, *, work: Path,
                   quiet: bool = False, check_imports: bool = False,
                   say: Callable[[str], None] = lambda s: None) -> dict:
    """Install a plan into an existing interpreter (a notebook's, a system Python), keeping its torch when
    doctor finds that torch right for the GPU: the plan is then made for that torch."""
    # start-up: resolver.doctor, resolver.hardware imported only when this runs
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
                          check_imports=check_imports, secrets=secrets_of(sources))
    return {**result, "lock": str(env_dir)}


# ---------------------------------------------------------------------------- build


class ImageOptions(NamedTuple):
    """What `envtool build` makes of each plan's image: its `tag` (one target only; default: the plan's tag),
    whether to `push` it, another `base_image`, a `wheelhouse` to fill and reuse, the build's `network`.
    (A NamedTuple, not a dataclass: importing dataclasses, and inspect with it, cost `resolve` ~10 ms.)"""

    tag: str | None = None
    push: bool = False
    base_image: str | None = None
    wheelhouse: Path | None = None
    network: str | None = None


def build(plans: list[Plan], sources, options: ImageOptions = ImageOptions(), *, quiet: bool = False,
          say: Callable[[str], None] = lambda s: None) -> list[dict]:
    # start-up: tempfile, resolver.docker imported only when this runs
    import tempfile

    from . import docker as images
    from .matrix import load
    from .wheelhouse import fill

    m = load()
    tag, push, base_image, wheelhouse, network = (options.tag, options.push, options.base_image, options.wheelhouse,
                                                  options.network)
    if tag is not None:  # `--tag ''` or a tag with a space: one line now, not a default tag or a failed build later
        images.check_image_reference(tag, "--tag")
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
            fill(env_dir, house, plan.python, plan.platform, sources.ca_bundle, quiet=quiet,
                 secrets=secrets_of(sources))
            images.prepare_context(plan, m, env_dir, house, Path(tmp) / "context", base_image)
            image_id = images.build(Path(tmp) / "context", name, network=network, quiet=quiet)
        if push:
            images.push(name)
        built.append({"target": plan.target, "tag": name, "id": image_id, "pushed": push})
        say(f"built {name} ({image_id[:19]}) for {plan.target}")
    return built
