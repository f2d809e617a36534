"""doctor: what it finds in an environment, against the machine, with the command that fixes it."""

import json

import pytest

from resolver import hardware
from resolver.doctor import diagnose, report

from .conftest import FAKES, run_envtool

CU126 = "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90".split()
CU130 = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120".split()


def info(cuda="12.6", arch=CU126, packages=None, plan=None, torch_error=None):
    torch = {"error": torch_error} if torch_error else {"version": f"2.14.1+cu{cuda.replace('.', '')}" if cuda
                                                        else "2.14.1+cpu", "cuda": cuda, "arch_list": arch if cuda else []}
    return {"torch": torch, "packages": {"torch": "2.14.1", **(packages or {})}, "plan": plan, "prefix": "/v"}


def levels(findings):
    return {f.check: f.level for f in findings}


def check(m, gpu, driver, **kw):
    return diagnose(info(**kw), hardware.lookup(gpu, m), driver, m, ".venv")


def test_a_good_environment(m):
    findings = check(m, "t4", "560.35.03")
    assert report(findings)["ok"] and set(levels(findings).values()) == {"ok"}


def test_torch_without_code_for_the_gpu(m):
    findings = check(m, "v100", "580.65.06", cuda="13.0", arch=CU130)
    arch = next(f for f in findings if f.check == "arch")
    assert arch.level == "error" and "has no sm_70 code" in arch.message
    assert arch.fix == "envtool install --gpu auto --venv .venv"


def test_driver_too_old_for_torchs_cuda(m):
    finding = next(f for f in check(m, "t4", "470.82.01") if f.check == "driver")
    assert finding.level == "error" and "too old for torch's CUDA 12.6" in finding.message


def test_flash_attn_on_turing(m):
    finding = next(f for f in check(m, "t4", "560.35.03", packages={"flash-attn": "2.8.3"}) if f.check == "flash-attn")
    assert finding.level == "error" and "FlashAttention only supports Ampere GPUs or newer" in finding.message


@pytest.mark.parametrize("claims, level", [(True, "error"), (False, "warning")])
def test_triton_on_volta(m, claims, level):
    plan = {"features": {"torch_compile": claims}, "gpu": {"compute_capability": "7.0"}, "precision": "fp16"}
    finding = next(f for f in check(m, "v100", "560.35.03", packages={"triton": "3.8.0"}, plan=plan)
                   if f.check == "triton")
    assert finding.level == level


def test_bf16_plan_on_a_gpu_without_bf16(m):
    plan = {"precision": "bf16", "gpu": {"compute_capability": "8.0"}, "features": {}}
    findings = levels(check(m, "t4", "560.35.03", plan=plan))
    assert findings["precision"] == "error" and findings["plan"] == "warning"


def test_cpu_torch_on_a_gpu_machine_and_a_broken_torch(m):
    assert levels(check(m, "a100", "560.35.03", cuda=None))["torch-cuda"] == "error"
    assert levels(check(m, "a100", None, torch_error="ImportError: libcudart.so.12"))["torch"] == "error"


@pytest.mark.slow
def test_doctor_cli_on_this_cpu_machine(tmp_path):
    out = run_envtool("doctor", "--json", PATH="/usr/bin:/bin", PYTHONPATH=str(FAKES), ENVTOOL_GPU=None)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] and result["gpu"] == "CPU"
    assert result["recommended"]["torch"].endswith("+cpu") and result["recommended"]["precision"] == "fp32"
    assert any(f["check"] == "torch" and "CPU build" in f["message"] for f in result["findings"])


@pytest.mark.slow
def test_doctor_cli_exits_1_on_errors_with_a_table():
    out = run_envtool("doctor", "--gpu", "sm_120", "--driver", "580.65.06", COLUMNS="200")
    assert out.returncode == 1
    assert "torch is the CPU build" in out.stdout
    # the fix names the GPU doctor checked against and installs into the interpreter it checked (no --venv)
    assert "envtool install --system --gpu sm_120 --driver 580.65.06" in out.stdout
    assert "envtool's plan for this machine: torch" in out.stdout


def test_the_fix_installs_where_install_accepts(tmp_path):
    """A venv envtool made (or none yet) takes --venv; any other environment --python PATH, since install refuses
    to replace a venv it did not make; the interpreter running envtool --system."""
    from resolver.doctor import fix_command

    assert fix_command(tmp_path / "new", "t4", None) == f"envtool install --gpu t4 --venv {tmp_path / 'new'}"
    (tmp_path / "theirs" / "bin").mkdir(parents=True)
    assert fix_command(tmp_path / "theirs", "a100", "550.54.14") == \
        f"envtool install --python {tmp_path / 'theirs' / 'bin' / 'python'} --gpu a100 --driver 550.54.14"
    (tmp_path / ".venv.versions" / "v1").mkdir(parents=True)
    (tmp_path / ".venv").symlink_to(tmp_path / ".venv.versions" / "v1")
    assert fix_command(tmp_path / ".venv", "auto", None) == f"envtool install --gpu auto --venv {tmp_path / '.venv'}"
    assert fix_command(None, "t4", None) == "envtool install --system --gpu t4"


def test_the_quick_probe_reads_what_the_import_reads_here():
    """A launch deciding where to train probes quickly (a CPU-only torch read from torch/version.py, 0.2 s instead
    of 3 s of import); here, a CPU build, it must find what the full probe (doctor's) finds."""
    from resolver.doctor import probe

    assert probe(None, quick=True) == probe(None)


def fake_torch(root, cuda, imports: bool):
    """A torch installed at `root` as pip lays it out: its metadata, its version file, and a package that may not
    import (a broken build)."""
    (root / "torch").mkdir(parents=True)
    (root / "torch-2.13.0.dist-info").mkdir()
    (root / "torch-2.13.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    (root / "torch" / "version.py").write_text(f"__version__ = '2.13.0+{'cu128' if cuda else 'cpu'}'\n"
                                               f"cuda = {cuda!r}\nhip = None\n")
    (root / "torch" / "__init__.py").write_text("" if imports else "raise ImportError('libtorch_cpu.so: cannot open')\n")


@pytest.mark.parametrize("cuda", [None, "12.8"])
def test_the_quick_probe_imports_every_build_but_a_cpu_one(tmp_path, monkeypatch, cuda):
    """A CUDA build is always imported (whether it imports is what doctor checks for a GPU); only a CPU-only build
    is read without importing, so a broken one is found by the run, not by the quick probe. doctor (full) finds it."""
    from resolver.doctor import probe

    fake_torch(tmp_path, cuda, imports=False)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert probe(None)["torch"] == {"error": "ImportError: libtorch_cpu.so: cannot open"}
    quick = probe(None, quick=True)["torch"]
    if cuda:
        assert quick == {"error": "ImportError: libtorch_cpu.so: cannot open"}
    else:
        assert quick == {"version": "2.13.0+cpu", "cuda": None, "hip": None, "xpu": None, "arch_list": [], "mps": False}
