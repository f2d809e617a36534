"""The `envtool` command line: parse arguments, call the stage that does the work, print the result.

Exit codes: 0 success; 1 failure while doing the work; 2 bad input or an unsatisfiable request.
Errors are one line on stderr; --debug shows the traceback. `resolve` stays fast: torch, docker,
requests, transformers and rich are imported only where they are used.
"""

from __future__ import annotations

import functools
import json
import sys

import typer

from . import __version__
from .errors import EnvtoolError

app = typer.Typer(
    name="envtool",
    help="Detect the GPU, pick the fastest stack that really runs on it, lock it, containerize it, train in it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

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


@app.command()
@reported
def resolve(
    gpu: str = typer.Option("auto", "--gpu", help="'auto' (detect this machine), a GPU name or alias (t4, a100, "
                            "'Tesla V100'), a compute capability (sm_80, 8.6), 'cpu', or a comma list for one plan "
                            "per target. `envtool gpus` lists the names."),
    driver: str = typer.Option(None, "--driver", help="NVIDIA driver of the run host, e.g. 550.54.14 "
                               "(default: detected with --gpu auto, unknown otherwise)."),
    python: str = typer.Option(None, "--python", help="Python of the environment, e.g. 3.11 (default: this one)."),
    torch: str = typer.Option(None, "--torch", help="Pin torch: 2.8 (newest 2.8.x) or 2.8.0."),
    cuda: str = typer.Option(None, "--cuda", help="Pin the CUDA variant: 12.6 or 12."),
    flash_attn: str = typer.Option(None, "--flash-attn", help="Require this flash-attn release's prebuilt wheel."),
    no_flash_attn: bool = typer.Option(False, "--no-flash-attn", help="Never use flash-attn (SDPA instead)."),
    attention: str = typer.Option(None, "--attention", help="Force the attention backend: flash_attention_2, "
                                  "flash_attention_3, sdpa, xformers or eager."),
    platform: str = typer.Option(None, "--platform", help="x86_64 or aarch64 (default: this machine)."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON (a list for several targets)."),
    fmt: str = typer.Option("table", "--format", help="table, json, or github (a CI strategy matrix)."),
    explain: bool = typer.Option(False, "--explain", help="Also show every candidate build not taken, and why."),
) -> None:
    """Plan the environment for a GPU: torch build and CUDA variant, attention, precision, triton, packages.

    Every decision comes with its reason. Examples:

      envtool resolve --gpu auto

      envtool resolve --gpu sm_80 --driver 550.54.14 --python 3.11 --json

      envtool resolve --gpu v100 --torch 2.8 --explain

      envtool resolve --gpu t4,v100,a100 --format github
    """
    from .errors import BadInput
    from .hardware import targets
    from .matrix import load
    from .solve import Request, solve

    fmt = "json" if json_out else fmt
    if fmt not in ("table", "json", "github"):
        raise BadInput(f"--format {fmt!r}: choose table, json or github")
    m = load()
    plans = []
    for t in targets(gpu, m, driver):
        req = Request(gpu=t.gpu, driver=t.driver, python=python or _host_python(),
                      platform=platform or _host_platform(), torch=torch, cuda=cuda, flash_attn=flash_attn,
                      no_flash_attn=no_flash_attn, attention=attention, target=t.label, notes=t.notes)
        plans.append(solve(req, m))

    if fmt == "json":
        data = [p.to_dict(explain) for p in plans]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    elif fmt == "github":
        from .ci import github_matrix

        print(github_matrix(plans))
    else:
        from .render import plan_table

        for plan in plans:
            plan_table(plan, explain)


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
