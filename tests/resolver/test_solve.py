"""What a user on each real GPU gets from today's matrices: invariants that hold whatever releases the data
lists (the build carries the GPU's code, the driver runs it). Preference policy is tested on a synthetic
matrix in test_policy.py, so a new torch or flash-attn row breaks no test here."""

import pytest
from packaging.version import Version

from resolver import hardware
from resolver.errors import BadInput, Unsatisfiable
from resolver.solve import Request, has_sass, solve


def plan(m, gpu, driver=None, python="3.11", **pins):
    return solve(Request(gpu=hardware.lookup(gpu, m), driver=driver, python=python, target=gpu, **pins), m)


def build_of(m, p):
    release = next(r for r in m.torch if r.version == p.torch.version)
    return next(b for b in release.build if b.variant == p.torch.variant)


def newest_torch(m):
    return max((r.version for r in m.torch), key=Version)


def reasons(p):
    return "\n".join(p.reasons)


# (gpu, driver) -> attention, precision, torch compile/liger kernels on?
CASES = [
    ("t4", None, "sdpa", "fp16", True),
    ("t4", "535.104.05", "sdpa", "fp16", True),
    ("v100", None, "sdpa", "fp16", False),
    ("v100", "470.82.01", "sdpa", "fp16", False),
    ("p100", None, "sdpa", "fp16", False),
    ("p100", "525.60.13", "sdpa", "fp16", False),
    ("a100", None, "flash_attention_2", "bf16", True),
    ("a100", "550.54.14", "flash_attention_2", "bf16", True),
    ("a10g", None, "flash_attention_2", "bf16", True),
    ("a10g", "535.183.01", "flash_attention_2", "bf16", True),
    ("h100", None, "flash_attention_2", "bf16", True),
    ("h100", "580.65.06", "flash_attention_2", "bf16", True),
    ("l4", None, "flash_attention_2", "bf16", True),
    ("l4", "570.26", "flash_attention_2", "bf16", True),
    ("rtx4090", None, "flash_attention_2", "bf16", True),
    ("rtx4090", "560.28.03", "flash_attention_2", "bf16", True),
    ("rtx5090", None, "flash_attention_2", "bf16", True),
    ("rtx5090", "575.51.03", "flash_attention_2", "bf16", True),
]


@pytest.mark.parametrize("gpu, driver, attention, precision, kernels", CASES)
def test_plan_runs_on_the_gpu(m, gpu, driver, attention, precision, kernels):
    p = plan(m, gpu, driver)
    cc = p.gpu["compute_capability"]
    build = build_of(m, p)
    # the torch build carries SASS for the GPU (never PTX alone)
    assert has_sass(build, cc), (p.torch, build.sass)
    # the driver runs the build's CUDA, at least through minor-version compatibility
    if driver:
        major = m.cuda_major(int(build.cuda.split(".")[0]))
        assert Version(driver) >= Version(major.compat_min_driver)
    assert p.attention == attention
    assert p.precision == precision
    assert p.features == {"torch_compile": kernels, "liger": kernels}
    assert p.triton == next(r.triton for r in m.torch if r.version == p.torch.version)
    assert p.torch.index_url == f"https://download.pytorch.org/whl/{p.torch.variant}"
    if attention == "flash_attention_2":
        torch_mm = ".".join(p.torch.version.split(".")[:2])
        abi = "TRUE" if next(r for r in m.torch if r.version == p.torch.version).cxx11abi else "FALSE"
        assert p.flash_attn.filename == (f"flash_attn-{p.flash_attn.version}+cu12torch{torch_mm}cxx11abi{abi}"
                                         f"-cp311-cp311-linux_x86_64.whl")
        assert p.flash_attn.wheel_url.endswith(f"/v{p.flash_attn.version}/{p.flash_attn.filename}")
        assert p.packages["flash-attn"] == p.flash_attn.version
    else:
        assert p.flash_attn is None and "flash-attn" not in p.packages
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "deepspeed"):
        assert name in p.packages


def test_t4_explains_why_no_flash_attn_and_no_bf16(m):
    p = plan(m, "t4", "580.65.06")
    text = reasons(p)
    assert "passed over on Tesla T4 (sm_75, Turing): flash_attention_3 (needs sm_90 only), flash_attention_2 (needs sm_80+)" in text
    assert "no native bf16" in text and "is_bf16_supported" in text
    assert p.torch.version == newest_torch(m)  # nothing to trade for flash-attn on Turing


def test_volta_turns_triton_kernels_off_and_never_gets_cuda13(m):
    for driver in (None, "580.95.05"):  # R580 is the last branch that drives Volta, and runs CUDA 13
        p = plan(m, "v100", driver)
        assert not p.torch.variant.startswith("cu13")
        assert "triton kernels (torch.compile, liger) are off" in reasons(p)


def test_gtx_1080ti_never_gets_a_build_that_starts_at_sm75(m):
    # astral-sh/uv#14742: driver-only selection gave a Pascal card a cu128 build that starts at sm_75.
    p = plan(m, "gtx1080ti", "570.26")
    assert p.torch.variant == "cu126"
    assert "6.0" in build_of(m, p).sass
    assert any("carries no sm_61 code" in r.reason for r in solve(Request(
        gpu=hardware.lookup("gtx1080ti", m), driver="570.26", python="3.11"), m).rejected)


def test_no_flash_attn_gives_the_newest_torch_with_sdpa(m):
    p = plan(m, "a100", "580.65.06", no_flash_attn=True)
    assert p.attention == "sdpa" and p.flash_attn is None
    assert p.torch.version == newest_torch(m)
    assert "--no-flash-attn" in reasons(p)


def test_cpu_plan(m):
    p = plan(m, "cpu")
    assert (p.torch.variant, p.torch.cuda, p.precision, p.attention, p.triton) == ("cpu", None, "fp32", "sdpa", None)
    assert p.torch.index_url.endswith("/whl/cpu")
    assert "bitsandbytes" in p.packages  # its CPU backend runs 4-bit and 8-bit optimizers without a GPU


def test_known_driver_picks_the_newest_cuda_it_runs_natively(m):
    assert plan(m, "t4", "580.65.06").torch.variant == "cu130"
    p = plan(m, "t4", "560.28.03")
    assert p.torch.variant == "cu126" and "runs CUDA 12.6" in reasons(p)
    assert p.driver == {"version": "560.28.03", "max_cuda": "12.6"}


def test_old_driver_runs_through_minor_version_compatibility_and_says_so(m):
    p = plan(m, "t4", "535.104.05")
    assert p.torch.variant == "cu126"
    assert "minor-version compatibility" in reasons(p)
    assert p.driver["max_cuda"] == "12.2"


def test_unknown_driver_picks_the_cuda_that_runs_on_the_oldest_drivers(m):
    p = plan(m, "t4")
    assert p.torch.variant == "cu126" and "driver unknown" in reasons(p)
    newest = newest_torch(m)
    if Version(p.torch.version) < Version(newest):  # the newest torch has CUDA 13 builds only
        assert f"torch {newest} is newer but needs CUDA 13" in reasons(p)
    assert plan(m, "t4", "580.65.06").torch.version == newest


def test_xformers_on_request(m):
    p = plan(m, "t4", attention="xformers")
    assert p.attention == "xformers" and "xformers" in p.packages
    assert p.precision == "fp16"


def test_python_narrows_torch(m):
    p = plan(m, "t4", python="3.9")
    assert Version(p.torch.version) < Version("2.9")


# ---------------------------------------------------------------------------- conflicts


@pytest.mark.parametrize("gpu, driver, pins, message", [
    ("v100", None, {"cuda": "13.0"},
     "--cuda 13.0 with Tesla V100 (sm_70, Volta): CUDA 13 torch builds carry no sm_70 code: CUDA 13 supports "
     "sm_75+ only (CUDA 13.0 removed Maxwell, Pascal and Volta); use --cuda 12.6"),
    ("p100", None, {"cuda": "12.8"}, "carries no sm_60 code"),
    ("t4", None, {"attention": "flash_attention_2"},
     "--attention flash_attention_2 with Tesla T4 (sm_75, Turing): flash_attention_2 needs sm_80+; use --attention sdpa"),
    ("a100", None, {"torch": "9.9"}, "no torch release matches --torch 9.9"),
    ("a100", None, {"flash_attn": "1.0.9"}, "--flash-attn 1.0.9: no prebuilt wheels recorded"),
    ("t4", "440.33", {}, "driver 440.33 cannot run CUDA"),
    ("t4", "560.28.03", {"cuda": "13.0"}, "driver 560.28.03 cannot run CUDA 13.0"),
    ("cpu", None, {"cuda": "12.6"}, "CPU plans use torch's CPU build"),
    ("m40", None, {"torch": "2.6", "cuda": "12.4", "attention": "xformers"},
     "xformers 0.0.29.post3 (for torch 2.6.0) carries kernels for sm_60+ only, not sm_52; use --attention sdpa"),
])
def test_unsatisfiable_names_the_conflicting_facts(m, gpu, driver, pins, message):
    with pytest.raises(Unsatisfiable) as err:
        plan(m, gpu, driver, **pins)
    assert message in str(err.value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize("pins, message", [
    ({"python": "three"}, "--python 'three' is not a Python version"),
    ({"torch": "two"}, "--torch 'two' is not a version"),
    ({"attention": "flash"}, "--attention 'flash': choose one of"),
    ({"platform": "ppc64le"}, "--platform 'ppc64le'"),
    ({"no_flash_attn": True, "attention": "flash_attention_2"}, "contradicts"),
])
def test_malformed_pins(m, pins, message):
    python = pins.pop("python", "3.11")
    with pytest.raises(BadInput, match=message.replace("(", r"\(")):
        plan(m, "a100", python=python, **pins)


def test_rejections_explain_every_candidate(m):
    p = plan(m, "v100", torch="2.8")
    assert p.torch.version.startswith("2.8")
    assert p.rejected and all(r.reason for r in p.rejected)
    assert any(r.torch == newest_torch(m) and "--torch 2.8 excludes" in r.reason for r in p.rejected)
