"""envtool doctor: check an installed environment against this machine's GPU and driver.

A probe runs inside the environment's interpreter and reports what is installed (torch and the arch list it
was compiled for, flash-attn, triton, the plan it was installed from); the checks below compare that with the
machine. Each finding carries its fix as an exact envtool command.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from . import DISTRIBUTION
from .errors import BadInput
from .hardware import GpuSpec
from matrices.catalog import backend_range, backend_runs_on

from .matrix import Matrix, cc_tuple
from .plan import target_label
from .solve import runs_on

PROBE = r"""
import json, sys, importlib.metadata as md
from pathlib import Path

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

info = {"python": "%d.%d" % sys.version_info[:2], "prefix": sys.prefix,
        "packages": {n: version(n) for n in ("torch", "triton", "flash-attn", "flash-attn-3", "xformers",
                                              "transformers", "bitsandbytes", "deepspeed")}}
info["packages"]["envtool"] = version(__DISTRIBUTION__)  # the key names the tool; the distribution is envtool-llm
def cpu_build():
    # "quick" (a launch deciding where to train, not doctor): a CPU-only Linux build is read from torch/version.py
    # without importing torch (2-3 s); every other build is imported, as its import is what doctor checks
    import importlib.util
    spec = importlib.util.find_spec("torch") if info["packages"]["torch"] and sys.platform != "darwin" else None
    if spec is None or not spec.submodule_search_locations:
        return None
    facts = {}
    try:
        exec((Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text(), facts)
    except Exception:
        return None
    if facts.get("cuda") or facts.get("hip") or facts.get("xpu"):
        return None
    return {"version": facts["__version__"], "cuda": None, "hip": None, "xpu": None, "arch_list": [], "mps": False}
def imported_build():
    try:
        import torch
        hip = getattr(torch.version, "hip", None)
        xpu = getattr(torch.version, "xpu", None)
        found = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": hip, "xpu": xpu,
                 "arch_list": torch._C._cuda_getArchFlags().split() if (torch.version.cuda or hip) else []}
        if xpu:
            try:
                found["arch_list"] = list(torch.xpu.get_arch_list())
            except Exception:
                pass
        try:
            found["mps"] = bool(torch.backends.mps.is_built())
        except Exception:
            found["mps"] = False
        return found
    except Exception as e:  # a broken torch is a finding, not a crash
        return {"error": f"{type(e).__name__}: {e}"}
info["torch"] = (sys.argv[1:] == ["quick"] and cpu_build()) or imported_build()
plan = Path(sys.prefix) / "plan.json"
info["plan"] = json.loads(plan.read_text()) if plan.is_file() else None
# compiled attention kernels load their CUDA code at import: try them only where torch sees a GPU
info["imports"] = {}
try:
    on_gpu = bool(info["torch"].get("cuda")) and not info["torch"].get("hip") and sys.modules["torch"].cuda.is_available()
except Exception:
    on_gpu = False
for module, package in (("flash_attn_interface", "flash-attn-3"),):
    if info["packages"].get(package):
        info["imports"][module] = None
        if on_gpu:
            try:
                __import__(module)
                info["imports"][module] = "ok"
            except Exception as e:
                info["imports"][module] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
""".replace("__DISTRIBUTION__", repr(DISTRIBUTION))


SM = re.compile(r"^sm_(\d+?)(\d)a?$")  # sm_86 -> (8, 6); sm_100 -> (10, 0); sm_90a -> (9, 0)


class Finding(NamedTuple):
    level: str  # "error" | "warning" | "ok"
    check: str
    message: str
    fix: str | None = None


def probe(venv: Path | None, quick: bool = False) -> dict:
    python = sys.executable if venv is None else str(Path(venv) / "bin" / "python")
    if venv is not None and not Path(python).exists():
        raise BadInput(f"{venv}: no bin/python; is it a virtual environment?")
    return probe_python(python, str(venv or "this interpreter"), quick)


def probe_python(python: str, name: str | None = None, quick: bool = False) -> dict:
    """What is installed in the environment of interpreter `python` (see PROBE). `quick`: for a launch deciding
    which environment trains (not doctor): a CPU-only torch on Linux is read from its version file, not imported
    (whether it imports is then found by the run itself)."""
    try:
        out = subprocess.run([python, "-c", PROBE, *(["quick"] if quick else [])], capture_output=True, text=True,
                             timeout=300)
    except OSError as e:
        raise BadInput(f"could not run {python}: {e.strerror}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BadInput(f"could not inspect {name or python}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def is_managed_venv(path: Path) -> bool:
    """A venv `envtool install` made: a symlink into <venv>.versions/ (the only kind it replaces)."""
    return path.is_symlink() and path.resolve().parent == (path.parent / f"{path.name}.versions").resolve()


def fix_command(venv: Path | None, target: str, driver: str | None) -> str:
    """The install that fixes the environment doctor checked, for the GPU it checked against (`target`, as the
    user named it) and the driver they gave: into the interpreter running envtool (--system), into a venv
    `envtool install` made or a new one (--venv), or into any other existing environment (--python PATH, which
    install accepts where it refuses to replace a venv it did not make)."""
    # start-up: shlex imported only when this runs
    import shlex

    gpu = f"--gpu {shlex.quote(target)}" + (f" --driver {shlex.quote(driver)}" if driver else "")
    if venv is None:
        return f"envtool install --system {gpu}"
    path = Path(venv)
    if not path.exists() or is_managed_venv(path):
        return f"envtool install {gpu} --venv {shlex.quote(str(venv))}"
    return f"envtool install --python {shlex.quote(str(path / 'bin' / 'python'))} {gpu}"


def machine_has(gpu: GpuSpec) -> str:
    """"this machine has X" for a detected GPU; for one only named (--gpu, ENVTOOL_GPU) on a machine that may have
    none, "X is named (--gpu)" -- never a claim about this machine's hardware it did not see."""
    if gpu.named:
        return f"{gpu.describe()} is named ({'ENVTOOL_GPU' if gpu.source == 'ENVTOOL_GPU' else '--gpu'}, not detected here)"
    return f"this machine has {gpu.describe()}"


def diagnose(info: dict, gpu: GpuSpec, driver: str | None, m: Matrix, venv: str,
             fix: str | None = None) -> list[Finding]:
    """Findings for the environment `info` describes on `gpu` with `driver`; `fix` is the command each error
    names (default: a new install for this machine into `venv`)."""
    fix = fix or f"envtool install --gpu auto --venv {venv}"
    torch = info.get("torch") or {}
    findings: list[Finding] = []
    add = findings.append
    if "error" in torch:
        add(Finding("error", "torch", f"torch does not import: {torch['error']}", fix))
        return findings
    cuda, arch_list = torch.get("cuda"), torch.get("arch_list", [])
    backend = torch_backend(torch)
    add(Finding("ok", "torch", f"torch {torch['version']} ({BUILD_NAMES[backend](torch)})"))
    if not gpu.is_cpu and not gpu.is_nvidia:
        return findings + vendor_findings(info, backend, gpu, fix)

    if gpu.is_cpu:
        add(Finding("ok", "gpu", "no GPU found: a CPU environment is what this machine can use"))
    elif backend in ("rocm", "xpu", "mps"):
        add(Finding("error", "torch-backend", f"torch is the {build_name(backend, torch)} build, but "
                    f"{machine_has(gpu)}, which runs torch's CUDA builds", fix))
    elif cuda is None:
        add(Finding("error", "torch-cuda", f"torch is the CPU build, but {machine_has(gpu)}", fix))
    else:
        sms = sorted({a for a in arch_list if SM.match(a)})
        major, minor = cc_tuple(gpu.compute_capability)
        runnable = [a for a in sms if int(SM.match(a)[1]) == major and int(SM.match(a)[2]) <= minor]
        if runnable:
            add(Finding("ok", "arch", f"torch carries {gpu.sm} code ({' '.join(sms)})"))
        else:
            add(Finding("error", "arch", f"torch {torch['version']} has no {gpu.sm} code (built for "
                        f"{' '.join(sms) or 'nothing'}): 'CUDA capability {gpu.sm} is not compatible with the "
                        f"current PyTorch installation'", fix))
        if driver is None:
            add(Finding("warning", "driver", "NVIDIA driver version unknown: cannot check it runs CUDA " + cuda))
        elif not runs_on(m, cuda, driver):
            major_row = m.cuda_major(int(cuda.split(".")[0]))
            add(Finding("error", "driver", f"driver {driver} is too old for torch's CUDA {cuda} (needs ≥ "
                        f"{major_row.compat_min_driver}); upgrade the driver or reinstall for it", fix))
        else:
            add(Finding("ok", "driver", f"driver {driver} runs CUDA {cuda}"))

    packages = info.get("packages", {})
    fa = packages.get("flash-attn")
    fa2 = m.backend(m.flash_attn_impl("fa2").attention)
    if fa and not backend_runs_on(fa2, gpu.compute_capability):
        add(Finding("error", "flash-attn", f"flash-attn {fa} is installed but {gpu.describe()} cannot run it "
                    f"('FlashAttention only supports Ampere GPUs or newer'); the plan for this GPU uses SDPA", fix))

    fa3 = packages.get("flash-attn-3")
    if fa3:
        findings.extend(flash_attn_3_findings(info, fa3, gpu, m, fix))

    triton = packages.get("triton")
    plan = info.get("plan") or {}
    support = next(iter(m.triton_support), None)
    if triton and not gpu.is_cpu and support and cc_tuple(gpu.compute_capability) < cc_tuple(support.min_cc):
        claims = (plan.get("features") or {}).get("torch_compile")
        level = "error" if claims else "warning"
        add(Finding(level, "triton", f"triton {triton} is installed (torch pins it) but its kernels do not compile "
                    f"on {gpu.describe()}: keep torch.compile and liger off", fix if claims else None))

    precision = plan.get("precision")
    if precision == "bf16" and not gpu.is_cpu and not gpu.bf16:
        add(Finding("error", "precision", f"the environment's plan trains in bf16, but {gpu.describe()} has no "
                    f"native bf16 (sm_80+); it would run emulated and slow, or fail", fix))
    if plan:
        planned = target_label(plan.get("gpu") or {})
        if planned != gpu.sm:
            add(Finding("warning", "plan", f"the environment was planned for {'CPU' if planned == 'cpu' else planned}, "
                        f"{'the GPU named is' if gpu.named else 'this machine is'} {gpu.sm}", fix))
    return findings


BUILD_NAMES = {
    "cuda": lambda t: f"CUDA {t['cuda']}",
    "rocm": lambda t: f"ROCm, HIP {t['hip']}",
    "xpu": lambda t: f"XPU, SYCL {t['xpu']}" if isinstance(t.get("xpu"), str) else "XPU",
    "mps": lambda t: "macOS, MPS",
    "cpu": lambda t: "CPU build",
}
BACKEND_OF_VENDOR = {"amd": "rocm", "intel": "xpu", "apple": "mps"}


def build_name(backend: str, torch: dict) -> str:
    """'CPU', 'CUDA 12.6', 'ROCm (HIP 6.2.41133-dd7f95766)', for 'torch is the ... build'."""
    return BUILD_NAMES[backend](torch).removesuffix(" build").replace("ROCm, HIP ", "ROCm (HIP ") + \
        (")" if backend == "rocm" else "")


def torch_backend(torch: dict) -> str:
    """Which build of torch the probe found: cuda | rocm (torch.version.hip) | xpu | mps | cpu."""
    if torch.get("hip"):
        return "rocm"
    if torch.get("cuda"):
        return "cuda"
    if torch.get("xpu"):
        return "xpu"
    if torch.get("mps") and sys.platform == "darwin":  # Linux wheels report MPS unbuilt; only macOS runs it
        return "mps"
    return "cpu"


def vendor_findings(info: dict, backend: str, gpu: GpuSpec, fix: str) -> list[Finding]:
    """An AMD, Intel or Apple GPU: a torch of its backend (ROCm/HIP, XPU, MPS), with code for its target, and a
    plan made for it."""
    torch = info.get("torch") or {}
    findings: list[Finding] = []
    add = findings.append
    want = BACKEND_OF_VENDOR[gpu.vendor]
    if backend != want:
        add(Finding("error", "torch-backend", f"torch is the {build_name(backend, torch)} build, but "
                    f"{machine_has(gpu)}, which needs torch's {want.upper() if want != 'rocm' else 'ROCm'} build", fix))
    elif want == "rocm":
        arch_list = [a.split(":")[0] for a in torch.get("arch_list") or []]
        if gpu.target in arch_list:
            add(Finding("ok", "arch", f"torch carries {gpu.target} code ({' '.join(arch_list)})"))
        else:
            add(Finding("error", "arch", f"torch {torch['version']} has no {gpu.target} code (built for "
                        f"{' '.join(arch_list) or 'nothing'}): 'HIP error: invalid device function' at the first "
                        f"kernel", fix))
    elif want == "xpu" and gpu.target and torch.get("arch_list"):
        if gpu.target in torch["arch_list"]:
            add(Finding("ok", "arch", f"torch carries ahead-of-time {gpu.target} code ({' '.join(torch['arch_list'])})"))
        else:
            add(Finding("warning", "arch", f"torch's xpu build has no ahead-of-time {gpu.target} code "
                        f"({' '.join(torch['arch_list'])}): its kernels compile at first use"))
    packages = info.get("packages", {})
    for package in ("flash-attn", "flash-attn-3"):
        if packages.get(package):
            add(Finding("error", package, f"{package} {packages[package]} is installed but {gpu.describe()} cannot "
                        f"run it (CUDA kernels); the plan for this GPU uses SDPA", fix))
    plan = info.get("plan") or {}
    if plan.get("precision") == "bf16" and gpu.bf16 is False:
        add(Finding("error", "precision", f"the environment's plan trains in bf16, but {gpu.describe()} has no bf16 "
                    f"on its matrix cores", fix))
    if plan:
        planned = target_label(plan.get("gpu") or {})
        if planned != gpu.sm:
            add(Finding("warning", "plan", f"the environment was planned for {planned}, "
                        f"{'the GPU named is' if gpu.named else 'this machine is'} {gpu.sm}", fix))
    return findings


def flash_attn_3_findings(info: dict, version: str, gpu: GpuSpec, m: Matrix, fix: str) -> list[Finding]:
    """flash-attn-3 installed: the GPU must run it (attention.toml), and on the GPU `flash_attn_interface` must
    import (its compiled kernels load torch's stable-ABI symbols: a torch older than the wheel's target fails
    here, with 'undefined symbol: aoti_torch_...')."""
    backend = m.backend(m.flash_attn_impl("fa3").attention)
    if not backend_runs_on(backend, gpu.compute_capability):
        return [Finding("error", "flash-attn-3", f"flash-attn-3 {version} is installed but {gpu.describe()} cannot run "
                        f"FlashAttention-3 (needs {backend_range(backend)}); the plan for this GPU uses another "
                        f"attention", fix)]
    result = (info.get("imports") or {}).get("flash_attn_interface")
    if result == "ok":
        return [Finding("ok", "flash-attn-3", f"flash-attn-3 {version}: flash_attn_interface imports on the GPU")]
    if result is None:
        return [Finding("warning", "flash-attn-3", f"flash-attn-3 {version} is installed; flash_attn_interface was not "
                        f"imported, since torch sees no CUDA device here")]
    return [Finding("error", "flash-attn-3", f"flash-attn-3 {version} is installed but flash_attn_interface does not "
                    f"import on the GPU: {result}", fix)]


def report(findings: list[Finding]) -> dict:
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    return {"ok": errors == 0, "errors": errors, "warnings": warnings,
            "findings": [f._asdict() for f in findings]}
