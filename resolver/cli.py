"""The `envtool` command line: parse arguments, call the stage that does the work, print the result.

Exit codes: 0 success; 1 failure while doing the work; 2 bad input or an unsatisfiable request.
Errors are one line on stderr; --debug shows the traceback. `resolve` stays fast: torch, docker,
requests, transformers and rich are imported only where they are used.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__
from .errors import EnvtoolError

APP_SETTINGS = dict(
    name="envtool",
    help="Detect the GPU, pick the fastest stack that really runs on it, lock it, containerize it, train in it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app = typer.Typer(**APP_SETTINGS)

_debug = False


def _version(value: bool) -> None:
    if value:
        print(f"envtool {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    global _debug
    _debug = debug


def reported(command):
    """Turn envtool's errors into one stderr line and the documented exit code."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except EnvtoolError as e:
            if _debug:
                raise
            print(f"envtool: error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            print("envtool: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return run


def _host_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _host_platform() -> str:
    import os

    machine = os.uname().machine.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


# Options shared by the commands that make a plan (resolve, lock, install --gpu).
GpuOpt = Annotated[str, typer.Option(
    "--gpu", help="'auto' (detect this machine), a GPU name or alias (t4, a100, 'Tesla V100'), a compute "
    "capability (sm_80, 8.6), 'cpu', or a comma list for one plan per target. `envtool gpus` lists the names.")]
DriverOpt = Annotated[Optional[str], typer.Option(
    "--driver", help="NVIDIA driver of the run host, e.g. 550.54.14 (default: detected with --gpu auto, "
    "unknown otherwise).")]
PythonOpt = Annotated[Optional[str], typer.Option("--python", help="Python of the environment, e.g. 3.11 "
                                                   "(default: this one).")]
TorchOpt = Annotated[Optional[str], typer.Option("--torch", help="Pin torch: 2.8 (newest 2.8.x) or 2.8.0.")]
CudaOpt = Annotated[Optional[str], typer.Option("--cuda", help="Pin the CUDA variant: 12.6 or 12.")]
FlashAttnOpt = Annotated[Optional[str], typer.Option("--flash-attn",
                                                     help="Require this flash-attn release's prebuilt wheel.")]
NoFlashAttnOpt = Annotated[bool, typer.Option("--no-flash-attn", help="Never use flash-attn (SDPA instead).")]
AttentionOpt = Annotated[Optional[str], typer.Option(
    "--attention", help="Force the attention backend: flash_attention_2, flash_attention_3, sdpa, xformers or eager.")]
PlatformOpt = Annotated[Optional[str], typer.Option("--platform", help="x86_64 or aarch64 (default: this machine).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
CaBundleOpt = Annotated[Optional[str], typer.Option(
    "--ca-bundle", help="CA certificates for a proxy with its own CA (also honoured: SSL_CERT_FILE).")]


def make_plans(gpu, driver, python, torch, cuda, flash_attn, no_flash_attn, attention, platform) -> list:
    from .hardware import targets
    from .matrix import load
    from .solve import Request, solve

    m = load()
    plans = []
    for t in targets(gpu, m, driver):
        req = Request(gpu=t.gpu, driver=t.driver, python=python or _host_python(),
                      platform=platform or _host_platform(), torch=torch, cuda=cuda, flash_attn=flash_attn,
                      no_flash_attn=no_flash_attn, attention=attention, target=t.label, notes=t.notes)
        plans.append(solve(req, m))
    return plans


def one_plan(*args):
    from .errors import BadInput

    plans = make_plans(*args)
    if len(plans) != 1:
        raise BadInput("this command makes one environment: give --gpu a single target")
    return plans[0]


@app.command()
@reported
def resolve(
    gpu: GpuOpt = "auto",
    driver: DriverOpt = None,
    python: PythonOpt = None,
    torch: TorchOpt = None,
    cuda: CudaOpt = None,
    flash_attn: FlashAttnOpt = None,
    no_flash_attn: NoFlashAttnOpt = False,
    attention: AttentionOpt = None,
    platform: PlatformOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (a list for several targets).")] = False,
    fmt: Annotated[str, typer.Option("--format", help="table, json, github (a CI strategy matrix) or markdown.")] = "table",
    explain: Annotated[bool, typer.Option("--explain", help="Also show every candidate build not taken, and why.")] = False,
) -> None:
    """Plan the environment for a GPU: torch build and CUDA variant, attention, precision, triton, packages.

    Every decision comes with its reason. Examples:

      envtool resolve --gpu auto

      envtool resolve --gpu sm_80 --driver 550.54.14 --python 3.11 --json

      envtool resolve --gpu v100 --torch 2.8 --explain

      envtool resolve --gpu t4,v100,a100 --format github
    """
    from .errors import BadInput

    fmt = "json" if json_out else fmt
    if fmt not in ("table", "json", "github", "markdown"):
        raise BadInput(f"--format {fmt!r}: choose table, json, github or markdown")
    plans = make_plans(gpu, driver, python, torch, cuda, flash_attn, no_flash_attn, attention, platform)
    if fmt == "json":
        data = [p.to_dict(explain) for p in plans]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    elif fmt == "github":
        from .ci import github_matrix

        print(github_matrix(plans))
    elif fmt == "markdown":
        from .markdown import plans_markdown
        from .matrix import load

        print(plans_markdown(plans, load()))
    else:
        from .render import plan_table

        for plan in plans:
            plan_table(plan, explain)


def _sources(index_url, extra_index_url, torch_index, find_links, ca_bundle):
    from .lock import Sources

    return Sources(index_url=index_url, extra_index_urls=tuple(extra_index_url or ()), torch_index=torch_index,
                   find_links=tuple(find_links or ()), ca_bundle=ca_bundle or None)


IndexUrlOpt = Annotated[Optional[str], typer.Option("--index-url", help="Replace PyPI with this index (a mirror).")]
ExtraIndexOpt = Annotated[Optional[list[str]], typer.Option("--extra-index-url", help="Another index; repeatable.")]
TorchIndexOpt = Annotated[Optional[str], typer.Option(
    "--torch-index", help="Replace the PyTorch index: a URL, '{variant}' is replaced by cu126, cpu, ...")]
FindLinksOpt = Annotated[Optional[list[str]], typer.Option("--find-links", help="A directory of wheels; repeatable.")]


@app.command()
@reported
def lock(
    out: Annotated[Path, typer.Option("--out", help="The directory to write: pyproject.toml, uv.lock, plan.json.")],
    gpu: GpuOpt = "auto",
    driver: DriverOpt = None,
    python: PythonOpt = None,
    torch: TorchOpt = None,
    cuda: CudaOpt = None,
    flash_attn: FlashAttnOpt = None,
    no_flash_attn: NoFlashAttnOpt = False,
    attention: AttentionOpt = None,
    platform: PlatformOpt = None,
    index_url: IndexUrlOpt = None,
    extra_index_url: ExtraIndexOpt = None,
    torch_index: TorchIndexOpt = None,
    find_links: FindLinksOpt = None,
    wheelhouse: Annotated[Optional[Path], typer.Option(
        "--wheelhouse", help="Also download every locked wheel here (hash-checked) for `install --offline`.")] = None,
    ca_bundle: CaBundleOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Write a locked environment for a GPU: pyproject.toml + uv.lock (with hashes) + plan.json.

      envtool lock --gpu a100 --out envs/a100

      envtool lock --gpu t4 --out envs/t4 --wheelhouse wheels/t4   # then: envtool install --offline
    """
    from .lock import lock as do_lock
    from .matrix import load

    plan = one_plan(gpu, driver, python, torch, cuda, flash_attn, no_flash_attn, attention, platform)
    sources = _sources(index_url, extra_index_url, torch_index, find_links, ca_bundle)
    env_dir = do_lock(plan, out, sources, load(), quiet=json_out)
    result = {"out": str(env_dir), "plan": plan.to_dict()}
    if wheelhouse:
        from .wheelhouse import fill

        wheels = fill(env_dir, wheelhouse, plan.python, plan.platform, ca_bundle, quiet=json_out)
        result["wheelhouse"] = {"path": str(wheelhouse.resolve()), "wheels": len(wheels)}
    if json_out:
        print(json.dumps(result, indent=2))
        return
    print(f"locked {plan.target} (torch {plan.torch.version}+{plan.torch.variant}, {plan.attention}, "
          f"{plan.precision}) in {env_dir}")
    if wheelhouse:
        print(f"wheelhouse: {result['wheelhouse']['wheels']} wheels in {result['wheelhouse']['path']}")
    print(f"next: envtool install {out} --venv .venv")


@app.command()
@reported
def install(
    env_dir: Annotated[Optional[Path], typer.Argument(help="A directory written by `envtool lock`.")] = None,
    venv: Annotated[Path, typer.Option("--venv", help="The venv to create or replace (a managed symlink).")] = Path(".venv"),
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="Without ENV_DIR: resolve and lock for this GPU "
                                               "first ('auto' detects), into <venv>.lock/.")] = None,
    driver: DriverOpt = None,
    python: PythonOpt = None,
    torch: TorchOpt = None,
    cuda: CudaOpt = None,
    no_flash_attn: NoFlashAttnOpt = False,
    index_url: IndexUrlOpt = None,
    extra_index_url: ExtraIndexOpt = None,
    torch_index: TorchIndexOpt = None,
    find_links: FindLinksOpt = None,
    offline: Annotated[bool, typer.Option("--offline", help="Install from a wheelhouse with no network.")] = False,
    wheelhouse: Annotated[Optional[Path], typer.Option(
        "--wheelhouse", help="The wheelhouse for --offline (default: ENV_DIR/wheelhouse).")] = None,
    ca_bundle: CaBundleOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Install a locked environment into a venv, atomically: the old venv stays until the new one imports.

      envtool install envs/a100 --venv .venv-a100

      envtool install --gpu auto --venv .venv        # resolve + lock + install for this machine
    """
    from .errors import BadInput
    from .install import install as do_install

    if env_dir is None:
        if gpu is None:
            raise BadInput("give a lock directory (from `envtool lock`) or --gpu to resolve and lock first")
        from .lock import lock as do_lock
        from .matrix import load

        plan = one_plan(gpu, driver, python, torch, cuda, None, no_flash_attn, None, None)
        sources = _sources(index_url, extra_index_url, torch_index, find_links, ca_bundle)
        env_dir = do_lock(plan, venv.parent / f"{venv.name}.lock", sources, load(), quiet=json_out)
    result = do_install(env_dir, venv, offline=offline, wheelhouse=wheelhouse, ca_bundle=ca_bundle, quiet=json_out)
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        print(f"installed torch {result['torch']}, transformers {result['transformers']} into {result['venv']}")


def recommended(target, python: str, m) -> dict | None:
    """What `envtool resolve` would choose for this machine and the environment's Python."""
    from .errors import EnvtoolError
    from .solve import Request, solve

    try:
        plan = solve(Request(gpu=target.gpu, driver=target.driver, python=python, platform=_host_platform(),
                             target=target.label), m)
    except EnvtoolError:
        return None
    return {"torch": f"{plan.torch.version}+{plan.torch.variant}", "attention": plan.attention,
            "precision": plan.precision, "flash_attn": plan.flash_attn.version if plan.flash_attn else None}


@app.command()
@reported
def doctor(
    venv: Annotated[Optional[Path], typer.Option("--venv", help="The environment to check (default: the "
                                                 "interpreter running envtool).")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="The GPU to check against ('auto': this machine's).")] = "auto",
    driver: DriverOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check an environment against this machine: torch's CUDA build and arch list, the driver, flash-attn,
    triton, bf16. Exits 1 on any error-level finding; each finding names the envtool command that fixes it."""
    from .doctor import diagnose, probe, report
    from .hardware import targets
    from .matrix import load

    m = load()
    found = targets(gpu, m, driver)
    if len(found) != 1:
        from .errors import BadInput

        raise BadInput("doctor checks against one GPU: give --gpu a single target")
    target = found[0]
    info = probe(venv)
    findings = diagnose(info, target.gpu, target.driver, m, str(venv or info.get("prefix", ".venv")))
    result = {**report(findings), "gpu": target.gpu.describe(), "driver": target.driver, "venv": info["prefix"],
              "packages": info.get("packages", {}), "recommended": recommended(target, info["python"], m)}
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        from .render import doctor_table

        doctor_table(result)
    if not result["ok"]:
        raise typer.Exit(1)


@app.command()
@reported
def export(
    env_dir: Annotated[Path, typer.Argument(help="A directory written by `envtool lock`.")],
    fmt: Annotated[str, typer.Option("--format", help="requirements (requirements.txt with hashes) or pylock.")] = "requirements",
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write here (default: stdout).")] = None,
) -> None:
    """Export a locked environment for other installers: requirements.txt with hashes, or pylock.toml."""
    from .lock import export as do_export

    text = do_export(env_dir, fmt)
    if output is None:
        sys.stdout.write(text)
        return
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(text)
    tmp.replace(output)


BaseImageOpt = Annotated[Optional[str], typer.Option(
    "--base-image", help="Replace the base image the matrix picks (a private registry, an air-gapped site).")]


@app.command()
@reported
def dockerfile(
    gpu: GpuOpt = "auto",
    driver: DriverOpt = None,
    python: PythonOpt = None,
    torch: TorchOpt = None,
    cuda: CudaOpt = None,
    no_flash_attn: NoFlashAttnOpt = False,
    platform: PlatformOpt = None,
    base_image: BaseImageOpt = None,
) -> None:
    """Print the Dockerfile `envtool build` would use for a GPU (render only).

      envtool dockerfile --gpu t4 > Dockerfile.t4
    """
    from .docker import render
    from .matrix import load

    plan = one_plan(gpu, driver, python, torch, cuda, None, no_flash_attn, None, platform)
    sys.stdout.write(render(plan, load(), base_image))


@app.command()
@reported
def build(
    gpu: GpuOpt = "auto",
    driver: DriverOpt = None,
    python: PythonOpt = None,
    torch: TorchOpt = None,
    cuda: CudaOpt = None,
    no_flash_attn: NoFlashAttnOpt = False,
    platform: PlatformOpt = None,
    tag: Annotated[Optional[str], typer.Option("--tag", help="Image tag (default: envtool-trainer:"
                                               "sm75-cu126-torch2.9-py3.11 style). One target only.")] = None,
    push: Annotated[bool, typer.Option("--push", help="Push the image after building (never by default).")] = False,
    base_image: BaseImageOpt = None,
    wheelhouse: Annotated[Optional[Path], typer.Option(
        "--wheelhouse", help="Wheelhouse to build from and to top up (default: a temporary one).")] = None,
    network: Annotated[Optional[str], typer.Option("--network", help="Network for the build's RUN steps; "
                                                   "'none' proves it needs none.")] = None,
    index_url: IndexUrlOpt = None,
    extra_index_url: ExtraIndexOpt = None,
    torch_index: TorchIndexOpt = None,
    find_links: FindLinksOpt = None,
    ca_bundle: CaBundleOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Build one image per target architecture: lock, fill a hash-checked wheelhouse, docker build offline.

      envtool build --gpu t4

      envtool build --gpu t4,v100,a100

      envtool build --gpu a100 --tag myorg/trainer:a100 --push
    """
    import tempfile

    from . import docker as images
    from .errors import BadInput
    from .lock import lock as do_lock
    from .matrix import load
    from .plan import image_tag
    from .wheelhouse import fill

    m = load()
    plans = make_plans(gpu, driver, python, torch, cuda, None, no_flash_attn, None, platform)
    if tag and len(plans) > 1:
        raise BadInput("--tag names one image: build several targets without it (tags name the architecture)")
    images.client()  # fail now, in one line, if no engine answers
    sources = _sources(index_url, extra_index_url, torch_index, find_links, ca_bundle)
    built = []
    for plan in plans:
        name = tag or image_tag(plan)
        with tempfile.TemporaryDirectory(prefix="envtool-build-") as tmp:
            env_dir = do_lock(plan, Path(tmp) / "env", sources, m, quiet=json_out)
            house = wheelhouse or Path(tmp) / "wheelhouse"
            fill(env_dir, house, plan.python, plan.platform, ca_bundle, quiet=json_out)
            images.prepare_context(plan, m, env_dir, house, Path(tmp) / "context", base_image)
            image_id = images.build(Path(tmp) / "context", name, network=network, quiet=json_out)
        if push:
            images.push(name)
        built.append({"target": plan.target, "tag": name, "id": image_id, "pushed": push})
        if not json_out:
            print(f"built {name} ({image_id[:19]}) for {plan.target}")
    if json_out:
        print(json.dumps(built, indent=2))


@app.command(context_settings={"allow_interspersed_args": False})
@reported
def run(
    command: Annotated[Optional[list[str]], typer.Argument(help="The command to run in the image, after --.")] = None,
    image: Annotated[str, typer.Option("--image", help="The image to run.")] = "",
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="'all' or a count (needs the NVIDIA container "
                                                "toolkit); default: none.")] = None,
    shm_size: Annotated[str, typer.Option("--shm-size", help="Shared memory for data loader workers / NCCL.")] = "8g",
    hf_cache: Annotated[Optional[Path], typer.Option("--hf-cache", help="Host directory mounted as the "
                                                     "Hugging Face cache.")] = None,
    env: Annotated[Optional[list[str]], typer.Option("-e", "--env", help="Pass this environment variable "
                                                     "(e.g. HF_TOKEN) at run time; repeatable.")] = None,
    volume: Annotated[Optional[list[str]], typer.Option("-v", "--volume", help="HOST:CONTAINER; repeatable.")] = None,
) -> None:
    """Run a command in an image with what training needs: GPUs, shared memory, the HF cache, tokens.

    Tokens and other secrets are passed at run time, never baked into a layer.

      envtool run --image myorg/trainer:a100 --gpus all -e HF_TOKEN -- python -m trainer train config.yml
    """
    from .docker import run as do_run
    from .errors import BadInput

    if not image:
        raise BadInput("--image is required")
    code = do_run(image, command or [], gpus=gpus, shm_size=shm_size, hf_cache=hf_cache, env_names=env or [],
                  volumes=volume or [])
    raise typer.Exit(code)


@app.command()
@reported
def gpus(json_out: bool = typer.Option(False, "--json", help="Print the catalog as JSON.")) -> None:
    """List the GPUs the matrix knows: names, aliases, compute capability, architecture, bf16/fp8."""
    from .matrix import load

    m = load()
    if json_out:
        rows = []
        for g in m.gpus:
            arch = m.arch_for(g.compute_capability)
            rows.append({"name": g.name, "aliases": g.aliases, "compute_capability": g.compute_capability,
                         "arch": arch.name, "memory_gb": g.memory_gb, "bf16": arch.bf16, "fp8": arch.fp8})
        print(json.dumps(rows, indent=2))
        return
    from .render import gpus_table

    gpus_table(m)


# ---------------------------------------------------------------------------- envtool matrix (update, verify)
# Network commands for maintainers: requests, tomlkit and rich are imported inside them, never by `resolve`.

matrix_app = typer.Typer(name="matrix", no_args_is_help=True, rich_markup_mode=None,
                         help="Keep matrices/ fresh: regenerate from upstream metadata, verify wheel URLs.")
app.add_typer(matrix_app)

_PYPI_HELP = "PyPI-compatible index to read (default: $ENVTOOL_PYPI_URL, else https://pypi.org)."
_DIR_HELP = "The matrices directory (default: $ENVTOOL_MATRIX_DIR, else the installed matrices/)."


@matrix_app.command("update")
@reported
def matrix_update(
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 when the matrices are stale."),
    json_out: bool = typer.Option(False, "--json", help="Print the changes as JSON."),
    pypi_url: Optional[str] = typer.Option(None, "--pypi-url", help=_PYPI_HELP),
    matrix_dir: Optional[Path] = typer.Option(None, "--matrix-dir", help=_DIR_HELP),
) -> None:
    """Regenerate what PyPI metadata states (torch releases, Python ranges, triton pins; xformers' torch pins;
    the training stack's newest versions), print the diff, and write it after the schema check."""
    from .update import command

    raise typer.Exit(command(check=check, json_out=json_out, pypi_url=pypi_url, matrix_dir=matrix_dir))


@matrix_app.command("verify")
@reported
def matrix_verify(
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    pypi_url: Optional[str] = typer.Option(None, "--pypi-url", help=_PYPI_HELP),
    torch_index_url: Optional[str] = typer.Option(
        None, "--torch-index-url", help="torch index template with {variant} (default: $ENVTOOL_TORCH_INDEX_URL, "
        "else torch.toml's index_url)."),
    flash_attn_url: Optional[str] = typer.Option(
        None, "--flash-attn-url", help="flash-attn wheel URL template with {version} and {filename} (default: "
        "$ENVTOOL_FLASH_ATTN_URL, else flash_attn.toml's wheel_url)."),
    jobs: int = typer.Option(8, "--jobs", "-j", min=1, max=64, help="Requests in flight at once."),
    matrix_dir: Optional[Path] = typer.Option(None, "--matrix-dir", help=_DIR_HELP),
) -> None:
    """Check that every wheel a plan can name exists: torch index pages, flash-attn release assets (HEAD),
    pinned PyPI versions. Exit 1 with the list of what is missing."""
    from .verify import command

    raise typer.Exit(command(json_out=json_out, pypi_url=pypi_url, torch_index_url=torch_index_url,
                             flash_attn_url=flash_attn_url, jobs=jobs, matrix_dir=matrix_dir))


FAST_COMMANDS = ("resolve", "gpus")


def main() -> None:
    """Typer builds a parser for every command of the app it runs, on every call. `resolve` and `gpus` are what
    scripts and CI call most and must start fast, so they run in an app of their own (same options)."""
    words = [a for a in sys.argv[1:] if not a.startswith("-")]
    if words[:1] and words[0] in FAST_COMMANDS:
        fast = typer.Typer(**APP_SETTINGS)
        fast.callback()(_options)
        for name in FAST_COMMANDS:
            fast.command()(globals()[name])
        fast()
    else:
        app()


if __name__ == "__main__":
    main()
