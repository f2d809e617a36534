"""Issue 8's corrections, as a user sees them: plans for real catalog GPUs that now install and run, and
refusals that say why. Each test names the corrected fact it rests on (matrices/*.toml, with its source)."""

import json

import pytest

from resolver import hardware
from resolver.errors import Unsatisfiable
from resolver.matrix import in_range
from resolver.solve import Request, solve

from .conftest import run_envtool


def plan(m, gpu, driver=None, python="3.11", platform="x86_64", **pins):
    return solve(Request(gpu=hardware.lookup(gpu, m), driver=driver, python=python, platform=platform,
                         target=gpu, **pins), m)


def refusal(m, gpu, driver=None, python="3.11", platform="x86_64", **pins) -> str:
    with pytest.raises(Unsatisfiable) as e:
        plan(m, gpu, driver, python, platform, **pins)
    return str(e.value)


def build_of(m, p):
    release = next(r for r in m.torch if r.version == p.torch.version)
    return next(b for b in release.build if b.variant == p.torch.variant)


def supported_pythons(m):
    return sorted({f"3.{n}" for r in m.torch for n in range(8, 17) if in_range(f"3.{n}", r.python)},
                  key=lambda v: int(v.split(".")[1]))


# ---------------------------------------------------------------------------- triton: Python-conditional pins


def test_torch_2_5_on_python_3_13_names_no_triton(m):
    # torch 2.5.1's wheel requires triton==3.1.0 only for python_version < "3.13", and triton 3.1.0 has no
    # cp313 wheel: a plan that pinned it could not install.
    p = plan(m, "a100", python="3.13", torch="2.5")
    assert p.torch.version == "2.5.1"
    assert p.triton is None and "triton" not in p.packages
    assert p.features == {"torch_compile": False, "liger": False}
    assert any("requires triton only for Python <3.13" in r for r in p.reasons)


def test_torch_2_5_on_python_3_12_still_pins_its_triton(m):
    p = plan(m, "a100", python="3.12", torch="2.5")
    assert p.triton == "3.1.0" and p.packages["triton"] == "3.1.0"


@pytest.mark.parametrize("platform", ["x86_64", "aarch64"])
def test_no_plan_names_a_triton_without_a_wheel_for_its_python_and_platform(m, platform):
    # Every torch release x every Python it supports: the triton a plan pins has a wheel there.
    checked = 0
    for release in m.torch:
        for python in supported_pythons(m):
            if not in_range(python, release.python):
                continue
            try:
                p = plan(m, "gh200" if platform == "aarch64" else "h100", python=python, platform=platform,
                         torch=release.version)
            except Unsatisfiable:
                continue  # no build for this platform/Python: nothing named
            checked += 1
            if p.triton is None:
                continue
            wheels = m.triton_release(p.triton)
            assert wheels is not None, p.triton
            assert platform in wheels.platforms and in_range(python, wheels.python), (release.version, python, p.triton)
    assert checked >= (20 if platform == "x86_64" else 8)


def test_aarch64_plan_with_an_x86_only_triton_marker_names_none(m):
    # torch 2.6-2.10 require triton only on platform_machine == "x86_64"; triton < 3.5 has no aarch64 wheels.
    # torch 2.12.1 requires it on all Linux machines and triton 3.7.1 publishes aarch64 wheels.
    p = plan(m, "gh200", platform="aarch64", torch="2.12")
    assert p.triton == "3.7.1"


# ---------------------------------------------------------------------------- aarch64 arch lists


def test_aarch64_t4_is_refused_with_the_aarch64_arch_list(m):
    # AWS g5g (Graviton + T4G): the aarch64 builds carry sm_80/sm_90 (cu126) or 8.0-12.0 (cu13x), no sm_75;
    # the x86_64 lists (which do carry sm_75) must not be reused.
    why = refusal(m, "t4", platform="aarch64")
    assert "aarch64 carries no sm_75 code" in why
    assert "SASS: 8.0 9.0" in why and "7.5" not in why.split("SASS:")[1]
    assert plan(m, "t4", platform="x86_64").torch.variant.startswith("cu")  # the same GPU on x86_64 has a plan


def test_aarch64_gh200_plan_uses_the_aarch64_sass(m):
    p = plan(m, "gh200", platform="aarch64")
    build = build_of(m, p)
    assert build.sass_aarch64 and "9.0" in build.sass_aarch64
    assert f"SASS {' '.join(build.sass_aarch64)})" in p.reasons[1]
    # flash-attn 2 publishes no aarch64 wheels (never a source build); FA3's aarch64 wheel is on the PyTorch index
    assert p.flash_attn.package == "flash-attn-3" and p.flash_attn.filename.endswith("-manylinux_2_34_aarch64.whl")
    assert "flash-attn publishes no prebuilt wheel" in refusal(m, "gh200", platform="aarch64",
                                                               attention="flash_attention_2")


def test_aarch64_skips_builds_without_a_recorded_aarch64_wheel(m):
    why = refusal(m, "gh200", platform="aarch64", torch="2.8")
    assert "has no linux aarch64 CUDA build recorded" in why


def test_grace_superchips_need_the_aarch64_platform(m):
    for gpu in ("gh200", "gb200"):
        why = refusal(m, gpu)
        assert "aarch64 host CPU, not x86_64: pass --platform aarch64" in why
    # with no driver (assumed CUDA 12 only): the newest aarch64 build with sm_100 and CUDA 12 is 2.11.0+cu128
    assert plan(m, "gb200", platform="aarch64").torch.variant == "cu128"


# ---------------------------------------------------------------------------- driver branches


def test_b200_with_an_r550_driver_is_refused_with_the_reason(m):
    why = refusal(m, "b200", driver="550.54.14")
    assert "driver 550.54.14 cannot run NVIDIA B200" in why and "≥ 570.26" in why
    assert "pin an older --torch" not in why  # no torch helps: the driver does not know the GPU


@pytest.mark.parametrize("gpu", ["b200", "rtx5090", "gb200"])
def test_blackwell_runs_from_the_first_r570_driver(m, gpu):
    platform = "aarch64" if gpu == "gb200" else "x86_64"
    # GB200 on R570: torch 2.9-2.11's aarch64 cu128 builds carry sm_100 (issue 34; 2.12+ aarch64 is cu126 or CUDA 13)
    p = plan(m, gpu, driver="570.26", platform=platform)
    assert "10.0" in build_of(m, p).sass_aarch64 if gpu == "gb200" else p.torch.variant in ("cu128", "cu129")
    assert refusal(m, gpu, driver="565.57.01", platform=platform).count("R570") == 1


def test_b300_needs_the_cuda_12_9_driver(m):
    assert "≥ 575.51.03" in refusal(m, "b300", driver="570.124.06")
    assert plan(m, "b300", driver="575.51.03").torch.variant.startswith("cu")


@pytest.mark.parametrize("gpu, arch", [("m40", "Maxwell"), ("p100", "Pascal"), ("gtx1080ti", "Pascal"),
                                       ("v100", "Volta")])
def test_drivers_past_r580_no_longer_drive_maxwell_pascal_volta(m, gpu, arch):
    why = refusal(m, gpu, driver="590.44.01")
    assert f"no longer supports" in why and arch in why and "R580" in why
    assert "upgrade" not in why  # upgrading the driver is the wrong advice here
    assert plan(m, gpu, driver="580.95.05").torch.variant == "cu126"  # the last branch still works


def test_k80_on_its_last_r470_driver_gets_a_cuda_11_8_build(m):
    p = plan(m, "k80", driver="470.256.02")
    assert (p.torch.version, p.torch.variant) == ("2.7.1", "cu118")
    assert "3.7" in build_of(m, p).sass
    assert p.driver["max_cuda"] == "11.4"
    assert "minor-version compatibility" in " ".join(p.reasons)
    assert "R470" in refusal(m, "k80", driver="525.60.13")


def test_cuda_13_2_needs_its_ga_driver_natively(m):
    native = plan(m, "h100", driver="595.45.04", no_flash_attn=True)
    assert (native.torch.cuda, native.driver["max_cuda"]) == ("13.2", "13.2")
    assert "runs CUDA 13.2 (needs ≥ 595.45.04)" in " ".join(native.reasons)
    compat = plan(m, "h100", driver="590.48.01", no_flash_attn=True)
    assert compat.driver["max_cuda"] == "13.1"
    assert compat.torch.cuda == "13.0"  # natively, rather than 13.2 through minor-version compatibility


# ---------------------------------------------------------------------------- GPUs people still fine-tune on


def test_maxwell_m40_gets_a_build_with_sm50_sass(m):
    p = plan(m, "m40")
    assert p.gpu["compute_capability"] == "5.2"
    assert "5.0" in build_of(m, p).sass  # sm_52 runs sm_50 SASS
    assert p.precision == "fp16" and p.attention == "sdpa"
    assert "bitsandbytes" not in p.packages  # below every bitsandbytes feature floor


@pytest.mark.parametrize("name, cc", [
    ("NVIDIA H100 80GB HBM3", "9.0"), ("Tesla T4", "7.5"), ("NVIDIA A100-SXM4-40GB", "8.0"),
    ("NVIDIA A100-SXM4-80GB", "8.0"), ("NVIDIA GeForce RTX 4090", "8.9"), ("Tesla V100-SXM2-32GB", "7.0"),
    ("NVIDIA RTX A6000", "8.6"), ("NVIDIA RTX 6000 Ada Generation", "8.9"), ("NVIDIA L40", "8.9"),
    ("NVIDIA H800", "9.0"), ("NVIDIA H20", "9.0"), ("NVIDIA GH200 480GB", "9.0"), ("NVIDIA GB200", "10.0"),
    ("Tesla K80", "3.7"), ("Tesla M40 24GB", "5.2"), ("Tesla M60", "5.2"), ("NVIDIA GeForce RTX 3060", "8.6"),
    ("NVIDIA GeForce RTX 4060", "8.9"), ("NVIDIA GeForce GTX TITAN X", "5.2"),
])
def test_nvidia_smi_names_resolve(m, name, cc):
    assert hardware.lookup(name, m).compute_capability == cc
    assert hardware.cc_from_name(name, m) == cc  # old drivers: detection by name


def test_h800_and_h20_are_their_own_gpus(m):
    assert hardware.lookup("h800", m).name == "NVIDIA H800"
    assert hardware.lookup("h20", m).memory_gb == 96
    assert hardware.cc_from_name("NVIDIA H200", m) == "9.0"


# ---------------------------------------------------------------------------- xformers


def test_xformers_on_volta_with_torch_2_6_is_allowed(m):
    # xformers 0.0.29.post3 (torch 2.6.0) is built for "6.0+PTX 7.0 7.5 8.0+PTX": V100 has kernels.
    p = plan(m, "v100", torch="2.6", attention="xformers")
    assert p.attention == "xformers" and p.packages["xformers"] == "0.0.29.post3"
    # unpinned, the solver walks back to the newest torch whose xformers still has sm_70 kernels
    p = plan(m, "v100", attention="xformers")
    assert (p.torch.version, p.packages["xformers"]) == ("2.6.0", "0.0.29.post3")
    assert "xformers" in p.packages and p.precision == "fp16"


def test_xformers_from_0_0_31_refuses_volta_with_the_reason(m):
    why = refusal(m, "v100", torch="2.7", cuda="12.6", attention="xformers")
    assert "xformers 0.0.31.post1 (for torch 2.7.1) carries kernels for sm_75+ only, not sm_70" in why
    # its cu118 build meets the other fact: the PyPI wheel is a CUDA 12 build
    assert "built against a CUDA 12 torch" in refusal(m, "v100", torch="2.7", cuda="11.8", attention="xformers")


def test_xformers_on_python_3_13_before_0_0_31_is_refused(m):
    # 0.0.29.post3 has cp39-cp312 wheels only.
    why = refusal(m, "a100", python="3.13", torch="2.6", attention="xformers")
    assert "xformers 0.0.29.post3" in why and "Python >=3.9,<3.13" in why


def test_xformers_has_no_aarch64_wheels(m):
    why = refusal(m, "gh200", platform="aarch64", attention="xformers")
    assert "on x86_64 only, not Python 3.11 on aarch64" in why


def test_xformers_abi3_wheels_cover_python_3_13(m):
    p = plan(m, "a100", python="3.13", torch="2.8", attention="xformers")
    assert p.packages["xformers"] == "0.0.32.post2"


# ---------------------------------------------------------------------------- bitsandbytes per feature


def test_cpu_plan_carries_bitsandbytes(m):
    p = plan(m, "cpu")
    assert p.packages["bitsandbytes"] == "0.50.2"
    assert not any(r.startswith("bitsandbytes left out") for r in p.reasons)


def test_gpu_below_every_bitsandbytes_floor_leaves_it_out_naming_the_floors(m):
    p = plan(m, "m40")
    note = next(r for r in p.reasons if r.startswith("bitsandbytes left out"))
    for feature, floor in (("bnb_4bit", "sm_60+"), ("bnb_8bit_optimizer", "sm_60+"), ("bnb_int8_loading", "sm_75+")):
        assert f"{feature} (" in note and floor in note.split(f"{feature} (")[1].split(";")[0]


def test_pascal_keeps_bitsandbytes_for_4bit_and_8bit_optimizers(m):
    assert "bitsandbytes" in plan(m, "p100").packages


# ---------------------------------------------------------------------------- flash-attn releases


def test_torch_2_8_plan_takes_the_newest_flash_attn_post_release(m):
    p = plan(m, "a100", torch="2.8")
    assert p.flash_attn.version == "2.8.3.post1"
    assert p.flash_attn.filename == "flash_attn-2.8.3.post1+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    assert p.flash_attn.wheel_url.endswith(f"/v2.8.3.post1/{p.flash_attn.filename}")


def test_flash_attn_pin_to_the_older_release_still_works(m):
    p = plan(m, "a100", torch="2.6", flash_attn="2.8.3")
    assert p.flash_attn.filename == "flash_attn-2.8.3+cu12torch2.6cxx11abiFALSE-cp311-cp311-linux_x86_64.whl"


# ---------------------------------------------------------------------------- the command line


def test_cli_refusal_for_an_old_driver_is_one_line_exit_2():
    out = run_envtool("resolve", "--gpu", "b200", "--driver", "550.54.14")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "R570" in lines[0] and "Traceback" not in out.stderr


def test_cli_cpu_plan_json_lists_bitsandbytes():
    out = run_envtool("resolve", "--gpu", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    assert "bitsandbytes" in json.loads(out.stdout)["packages"]


def test_xformers_pypi_wheels_are_cuda_12_builds(m):
    # Plans take xformers from PyPI, whose wheel is compiled against a CUDA 12 torch (upload filter
    # "*torch2.10.0+cu128*"): with a CUDA 13 torch its extensions do not load, so such a pair is never planned.
    why = refusal(m, "rtx5090", torch="2.10", cuda="13", attention="xformers")
    assert "built against a CUDA 12 torch" in why and "use --cuda 12.8" in why
    p = plan(m, "rtx5090", driver="595.45.04", attention="xformers")
    assert p.torch.cuda.startswith("12.") and p.attention == "xformers"


# ---------------------------------------------------------------------------- the loader keeps the facts consistent


def test_new_rows_carry_sources(m):
    assert all(t.source.strip() for t in m.triton_releases) and len(m.triton_releases) >= 10
    assert all(f.source.strip() for f in m.features)
    assert all(a.driver_note for a in m.archs if a.min_driver or a.max_driver_branch)


@pytest.fixture
def edited_matrix(tmp_path):
    import shutil

    from resolver import matrix

    target = tmp_path / "matrices"
    shutil.copytree(matrix.matrix_dir(), target, ignore=shutil.ignore_patterns("*.py", "__pycache__"))

    def edit(name, old, new):
        path = target / name
        text = path.read_text()
        assert old in text, old
        path.write_text(text.replace(old, new, 1))
        return lambda: matrix._load(target)

    return edit


@pytest.mark.parametrize("name, old, new, message", [
    # drop torch 2.5.1's python_version marker: it would then require triton 3.1.0 on 3.13, which has no wheel
    ("torch.toml", 'triton_python = "<3.13"\ntriton_platforms = ["x86_64"]\nsource = "PyPI metadata of the Linux x86_64 wheel (Requires-Python, Requires-Dist triton); pytorch/pytorch RELEASE.md release compatibility matrix; triton marker (PEP 658 METADATA of the PyPI cp312 manylinux x86_64 and aarch64 wheels, checked 2026-11-22): triton==3.1.0',
     'triton_platforms = ["x86_64"]\nsource = "x; triton==3.1.0', "requires triton 3.1.0 on Python 3.13, where triton publishes no wheel"),
    ("torch.toml", 'triton = "3.2.0"\ncxx11abi = false\ntriton_platforms = ["x86_64"]',
     'triton = "3.2.0"\ncxx11abi = false\ntriton_platforms = ["x86_64", "aarch64"]', "requires triton 3.2.0 on aarch64"),
    ("packages.toml", 'version = "3.7.1"\npython = ">=3.10,<3.15"', 'version = "3.7.2"\npython = ">=3.10,<3.15"',
     "triton 3.7.1 has no packages.toml [[triton_release]] row"),
    ("archs.toml", 'max_driver_branch = 470\ndriver_note = "the R470 driver branch is the last to support Kepler GPUs"\n',
     "max_driver_branch = 470\n", "a driver limit needs a driver_note"),
    ("xformers.toml", 'platforms = ["x86_64"]', 'platforms = ["x86-64"]', "platform 'x86-64' is not one of"),
    ("torch.toml", 'sass_aarch64 = ["8.0", "9.0"]', "sass_aarch64 = []", "empty sass_aarch64 list"),
    ("packages.toml", 'hold = { transformers = "<5.24" }', 'hold = { transformers = "<5.23" }',
     "hold.transformers <5.23 excludes its own pin 5.23.0"),
    ("packages.toml", 'hold = { transformers = "<5.24" }', 'hold = { torchao = "<2" }', "hold.torchao is not one of"),
    ("packages.toml", '\nhold_source = "', '\n# hold_source = "', "hold without hold_source"),
    ("gpus.toml", 'pci_ids = ["2c05"]', 'pci_ids = ["2C05"]', "pci_ids '2C05' is not a PCI device id"),
    ("gpus.toml", 'pci_ids = ["2d04"]', 'pci_ids = ["2c05"]', "PCI id 2c05 also names GeForce RTX 5070 Ti"),
])
def test_loader_refuses_inconsistent_facts(edited_matrix, name, old, new, message):
    from resolver.errors import MatrixError

    load = edited_matrix(name, old, new)
    with pytest.raises(MatrixError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load()


@pytest.mark.parametrize("name, cc, memory_gb, same", [
    ("NVIDIA GeForce RTX 5070 Ti", "12.0", 16.0, True),  # its own row (issue 43), not the RTX 5070's 12 GB
    ("NVIDIA GeForce RTX 5060 Ti", "12.0", 8.0, True),  # its own row: the 8 GB of its two memory sizes
    ("NVIDIA GeForce RTX 5060 Ti 16GB", "12.0", 16.0, False),  # the name states the other size
    ("NVIDIA GeForce RTX 4060 Ti", "8.9", None, False),
    ("NVIDIA GH200 144G HBM3e", "9.0", 144.0, True),  # its own row (issue 43), not the 96 GB GH200 480GB row
    ("Tesla V100-SXM2-32GB", "7.0", 32.0, True),  # the name states its memory
    ("NVIDIA H100 80GB HBM3", "9.0", 80.0, True),
    ("NVIDIA A100-SXM4-40GB", "8.0", 40.0, True),
    ("Tesla T4", "7.5", 16.0, True),
])
def test_a_gpu_name_is_never_taken_for_another_product_of_its_line(name, cc, memory_gb, same):
    """nvidia-smi's names of a variant (Ti) or of another memory size (GH200 144G) keep the product line's compute
    capability but never the catalog row's memory: through `envtool resolve`, and the trainer's own reading."""
    from matrices import catalog
    from resolver import matrix
    from trainer.runtime.hardware import gpu_from_name

    row, memory, own = catalog.gpu_family(name, matrix.load().gpus)
    assert (row.compute_capability, memory, own) == (cc, memory_gb, same)
    assert (catalog.find_gpu(name, matrix.load().gpus) is row) == same  # find_gpu never answers another product
    out = run_envtool("resolve", "--gpu", name, "--json")
    assert out.returncode == 0, out.stderr
    gpu = json.loads(out.stdout)["gpu"]
    assert (gpu["compute_capability"], gpu["memory_gb"]) == (cc, memory_gb)
    assert gpu["name"] == (row.name if same else name)
    trainer = gpu_from_name(name)
    assert (trainer.compute_capability, trainer.memory_gb) == (cc, memory_gb)
