"""Human output: rich tables for plans and the GPU catalog. Imported only when a human reads the output."""

from __future__ import annotations

from packaging.version import Version
from rich.console import Console
from rich.table import Table

from .matrix import Matrix, load
from .plan import PYPI_SIMPLE, Plan


def plan_table(plan: Plan, explain: bool = False, console: Console | None = None) -> None:
    console = console or Console()
    gpu = plan.gpu
    table = Table(title=f"envtool plan for {plan_title(plan)}", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    torch = plan.torch
    if torch.backend == "mps":
        table.add_row("torch", f"{torch.version}  (PyPI's macOS arm64 wheel: the MPS build; {torch.index_url})")
    else:
        table.add_row("torch", f"{torch.version}+{torch.variant}  ({torch.index_url})")
    if torch.backend not in ("cuda", "cpu"):
        table.add_row("device", f"{plan.device}" + (" (HIP)" if torch.backend == "rocm" else ""))
    if torch.cuda:
        table.add_row("CUDA", f"{torch.cuda} (driver ≥ {torch.min_driver or 'see reasons'})")
    if torch.rocm:
        table.add_row("ROCm", f"{torch.rocm} (bundled in the wheel; the host needs the amdgpu driver only)")
    driver = plan.driver
    if gpu.get("vendor") in ("nvidia", "cpu", None):
        table.add_row("driver", f"{driver['version']} (runs CUDA ≤ {driver['max_cuda']})" if driver["version"]
                      else "unknown (pass --driver)")
    if plan.env:
        table.add_row("env", " ".join(f"{k}={v}" for k, v in plan.env.items()))
    table.add_row("python", f"{plan.python} · {plan.platform}")
    runs = load().runs_as(plan.attention, plan.packing, plan.torch.version)  # what the trainer runs
    table.add_row("attention", runs if runs == plan.attention else f"{runs} (torch's own kernel; JSON attention: "
                                                                  f"{plan.attention})")
    packing = "varlen (cu_seqlens, no mask)" if plan.packing == "varlen" else "mask (block-diagonal)"
    if plan.mask_without_cudnn:
        packing += "; masked SDPA calls without cuDNN"
    table.add_row("packing", packing)
    if plan.flash_attn:
        where = f"  (from the index {plan.flash_attn.index_url})" if plan.flash_attn.index_url else ""
        if plan.flash_attn.index_url == PYPI_SIMPLE:
            beta = ", beta: a pre-release" if Version(plan.flash_attn.version).is_prerelease else ""
            where = f"  (from PyPI{beta})"
        table.add_row("flash-attn", f"{plan.flash_attn.wheel_url}{where}" if not where
                      else f"{plan.flash_attn.package}=={plan.flash_attn.version}{where}")
    table.add_row("precision", plan.precision)
    table.add_row("triton", f"{plan.triton or '-'} ({kernel_switches(plan)})")
    table.add_row("packages", ", ".join(f"{k}=={v}" for k, v in plan.packages.items()))
    table.add_row("matrix", plan.matrix_version)
    console.print(table)
    console.print("[bold]Why[/bold]")
    for reason in plan.reasons:
        console.print(f"  • {reason}", highlight=False, markup=False)
    if explain:
        rejected = Table(title="Candidates not taken", title_justify="left")
        rejected.add_column("torch")
        rejected.add_column("build")
        rejected.add_column("rejected because")
        for r in plan.rejected:
            rejected.add_row(r.torch, r.variant, r.reason)
        console.print(rejected)


def plan_title(plan: Plan) -> str:
    """`Tesla T4 · sm_75 · turing`, `AMD Instinct MI300X · gfx942 · CDNA3`, `CPU`."""
    gpu = plan.gpu
    if not plan.on_gpu:
        return "CPU"
    label = plan.target_label
    arch = gpu["arch"] if gpu.get("arch") not in (None, label) else None
    return " · ".join(x for x in (gpu["name"], label if label not in gpu["name"] else None, arch) if x)


def kernel_switches(plan: Plan) -> str:
    compile_, liger = plan.features.get("torch_compile"), plan.features.get("liger")
    if compile_ == liger:
        return f"torch.compile / liger kernels: {'on' if compile_ else 'off'}"
    return f"torch.compile: {'on' if compile_ else 'off'}, liger kernels: {'on' if liger else 'off'}"


def gpus_table(m: Matrix, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"GPUs in the matrix ({m.version}); any other: --gpu sm_XY", title_justify="left")
    for column in ("name", "aliases", "CC", "arch", "memory", "bf16", "fp8"):
        table.add_column(column)
    for g in m.gpus:
        arch = m.arch_for(g.compute_capability)
        table.add_row(g.name, ", ".join(g.aliases), g.compute_capability, arch.name,
                      f"{g.memory_gb:g} GB" if g.memory_gb else "unverified",
                      "yes" if arch.bf16 else "no", "yes" if arch.fp8 else "no")
    console.print(table)
    # start-up: resolver.vendors imported only when this runs
    from .vendors import load as load_vendors

    v = load_vendors()
    table = Table(title="AMD and Intel GPUs; any other AMD GPU: --gpu gfxNNNN; any Mac: --gpu mps",
                  title_justify="left")
    for column in ("name", "aliases", "target", "arch", "memory", "bf16", "newest torch with its code"):
        table.add_column(column)
    for g in v.amd_gpus:
        t = v.amd_target(g.gfx)
        builds = v.rocm_builds_for(g.gfx)
        newest = f"{builds[-1].torch}+{builds[-1].variant}" if builds else "none: torch does not run on it"
        memory = f"{g.memory_gb / g.devices:g} GB" + (f" × {g.devices}" if g.devices > 1 else "") if g.memory_gb \
            else "shared"
        table.add_row(g.name, ", ".join(g.aliases), g.gfx, t.family, memory, "yes" if t.bf16 else "no", newest)
    for g in v.intel_gpus:
        table.add_row(g.name, ", ".join(g.aliases), g.aot, v.intel_target(g.aot).family, "-", "at run time",
                      "every xpu build")
    console.print(table)


def doctor_table(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"envtool doctor: {result['venv']} on {result['gpu']}", title_justify="left")
    for column in ("", "check", "finding", "fix"):
        table.add_column(column, overflow="fold")
    marks = {"ok": "[green]✓[/green]", "warning": "[yellow]![/yellow]", "error": "[red]✗[/red]"}
    for f in result["findings"]:
        table.add_row(marks[f["level"]], f["check"], f["message"], f["fix"] or "")
    console.print(table)
    console.print(f"{result['errors']} error(s), {result['warnings']} warning(s)")
    plan = result.get("recommended")
    if plan:
        console.print(f"envtool's plan for this machine: torch {plan['torch']}, {plan['attention']}, "
                      f"{plan['precision']}", highlight=False)


def fit_report(found, console: Console | None = None) -> None:
    """`envtool fit`: the verdict, the terms at the peak, what was assumed, the suggestions."""
    console = console or Console(highlight=False)
    r = found.result
    gpu = r["gpu"]
    memory = f"{gpu['memory_gb']:g} GB" if gpu["memory_gb"] else "memory unknown"
    where = f"{gpu['name']} ({memory}) x {gpu['count']}"
    if r["peak_gb"] is None:
        console.print(f"{found.model} on {where}: [bold]unknown[/bold] ({found.reason})")
        return
    colour = {"fits": "green", "tight": "yellow", "does_not_fit": "red", "unknown": "white"}[r["verdict"]]
    est = found.estimate
    console.print(f"{found.model} on {where}: peak [bold]{r['peak_gb']:.1f} GB[/bold] per GPU "
                  f"(band {r['low_gb']:.1f}-{r['high_gb']:.1f}) -> [bold {colour}]{r['verdict'].replace('_', ' ')}"
                  f"[/bold {colour}]")
    table = Table(title=f"at the peak ({est.peak_moment.name.replace('_', ' ')})", title_justify="left")
    table.add_column("term")
    table.add_column("GB", justify="right")
    for term, value in r["breakdown"].items():
        if value:
            table.add_row(term.replace("_", " "), f"{value:.2f}")
    console.print(table)
    s = est.setup
    console.print(f"counted: {est.static.total / 1e9:.2f}B parameters ({est.shape.counted}), "
                  f"{est.static.trained / 1e6:.1f}M trained; {s.micro_batch} x {s.sequence_len} tokens per "
                  f"micro-batch; {s.precision}, attention {s.attention}, optimizer {s.optimizer}"
                  f"{', gradient checkpointing' if s.checkpointing else ''}"
                  f"{', loss in chunks (the logits never whole)' if est.chunked_loss else ''}")
    for note in found.notes:
        console.print(f"note: {note}")
    for suggestion in r["suggestions"]:
        console.print(f"  • {suggestion['text']} -> {suggestion['peak_gb']:.1f} GB")


def train_dry_run(training, opts) -> None:
    """`envtool train --dry-run`: the plan, the config's notes, what the trainer will run under the plan (attention,
    precision, packing, the memory estimate), where it runs and the exact command."""
    # start-up: shlex, resolver.fit imported only when this runs
    import shlex

    from .fit import lines, loss_line
    from .launch import image_line

    plan_table(training.plan)
    for note in training.notes:
        print(f"config: {note}")
    trainer, launch = training.trainer, training.launch
    print(f"trainer: attention {trainer['attention']}, precision {trainer['precision']}"
          f"{' + tf32' if trainer['tf32'] else ''}")
    print(f"trainer: packing {trainer['isolation']}")
    print(f"trainer: loss {loss_line(training.cfg)}")
    if training.fit is not None:
        print("\n".join(lines(training.fit)))
    for note in trainer["notes"]:
        print(f"note: {note}")
    print(f"environment: {launch.kind} {launch.path or ''} — {launch.why}")
    if launch.kind != "image":
        print(f"image: {image_line(training.plan, opts)}")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
    print(f"command: {env + ' ' if env else ''}{shlex.join(launch.command)}")
