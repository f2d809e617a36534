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


# (gpu, driver) -> attention, packing, precision, torch compile/liger kernels on?
# Issue 19's policy: the fastest attention, then the newest torch. Hopper takes FA3 (its abi3 wheel on the
# PyTorch index, torch >= 2.9); every other sm_80+ GPU gets torch's own varlen_attn (FA2 kernels inside torch
# >= 2.10), so none of them is held at the torch the last flash-attn 2 wheel was built for.
CASES = [
    ("t4", None, "sdpa", "mask", "fp16", True),
    ("t4", "535.104.05", "sdpa", "mask", "fp16", True),
    ("v100", None, "sdpa", "mask", "fp16", False),
    ("v100", "470.82.01", "sdpa", "mask", "fp16", False),
    ("p100", None, "sdpa", "mask", "fp16", False),
    ("p100", "525.60.13", "sdpa", "mask", "fp16", False),
    ("a100", None, "sdpa", "varlen", "bf16", True),
    ("a100", "550.54.14", "sdpa", "varlen", "bf16", True),
    ("a100", "580.65.06", "sdpa", "varlen", "bf16", True),
    ("a10g", None, "sdpa", "varlen", "bf16", True),
    ("a10g", "535.183.01", "sdpa", "varlen", "bf16", True),
    ("h100", None, "flash_attention_3", "varlen", "bf16", True),
    ("h100", "580.65.06", "flash_attention_3", "varlen", "bf16", True),
    ("h100", "595.45.04", "flash_attention_3", "varlen", "bf16", True),
    ("h200", "580.65.06", "flash_attention_3", "varlen", "bf16", True),
    ("l4", None, "sdpa", "varlen", "bf16", True),
    ("l4", "570.26", "sdpa", "varlen", "bf16", True),
    ("rtx4090", None, "sdpa", "varlen", "bf16", True),
    ("rtx4090", "560.28.03", "sdpa", "varlen", "bf16", True),
    ("b200", "580.65.06", "sdpa", "varlen", "bf16", True),
    ("rtx5090", None, "sdpa", "varlen", "bf16", True),
    ("rtx5090", "575.51.03", "sdpa", "varlen", "bf16", True),
    ("rtx5090", "580.65.06", "sdpa", "varlen", "bf16", True),
]


def newest_for(m, cc, driver):
    """The newest torch release with a build that carries the GPU's code and that the driver runs (driver
    unknown: the one cuda.toml assumes)."""
    floor = Version(driver or m.assumed_driver)
    return max((r.version for r in m.torch for b in r.build if has_sass(b, cc)
                and floor >= Version(m.cuda_major(int(b.cuda.split(".")[0])).compat_min_driver)), key=Version)


@pytest.mark.parametrize("gpu, driver, attention, packing, precision, kernels", CASES)
def test_plan_runs_on_the_gpu(m, gpu, driver, attention, packing, precision, kernels):
    p = plan(m, gpu, driver)
    cc = p.gpu["compute_capability"]
    build = build_of(m, p)
    # the torch build carries SASS for the GPU (never PTX alone)
    assert has_sass(build, cc), (p.torch, build.sass)
    # the driver runs the build's CUDA, at least through minor-version compatibility
    if driver:
        major = m.cuda_major(int(build.cuda.split(".")[0]))
        assert Version(driver) >= Version(major.compat_min_driver)
    assert (p.attention, p.packing) == (attention, packing)
    assert p.precision == precision
    assert p.features == {"torch_compile": kernels, "liger": kernels}
    assert p.triton == next(r.triton for r in m.torch if r.version == p.torch.version)
    assert p.torch.index_url == f"https://download.pytorch.org/whl/{p.torch.variant}"
    if p.gpu["bf16"]:  # sm_80+: nothing holds torch back (no flash-attn wheel, no cap at 2.8)
        assert p.torch.version == newest_for(m, cc, driver), (p.torch, reasons(p))
    if attention == "flash_attention_3":
        assert p.flash_attn.filename == f"flash_attn_3-{p.flash_attn.version}-cp39-abi3-manylinux_2_28_x86_64.whl"
        assert p.flash_attn.index_url == p.torch.index_url  # uv takes it from the torch build's own index
        assert p.flash_attn.wheel_url == f"{p.torch.index_url}/{p.flash_attn.filename}"
        assert p.packages["flash-attn-3"] == p.flash_attn.version and "flash-attn" not in p.packages
    else:
        assert p.flash_attn is None and "flash-attn" not in p.packages and "flash-attn-3" not in p.packages
    if packing == "varlen" and attention == "sdpa":
        assert "varlen_attn" in reasons(p)
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
    p = plan(m, "h100", "580.65.06", no_flash_attn=True)
    assert p.attention == "sdpa" and p.flash_attn is None and p.packing == "varlen"
    assert p.torch.version == newest_torch(m)
    assert "--no-flash-attn" in reasons(p)


def test_grace_hopper_gets_the_aarch64_flash_attn_3_wheel(m):
    p = plan(m, "gh200", "580.65.06", platform="aarch64")
    assert (p.attention, p.torch.version) == ("flash_attention_3", newest_torch(m))
    assert p.flash_attn.filename == "flash_attn_3-3.0.0-cp39-abi3-manylinux_2_34_aarch64.whl"
    assert has_sass(build_of(m, p), "9.0")  # (aarch64 arch lists: torch.toml sass_aarch64)


def test_an_old_flash_attn_2_wheel_never_holds_torch_back(m):
    """A100: flash-attn 2's wheels stop at torch 2.8, torch's own varlen_attn is the same kernels: the plan
    takes the newest torch and names the wheel it passed over."""
    p = plan(m, "a100", "580.65.06")
    assert p.torch.version == newest_torch(m) and (p.attention, p.packing) == ("sdpa", "varlen")
    assert "not taken: flash_attention_2 through the flash-attn" in reasons(p)
    pinned = plan(m, "a100", "580.65.06", attention="flash_attention_2")  # asked for: still there
    assert pinned.flash_attn.package == "flash-attn" and Version(pinned.torch.version) < Version("2.9")


def test_cudnn_sdpa_is_switched_off_for_masks_where_it_is_the_default(m):
    b200 = plan(m, "b200", "580.65.06")
    assert b200.mask_without_cudnn and "cuDNN SDPA off for masked calls" in reasons(b200)
    assert not plan(m, "a100", "580.65.06").mask_without_cudnn  # sm_80: cuDNN never goes first
    assert not plan(m, "h100", "580.65.06").mask_without_cudnn  # FA3: no SDPA call at all
    assert plan(m, "h100", "580.65.06", no_flash_attn=True).mask_without_cudnn
    assert not plan(m, "h100", "580.65.06", no_flash_attn=True, cuda="12.6").mask_without_cudnn  # older cuDNN


def test_hub_kernels_on_python_3_11_take_the_stacks_own_transformers_with_kernels_0_18(m):
    """Issue 43: kernels 0.18.3 (PyPI, uploaded 2026-11-12) is inside transformers 5.23.0's kernels>=0.18.2,<0.19,
    so Hub-kernel plans on Python >= 3.11 keep the stack's transformers 5.23.0 (issue 34 had to lower them to 5.22.2
    while PyPI's newest kernels was 0.17.2); PyPI's newest, 0.19.1, is outside that range and never pinned."""
    hub = "kernels-community/vllm-flash-attn3"
    for python in ("3.11", "3.12", "3.13"):
        p = plan(m, "h100", "580.65.06", python=python, attention=hub)
        assert (p.packages["transformers"], p.packages["kernels"]) == ("5.23.0", "0.18.3"), python
        assert p.packages["trl"] == "1.16.0" and p.torch.version != "2.8.0"
    # Python 3.10's stack (transformers 5.20.2) takes kernels>=0.17.2,<0.18: 0.17.2 installs beside it
    p = plan(m, "h100", "580.65.06", python="3.10", attention=hub)
    assert p.packages["kernels"] == "0.17.2" and p.packages["transformers"] == "5.20.2"


def test_hub_kernels_are_refused_where_no_transformers_of_the_stack_accepts_a_kernels_release(m):
    newest = m.stacks[0]._replace(hub_kernels={}, hub_kernels_source=None)
    bare = m._replace(stacks=[newest, *m.stacks[1:]],
                      kernels_releases=[k for k in m.kernels_releases if not k.version.startswith("0.18.")])
    with pytest.raises(Unsatisfiable, match=r"transformers 5\.23\.0 loads Hub kernels through kernels>=0\.18\.2,<0\.19, "
                       r"and no kernels release in that range exists \(PyPI's newest: 0\.19\.1\)"):
        plan(bare, "h100", "580.65.06", attention="kernels-community/vllm-flash-attn3")


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
