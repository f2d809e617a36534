"""envtool lock / export: a self-contained project directory that pins a plan, locked by uv.

The directory holds `pyproject.toml` (the plan's pins and where each package comes from), `uv.lock` (uv's
resolution, with hashes), `plan.json` and `wheels/envtool_llm-*.whl` (the bundled trainer and `envtool doctor`).
We choose constraints and sources; uv resolves. Nothing is built from source that must not be: the plan's
CUDA packages are listed under uv's `no-build-package`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from packaging.version import InvalidVersion, Version

from . import DISTRIBUTION, selfwheel
from .credentials import auth_for, given, lock_indexes, strip, uv_index_env
from .errors import BadInput
from .matrix import Matrix
from .matrix import load as load_matrix
from .plan import PLAN_FILE, PYPI_SIMPLE, Plan
from .uvrun import MissingWheel, run_uv, tls_verify, uv_env



class Sources(NamedTuple):
    """Where packages come from; every public URL can be replaced (mirrors, air-gapped sites, tests)."""

    index_url: str | None = None  # replaces PyPI
    extra_index_urls: tuple[str, ...] = ()
    torch_index: str | None = None  # replaces the PyTorch index of the plan's variant
    find_links: tuple[str, ...] = ()
    ca_bundle: str | None = None


def source_urls(sources: Sources) -> list[str | None]:
    """The URLs of `sources` that may carry credentials (kept in memory only; see credentials.py)."""
    return [sources.index_url, *sources.extra_index_urls, sources.torch_index]


def target_marker(plan: Plan) -> str:
    if plan.torch.backend == "mps":
        return "sys_platform == 'darwin' and platform_machine == 'arm64'"
    return f"sys_platform == 'linux' and platform_machine == '{plan.platform}'"


def torch_triton(plan: Plan) -> str | None:
    """The triton distribution a ROCm / XPU torch requires from its own index (pytorch-triton-rocm, triton-xpu,
    ...; rocm.toml / intel.toml [[triton]]), where the plan names one."""
    if plan.torch.backend not in ("rocm", "xpu"):
        return None
    # start-up: resolver.vendors imported only when this runs
    from .vendors import load

    row = load().triton_package(plan.gpu.get("vendor"), plan.torch.version)
    return row.package if row is not None and row.package in plan.packages else None


def requirements(plan: Plan, m: Matrix | None = None) -> list[str]:
    """What the environment asks for: envtool itself (trainer, doctor) and every package the plan pins, the
    packages a config's features import included (a plan for a config carries them: resolver/launch.py `_needs`),
    each with the extras its packages.toml [[package]] row names (ray[train]).
    triton is left to torch's own pin (torch 2.14+ pins it as `~=`); a ROCm / XPU torch's triton is named
    without a version (torch pins it) so that it can be taken from the torch index: uv routes direct
    dependencies only."""
    if m is None:
        m = load_matrix()
    refuse_clashes(plan, m)
    extras = {p.name: p.extras for p in m.packages if p.extras}
    extras.update(flash_attn_extras(plan, m))
    routed = torch_triton(plan)
    pins = [name if name == routed else f"{name}{_extras(extras.get(name))}=={version}"
            for name, version in plan.packages.items() if name != "triton"]
    return [f"{DISTRIBUTION}[train]", *pins]


def refuse_clashes(plan: Plan, m: Matrix) -> None:
    """BadInput where two flash-attn implementations the plan pins install the same import path (flash_attn.toml
    [[impl]] `owns`): flash-attn 2 and flash-attn-4 both write flash_attn/cute, and whichever installs last wins."""
    owners = [i for i in m.flash_attn_impls if i.package in plan.packages and i.owns]
    for a, b in ((a, b) for n, a in enumerate(owners) for b in owners[n + 1:]):
        shared = sorted(set(a.owns) & set(b.owns))
        if shared:
            raise BadInput(f"the plan pins both {a.package} {plan.packages[a.package]} and {b.package} "
                           f"{plan.packages[b.package]}, which both install {shared[0]} (their wheels' file lists: "
                           f"flash_attn.toml [[impl]] owns): one environment takes one of them; plan with "
                           f"--attention {a.attention} or --attention {b.attention}")


def flash_attn_extras(plan: Plan, m: Matrix) -> dict[str, list[str]]:
    """The extra a PyPI-hosted flash-attn release names for the plan's CUDA major (flash-attn-4[cu13] on a
    CUDA 13 torch: flash_attn.toml `cuda`)."""
    fa = plan.flash_attn
    if fa is None or not plan.torch.cuda:
        return {}
    rel = next((r for r in m.flash_attn_releases if r.version == fa.version and r.index == "pypi"
                and m.flash_attn_impl(r.impl).package == fa.package), None)
    extra = rel.cuda.get(plan.torch.cuda.split(".")[0]) if rel else None
    return {fa.package: [extra]} if extra else {}


def _extras(names: list[str] | None) -> str:
    return f"[{','.join(names)}]" if names else ""


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def with_sources(plan: Plan, sources: Sources) -> Plan:
    """The plan as this lock will install it: --torch-index replaces the PyTorch index it names."""
    if not sources.torch_index or plan.torch.backend == "mps":  # macOS: torch is PyPI's (or --index-url's)
        return plan
    index = strip(sources.torch_index).format(variant=plan.torch.variant)  # its credentials reach uv, not the plan
    fa = plan.flash_attn
    if fa is not None and fa.index_url == plan.torch.index_url:  # flash-attn-3 lives on the torch index: follow it
        fa = fa._replace(index_url=index, wheel_url=f"{index.rstrip('/')}/{fa.filename}")
    return plan._replace(torch=plan.torch._replace(index_url=index), flash_attn=fa)


def pyproject_text(plan: Plan, sources: Sources, envtool_wheel: str, no_build: list[str],
                   m: Matrix | None = None) -> str:
    torch_index = plan.torch.index_url
    gpu = plan.gpu["name"] if plan.on_gpu else "CPU"
    marker = target_marker(plan)
    routed = torch_triton(plan)
    no_build = [*no_build, *([routed] if routed else [])]
    from_pypi = plan.torch.backend == "mps"  # torch's macOS arm64 wheels are PyPI's own: no torch index
    lines = [
        f"# Written by `envtool lock` for {gpu}: torch {plan.torch.version}+{plan.torch.variant}, "
        f"{plan.attention}, {plan.precision}.",
        "# Regenerate it with envtool rather than editing it; plan.json beside it says why each pin is here.",
        "[project]",
        f'name = "envtool-env-{plan.torch.variant}-torch{plan.torch.version}"',
        'version = "0.0.0"',
        f'requires-python = "=={plan.python}.*"',
        "dependencies = [",
        *[f"    {json.dumps(r)}," for r in requirements(plan, m)],
        "]",
        "",
        "[tool.uv]",
        "package = false",
        f"environments = [{json.dumps(marker)}]",
        f"required-environments = [{json.dumps(marker)}]",
        f"no-build-package = {_toml_list(sorted(set(no_build)))}",
    ]
    if sources.find_links:
        lines.append(f"find-links = {_toml_list([str(Path(f).resolve()) for f in sources.find_links])}")
    if "deepspeed" in plan.packages:
        # DeepSpeed ships an sdist whose setup imports torch: build it against the locked torch.
        lines += ["", "[tool.uv.extra-build-dependencies]",
                  'deepspeed = [{ requirement = "torch", match-runtime = true }]']
    indexes = []
    if sources.index_url:
        indexes.append(("default", strip(sources.index_url), "default = true"))
    indexes += [(f"extra-{i + 1}", strip(url), None) for i, url in enumerate(sources.extra_index_urls)]
    if not from_pypi:
        indexes.append((f"pytorch-{plan.torch.variant}", torch_index, "explicit = true"))
    fa = plan.flash_attn
    fa_index = f"pytorch-{plan.torch.variant}"  # an index-hosted wheel (flash-attn-3) comes from the torch index
    if fa is not None and fa.index_url == PYPI_SIMPLE:  # flash-attn-4: the environment's own index, like the stack
        fa = None
    if fa is not None and fa.index_url and fa.index_url != torch_index:
        fa_index = f"{fa.package}-index"
        indexes.append((fa_index, fa.index_url, "explicit = true"))
    for name, url, flag in indexes:
        lines += ["", "[[tool.uv.index]]", f'name = "{name}"', f"url = {json.dumps(url)}"]
        if flag:
            lines.append(flag)
    lines += ["", "[tool.uv.sources]"]
    if not from_pypi:
        lines.append(f'torch = {{ index = "pytorch-{plan.torch.variant}" }}')
    if routed:
        lines.append(f'{routed} = {{ index = "pytorch-{plan.torch.variant}" }}')
    lines.append(f'{DISTRIBUTION} = {{ path = "wheels/{envtool_wheel}" }}')
    if fa is not None and fa.index_url:
        lines.append(f'{fa.package} = {{ index = "{fa_index}" }}')
    elif fa is not None:
        lines.append(f"{fa.package} = {wheel_source(fa.wheel_url)}")
    return "\n".join(lines) + "\n"


def wheel_source(url: str) -> str:
    """A wheel URL as a [tool.uv.sources] entry: a `file://` URL (a mirror on disk) is a path, which uv takes
    where it refuses the file scheme in a `url` source."""
    if urlsplit(url).scheme == "file":
        return f"{{ path = {json.dumps(unquote(urlsplit(url).path))} }}"
    return f"{{ url = {json.dumps(url)} }}"


def lock(plan: Plan, out: Path, sources: Sources, m: Matrix, quiet: bool = False) -> Path:
    """Write and lock the project directory `out`; replace a previous one only once the new lock exists."""
    # start-up: resolver.files imported only when this runs
    from .files import one_writer

    out = out.resolve()
    with one_writer(out, "the lock directory"):  # two locks into one --out: one after the other
        return _lock(plan, out, sources, m, quiet)


def _lock(plan: Plan, out: Path, sources: Sources, m: Matrix, quiet: bool) -> Path:
    plan = with_sources(plan, sources)
    if out.exists() and not (out / PLAN_FILE).exists():
        raise BadInput(f"{out} exists and is not an envtool lock directory (no {PLAN_FILE}); choose another --out")
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        wheel = selfwheel.build(staging / "wheels")
        (staging / "pyproject.toml").write_text(pyproject_text(plan, sources, wheel.name, m.no_build, m))
        (staging / PLAN_FILE).write_text(plan.to_json() + "\n")
        env = {**uv_env(sources.ca_bundle), **uv_index_env(lock_indexes(staging), given(source_urls(sources)))}
        try:
            run_uv(["lock", "--project", str(staging)], what="Locking with uv", env=env, quiet=quiet)
        except MissingWheel as e:
            fa = plan.flash_attn
            if fa is not None and fa.index_url and e.name == fa.package:
                e.args = (f"{e}: {fa.index_url} lists no {fa.filename} (`envtool resolve --no-flash-attn` plans "
                          f"without it)",)
            nearest = nearest_wheels(plan, sources, e.name, e.version)
            if nearest:
                e.args = (f"{e}; nearest published: {', '.join(nearest)}",)
            raise
        swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def swap_in(new: Path, target: Path) -> None:
    """Put directory `new` at `target`; the old one is moved aside first and removed last."""
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def nearest_wheels(plan: Plan, sources: Sources, name: str, version: str | None) -> list[str]:
    """The wheels of `name` that its index does publish: the same version (other tags) first, then the
    versions nearest to it."""
    if version is None:
        return []

    # optional: requests is imported only where it is used
    import requests

    if name == "torch" or (plan.flash_attn and plan.flash_attn.index_url and name == plan.flash_attn.package):
        index = plan.torch.index_url if name == "torch" else plan.flash_attn.index_url
    else:
        index = strip(sources.index_url) or "https://pypi.org/simple/"
    project = re.sub(r"[-_.]+", "-", name).lower()
    try:
        page = requests.get(f"{index.rstrip('/')}/{project}/", timeout=10, verify=tls_verify(sources.ca_bundle),
                            auth=auth_for(index, given(source_urls(sources))))
    except requests.RequestException:
        return []
    published = {}
    for filename in set(re.findall(r">([^<>]+\.whl)<", page.text)):
        try:
            published[filename] = Version(filename.split("-")[1])
        except (IndexError, InvalidVersion):
            continue
    order = sorted({*published.values(), Version(version)})
    at = order.index(Version(version))
    return sorted(published, key=lambda f: (abs(order.index(published[f]) - at), f))[:3]


def install_hint(env_dir: Path, cwd: Path | None = None) -> str:
    """The `envtool install` command that installs this lock, with a --venv that install will accept: .venv, or
    when a venv envtool did not make is there already (install refuses to replace it), .venv-<lock name>,
    numbered if that is taken too."""
    # start-up: shlex, resolver.doctor imported only when this runs
    import shlex

    from .doctor import is_managed_venv

    cwd = cwd or Path.cwd()
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", env_dir.resolve().name).strip("-") or "env"
    names = [".venv", f".venv-{slug}", *(f".venv-{slug}-{n}" for n in range(2, 100))]
    venv = next(n for n in names if not (cwd / n).exists() and not (cwd / n).is_symlink()
                or is_managed_venv(cwd / n))
    return f"envtool install {shlex.quote(str(env_dir))} --venv {venv}"


def load_plan(env_dir: Path) -> Plan:
    path = env_dir / PLAN_FILE
    if not path.is_file():
        raise BadInput(f"{env_dir}: no {PLAN_FILE} here; make one with `envtool lock --gpu ... --out {env_dir}`")
    return Plan.read(path)


EXPORT_FORMATS = {"requirements": "requirements-txt", "pylock": "pylock.toml"}  # `envtool export --format`: uv's name


def export(env_dir: Path, fmt: str, quiet: bool = True) -> str:
    """The locked environment as requirements.txt (with hashes) or pylock.toml, via `uv export`."""
    formats = EXPORT_FORMATS
    if fmt not in formats:
        raise BadInput(f"--format {fmt!r}: choose requirements or pylock")
    load_plan(env_dir)
    if not (env_dir / "uv.lock").is_file():
        raise BadInput(f"{env_dir}: no uv.lock; run `envtool lock` first")
    result = run_uv(["export", "--frozen", "--no-header", "--format", formats[fmt], "--project", str(env_dir)],
                    what="Exporting the lock", env=uv_env(), quiet=quiet)
    return result.stdout
