"""The GPU acceptance kit: everything the project promises about GPUs, proved on the GPU at hand in one run.

    bash bench/gpu/run.sh            # on a GPU host: install the bundle, run every step, write the report
    python bench/gpu/kit.py --cpu    # the same steps on the CPU with a tiny model (the slow-tier test runs this)

Steps, each in its own process, each bounded in time (`STEPS`: seconds on a GPU, on the CPU) inside one budget
(`--budget`, 470 s on a GPU: the whole run stays under 8 minutes). A step writes its figures, or "skipped: <reason>",
or "failed: <reason>"; a failed or timed-out step is recorded and the next one runs.

0. install: the wheel bundle (bench/gpu/bundle.py) checked against its manifest, then installed with
   `pip install --no-index --find-links` into a venv that sees the machine's own site-packages (its torch stays the
   one that runs, never replaced), and the project itself from the working tree (editable, --no-deps);
1. detect: `envtool resolve --gpu auto --json` and `envtool doctor --json` on the machine's GPU, driver and torch;
2. numerics: packed rows through torch's varlen_attn (the trainer's backend, trainer/model/attention_varlen.py)
   against each sequence alone under SDPA, loss and gradients in bf16; the packed row under SDPA with the
   block-diagonal mask (trainer/batch/attention.py) with cuDNN attention forced, by default, and without cuDNN (the
   trainer's mask_without_cudnn path); and the packed row with no isolation at all, which must differ;
3. speed: trained tokens/s of `python -m trainer train` packed by varlen, packed by a mask (a plan whose packing is
   mask) and padded: same model (Qwen2.5-0.5B's config.json, random weights), same data, same steps;
4. memory: torch.cuda.max_memory_allocated of a bf16 full fine-tune and of a LoRA run against `envtool fit`'s
   estimate for the same config; `micro_batch_size: auto`'s pick, and its back-off on a real out-of-memory error
   (device memory taken by a ballast tensor in the trainer's own process before it starts);
5. train: `envtool train CONFIG` as a user types it, in the machine's environment, to a saved model.

The report (JSON + Markdown) goes to $OUT when set, else bench/results/, named after the GPU, driver and date.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS = Path(os.environ.get("KIT_WHEELS") or HERE / "wheels")  # (KIT_WHEELS: another bundle, to try one)
GIB = 2 ** 30

# (name, seconds on a GPU, seconds on the CPU, what it proves)
STEPS = [
    ("install", 90, 240, "the bundle installs offline beside the machine's torch, and the project from the tree"),
    ("detect", 30, 120, "envtool resolve --gpu auto and envtool doctor on the real GPU and driver"),
    ("numerics", 60, 150, "packed rows: varlen_attn and masked SDPA (with and without cuDNN) = each sequence alone; "
                          "the chunked loss = the full logits"),
    ("speed", 110, 300, "trained tokens/s: packing by varlen vs by mask vs padding"),
    ("memory", 100, 240, "peak allocated vs envtool fit's estimate; micro_batch_size auto's pick and back-off; "
                         "the loss's peak, chunked vs full logits"),
    ("train", 75, 240, "envtool train CONFIG to a saved model, in the machine's environment"),
]
GPU_BUDGET, CPU_BUDGET = 470, 1100  # (the CPU's bounds are for a busy 2-core machine)
REPORT_RESERVE = 5  # seconds kept for writing the report

# The model on a GPU: Qwen/Qwen2.5-0.5B's config.json, as bench/data/model_configs.toml captured it (random weights).
GPU_MODEL = "Qwen/Qwen2.5-0.5B"


class Skip(Exception):
    """Raised by a step (or a part of one) that cannot run here: reported as skipped, with the reason."""


# ============================================================================ the orchestrator (any Python, stdlib)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode: tiny model, CPU device, GPU-only parts skipped")
    parser.add_argument("--out", type=Path, help="report folder (default: $OUT, else bench/results/)")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole run (default {GPU_BUDGET}; --cpu "
                                                     f"{CPU_BUDGET})")
    parser.add_argument("--install", action="store_true", help="with --cpu: install the bundle too, as on a GPU host "
                                                                "(the bundle must be built for this Python)")
    parser.add_argument("--steps", help="comma-separated subset of: " + ", ".join(s[0] for s in STEPS))
    parser.add_argument("--work", type=Path, help="working folder (default: a fresh temporary one, removed after)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this process
    parser.add_argument("--run-trainer", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--ballast-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_trainer:
        return run_trainer(Path(args.run_trainer[0]), Path(args.run_trainer[1]), args.ballast_gib)
    if args.step:
        return run_step(args.step, args.work, args.cpu)
    return orchestrate(args)


def orchestrate(args) -> int:
    started = time.time()
    on_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the running step is killed, the work removed
    budget = args.budget or (CPU_BUDGET if args.cpu else GPU_BUDGET)
    deadline = started + budget
    wanted = set(args.steps.split(",")) if args.steps else None
    unknown = (wanted or set()) - {s[0] for s in STEPS}
    if unknown:
        print(f"kit.py: --steps: unknown step {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results")
    keep = args.work is not None
    work = (args.work or Path(tempfile.mkdtemp(prefix="envtool-gpu-kit-"))).resolve()
    (work / "results").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    context = {"cpu": args.cpu, "install": args.install or not args.cpu, "python": sys.executable, "repo": str(REPO),
               "work": str(work)}
    (work / "context.json").write_text(json.dumps(context))
    results, paths = {}, None
    try:
        for name, gpu_limit, cpu_limit, what in STEPS:
            if wanted is not None and name not in wanted:
                continue
            limit = min(cpu_limit if args.cpu else gpu_limit, deadline - time.time() - REPORT_RESERVE)
            if limit < 5:
                result = {"status": "skipped", "reason": f"the kit's budget of {budget:.0f} s ran out before it"}
            else:
                python = sys.executable if name == "install" else context["python"]
                result = spawn_step(name, python, work, args.cpu, limit)
            result["what"] = what
            results[name] = result
            if name == "install" and result.get("python"):
                context["python"] = result["python"]  # every later step runs in the environment it made
                (work / "context.json").write_text(json.dumps(context))
            print(f"[kit] {name}: {result['status']}" + (f" ({result['reason']})" if result.get("reason") else "")
                  + f" in {result.get('seconds', 0):.0f} s", flush=True)
            previous, paths = paths, report(args, started, budget, results, out, work)  # after every step
            if previous and previous != paths:  # (named after the GPU once detect has found it)
                for old in (*previous, previous[0].with_suffix(".logs")):
                    shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
        print(paths[1].read_text())
        print(f"[kit] report: {paths[0]} and {paths[1]} ({time.time() - started:.0f} s)")
    finally:
        signal.signal(signal.SIGTERM, on_term)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    return 1 if failed else 0


def report(args, started: float, budget: float, results: dict, out: Path, work: Path) -> tuple[Path, Path]:
    """The report so far, JSON and Markdown, and every step's whole log beside them (<stem>.logs/)."""
    data = {"kit": "envtool GPU acceptance kit (bench/gpu/kit.py)", "mode": "cpu" if args.cpu else "gpu",
            "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 1), "budget_s": budget, "machine": machine(results, args.cpu),
            "steps": results}
    paths = write_report(data, out)
    logs = paths[0].with_suffix(".logs")
    shutil.rmtree(logs, ignore_errors=True)
    shutil.copytree(work / "logs", logs)
    return paths


def spawn_step(name: str, python: str, work: Path, cpu: bool, limit: float) -> dict:
    """One step in its own process group, killed at `limit` seconds; its JSON result, or why there is none."""
    result_file = work / "results" / f"{name}.json"
    log = work / "logs" / f"{name}.log"
    command = [python, str(Path(__file__).resolve()), "--step", name, "--work", str(work)] + (["--cpu"] if cpu else [])
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled"}
    begun = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        except BaseException:  # the kit itself stopped (Ctrl-C, SIGTERM): its step's processes stop with it
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    seconds = round(time.time() - begun, 1)
    if result_file.is_file():
        result = json.loads(result_file.read_text())
    else:
        result = {"status": "failed", "reason": f"timed out after {limit:.0f} s (the step's bound)" if code is None
                  else f"exited {code} without a result: {tail(log, 1)}"}
    if code is None and result.get("status") != "failed":
        result = {**result, "status": "failed", "reason": f"timed out after {limit:.0f} s (the step's bound)"}
    partial = result_file.with_suffix(".partial.json")
    if "figures" not in result and partial.is_file():  # the parts it finished before it was stopped
        result["figures"] = json.loads(partial.read_text())
    result["seconds"] = seconds
    result["log_tail"] = tail(log, 15)
    return result


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def machine(results: dict, cpu: bool) -> dict:
    detect = results.get("detect", {}).get("figures", {})
    plan = detect.get("resolve", {}).get("plan") or {}
    gpu = (plan.get("gpu") or {}).get("name") or detect.get("device") or ("cpu" if cpu else "unknown-gpu")
    return {"gpu": gpu, "driver": (plan.get("driver") or {}).get("version"),
            "torch": detect.get("torch"), "python": plan.get("python")}


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    m = report["machine"]
    date = report["started"][:10]
    stem = "gpu-kit-" + "-".join(re.sub(r"[^A-Za-z0-9.]+", "-", str(x)).strip("-").lower()
                                 for x in (m["gpu"], m.get("driver") or "no-driver", date))
    paths = (out / f"{stem}.json", out / f"{stem}.md")
    for path, text in zip(paths, (json.dumps(report, indent=2) + "\n", markdown(report))):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return paths


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# envtool GPU acceptance kit: {m['gpu']}, driver {m.get('driver') or '-'}, {report['started']}", "",
             f"Mode: {report['mode']}; torch {m.get('torch') or '-'}; Python {m.get('python') or '-'}; "
             f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget.", "",
             "| step | status | seconds | what it proves |", "| --- | --- | --- | --- |"]
    for name, r in report["steps"].items():
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {name} | {status.replace('|', '/')} | {r.get('seconds', 0):.0f} | {r.get('what', '')} |")
    for name, r in report["steps"].items():
        lines += ["", f"## {name}", ""]
        if r.get("summary"):
            lines += [f"- {s}" for s in r["summary"]]
        if r.get("figures"):
            lines += ["", "```json", json.dumps(r["figures"], indent=1)[:6000], "```"]
        if r["status"] == "failed" and r.get("log_tail"):
            lines += ["", "Log tail:", "", "```", r["log_tail"], "```"]
    return "\n".join(lines) + "\n"


# ============================================================================ one step (the environment's Python)


def run_step(name: str, work: Path, cpu: bool) -> int:
    work = Path(work)
    ctx = json.loads((work / "context.json").read_text())
    ctx["cpu"] = cpu
    os.environ["KIT_PARTIAL"] = str(work / "results" / f"{name}.partial.json")
    result: dict
    try:
        figures, summary = globals()[f"step_{name}"](ctx, work)
        result = {"status": "ok", "figures": figures, "summary": summary}
        parts = [v for v in figures.values() if isinstance(v, dict) and "status" in v]
        if any(p["status"] == "failed" for p in parts):
            failed = [f"{k}: {v['reason']}" for k, v in figures.items()
                      if isinstance(v, dict) and v.get("status") == "failed"]
            result["status"], result["reason"] = "failed", "; ".join(failed)
        if name == "install" and figures.get("python"):
            result["python"] = figures["python"]
    except Skip as why:
        result = {"status": "skipped", "reason": str(why)}
    except Exception as err:
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    path = work / "results" / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(path)
    return 0


def checkpoint(figures: dict) -> None:
    """The step's figures so far, where the kit finds them if the step is stopped at its bound."""
    path = Path(os.environ["KIT_PARTIAL"]) if os.environ.get("KIT_PARTIAL") else None
    if path is not None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(figures, default=str))
        tmp.replace(path)


def part(fn, *args, **kwargs) -> dict:
    """A part of a step: its figures with status ok, or skipped/failed with the reason (the others still run)."""
    try:
        return {"status": "ok", **fn(*args, **kwargs)}
    except Skip as why:
        return {"status": "skipped", "reason": str(why)}
    except Exception as err:
        traceback.print_exc()
        return {"status": "failed", "reason": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"}


def sh(command: list[str], timeout: float = 120, env: dict | None = None, check: bool = True,
       cwd: Path | None = None, capture: bool = True) -> subprocess.CompletedProcess:
    """Run a command; `capture=False` streams its output into this step's log as it comes (a training)."""
    sys.stdout.write(f"$ {' '.join(map(str, command))}\n")
    sys.stdout.flush()
    proc = subprocess.run(command, capture_output=capture, text=True, timeout=timeout, env=env, cwd=cwd or REPO)
    proc.stdout, proc.stderr = proc.stdout or "", proc.stderr or ""
    sys.stdout.write(f"-> exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}\n")
    sys.stdout.flush()
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command[:4]))} exited {proc.returncode}: "
                           f"{(proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [''])[-1]}")
    return proc


def envtool(ctx) -> str:
    """The `envtool` command of the environment the steps run in (the console script pip installed)."""
    script = Path(ctx["python"]).parent / "envtool"
    found = str(script) if script.exists() else shutil.which("envtool")
    if not found:
        raise RuntimeError(f"no envtool command beside {ctx['python']} nor on PATH (did the install step fail?)")
    return found


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def need_gpu(ctx, what: str) -> None:
    if ctx["cpu"]:
        raise Skip(f"--cpu: {what}")
    if not has_cuda():
        raise Skip(f"torch.cuda.is_available() is False here: {what}")


# ---------------------------------------------------------------------------- 0. install


KIT_MARK = ".envtool-gpu-kit"  # in the root of the venv the kit makes: what it may remove before its next run


def remove_own_venv(venv: Path) -> None:
    """Remove the venv an earlier run of the kit made at `venv` (KIT_VENV), and nothing else: a path that exists
    without the kit's mark (a project folder, someone's venv, a file) is refused in one line, untouched."""
    if not venv.exists() and not venv.is_symlink():
        return
    if venv.is_symlink() or not venv.is_dir() or not (venv / KIT_MARK).is_file():
        raise RuntimeError(f"KIT_VENV {venv}: exists and is not a venv this kit made (no {KIT_MARK} in it); the kit "
                           "removes only its own: name a new path, or remove it yourself")
    shutil.rmtree(venv)


def step_install(ctx, work: Path):
    """The bundle checked, then installed beside the machine's torch, and the project from the working tree."""
    if not ctx.get("install"):
        sys.path.insert(0, str(HERE))
        from bundle import check_bundle

        if not (WHEELS / "manifest.json").is_file():
            raise Skip("--cpu runs in the interpreter that started it (no bundle at bench/gpu/wheels to check)")
        problems = check_bundle(WHEELS)
        return {"bundle": {"status": "failed" if problems else "ok", "reason": "; ".join(problems),
                           "wheels": len(json.loads((WHEELS / "manifest.json").read_text())["wheels"])}}, \
            ["--cpu: the bundle is checked, not installed; the steps run in the interpreter that started the kit"]
    sys.path.insert(0, str(HERE))
    from bundle import check_bundle

    problems = check_bundle(WHEELS)
    if problems:
        raise RuntimeError("the bundle does not match its manifest: " + "; ".join(problems[:5]))
    manifest = json.loads((WHEELS / "manifest.json").read_text())
    base = sys.executable
    torch_before = sh([base, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    venv = Path(os.environ.get("KIT_VENV") or "/tmp/envtool-gpu-kit-venv")
    remove_own_venv(venv)
    # A venv whose sys.path ends with the machine's own site-packages (a .pth file: --system-site-packages alone would
    # reach the base interpreter's, not those of a venv or a conda env the stack lives in). Its own packages come
    # first; the machine's torch and pip are the ones seen; nothing outside the venv is ever uninstalled.
    sh([base, "-m", "venv", "--without-pip", str(venv)])
    (venv / KIT_MARK).write_text("made by envtool's GPU kit (bench/gpu/kit.py), which removes it before its next run\n")
    theirs = json.loads(sh([base, "-c", "import json, sys, os; print(json.dumps([p for p in sys.path if os.path"
                            ".isdir(p) and os.path.basename(p) in ('site-packages', 'dist-packages')]))"]).stdout)
    ours = sh([str(venv / "bin" / "python"), "-c",
               "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    Path(ours, "_envtool_gpu_kit_machine.pth").write_text("".join(f"{p}\n" for p in theirs))
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS), "--disable-pip-version-check"]
    done = sh(pip + manifest["requirements"], timeout=240)
    sh(pip + ["--no-deps", "--editable", str(REPO)], timeout=120)  # the build backend (uv_build) from the bundle
    torch_after = sh([python, "-c", "import torch; print(torch.__version__, torch.__file__)"]).stdout.strip()
    versions = json.loads(sh([python, "-c", "import json, importlib.metadata as md; print(json.dumps({n: md.version(n) "
                              "for n in ('torch', 'transformers', 'peft', 'accelerate', 'datasets', 'trl', "
                              "'pydantic', 'tomlkit', 'huggingface-hub', 'envtool-llm')}))"]).stdout)
    if torch_after.split()[0] != torch_before:
        raise RuntimeError(f"torch changed: {torch_before} before, {torch_after} after the install")
    installed = next((l for l in done.stdout.splitlines() if l.startswith("Successfully installed")), "nothing new")
    return {"python": python, "torch_before": torch_before, "torch_after": torch_after, "versions": versions,
            "bundle": {"wheels": len(manifest["wheels"]), "mib": round(manifest["total_size"] / 2 ** 20, 1)},
            "pip": installed}, \
        [f"bundle checked ({len(manifest['wheels'])} wheels, {manifest['total_size'] / 2 ** 20:.1f} MiB), installed "
         f"offline into {venv} beside the machine's torch {torch_before} (unchanged)", installed[:300]]


# ---------------------------------------------------------------------------- 1. detect


def step_detect(ctx, work: Path):
    import torch

    tool = envtool(ctx)
    resolve = sh([tool, "resolve", "--gpu", "auto", "--json"], timeout=60, check=False)
    doctor = sh([tool, "doctor", "--json"], timeout=90, check=False)
    figures = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        figures["device"] = torch.cuda.get_device_name(0)
        figures["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        figures["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        figures["arch_list"] = torch.cuda.get_arch_list()
    figures["resolve"] = _command_part(resolve)
    figures["doctor"] = _command_part(doctor)
    plan = figures["resolve"].get("plan") or {}
    summary = []
    if plan:
        cc = str(plan["gpu"].get("compute_capability")).replace(".", "")
        summary.append(f"resolve: {plan['gpu'].get('name')} (sm_{cc}), driver "
                       f"{(plan.get('driver') or {}).get('version')}, torch {plan['torch']['version']}"
                       f"+{plan['torch'].get('variant')}, attention {plan.get('attention')}, packing "
                       f"{plan.get('packing')}, mask_without_cudnn {plan.get('mask_without_cudnn')}")
    verdict = figures["doctor"].get("plan") or {}  # (the parsed JSON of doctor --json)
    if verdict:
        findings = verdict.get("findings") or []
        findings = [f for f in findings if f.get("level") != "ok"] or findings
        summary.append(f"doctor (exit {figures['doctor']['exit']}): " + ("; ".join(
            f"{f.get('level')}: {f.get('message')}" for f in findings[:6]) or "no findings"))
    return figures, summary


def _command_part(proc) -> dict:
    out = {"exit": proc.returncode, "status": "ok" if proc.returncode == 0 else "failed"}
    try:
        out["plan"] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out["stdout"] = proc.stdout[-2000:]
    if proc.returncode != 0:
        out["reason"] = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:300]
    return out


# ---------------------------------------------------------------------------- the model, the data


def model_dir(ctx, work: Path) -> Path:
    """The kit's model, made once per run: on a GPU Qwen2.5-0.5B's config with random weights (bf16), on the CPU the
    trainer's tiny model; both with the trainer's tiny tokenizer (trainer/model/tiny.py)."""
    folder = work / "model"
    if (folder / "config.json").is_file():
        return folder
    import tomllib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model.tiny import build_tokenizer, make_tiny_model

    tmp = work / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if ctx["cpu"]:
        make_tiny_model(tmp, family="qwen2")
    else:
        tokenizer = build_tokenizer()
        captured = tomllib.loads((REPO / "bench" / "data" / "model_configs.toml").read_text())["models"][GPU_MODEL]
        raw = dict(captured["config"])
        model_type = raw.pop("model_type")
        raw.pop("architectures", None)
        config = AutoConfig.for_model(model_type, **raw, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
    tmp.rename(folder)
    return folder


def data_file(work: Path, rows: int) -> Path:
    """Completion rows with log-normal lengths (bench/bench_train_packed_vs_padded.py's generator)."""
    path = work / f"data-{rows}.jsonl"
    if not path.is_file():
        sys.path.insert(0, str(REPO / "bench"))
        from bench_train_packed_vs_padded import write_data

        write_data(path, rows)
    return path


def trainer_config(ctx, work: Path, name: str, **overrides) -> Path:
    import yaml

    cpu = ctx["cpu"]
    config = {"base_model": str(model_dir(ctx, work)),
              "datasets": [{"path": str(data_file(work, 600 if cpu else 4000)), "type": "completion"}],
              "dataset_prepared_path": str(work / "prepared"), "output_dir": str(work / "runs" / name),
              "sequence_len": 256 if cpu else 4096, "sample_packing": True, "micro_batch_size": 1,
              "gradient_accumulation_steps": 1, "max_steps": 4 if cpu else 25, "learning_rate": 1e-5,
              "lr_scheduler": "constant", "optimizer": "adamw_torch", "attn_implementation": "sdpa",
              "bf16": "auto", "logging_steps": 1, "seed": 0, "gradient_checkpointing": False}
    config.update(overrides)
    path = work / "configs" / f"{name}.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def train(ctx, work: Path, config: Path, timeout: float, env: dict | None = None, ballast_gib: float = 0.0) -> dict:
    """`python -m trainer train CONFIG` in a process of its own (run_trainer), with its peak allocated memory."""
    result = config.with_suffix(".result.json")
    command = [ctx["python"], str(Path(__file__).resolve()), "--run-trainer", str(config), str(result)]
    if ballast_gib:
        command += ["--ballast-gib", f"{ballast_gib:.3f}"]
    sh(command, timeout=timeout, env={**os.environ, **(env or {})}, check=False, capture=False)
    if not result.is_file():
        raise RuntimeError(f"the trainer left no result for {config.name}")
    out = json.loads(result.read_text())
    if out["exit"] != 0:
        raise RuntimeError(f"python -m trainer train {config.name} exited {out['exit']}: {out.get('error', '')}")
    return out


def run_trainer(config: Path, result: Path, ballast_gib: float) -> int:
    """`python -m trainer train CONFIG` in this process (trainer.cli.main, as python -m trainer calls it), then
    torch.cuda.max_memory_allocated() of the run (less the ballast, if any) into RESULT."""
    import torch

    cuda = torch.cuda.is_available()
    ballast = None
    if cuda:
        torch.cuda.init()
        if ballast_gib > 0:  # device memory the run cannot have: its first steps meet a real out-of-memory error
            ballast = torch.empty(int(ballast_gib * GIB), dtype=torch.uint8, device="cuda")
        torch.cuda.reset_peak_memory_stats()
    code, error = 1, ""
    begun = time.time()
    from trainer.cli import main as trainer_main

    try:
        code = trainer_main(["train", str(config)])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 (recorded, not raised: the kit goes on)
        error = f"{type(e).__name__}: {e}"[:300]
        traceback.print_exc()
    out = {"exit": code, "error": error, "seconds": round(time.time() - begun, 1)}
    if cuda:
        taken = ballast.numel() if ballast is not None else 0
        out["peak_allocated_gib"] = round((torch.cuda.max_memory_allocated() - taken) / GIB, 3)
        out["ballast_gib"] = round(taken / GIB, 3)
    result.write_text(json.dumps(out))
    return 0


def metrics(output_dir: Path, warmup: int = 3) -> dict:
    rows = [json.loads(l) for l in (output_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r for r in rows if "loss" in r and "tokens" in r][warmup:]
    if not steps:
        raise RuntimeError(f"{output_dir}/metrics.jsonl has no step past the {warmup} warm-up steps")
    tokens, seconds = sum(r["tokens"] for r in steps), sum(r["step_time_s"] for r in steps)
    return {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 3),
            "steps": len(steps), "last_loss": steps[-1]["loss"]}


# ---------------------------------------------------------------------------- 2. numerics


def step_numerics(ctx, work: Path):
    """Packed rows against each sequence alone, loss and gradients: varlen_attn, masked SDPA (cuDNN forced, the
    default choice, cuDNN off), and no isolation (must differ: the check can fail)."""
    import torch

    device = "cpu" if ctx["cpu"] or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model(ctx, work, device, dtype)
    lengths = [37, 200, 311, 475] if device == "cuda" else [9, 30, 57]
    vocab = 300  # the tiny tokenizer's ids
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": (ids := torch.randint(5, vocab, (n,), generator=generator).tolist()), "labels": ids}
                for n in lengths]
    tol = {"loss_rel": 1e-2, "grad_rel_norm": 5e-2, "grad_cosine": 0.995} if dtype == torch.bfloat16 else \
        {"loss_rel": 1e-4, "grad_rel_norm": 1e-3, "grad_cosine": 0.99999}
    reference = _reference(model, examples, device)
    figures = {"device": device, "dtype": str(dtype).replace("torch.", ""), "lengths": lengths, "tolerances": tol,
               "reference_loss": reference[0]}
    checkpoint(figures)
    figures["varlen_attn"] = part(_compare_packed, ctx, model, examples, reference, tol, "varlen", device)
    checkpoint(figures)
    figures["masked_sdpa_cudnn"] = part(_compare_packed, ctx, model, examples, reference, tol, "cudnn", device)
    figures["masked_sdpa_default"] = part(_compare_packed, ctx, model, examples, reference, tol, "default", device)
    figures["masked_sdpa_without_cudnn"] = part(_compare_packed, ctx, model, examples, reference, tol, "no_cudnn",
                                                device)
    figures["no_isolation"] = part(_compare_packed, ctx, model, examples, reference, tol, "none", device)
    figures["chunked_loss"] = part(_compare_chunked, model, examples, reference, tol, device)
    leak = figures["no_isolation"]
    if leak["status"] == "ok":  # this one must NOT match: else the comparison cannot tell isolation from none
        leak["status"] = "ok" if not leak["within"] else "failed"
        if leak["within"]:
            leak["reason"] = "the packed row with no isolation matched the reference: the check cannot fail"
    summary = [f"{k}: {v['status']}" + (f" (loss rel {v['loss_rel']:.2e}, grad rel norm {v['grad_rel_norm']:.2e}, "
                                        f"cosine {v['grad_cosine']:.5f}{', within' if v['within'] else ', OUTSIDE'} "
                                        "tolerance)" if "loss_rel" in v else f": {v.get('reason')}")
               for k, v in figures.items() if isinstance(v, dict) and "status" in v]
    return figures, [f"tolerances ({figures['dtype']}): {tol}"] + summary


def load_model(ctx, work: Path, device: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(ctx, work), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).train()


def _loss_and_grads(model, batch: dict, device: str):
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"].to(device)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")
    loss.backward()
    grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
             for p in model.parameters()]
    return float(loss.detach()), grads


def _reference(model, examples, device):
    """Each sequence alone under plain SDPA (no mask, one row): summed loss and summed gradients."""
    import torch

    from trainer.batch.collate import Collator

    model.set_attn_implementation("sdpa")
    total, grads = 0.0, None
    for example in examples:
        batch = Collator(pad_token_id=0, attention="sdpa")([[example]])
        batch.pop("attention_mask", None)  # one sequence: causal, nothing to keep apart
        loss, g = _loss_and_grads(model, batch, device)
        total += loss
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    return total, grads


def _compare_packed(ctx, model, examples, reference, tol, how: str, device: str) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.batch.collate import Collator
    from trainer.model import attention_varlen

    runtime = type("Runtime", (), {"mask_without_cudnn": how == "no_cudnn"})()
    attention_varlen.install(runtime)  # the trainer's own registration (varlen_attn; sdpa without cuDNN on masks)
    context = None
    if how == "varlen":
        if device != "cuda":
            raise Skip("varlen_attn runs on CUDA only (torch's CPU build has no flash-attention kernel)")
        model.set_attn_implementation(attention_varlen.NAME)
        batch = Collator(pad_token_id=0, attention=attention_varlen.NAME)([examples])
    else:
        model.set_attn_implementation("sdpa")
        batch = Collator(pad_token_id=0, attention="sdpa")([examples])
        if how == "none":
            # plain causal over the whole row, positions running on: the sequences see each other (transformers would
            # find the sequences from position_ids restarting at 0 and keep them apart itself)
            batch.pop("attention_mask")
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
        elif how == "cudnn":
            if device != "cuda":
                raise Skip("cuDNN attention is CUDA's")
            context = sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
        elif how == "no_cudnn" and device != "cuda":
            raise Skip("cuDNN attention is CUDA's: the CPU has nothing to turn off")
    calls = attention_varlen._WithoutCudnn.masked_calls
    try:
        if context is not None:
            with context:
                loss, grads = _loss_and_grads(model, batch, device)
        else:
            loss, grads = _loss_and_grads(model, batch, device)
    except RuntimeError as err:
        if how == "cudnn" and "kernel" in str(err).lower():  # a finding, not a failure: cuDNN did not take the call
            raise Skip(f"cuDNN SDPA does not take this masked call on torch {torch.__version__}: "
                       f"{str(err).splitlines()[0][:200]}") from None
        raise
    finally:
        attention_varlen._WithoutCudnn.on = False
        model.set_attn_implementation("sdpa")
    out = {**_against(reference, loss, grads, tol), "tokens": int(batch["input_ids"].numel())}
    if how == "no_cudnn":
        out["masked_calls_without_cudnn"] = attention_varlen._WithoutCudnn.masked_calls - calls
    if how != "none" and not out["within"]:  # a failure, with its figures
        out["status"], out["reason"] = "failed", (f"outside tolerance: loss rel {out['loss_rel']:.2e}, grad rel norm "
                                                  f"{out['grad_rel_norm']:.2e}, cosine {out['grad_cosine']:.5f}")
    return out


def _against(reference, loss: float, grads: list, tol: dict) -> dict:
    """Loss and gradients against the reference's: relative loss error, relative gradient norm error, cosine."""
    ref_loss, ref_grads = reference
    diff2 = ref2 = dot = new2 = 0.0
    for a, b in zip(ref_grads, grads):
        diff2 += float((a - b).pow(2).sum())
        ref2 += float(a.pow(2).sum())
        new2 += float(b.pow(2).sum())
        dot += float((a * b).sum())
    out = {"loss": loss, "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
           "grad_rel_norm": (diff2 ** 0.5) / max(ref2 ** 0.5, 1e-30),
           "grad_cosine": dot / max((ref2 * new2) ** 0.5, 1e-30)}
    out["within"] = out["loss_rel"] <= tol["loss_rel"] and out["grad_rel_norm"] <= tol["grad_rel_norm"] \
        and out["grad_cosine"] >= tol["grad_cosine"]
    return out


def _compare_chunked(model, examples, reference, tol, device: str) -> dict:
    """The trainer's loss (trainer/objectives/loss.py: the chunked cross-entropy where the model allows it) on each
    sequence alone, against the reference's full logits: the same loss and gradients in the machine's dtype."""
    import torch

    from trainer.batch.collate import Collator
    from trainer.objectives import chunked_loss
    from trainer.objectives.loss import token_loss_sum

    model.set_attn_implementation("sdpa")
    total, grads = 0.0, None
    for example in examples:
        batch = Collator(pad_token_id=0, attention="sdpa")([[example]])
        batch.pop("attention_mask", None)
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        loss.backward()
        g = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
             for p in model.parameters()]
        total += float(loss.detach())
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    out = {**_against(reference, total, grads, tol), "chunked": chunked_loss._decided.get(model) is not None,
           "notes": chunked_loss.notes()}
    if not out["within"]:
        out["status"], out["reason"] = "failed", (f"outside tolerance: loss rel {out['loss_rel']:.2e}, grad rel norm "
                                                  f"{out['grad_rel_norm']:.2e}, cosine {out['grad_cosine']:.5f}")
    return out


# ---------------------------------------------------------------------------- 3. speed


def step_speed(ctx, work: Path):
    """The same model, data and steps through `python -m trainer train`, packed by varlen, by a mask, and padded."""
    import torch

    on_gpu = not ctx["cpu"] and torch.cuda.is_available()
    seq = 256 if ctx["cpu"] else 4096
    plans = _plans(ctx, work) if on_gpu else {}
    per_batch, lengths = _padded_batch(ctx, work, seq)
    figures = {"sequence_len": seq, "model": "tiny qwen2 (trainer/model/tiny.py)" if ctx["cpu"] else
               f"{GPU_MODEL} config, random weights, bf16", "padded_micro_batch": per_batch, "lengths": lengths}
    runs = {
        "varlen": dict(sample_packing=True, micro_batch_size=1),
        "mask": dict(sample_packing=True, micro_batch_size=1),
        "padding": dict(sample_packing=False, micro_batch_size=per_batch),
    }
    for mode, overrides in runs.items():
        figures[mode] = part(_speed_run, ctx, work, mode, overrides, plans, on_gpu)
        checkpoint(figures)
    summary = []
    base = figures["padding"].get("tokens_per_s")
    for mode in runs:
        r = figures[mode]
        if r["status"] == "ok":
            ratio = f" ({r['tokens_per_s'] / base:.2f}x padding)" if base else ""
            summary.append(f"{mode}: {r['tokens_per_s']:,.0f} tokens/s{ratio}, {r['tokens']:,} tokens over "
                           f"{r['steps']} steps after warm-up")
        else:
            summary.append(f"{mode}: {r['status']}: {r.get('reason')}")
    return figures, summary


def _plans(ctx, work: Path) -> dict:
    """The plan for this machine with sdpa and the machine's torch (envtool resolve), and a copy whose packing is
    mask: the trainer keeps packed rows apart by a mask where the plan says so (trainer/model/attention.py)."""
    import torch

    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    proc = sh([envtool(ctx), "resolve", "--gpu", "auto", "--attention", "sdpa", "--torch", version, "--json"],
              timeout=60, check=False)
    if proc.returncode != 0:
        return {}
    plan = json.loads(proc.stdout)
    plans = {}
    for packing in ("varlen", "mask"):
        path = work / f"plan-{packing}.json"
        path.write_text(json.dumps({**plan, "packing": packing}))
        plans[packing] = path
    return plans


def _padded_batch(ctx, work: Path, seq: int) -> tuple[int, dict]:
    """As many sequences per padded micro-batch as fit sequence_len on average (bench_train_packed_vs_padded's rule),
    at most as many of the longest as fit 4 x sequence_len: padded to the longest of a random draw, a micro-batch of
    the average's count can reach tens of thousands of tokens (logits of a 152k vocabulary: tens of GB)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(ctx, work))
    texts = [json.loads(l)["text"] for l in data_file(work, 600 if ctx["cpu"] else 4000).read_text().splitlines()]
    lengths = [min(len(tokenizer(t)["input_ids"]) + 1, seq) for t in texts]
    mean, longest = sum(lengths) / len(lengths), max(lengths)
    by_mean, cap = max(1, round(seq / mean)), max(1, 4 * seq // longest)
    return min(by_mean, cap), {"mean_tokens": round(mean, 1), "longest_tokens": longest, "by_mean": by_mean,
                               "cap_4x_sequence_len": cap}


def _speed_run(ctx, work: Path, mode: str, overrides: dict, plans: dict, on_gpu: bool) -> dict:
    if mode == "varlen" and not on_gpu:
        raise Skip("varlen_attn runs on CUDA only; on the CPU packed rows are kept apart by a mask")
    env = {}
    if on_gpu:
        plan = plans.get("mask" if mode == "mask" else "varlen")
        if plan is None:
            if mode == "mask":
                raise Skip("no plan from envtool resolve (see detect): the mask run needs one whose packing is mask")
        else:
            env["ENVTOOL_PLAN"] = str(plan)
    config = trainer_config(ctx, work, f"speed-{mode}", **overrides)
    run = train(ctx, work, config, timeout=100 if on_gpu else 150, env=env)
    out = metrics(work / "runs" / f"speed-{mode}", warmup=3 if on_gpu else 1)
    out["peak_allocated_gib"] = run.get("peak_allocated_gib")
    out["packing"] = "plan: " + mode if env else ("mask (the CPU)" if mode == "mask" else mode)
    shutil.rmtree(work / "runs" / f"speed-{mode}" / "final", ignore_errors=True)
    return out


# ---------------------------------------------------------------------------- 4. memory


def step_memory(ctx, work: Path):
    import torch

    on_gpu = not ctx["cpu"] and torch.cuda.is_available()
    seq = 256 if ctx["cpu"] else 2048
    common = dict(sequence_len=seq, max_steps=3 if on_gpu else 1, bf16=True if on_gpu else "auto")
    figures = {"sequence_len": seq}
    figures["full_bf16"] = part(_peak_vs_fit, ctx, work, "mem-full", dict(common, micro_batch_size=2), on_gpu)
    checkpoint(figures)
    figures["lora"] = part(_peak_vs_fit, ctx, work, "mem-lora", dict(common, micro_batch_size=2, adapter="lora",
                                                                       lora_r=16, lora_alpha=32, lora_dropout=0.0,
                                                                       lora_target_linear=True), on_gpu)
    checkpoint(figures)
    figures["auto_batch"] = part(_auto_batch, ctx, work, dict(common, micro_batch_size="auto",
                                                               gradient_accumulation_steps=16), on_gpu)
    checkpoint(figures)
    figures["loss_peak"] = part(_loss_peak, on_gpu)
    summary = []
    for key in ("full_bf16", "lora"):
        r = figures[key]
        if r["status"] == "ok" and r.get("measured_gib") is not None:
            summary.append(f"{key}: measured {r['measured_gib']:.2f} GiB allocated, envtool fit {r['estimate_gib']:.2f}"
                           f" GiB (band {r['estimate_low_gib']:.2f}-{r['estimate_high_gib']:.2f}): error "
                           f"{100 * r['relative_error']:+.1f}%")
        elif r["status"] == "ok":
            summary.append(f"{key}: envtool fit {r['estimate_gib']:.2f} GiB allocated on {r['gpu']} (band "
                           f"{r['estimate_low_gib']:.2f}-{r['estimate_high_gib']:.2f}); measured: {r['measured']}")
        else:
            summary.append(f"{key}: {r['status']}: {r.get('reason')}")
    lp = figures["loss_peak"]
    summary.append(f"loss peak, chunked vs full logits: {lp['status']}: " + (
        f"{lp['chunked_gib']:.2f} vs {lp['full_gib']:.2f} GiB ({lp['ratio']:.2f}x) at vocab {lp['vocab']} x "
        f"{lp['tokens']} tokens, loss rel. diff {lp['loss_rel_diff']:.1e}" if lp["status"] == "ok" else str(lp.get("reason"))))
    a = figures["auto_batch"]
    summary.append(f"micro_batch_size auto: {a['status']}: " + (json.dumps(a.get("record")) if a.get("record")
                                                                 else str(a.get("reason"))))
    return figures, summary


def _loss_peak(on_gpu: bool) -> dict:
    """bench/bench_loss_memory.py on the GPU: the loss's peak allocated memory (torch.cuda.max_memory_allocated above
    what the head and hidden states hold) with the chunked cross-entropy and with the full logits, bf16, at Qwen2.5's
    vocabulary x 4096 tokens; the two losses side by side. On the CPU: the two losses only (a tiny shape)."""
    import torch

    from trainer.objectives import chunked_loss

    vocab, tokens, hidden = (151936, 4096, 896) if on_gpu else (512, 64, 32)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    out = {"vocab": vocab, "tokens": tokens, "hidden": hidden, "dtype": str(dtype)}
    losses = {}
    for path in ("full", "chunked"):
        torch.manual_seed(0)
        head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
        h = (torch.randn(1, tokens + 1, hidden, device=device, dtype=dtype) * 0.5).requires_grad_(True)
        labels = torch.randint(0, vocab, (1, tokens + 1), device=device)
        seen = {"dtype": dtype, "device_type": device, "autocast": False, "autocast_dtype": None}
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        if path == "chunked":
            loss = chunked_loss.loss_sum_from_hidden(h, head, seen, labels)
        else:
            loss = torch.nn.functional.cross_entropy(head(h)[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                     reduction="sum")
        loss.backward()
        losses[path] = float(loss)
        if on_gpu:
            torch.cuda.synchronize()
            out[f"{path}_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        del head, h, labels, loss
    out["loss_rel_diff"] = abs(losses["chunked"] - losses["full"]) / abs(losses["full"])
    out.update(losses=losses)
    if not on_gpu:
        raise Skip(f"peak CUDA memory needs a GPU "
                   f"(on the CPU the two losses differ by {out['loss_rel_diff']:.1e}, relative)")
    out["ratio"] = out["chunked_gib"] / out["full_gib"]
    return out


def fit_estimate(ctx, config: Path) -> dict:
    """`envtool fit`'s estimate for the config (resolver.fit.fit, what the command prints), on this GPU or an H100."""
    from resolver.fit import fit

    gpu = "h100" if ctx["cpu"] or not has_cuda() else "auto"
    found = fit(config, gpu)
    if found.estimate is None:
        raise RuntimeError(f"envtool fit has no estimate: {found.reason}")
    e = found.estimate
    return {"gpu": gpu, "estimate_gib": round(e.allocated / GIB, 3),
            "estimate_low_gib": round(e.allocated_low / GIB, 3),
            "estimate_high_gib": round(e.allocated_high / GIB, 3), "micro_batch": e.setup.micro_batch,
            "fit_json": found.result}


def _peak_vs_fit(ctx, work: Path, name: str, overrides: dict, on_gpu: bool) -> dict:
    config = trainer_config(ctx, work, name, **overrides)
    out = fit_estimate(ctx, config)
    out.pop("fit_json")
    if not on_gpu:
        out["measured"] = "skipped: torch.cuda.max_memory_allocated needs a CUDA device"
        return out
    run = train(ctx, work, config, timeout=90)
    out["measured_gib"] = run["peak_allocated_gib"]
    out["relative_error"] = round((out["estimate_gib"] - run["peak_allocated_gib"]) / run["peak_allocated_gib"], 4)
    out["within_band"] = out["estimate_low_gib"] <= run["peak_allocated_gib"] <= out["estimate_high_gib"]
    shutil.rmtree(work / "runs" / name / "final", ignore_errors=True)
    return out


def _auto_batch(ctx, work: Path, overrides: dict, on_gpu: bool) -> dict:
    """micro_batch_size: auto's pick (micro_batch.json); on a GPU the run starts with device memory taken so that the
    pick cannot fit but half of it can, by envtool fit's estimates: the back-off on a real out-of-memory error."""
    import torch

    from trainer.fit.auto_batch import FILE

    config = trainer_config(ctx, work, "mem-auto", **overrides)
    ballast, plan = 0.0, {}
    if on_gpu:
        pick = fit_estimate(ctx, config)["micro_batch"]  # envtool fit's pick: the one the trainer makes at start
        if pick == 1:
            raise Skip("envtool fit says only micro_batch_size 1 fits: there is nothing to back off from")
        batch = overrides["gradient_accumulation_steps"]
        half = max(m for m in range(1, pick // 2 + 1) if batch % m == 0)
        at = {m: fit_estimate(ctx, trainer_config(ctx, work, f"mem-auto-mb{m}", **{
            **overrides, "micro_batch_size": m, "gradient_accumulation_steps": batch // m}))["estimate_gib"]
            for m in (pick, half)}
        # free now (this step's own CUDA context already taken) less the trainer's context: what the run may allocate
        # is set halfway between the estimates at the pick and at half of it
        free = torch.cuda.mem_get_info()[0] / GIB
        ballast = max(0.0, free - 0.5 - (at[pick] + at[half]) / 2)
        plan = {"estimated_pick": pick, "estimate_gib_at_pick": at[pick], "half": half,
                "estimate_gib_at_half": at[half], "ballast_gib": round(ballast, 2),
                "free_gib_left_for_the_run": round(free - ballast, 2)}
    run = train(ctx, work, config, timeout=100 if on_gpu else 150, ballast_gib=ballast)
    record = json.loads((work / "runs" / "mem-auto" / FILE).read_text())
    out = {"record": record, **plan, "run_seconds": run["seconds"]}
    if on_gpu:
        out["backed_off"] = bool(record.get("backoffs"))
        if not record.get("backoffs"):
            out["note"] = ("no out-of-memory error: the pick ran in the memory left (the estimate is above the real "
                           "peak)")
    else:
        out["backed_off"] = "skipped: a real out-of-memory error needs a CUDA device"
    return out


# ---------------------------------------------------------------------------- 5. train


def step_train(ctx, work: Path):
    """`envtool train CONFIG` as a user types it: first --dry-run --json (where it runs, and why), then the run."""
    import torch

    on_gpu = not ctx["cpu"] and torch.cuda.is_available()
    config = trainer_config(ctx, work, "envtool-train", max_steps=5 if on_gpu else 2,
                            sequence_len=2048 if on_gpu else 256, micro_batch_size=1)
    tool = envtool(ctx)
    gpu = ["--gpu", "cpu"] if ctx["cpu"] else []
    dry = sh([tool, "train", str(config), *gpu, "--dry-run", "--json"], timeout=90, check=False)
    extra = []
    where = _where(dry)
    figures = {"dry_run": {"exit": dry.returncode, **where}}
    if dry.returncode == 0 and where.get("kind") != "active":
        # the plan's newest torch is not this machine's: pin the machine's torch, as a user here would
        version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
        extra = ["--torch", version]
        dry = sh([tool, "train", str(config), *gpu, *extra, "--dry-run", "--json"], timeout=90, check=False)
        figures["dry_run_pinned"] = {"exit": dry.returncode, "args": extra, **_where(dry)}
        if _where(dry).get("kind") != "active":
            raise RuntimeError(f"envtool train would not run in this environment: {_where(dry).get('why')}")
    if dry.returncode != 0:
        raise RuntimeError(f"envtool train --dry-run exited {dry.returncode}: "
                           f"{(dry.stderr.strip().splitlines() or [''])[-1]}")
    begun = time.time()
    proc = sh([tool, "train", str(config), *gpu, *extra], timeout=600, check=False)
    final = work / "runs" / "envtool-train" / "final"
    saved = sorted(p.name for p in final.iterdir()) if final.is_dir() else []
    figures["run"] = {"command": " ".join(["envtool", "train", config.name, *gpu, *extra]), "exit": proc.returncode,
                      "seconds": round(time.time() - begun, 1), "saved": saved}
    if proc.returncode != 0 or not any(n.endswith(".safetensors") for n in saved):
        raise RuntimeError(f"envtool train exited {proc.returncode}, saved {saved or 'nothing'}: "
                           f"{(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
    figures["metrics"] = metrics(work / "runs" / "envtool-train", warmup=1)
    return figures, [f"envtool train ran in {where.get('kind') if not extra else 'the active environment'} "
                     f"({figures['run']['seconds']:.0f} s, exit 0) and saved {', '.join(saved)}"]


def _where(proc) -> dict:
    """Where `envtool train --dry-run --json` says the trainer runs (environment.kind: active, venv, cached, image)
    and what the trainer will do with packed rows."""
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {}
    env, trainer = data.get("environment") or {}, data.get("trainer") or {}
    return {"kind": env.get("kind"), "why": env.get("why"), "torch": (data.get("plan") or {}).get("torch", {}).get(
        "version"), "attention": trainer.get("attention"), "isolation": trainer.get("isolation"),
        "fit": (data.get("fit") or {}).get("verdict") if isinstance(data.get("fit"), dict) else data.get("fit")}

if __name__ == "__main__":
    raise SystemExit(main())
