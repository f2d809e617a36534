"""AMD, Intel and Apple GPUs through the commands users type: resolve (named, by gfx target, detected from a
captured KFD topology), the refusals, --format github, train --dry-run / --emit, doctor against a stand-in HIP
torch on PYTHONPATH, and the docker run options for a ROCm image. The facts are matrices/amd.toml, rocm.toml,
intel.toml, apple.toml; the lock, install and image chain is in test_vendor_chain.py and tests/docker."""

import json
import os
from pathlib import Path

import pytest
import yaml

from resolver.errors import BadInput
from tests.support.pypi import CAPTURED_ROCM_ARCH, torch_files

from .conftest import run_envtool
from .test_cli import CONTRACT, TOP_LEVEL

ROOT = Path(__file__).resolve().parents[2]
VENDORS = ROOT / "tests" / "resolver" / "data" / "vendors"
X86 = ["--python", "3.11", "--platform", "x86_64"]


def resolve(*args, **env):
    out = run_envtool("resolve", "--json", *args, **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def refused(*args, **env):
    """The command exits 2 with one line on stderr; that line."""
    out = run_envtool(*args, **env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("envtool: error: "), out.stderr
    return lines[0]


# ---------------------------------------------------------------------------- resolve


def test_mi300x_plan_keeps_the_json_contract_and_names_the_rocm_index():
    plan = resolve("--gpu", "mi300x", *X86)
    assert set(plan) == TOP_LEVEL
    for key, fields in CONTRACT.items():
        assert set(plan[key]) == fields, key
    assert plan["gpu"] | {"memory_gb": 192.0} == plan["gpu"]
    assert (plan["gpu"]["vendor"], plan["gpu"]["target"], plan["gpu"]["compute_capability"]) == ("amd", "gfx942", None)
    torch = plan["torch"]
    assert (torch["backend"], torch["variant"], torch["rocm"], torch["cuda"]) == ("rocm", "rocm7.14", "7.14", None)
    assert torch["index_url"] == "https://download.pytorch.org/whl/rocm7.14"
    assert (plan["device"], plan["attention"], plan["packing"], plan["precision"]) == ("cuda", "sdpa", "mask", "bf16")
    assert plan["flash_attn"] is None and plan["env"] == {}
    # torch's ROCm wheel requires its own triton, from the same index; the plan names it
    assert plan["packages"]["triton-rocm"] == plan["triton"] == "3.8.0"
    assert "bitsandbytes" in plan["packages"] and "deepspeed" in plan["packages"]
    assert any("AOTriton" in r and "gfx942" in r for r in plan["reasons"])


@pytest.mark.parametrize("name", ["mi300x", "MI300X", "AMD Instinct MI300X", "gfx942", "mi325x", "mi300a"])
def test_names_aliases_and_the_raw_target_plan_the_same_build(name):
    plan = resolve("--gpu", name, *X86)
    assert (plan["gpu"]["target"], plan["torch"]["variant"]) == ("gfx942", "rocm7.14")


def test_explain_says_which_builds_carry_no_code_for_the_target():
    out = run_envtool("resolve", "--gpu", "rx9070xt", "--explain", *X86, COLUMNS="220")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "envtool plan for AMD Radeon RX 9070 XT · gfx1201 · RDNA4" in text
    assert "2.14.1+rocm7.14" in text and "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in text
    # gfx1201 reached torch's wheels with 2.7: every older build is listed as carrying no code for it
    assert "torch 2.6.0+rocm6.2.4 carries no gfx1201 code" in text and "invalid device function" in text
    assert "Candidates not taken" in text


def test_targets_no_build_covers_are_refused_in_one_line():
    line = refused("resolve", "--gpu", "gfx803", *X86)
    assert "no torch ROCm build on record carries gfx803 code" in line
    line = refused("resolve", "--gpu", "mi8", *X86)  # the MI8 is a gfx803 GPU
    assert "AMD Instinct MI8" in line and "gfx803" in line


def test_a_pin_that_excludes_every_covering_build_names_the_newest_that_covers_it():
    # gfx906 (MI50, Radeon VII) left torch's ROCm wheels with 2.14 (TheRock's ROCm 7.14)
    assert resolve("--gpu", "mi50", *X86)["torch"]["version"] == "2.13.0"
    line = refused("resolve", "--gpu", "gfx906", "--torch", "2.14", *X86)
    assert "torch 2.14.1+rocm7.14 carries no gfx906 code" in line
    assert "the newest build that carries gfx906 code: torch 2.13.0+rocm7.2: use --torch 2.13" in line


def test_precision_attention_env_and_bitsandbytes_follow_the_target():
    mi50, mi355x, mi100 = (resolve("--gpu", g, *X86) for g in ("mi50", "mi355x", "mi100"))
    # gfx906 has no bf16 matrix cores; the ROCm library bitsandbytes loads carries no gfx906 code
    assert mi50["precision"] == "fp16" and "bitsandbytes" not in mi50["packages"]
    assert any(r.startswith("bitsandbytes left out:") and "no gfx906 code" in r for r in mi50["reasons"])
    # gfx950: AOTriton's kernels only with torch's experimental opt-in, which the plan carries
    assert mi355x["env"] == {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"}
    # gfx908: no AOTriton code at all: SDPA's math kernel
    assert any("has no gfx908 code, so SDPA runs its math kernel" in r for r in mi100["reasons"])
    assert mi100["precision"] == "bf16" and mi100["env"] == {}


@pytest.mark.slow
def test_driver_cuda_and_flash_attn_pins_are_refused_for_amd():
    assert "NVIDIA driver version" in refused("resolve", "--gpu", "mi300x", "--driver", "550.54.14", *X86)
    assert "pin --torch instead" in refused("resolve", "--gpu", "mi300x", "--cuda", "12.6", *X86)
    line = refused("resolve", "--gpu", "mi300x", "--attention", "flash_attention_2", *X86)
    assert "no ROCm wheels" in line and "use --attention sdpa" in line
    assert "ROCm wheels for linux x86_64 only" in refused("resolve", "--gpu", "mi300x", "--python", "3.11",
                                                          "--platform", "aarch64")
    assert "names a backend, not a GPU" in refused("resolve", "--gpu", "rocm")


@pytest.mark.slow
def test_intel_and_apple_plans():
    max1550 = resolve("--gpu", "max1550", *X86)
    assert (max1550["device"], max1550["torch"]["variant"], max1550["gpu"]["target"]) == ("xpu", "xpu", "pvc")
    assert max1550["torch"]["index_url"] == "https://download.pytorch.org/whl/xpu"
    assert "triton-xpu" in max1550["packages"] and "deepspeed" not in max1550["packages"]
    assert any(r.startswith("deepspeed left out:") and "intel_extension_for_pytorch" in r for r in max1550["reasons"])
    generic = resolve("--gpu", "xpu", *X86)
    assert generic["gpu"]["target"] is None and any("SPIR-V" in r for r in generic["reasons"])

    mps = resolve("--gpu", "m2-max", "--python", "3.12")
    assert (mps["device"], mps["platform"], mps["torch"]["backend"]) == ("mps", "arm64", "mps")
    assert mps["torch"]["index_url"] == "https://pypi.org/simple/" and mps["triton"] is None
    assert mps["features"] == {"torch_compile": False, "liger": False}
    assert "deepspeed" not in mps["packages"] and "bitsandbytes" in mps["packages"]  # 0.50.2: a macOS wheel
    old_stack = resolve("--gpu", "mps", "--python", "3.9")  # transformers 4.x and bitsandbytes 0.48.2: no macOS wheel
    assert "bitsandbytes" not in old_stack["packages"]


def test_a_mac_on_macos_13_gets_the_last_torch_for_it_and_fp32(monkeypatch):
    from resolver import hardware
    from resolver.matrix import load
    from resolver.solve import Request, solve

    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr("platform.machine", lambda: "arm64")
    monkeypatch.setattr("platform.mac_ver", lambda: ("13.6", ("", "", ""), "arm64"))
    monkeypatch.setenv("ENVTOOL_KFD_NODES", "/nonexistent")
    monkeypatch.setenv("ENVTOOL_PCI_DEVICES", "/nonexistent")
    monkeypatch.setattr(hardware, "probe_nvml", lambda m: ([], None, "NVML: none"))
    monkeypatch.setattr(hardware, "probe_nvidia_smi", lambda m: ([], None, "nvidia-smi: none"))
    found = hardware.detect(load())
    assert (found.gpu.vendor, found.gpu.macos) == ("apple", "13.6")
    plan = solve(Request(gpu=found.gpu, driver=None, python="3.11", platform="arm64", notes=found.notes), load())
    # torch 2.12+ ships macOS 14 wheels only: 2.11.0 is the newest a macOS 13 Mac installs
    assert plan.torch.version == "2.11.0" and plan.precision == "fp32"
    assert any("need macOS 14.0+, this Mac runs macOS 13.6" in r.reason for r in plan.rejected)


def test_auto_detects_amd_gpus_from_the_kfd_topology(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    plan = resolve("--gpu", "auto", *X86, PATH=str(bin_dir), ENVTOOL_KFD_NODES=str(VENDORS / "amd/kfd-mi210-xgmi"),
                   ENVTOOL_PCI_DEVICES=str(tmp_path / "none"), ENVTOOL_GPU=None)
    assert (plan["gpu"]["name"], plan["gpu"]["target"], plan["gpu"]["count"]) == ("AMD Instinct MI210", "gfx90a", 8)
    assert plan["gpu"]["source"] == "kfd" and plan["torch"]["backend"] == "rocm"
    assert any("8 devices: torchrun" in r and "RCCL" in r for r in plan["reasons"])
    assert any(r.startswith(f"{VENDORS / 'amd/kfd-mi210-xgmi'}: 8 GPU node(s)") for r in plan["reasons"])


def test_github_matrix_mixes_vendors():
    out = run_envtool("resolve", "--gpu", "t4,mi300x,max1550,mps", *X86, "--format", "github")
    assert out.returncode == 0, out.stderr
    rows = {r["target"]: r for r in json.loads(out.stdout)["include"]}
    assert {k: rows[k]["vendor"] for k in rows} == {"t4": "nvidia", "mi300x": "amd", "max1550": "intel", "mps": "apple"}
    assert [rows[k]["gpu_target"] for k in ("t4", "mi300x", "max1550", "mps")] == ["sm_75", "gfx942", "pvc", "mps"]
    assert [rows[k]["device"] for k in ("t4", "mi300x", "max1550", "mps")] == ["cuda", "cuda", "xpu", "mps"]
    assert rows["mi300x"]["image"] == "envtool-trainer:gfx942-rocm7.14-torch2.14-py3.11"
    assert rows["max1550"]["image"] is None and rows["mps"]["image"] is None
    assert rows["mps"]["platform"] == "arm64" and rows["t4"]["platform"] == "x86_64"


# ---------------------------------------------------------------------------- images, train, launchers


@pytest.mark.slow
def test_rocm_dockerfile_and_the_images_refused():
    out = run_envtool("dockerfile", "--gpu", "mi355x", "--platform", "x86_64")  # no --python: the base's
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert 'ARG BASE_IMAGE="rocm/dev-ubuntu-24.04:7.14-complete"' in text
    assert 'PYTORCH_ROCM_ARCH="gfx950"' in text and 'TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL="1"' in text
    assert "NVIDIA_VISIBLE_DEVICES" not in text and "/opt/venv/lib/python3.12/site-packages/" in text
    assert "pass --python 3.12" in refused("dockerfile", "--gpu", "mi300x", *X86)
    assert "no Linux container reaches" in refused("dockerfile", "--gpu", "mps")
    assert "Level Zero" in refused("build", "--gpu", "max1550", *X86)


@pytest.mark.slow
def test_train_dry_run_on_mi300x_shows_the_plan_the_image_and_the_command():
    out = run_envtool("train", "examples/mi300x.yml", "--gpu", "mi300x", "--dry-run", COLUMNS="200")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "envtool plan for AMD Instinct MI300X · gfx942 · CDNA3" in text and "2.14.1+rocm7.14" in text
    image = next(line for line in text.splitlines() if line.startswith("image: "))
    assert image.startswith("image: envtool-trainer:gfx942-rocm7.14-torch2.14-py3.12 (base "
                            "rocm/dev-ubuntu-24.04:7.14-complete, Python 3.12")
    command = next(line for line in text.splitlines() if line.startswith("command: "))
    assert command.endswith("-m trainer train examples/mi300x.yml") and "ENVTOOL_PLAN=" in command
    # with --python the user's, the image says why there is none for it
    out = run_envtool("train", "examples/mi300x.yml", "--gpu", "mi300x", *X86, "--dry-run", COLUMNS="200")
    assert "image: none: the base image for rocm7.14 builds" in out.stdout and "pass --python 3.12" in out.stdout

    # a plan's env reaches the command; a config asking for flash-attn on AMD trains with SDPA, and says why
    out = run_envtool("train", "examples/mi300x.yml", "--gpu", "mi355x", *X86, "--dry-run", "--json")
    assert json.loads(out.stdout)["env"]["TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"] == "1"
    out = run_envtool("train", "examples/a100.yml", "--gpu", "mi300x", *X86, "--dry-run", "--json")
    result = json.loads(out.stdout)
    assert result["plan"]["attention"] == "sdpa" and result["trainer"]["attention"] == "sdpa"
    assert any(r.startswith("flash_attention: true in examples/a100.yml -> sdpa: Dao-AILab "
                            "publishes no ROCm wheels") for r in result["plan"]["reasons"])
    assert result["trainer"]["tf32"] is False  # a100.yml's tf32: true is NVIDIA's format
    assert any(n.startswith("tf32: true -> false") for n in result["trainer"]["notes"])


@pytest.mark.slow
def test_config_features_the_gpu_cannot_run_are_refused(tmp_path):
    config = yaml.safe_load((ROOT / "examples/mi300x.yml").read_text())
    qlora = tmp_path / "qlora.yml"
    qlora.write_text(yaml.safe_dump({**config, "adapter": "qlora", "load_in_4bit": True, "bf16": "auto"}))
    line = refused("train", str(qlora), "--gpu", "mi50", *X86, "--dry-run")
    assert "needs bitsandbytes" in line and "no gfx906 code" in line
    eight_bit = tmp_path / "adam8.yml"
    eight_bit.write_text(yaml.safe_dump({**config, "optimizer": "adamw_bnb_8bit"}))
    line = refused("train", str(eight_bit), "--gpu", "mps", "--python", "3.11", "--dry-run")
    assert "bitsandbytes 8-bit optimizers" in line


@pytest.mark.slow
def test_launchers_ask_for_the_vendors_resources():
    out = run_envtool("train", "examples/mi300x.yml", "--gpu", "mi300x", "--python", "3.12", "--platform", "x86_64",
                      "--nproc", "8", "--emit", "k8s", "--dry-run")
    assert out.returncode == 0, out.stderr
    job = list(yaml.safe_load_all(out.stdout))[1]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert pod["resources"] == {"limits": {"amd.com/gpu": 8}}
    assert pod["image"] == "envtool-trainer:gfx942-rocm7.14-torch2.14-py3.12"
    out = run_envtool("train", "examples/mi300x.yml", "--gpu", "gfx950", *X86, "--nproc", "8", "--emit", "slurm",
                      "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --gpus-per-node=8" in out.stdout and "export TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in out.stdout
    out = run_envtool("train", "examples/mi300x.yml", "--gpu", "max1550", *X86, "--nproc", "2", "--emit", "k8s",
                      "--dry-run")
    job = list(yaml.safe_load_all(out.stdout))[1]
    limits = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]
    assert limits == {"limits": {"gpu.intel.com/i915": 2}}


def test_docker_run_options_for_amd_intel_and_nvidia(tmp_path):
    from resolver.docker import gpu_options

    dev = tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    for node in (dev / "kfd", dev / "dri" / "renderD128", dev / "dri" / "card0"):
        node.touch()
    if os.geteuid() == 0:  # as on a host: the nodes belong to the render group
        for node in (dev / "kfd", dev / "dri" / "renderD128"):
            os.chown(node, -1, 4321)
    render_gid = (dev / "dri" / "renderD128").stat().st_gid
    amd = {"gpu": {"name": "AMD Instinct MI300X", "vendor": "amd"}}
    options = gpu_options(amd, "all", dev)
    assert options["devices"] == ["/dev/kfd:/dev/kfd:rwm", "/dev/dri:/dev/dri:rwm"]
    assert options["security_opt"] == ["seccomp=unconfined"]
    assert str(render_gid) in options["group_add"] or render_gid == 0
    intel = gpu_options({"gpu": {"name": "Intel GPU", "vendor": "intel"}}, "all", dev)
    assert intel["devices"] == ["/dev/dri:/dev/dri:rwm"] and intel["security_opt"] is None
    nvidia = gpu_options({"gpu": {"name": "Tesla T4", "vendor": "nvidia"}}, "all", dev)
    assert nvidia["device_requests"][0]["Count"] == -1 and "devices" not in nvidia
    assert gpu_options(amd, None, dev) == {}
    (dev / "kfd").unlink()
    with pytest.raises(BadInput, match=r"no /dev/kfd on this host \(the amdgpu driver with KFD is not loaded\)"):
        gpu_options(amd, "all", dev)
    with pytest.raises(BadInput, match="give --gpus all"):
        gpu_options(amd, "2", dev)


# ---------------------------------------------------------------------------- doctor on a stand-in HIP torch


@pytest.fixture
def hip_torch(tmp_path):
    """torch 2.5.1+rocm6.2 as envtool doctor sees it (torch.version.hip, the arch list: captured), on PYTHONPATH."""
    site = tmp_path / "site"
    for name, text in torch_files("2.5.1", "rocm6.2", CAPTURED_ROCM_ARCH[("2.5.1", "rocm6.2")]).items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    return {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}


def doctor(env, *args):
    out = run_envtool("doctor", "--json", *args, **env)
    return out.returncode, json.loads(out.stdout)


@pytest.mark.slow
def test_doctor_on_a_hip_torch(hip_torch):
    code, result = doctor(hip_torch, "--gpu", "mi300x")
    assert code == 0, result
    checks = {f["check"]: f for f in result["findings"]}
    assert checks["torch"]["message"] == "torch 2.5.1+rocm6.2 (ROCm, HIP 6.2.41133-dd7f95766)"
    assert checks["arch"]["level"] == "ok" and "torch carries gfx942 code" in checks["arch"]["message"]
    # a target torch 2.5.1+rocm6.2 was not built for: the error names it, and the fix is an install for the GPU
    code, result = doctor(hip_torch, "--gpu", "rx7800xt")
    assert code == 1
    arch = next(f for f in result["findings"] if f["check"] == "arch")
    assert arch["level"] == "error" and "has no gfx1101 code" in arch["message"]
    assert arch["fix"] == "envtool install --system --gpu rx7800xt"
    # the wrong vendor either way
    code, result = doctor(hip_torch, "--gpu", "t4")
    assert code == 1 and any(f["check"] == "torch-backend" and "ROCm (HIP 6.2.41133-dd7f95766)" in f["message"]
                             for f in result["findings"])
    code, result = doctor({"PYTHONPATH": str(ROOT)}, "--gpu", "mi300x")  # this interpreter's CPU torch
    backend = next(f for f in result["findings"] if f["check"] == "torch-backend")
    assert code == 1 and "needs torch's ROCm build" in backend["message"]
