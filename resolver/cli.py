"""The `envtool` command line: parse arguments, call the stage that does the work, print the result.

Exit codes: 0 success; 1 failure while doing the work; 2 bad input or an unsatisfiable request.
Errors are one line on stderr; --debug shows the traceback. `resolve` stays fast: torch, docker,
requests, transformers and rich are imported only where they are used.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
import sys
from pathlib import Path
from typing import Annotated, Optional
from urllib.parse import urlsplit

import typer

from . import __version__
from . import quick
from .errors import BadInput
from .errors import EnvtoolError
from .quick import RESOLVE_FORMATS  # noqa: F401 (`envtool resolve --format`; read by tests/test_docs.py)
from .quick import error_lines

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
            for line in error_lines(e):  # several problems found at once: one line each
                print(line, file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            print("envtool: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return run


# ---------------------------------------------------------------------------- options, declared once

_GPU_HELP = ("'auto' (detect this machine: NVIDIA, then AMD, Intel, Apple), a GPU name or alias (t4, a100, mi300x, "
             "rx7900xtx, max1550), a compute capability (sm_80, 8.6), an AMD gfx target (gfx942), 'xpu', 'mps' or 'cpu'")
GpuOpt = Annotated[str, typer.Option(
    "--gpu", help=f"{_GPU_HELP}: one target. `envtool gpus` lists the names.")]
GpuListOpt = Annotated[str, typer.Option(  # resolve and build: one plan (one image) per target
    "--gpu", help=f"{_GPU_HELP}, or a comma list (t4,v100,a100) for one per target. `envtool gpus` lists the names.")]
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
    "--attention", help="Force the attention backend: flash_attention_2, flash_attention_3, flash_attention_4 (beta), "
                        "sdpa, xformers or eager; fa2, fa3, fa4 name the flash-attn ones.")]
PlatformOpt = Annotated[Optional[str], typer.Option("--platform", help="x86_64 or aarch64 (default: this machine).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
# how many processes on how many machines: train and doctor --multi-gpu
NprocOpt = Annotated[Optional[int], typer.Option("--nproc", help="Processes on this machine (default: every GPU "
                                                 "counted; on the CPU 1 for train, 2 for doctor --multi-gpu).")]
NnodesOpt = Annotated[int, typer.Option("--nnodes", help="Machines in the job (torchrun, c10d rendezvous).")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", help="This machine's rank, 0 to nnodes-1.")]
RdzvOpt = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on "
                                                "every machine (with --nnodes > 1).")]
CaBundleOpt = Annotated[Optional[str], typer.Option(
    "--ca-bundle", help="CA certificates for a proxy with its own CA (also honoured: SSL_CERT_FILE).")]
IndexUrlOpt = Annotated[Optional[str], typer.Option("--index-url", help="Replace PyPI with this index (a mirror).")]
ExtraIndexOpt = Annotated[Optional[list[str]], typer.Option("--extra-index-url", help="Another index; repeatable.")]
TorchIndexOpt = Annotated[Optional[str], typer.Option(
    "--torch-index", help="Replace the PyTorch index: a URL, '{variant}' is replaced by cu126, cpu, ...")]
FindLinksOpt = Annotated[Optional[list[str]], typer.Option("--find-links", help="A directory of wheels; repeatable.")]
UserOpt = Annotated[str, typer.Option(
    "--user", help="Who the container runs as: 'invoking' (default: your uid:gid, so files written to mounted "
    "directories are yours), 'image' (the image's user, uid 1000), or UID[:GID] / a name.")]

# The plan options every plan-making command takes (resolve, lock, install, dockerfile, build, train), in one
# list: `@plan_options` adds them to a command's signature and hands the command one PlanOptions.
PLAN_OPTIONS = (
    ("gpu", GpuOpt, "auto"),
    ("driver", DriverOpt, None),
    ("python", PythonOpt, None),
    ("torch", TorchOpt, None),
    ("cuda", CudaOpt, None),
    ("flash_attn", FlashAttnOpt, None),
    ("no_flash_attn", NoFlashAttnOpt, False),
    ("attention", AttentionOpt, None),
    ("platform", PlatformOpt, None),
)
# Where packages come from (lock, install, build, train): handed to the command as one `Sources`.
SOURCE_OPTIONS = (
    ("index_url", IndexUrlOpt, None),
    ("extra_index_url", ExtraIndexOpt, None),
    ("torch_index", TorchIndexOpt, None),
    ("find_links", FindLinksOpt, None),
    ("ca_bundle", CaBundleOpt, None),
)


def _with_options(options, into: str, build, overrides: dict | None = None):
    """Add `options` (name, Annotated type, default) to a command's signature; the command receives them
    built into one object as keyword `into`. `overrides` replaces an option's type or default per command."""
    def decorate(command):
        sig = inspect.signature(command, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != into]
        added = []
        for name, annotation, default in options:
            annotation, default = (overrides or {}).get(name, (annotation, default))
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                           annotation=annotation))
        names = [name for name, _, _ in options]

        @functools.wraps(command)
        def run(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in names if name in kwargs}
            return command(*args, **{into: build(values)}, **kwargs)

        run.__signature__ = sig.replace(parameters=[*own, *added])
        run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}
        return run

    return decorate


def plan_options(**overrides):
    return _with_options(PLAN_OPTIONS, "opts", quick.plan_options, overrides)


def _sources(values: dict):
    # start-up: resolver.lock imported only when this runs
    from .lock import Sources

    for name, value in values.items():  # `--index-url ''` is an error, not PyPI; a URL envtool can name, no secret
        option = f"--{name.replace('_', '-')}"
        for item in value if isinstance(value, list) else [value]:
            if item is not None and not item.strip():
                raise BadInput(f"{option} is empty: give a value, or leave the option out for the default")
            if item is not None and name in ("index_url", "extra_index_url", "torch_index"):
                check_index_url(option, item)
    return Sources(index_url=values.get("index_url"), extra_index_urls=tuple(values.get("extra_index_url") or ()),
                   torch_index=values.get("torch_index"), find_links=tuple(values.get("find_links") or ()),
                   ca_bundle=values.get("ca_bundle") or None)


def check_index_url(option: str, url: str) -> None:
    """An index is an http(s) URL with a host, or a file:// URL; said in one line (its credentials redacted)."""
    # start-up: resolver.credentials imported only when this runs
    from .credentials import redact

    parts = urlsplit(url)
    if parts.scheme == "file" or (parts.scheme in ("http", "https") and parts.hostname):
        return
    raise BadInput(f"{option} {redact(url)!r}: give an http(s):// or file:// URL of a package index")


def source_options(command):
    return _with_options(SOURCE_OPTIONS, "sources", _sources)(command)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@app.command()
@reported
@plan_options(gpu=(GpuListOpt, "auto"))
def resolve(
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (a list for several targets).")] = False,
    fmt: Annotated[str, typer.Option("--format", help="table, json, github (a CI strategy matrix) or markdown.")] = "table",
    explain: Annotated[bool, typer.Option("--explain", help="Also show every candidate build not taken, and why.")] = False,
    *,
    opts,
) -> None:
    """Plan the environment for a GPU: torch build and CUDA variant, attention, precision, triton, packages.

    Every decision comes with its reason. Examples:

      envtool resolve --gpu auto

      envtool resolve --gpu sm_80 --driver 550.54.14 --python 3.11 --json

      envtool resolve --gpu v100 --torch 2.8 --explain

      envtool resolve --gpu t4,v100,a100 --format github
    """
    quick.show_plans(opts, fmt, json_out, explain)


@app.command()
@reported
@source_options
@plan_options()
def lock(
    out: Annotated[Path, typer.Option("--out", help="The directory to write: pyproject.toml, uv.lock, plan.json.")],
    wheelhouse: Annotated[Optional[Path], typer.Option(
        "--wheelhouse", help="Also download every locked wheel here (hash-checked) for `install --offline`.")] = None,
    json_out: JsonOpt = False,
    *,
    opts,
    sources,
) -> None:
    """Write a locked environment for a GPU: pyproject.toml + uv.lock (with hashes) + plan.json.

      envtool lock --gpu a100 --out envs/a100

      envtool lock --gpu t4 --out envs/t4 --wheelhouse wheels/t4   # then: envtool install --offline
    """
    # start-up: resolver.pipeline, resolver.lock imported only when this runs
    from .pipeline import lock as do_lock
    from .pipeline import one_plan

    plan = one_plan(opts)
    result = do_lock(plan, out, sources, wheelhouse=wheelhouse, quiet=json_out)
    if json_out:
        print(json.dumps(result, indent=2))
        return
    print(f"locked {plan.target} (torch {plan.torch.version}+{plan.torch.variant}, {plan.attention}, "
          f"{plan.precision}) in {result['out']}")
    if wheelhouse:
        print(f"wheelhouse: {result['wheelhouse']['wheels']} wheels in {result['wheelhouse']['path']}")
    from .lock import install_hint

    print(f"next: {install_hint(out)}")


InstallGpuOpt = Annotated[Optional[str], typer.Option(
    "--gpu", help="Without ENV_DIR: resolve and lock for this GPU first (one target; 'auto' detects), into "
    "<venv>.lock/ (with --system / --python PATH: default auto).")]
InstallPythonOpt = Annotated[Optional[str], typer.Option(
    "--python", help="A version (3.11): the Python of the new venv. A path (/usr/bin/python3): install into that "
    "existing interpreter instead of a venv, like --system.")]


@app.command()
@reported
@source_options
@plan_options(gpu=(InstallGpuOpt, None), python=(InstallPythonOpt, None))
def install(
    env_dir: Annotated[Optional[Path], typer.Argument(help="A directory written by `envtool lock`.")] = None,
    venv: Annotated[Path, typer.Option("--venv", help="The venv to create or replace (a managed symlink).")] = Path(".venv"),
    system: Annotated[bool, typer.Option("--system", help="Install into the interpreter running envtool (a "
                                         "notebook's, a system Python) instead of a venv: keeps its torch when "
                                         "doctor finds it right for the GPU, never builds from source.")] = False,
    offline: Annotated[bool, typer.Option("--offline", help="Install from a wheelhouse with no network.")] = False,
    wheelhouse: Annotated[Optional[Path], typer.Option(
        "--wheelhouse", help="The wheelhouse for --offline (default: ENV_DIR/wheelhouse).")] = None,
    check_imports: Annotated[bool, typer.Option("--check-imports", help="Import torch, transformers and the "
                                                "trainer before the swap (seconds: their first import compiles "
                                                "bytecode); by default they must be found, at their versions.")] = False,
    json_out: JsonOpt = False,
    *,
    opts,
    sources,
) -> None:
    """Install a locked environment into a venv, atomically: the old venv stays until the new one imports.
    Or, with --system / --python PATH, into an existing interpreter (Colab, Kaggle, a system Python).

      envtool install envs/a100 --venv .venv-a100

      envtool install --gpu auto --venv .venv        # resolve + lock + install for this machine

      envtool install --system                       # into this interpreter (a notebook)
    """
    # start-up: resolver.pipeline, tempfile imported only when this runs
    from .pipeline import install as do_install
    from .pipeline import install_system, is_interpreter_path

    target = sys.executable if system else opts.python if is_interpreter_path(opts.python) else None
    if target is not None:
        if offline:
            raise BadInput("--offline installs into a venv; --system / --python PATH use an index")
        import tempfile

        python = shutil.which(target) or target
        with tempfile.TemporaryDirectory(prefix="envtool-system-") as work:
            result = install_system(python, env_dir, opts._replace(python=None, gpu=opts.gpu or "auto"), sources,
                                    work=Path(work), quiet=json_out, check_imports=check_imports, say=say)
        if env_dir is None:
            result.pop("lock")  # a temporary directory, gone now
        if json_out:
            print(json.dumps(result, indent=2))
            return
        print(f"installed torch {result['torch']}, transformers {result['transformers']} into {result['python']}"
              + (f" (kept {', '.join(result['kept'])})" if result["kept"] else ""))
        if result["plan"] is None:
            print(f"note: {result['prefix']} is read-only: set ENVTOOL_PLAN to a plan.json for the trainer")
        return
    if env_dir is not None and opts.gpu is not None:
        raise BadInput("give a lock directory or --gpu, not both")
    result = do_install(env_dir, venv, opts, sources, offline=offline, wheelhouse=wheelhouse, quiet=json_out,
                        check_imports=check_imports)
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        print(f"installed torch {result['torch']}, transformers {result['transformers']} into {result['venv']}")


def recommended(target, python: str, m) -> dict | None:
    """What `envtool resolve` would choose for this machine and the environment's Python."""
    # start-up: resolver.pipeline, resolver.solve imported only when this runs
    from .pipeline import host_platform
    from .solve import Request, solve

    try:
        plan = solve(Request(gpu=target.gpu, driver=target.driver, python=python, platform=host_platform(),
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
    gpu: GpuOpt = "auto",
    driver: DriverOpt = None,
    multi_gpu: Annotated[bool, typer.Option("--multi-gpu", help="Also start the trainer's preflight under "
                                            "torchrun in that environment: every rank joins, a timed all-reduce "
                                            "(gloo on the CPU, NCCL/RCCL on GPUs) that names a rank that does not "
                                            "answer, /dev/shm, ulimit -l, GPU peer-to-peer (and the catalog's "
                                            "NCCL_P2P_DISABLE advice), across machines the shared storage.")] = False,
    nproc: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="With --multi-gpu: seconds each phase waits for "
                                           "the other ranks.")] = 30.0,
    config: Annotated[Optional[Path], typer.Option("--config", help="With --multi-gpu across machines: the "
                                                   "trainer config whose output_dir and dataset_prepared_path "
                                                   "every machine must see.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Check an environment against this machine: torch's CUDA build and arch list, the driver, flash-attn,
    triton, bf16. Exits 1 on any error-level finding; each finding names the envtool command that fixes it.

    With --multi-gpu, what the first collective of a multi-GPU run would find minutes in, in seconds: a rank
    that never joins or never reaches the all-reduce is named within --timeout (exit 1, never a hang).

      envtool doctor --multi-gpu

      envtool doctor --multi-gpu --gpu cpu --nproc 2 --json

      envtool doctor --multi-gpu --nnodes 2 --node-rank 0 --rdzv-endpoint head:29400 --config train.yml
    """
    # start-up: resolver.doctor, resolver.hardware imported only when this runs
    from .doctor import diagnose, fix_command, probe, report
    from .hardware import targets
    from .launch import Distribution
    from .matrix import load

    if not multi_gpu and (nproc is not None or nnodes != 1 or node_rank != 0 or rdzv_endpoint or config
                          or timeout != 30.0):
        raise BadInput("--nproc, --nnodes, --node-rank, --rdzv-endpoint, --timeout and --config go with --multi-gpu")
    m = load()
    found = targets(gpu, m, driver)
    if len(found) != 1:
        raise BadInput("doctor checks against one GPU: give --gpu a single target")
    target = found[0]
    dist = Distribution(nproc, nnodes, node_rank, rdzv_endpoint)
    if multi_gpu:
        from .preflight import multi_gpu_processes

        multi_gpu_processes(target.gpu, dist, timeout=timeout, config=config)
    info = probe(venv)
    findings = diagnose(info, target.gpu, target.driver, m, str(venv or info.get("prefix", ".venv")),
                        fix=fix_command(venv, target.label, driver))
    preflight = None
    if multi_gpu:
        from .preflight import multi_gpu as run_preflight

        python = sys.executable if venv is None else str(Path(venv) / "bin" / "python")
        more, preflight = run_preflight(python, target.gpu, target.driver, dist, timeout=timeout, config=config)
        findings += more
    result = {**report(findings), "gpu": target.gpu.describe(), "driver": target.driver, "venv": info["prefix"],
              "packages": info.get("packages", {}), "recommended": recommended(target, info["python"], m)}
    if multi_gpu:
        result["multi_gpu"] = preflight
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
    # start-up: resolver.lock, resolver.files imported only when this runs
    from .lock import export as do_export

    text = do_export(env_dir, fmt)
    if output is None:
        sys.stdout.write(text)
        return
    from .files import write_atomic

    write_atomic(output, text)


BaseImageOpt = Annotated[Optional[str], typer.Option(
    "--base-image", help="Replace the base image the matrix picks (a private registry, an air-gapped site).")]


@app.command()
@reported
@plan_options()
def dockerfile(
    base_image: BaseImageOpt = None,
    *,
    opts,
) -> None:
    """Print the Dockerfile `envtool build` would use for a GPU (render only).

      envtool dockerfile --gpu t4 > Dockerfile.t4
    """
    # start-up: resolver.docker, resolver.matrix imported only when this runs
    from .docker import render
    from .matrix import load
    from .pipeline import image_plans

    plans = image_plans(opts, base_image)
    if len(plans) != 1:
        raise BadInput("this command makes one environment: give --gpu a single target")
    sys.stdout.write(render(plans[0], load(), base_image))


@app.command()
@reported
@source_options
@plan_options(gpu=(GpuListOpt, "auto"))
def build(
    tag: Annotated[Optional[str], typer.Option("--tag", help="Image tag (default: envtool-trainer:"
                                               "sm75-cu126-torch2.9-py3.11 style). One target only.")] = None,
    push: Annotated[bool, typer.Option("--push", help="Push the image after building (never by default).")] = False,
    base_image: BaseImageOpt = None,
    wheelhouse: Annotated[Optional[Path], typer.Option(
        "--wheelhouse", help="Wheelhouse to build from and to top up (default: a temporary one).")] = None,
    network: Annotated[Optional[str], typer.Option("--network", help="Network for the build's RUN steps; "
                                                   "'none' proves it needs none.")] = None,
    json_out: JsonOpt = False,
    *,
    opts,
    sources,
) -> None:
    """Build one image per target architecture: lock, fill a hash-checked wheelhouse, docker build offline.

      envtool build --gpu t4

      envtool build --gpu t4,v100,a100

      envtool build --gpu a100 --tag myorg/trainer:a100 --push
    """
    # start-up: resolver.pipeline imported only when this runs
    from .pipeline import ImageOptions, image_plans
    from .pipeline import build as do_build

    built = do_build(image_plans(opts, base_image), sources, ImageOptions(tag, push, base_image, wheelhouse, network),
                     quiet=json_out, say=(lambda s: None) if json_out else print)
    if json_out:
        print(json.dumps(built, indent=2))


# train's own options
TrainVenvOpt = Annotated[Optional[Path], typer.Option("--venv", help="Train in this venv (built for the plan first "
                                                      "when it does not run it).")]
TrainImageOpt = Annotated[bool, typer.Option("--image", help="Train in the plan's image (built first when missing), "
                                             "with the working directory mounted at /work.")]
IsolatedOpt = Annotated[bool, typer.Option("--isolated", help="Never the active environment: train in the "
                                           "environment cached for the plan (built once).")]
EmitOpt = Annotated[Optional[str], typer.Option("--emit", help="Write a launcher instead of training: slurm "
                                                "(an sbatch script) or k8s (a Kubeflow PyTorchJob).")]
EmitOutputOpt = Annotated[Optional[Path], typer.Option("-o", "--output", help="With --emit: write here (default: "
                                                       "stdout).")]
TrainHfCacheOpt = Annotated[Optional[Path], typer.Option("--hf-cache", help="With --image: host directory mounted "
                                                         "as the Hugging Face cache.")]
PvcOpt = Annotated[Optional[str], typer.Option("--pvc", help="With --emit k8s: the PersistentVolumeClaim every pod "
                                               "works in, at /work (data, output_dir; default envtool-work).")]
SecretOpt = Annotated[Optional[str], typer.Option("--secret", help="With --emit k8s: the Secret the pods take "
                                                  "HF_TOKEN and WANDB_API_KEY from, when it has them (secretKeyRef; "
                                                  "default envtool-secrets). Tokens are never written into a "
                                                  "launcher; an sbatch script takes them from the environment.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan, where it runs, the attention "
                                         "the trainer will run and how it keeps packed rows apart (varlen or a "
                                         "mask, and why), and the exact command; build and run nothing.")]
NoFitCheckOpt = Annotated[bool, typer.Option("--no-fit-check", help="Train (or write the launcher) even when the "
                                             "memory estimate says the run does not fit the plan's GPU.")]


@app.command()
@reported
@source_options
@plan_options()
def train(
    config: Annotated[Path, typer.Argument(help="The trainer config (Axolotl keys), e.g. examples/tiny-cpu.yml.")],
    venv: TrainVenvOpt = None,
    image: TrainImageOpt = False,
    isolated: IsolatedOpt = False,
    nproc: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvOpt = None,
    emit: EmitOpt = None,
    output: EmitOutputOpt = None,
    hf_cache: TrainHfCacheOpt = None,
    pvc: PvcOpt = None,
    secret: SecretOpt = None,
    dry_run: DryRunOpt = False,
    no_fit_check: NoFitCheckOpt = False,
    json_out: JsonOpt = False,
    *,
    opts,
    sources,
) -> None:
    """From a config to a trained model: read it, plan for it, then run the bundled trainer where the plan runs.

    The config is read by the trainer's own reader and checked against the plan before anything is built or
    started (also with --dry-run): a bad key or value exits 2 in one line. What the GPU cannot run is adapted
    with a reason where the config's intent is clear (flash_attention: true -> the fastest attention that
    runs; bf16: auto -> fp16 below sm_80); an explicit pin that would change the result (bf16: true on a T4,
    fp16: true on the CPU) exits 2. --attention / --no-flash-attn win over the config, with a reason. The
    trainer runs in the active environment when doctor finds nothing wrong with it for the plan, else in an
    environment built for the plan and cached by it (or --venv DIR, or the plan's image with --image). One
    process per device: torchrun for several GPUs or machines. The trainer's error line and exit code are
    envtool's, with one process or several (also in --image). SIGTERM, SIGUSR1 or Ctrl-C: every rank stops after
    the same step with a checkpoint (exit 138, or 130 for Ctrl-C; twice: at once); the same command again resumes
    it. An output_dir holding an earlier run's checkpoints (and no such stop) is continued with
    auto_resume_from_checkpoints: true, else refused before anything starts. At the end, the next commands for
    the run (merge-lora, export, chat-check) are printed.
    Before anything is built or started, the memory estimate (`envtool fit`'s, from the model's config.json when
    it is on this machine) is checked on the plan's GPU: when even the band's low end is above its memory
    (does_not_fit) the run stops, exit 2, naming the cheapest change that fits; --no-fit-check trains anyway.
    --dry-run prints the estimate.

      envtool train examples/tiny-cpu.yml --gpu cpu

      envtool train examples/t4-qlora.yml --gpu t4 --dry-run

      envtool train config.yml --nproc 4 --dry-run

      envtool train config.yml --nnodes 2 --node-rank 0 --rdzv-endpoint head:29500

      envtool train config.yml --gpu a100 --nnodes 4 --emit slurm -o train.sbatch
    """
    # start-up: resolver.emit, resolver.launch imported only when this runs
    from .emit import Request
    from .emit import emit as write_launcher
    from .launch import Distribution, Starting, check_places, plan_training, train_in

    check_places(venv=venv, image=image, emit=emit, output=output, pvc=pvc, secret=secret)
    dist = Distribution(nproc, nnodes, node_rank, rdzv_endpoint)
    training = plan_training(config, opts, dist, venv=venv, image=image, isolated=isolated, emit=emit,
                             then=Starting(fit_check=not (dry_run or no_fit_check),  # does_not_fit: exit 2 first
                                           starting=not dry_run and not emit))
    log = (lambda s: None) if json_out else say
    if emit:
        text = write_launcher(training, Request(emit, output, pvc, secret), dist, sources, dry_run=dry_run,
                              quiet=json_out, say=log)
        sys.stdout.write(text or "")
    elif dry_run and json_out:
        print(json.dumps(training.summary(), indent=2))
    elif dry_run:
        from .render import train_dry_run

        train_dry_run(training, opts)
    else:
        code, steps = train_in(training, sources, hf_cache=hf_cache, quiet=json_out, say=log)
        if json_out:
            print(json.dumps({**training.summary(), "exit_code": code, "next_steps": steps}, indent=2))
        raise typer.Exit(code)


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
    workdir: Annotated[Optional[str], typer.Option("-w", "--workdir", help="The command's working directory in "
                                                   "the container (e.g. /work, where -v mounts yours).")] = None,
    user: UserOpt = "invoking",
) -> None:
    """Run a command in an image with what training needs: GPUs, shared memory, the HF cache, tokens.

    Tokens and other secrets are passed at run time, never baked into a layer.

      envtool run --image myorg/trainer:a100 --gpus all -e HF_TOKEN -- python -m trainer train config.yml
    """
    # start-up: resolver.docker imported only when this runs
    from .docker import RunOptions
    from .docker import run as do_run

    if not image:
        raise BadInput("--image is required")
    code = do_run(image, command or [], RunOptions(gpus=gpus, shm_size=shm_size, hf_cache=hf_cache,
                                                   env_names=tuple(env or ()), volumes=tuple(volume or ()),
                                                   workdir=workdir, user=user))
    raise typer.Exit(code)


@app.command()
@reported
def gpus(json_out: bool = typer.Option(False, "--json", help="Print the catalog as JSON.")) -> None:
    """List the GPUs the matrix knows: names, aliases, compute capability (NVIDIA) or target (AMD's gfx, Intel's
    AOT family), architecture, bf16/fp8; for AMD, the newest torch build with code for the target. Any Mac with
    Apple silicon: --gpu mps."""
    # start-up: resolver.matrix, resolver.vendors imported only when this runs
    from .matrix import load

    m = load()
    if json_out:
        from .vendors import load as load_vendors

        rows = []
        for g in m.gpus:
            arch = m.arch_for(g.compute_capability)
            rows.append({"name": g.name, "aliases": g.aliases, "compute_capability": g.compute_capability,
                         "arch": arch.name, "memory_gb": g.memory_gb, "bf16": arch.bf16, "fp8": arch.fp8,
                         "vendor": "nvidia", "target": f"sm_{g.compute_capability.replace('.', '')}"})
        v = load_vendors()
        for g in v.amd_gpus:
            t = v.amd_target(g.gfx)
            rows.append({"name": g.name, "aliases": g.aliases, "compute_capability": None, "arch": t.family,
                         "memory_gb": g.memory_gb / g.devices if g.memory_gb else None, "bf16": t.bf16,
                         "fp8": bool(t.fp8), "vendor": "amd", "target": g.gfx})
        for g in v.intel_gpus:
            rows.append({"name": g.name, "aliases": g.aliases, "compute_capability": None,
                         "arch": v.intel_target(g.aot).family, "memory_gb": None, "bf16": None, "fp8": False,
                         "vendor": "intel", "target": g.aot})
        print(json.dumps(rows, indent=2))
        return
    from .render import gpus_table

    gpus_table(m)


# ---------------------------------------------------------------------------- envtool fit (will it fit?)

FitNprocOpt = Annotated[Optional[int], typer.Option(
    "--nproc", help="GPUs (processes) the run uses; ZeRO and FSDP shard over them (default: 1, or every GPU "
    "detected with --gpu auto).")]


@app.command()
@reported
def fit(
    config: Annotated[Path, typer.Argument(help="The trainer config (Axolotl keys).")],
    gpu: GpuOpt = "auto",
    nproc: FitNprocOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Will the config fit the GPU? The estimated peak memory per GPU, term by term, with a band, a verdict
    (fits, tight, does_not_fit, unknown) and the cheapest changes that fit. Reads the model's config.json only.

    Exit 0 whether or not it fits; 2 for bad input.

      envtool fit examples/t4-qlora.yml --gpu t4

      envtool fit config.yml --gpu a100-80gb --nproc 4 --json
    """
    # start-up: resolver.fit, resolver.render imported only when this runs
    from .fit import fit as do_fit

    found = do_fit(config, gpu, nproc)
    from trainer.config.load import MEMORY_NOTE

    for note in found.config_notes:  # a misspelt key is ignored, as Axolotl does: say so, as validate and train do
        if note.startswith(("warning", MEMORY_NOTE)):  # and a memory option Axolotl has that this estimate lacks
            say(f"note: {note}")
    if found.reason:
        say(f"envtool: {found.reason}")
    if json_out:
        print(json.dumps(found.result, indent=2))
        return
    from .render import fit_report

    fit_report(found)


# ---------------------------------------------------------------------------- envtool matrix (update, verify)
# Network commands for maintainers: requests, tomlkit and rich are imported inside them, never by `resolve`.

matrix_app = typer.Typer(name="matrix", no_args_is_help=True, rich_markup_mode=None,
                         help="Keep matrices/ fresh: regenerate from upstream metadata, verify wheel URLs.")
app.add_typer(matrix_app)

_PYPI_HELP = "PyPI-compatible index to read (default: $ENVTOOL_PYPI_URL, else https://pypi.org)."
_DIR_HELP = "The matrices directory (default: $ENVTOOL_MATRIX_DIR, else the installed matrices/)."
_TORCH_INDEX_HELP = ("torch index template with {variant} (default: $ENVTOOL_TORCH_INDEX_URL, else torch.toml's "
                     "index_url); flash-attn-3's wheels are read from the same index.")


@matrix_app.command("update")
@reported
def matrix_update(
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 when the matrices are stale."),
    json_out: bool = typer.Option(False, "--json", help="Print the changes as JSON."),
    pypi_url: Optional[str] = typer.Option(None, "--pypi-url", help=_PYPI_HELP),
    torch_index_url: Optional[str] = typer.Option(None, "--torch-index-url", help=_TORCH_INDEX_HELP),
    matrix_dir: Optional[Path] = typer.Option(None, "--matrix-dir", help=_DIR_HELP),
    pytorch_source_url: Optional[str] = typer.Option(
        None, "--pytorch-source-url", help="pytorch/pytorch raw-file URL template with {ref} and {path}, where "
        "each release's build matrix is read at its tag (default: $ENVTOOL_PYTORCH_SOURCE_URL, else "
        "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/{path})."),
    builds: bool = typer.Option(True, "--builds/--no-builds", help="Read torch's CUDA builds and arch lists from "
                                "PyTorch's release build matrix at each release tag."),
) -> None:
    """Regenerate what PyPI metadata states (torch releases, Python ranges, triton pins; xformers' torch pins;
    the training stack's newest versions; new kernels releases), where the PyTorch index holds flash-attn-3
    (its variant folders and platforms) and which CUDA builds each torch release has (PyTorch's release build
    matrix at its tag, with their arch lists), print the diff, and write it after the schema check."""
    # start-up: resolver.update (and requests) imported only when this runs
    from .update import command

    raise typer.Exit(command(check=check, json_out=json_out, pypi_url=pypi_url, matrix_dir=matrix_dir,
                             torch_index_url=torch_index_url, pytorch_source_url=pytorch_source_url,
                             builds=builds))


@matrix_app.command("verify")
@reported
def matrix_verify(
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    pypi_url: Optional[str] = typer.Option(None, "--pypi-url", help=_PYPI_HELP),
    torch_index_url: Optional[str] = typer.Option(None, "--torch-index-url", help=_TORCH_INDEX_HELP),
    flash_attn_url: Optional[str] = typer.Option(
        None, "--flash-attn-url", help="flash-attn wheel URL template with {version} and {filename} (default: "
        "$ENVTOOL_FLASH_ATTN_URL, else flash_attn.toml's wheel_url)."),
    jobs: int = typer.Option(8, "--jobs", "-j", min=1, max=64, help="Requests in flight at once."),
    matrix_dir: Optional[Path] = typer.Option(None, "--matrix-dir", help=_DIR_HELP),
) -> None:
    """Check that every wheel a plan can name exists: torch index pages, flash-attn release assets (HEAD),
    pinned PyPI versions. Exit 1 with the list of what is missing."""
    # start-up: resolver.verify (and requests) imported only when this runs
    from .verify import command

    raise typer.Exit(command(json_out=json_out, pypi_url=pypi_url, torch_index_url=torch_index_url,
                             flash_attn_url=flash_attn_url, jobs=jobs, matrix_dir=matrix_dir))


FAST_COMMANDS = ("resolve", "gpus")


def main() -> None:
    """Typer builds a parser for every command of the app it runs, on every call. `resolve` and `gpus` are what
    scripts and CI call most and must start fast, so they run in an app of their own (same options)."""
    # start-up: trainer.errors imported only when this runs (no torch, no pydantic)
    from trainer.errors import no_home

    why = no_home()
    if why:
        print(f"envtool: error: {why}", file=sys.stderr)
        sys.exit(2)
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
