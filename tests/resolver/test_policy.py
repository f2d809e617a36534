"""The solver's policy on a synthetic matrix (tests/resolver/synthetic.py): what it prefers and how it explains,
independent of which releases matrices/ lists today. Each test states the policy in its name."""

import pytest

from resolver import hardware
from resolver import matrix as matrix_module
from resolver.errors import Unsatisfiable
from resolver.solve import Request, solve

from . import synthetic


@pytest.fixture
def matrix(tmp_path):
    made = []

    def make(**extra):  # a directory per matrix: load() caches by directory
        made.append(1)
        return matrix_module.load(synthetic.make(tmp_path / f"m{len(made)}", **extra))

    return make


def plan(m, gpu, driver=None, python="3.11", **pins):
    return solve(Request(gpu=hardware.lookup(gpu, m), driver=driver, python=python, target=gpu, **pins), m)


def reasons(p):
    return "\n".join(p.reasons)


def test_a_newer_torch_with_varlen_built_in_beats_an_older_torch_held_back_for_a_flash_attn_2_wheel(matrix):
    m = matrix()  # flash-attn 9.0 has wheels for torch 3.0; torch 3.1 has FA2-class varlen_attn built in
    p = plan(m, "a100")
    assert (p.torch.version, p.attention, p.packing, p.flash_attn) == ("3.1.0", "sdpa", "varlen", None)
    assert "packed rows kept apart by cu_seqlens, no mask (packing: varlen), through torch 3.1.0's own varlen_attn" \
        in reasons(p)
    assert ("not taken: flash_attention_2 through the flash-attn 9.0 wheel on torch 3.0.0+cu126: the same attention "
            "class as sdpa through torch's varlen_attn on torch 3.1.0+cu126, and torch 3.0.0 is older than 3.1.0") \
        in reasons(p)
    assert "flash-attn" not in p.packages


def test_the_fastest_attention_comes_before_the_newest_torch(matrix):
    m = matrix(builtin_varlen="")  # no torch has a varlen kernel of its own: the wheel is the only fast path
    p = plan(m, "a100")
    assert (p.torch.version, p.attention, p.packing, p.flash_attn.version) == ("3.0.0", "flash_attention_2",
                                                                               "varlen", "9.0")
    assert ("torch 3.1.0 is newer, but its fastest attention here is sdpa with a packing mask, slower than "
            "flash_attention_2 through the flash-attn 9.0 wheel, so torch 3.0.0+cu126 was chosen for it") in reasons(p)
    assert p.flash_attn.wheel_url == ("https://fa.test/v9.0/flash_attn-9.0+cu12torch3.0cxx11abiTRUE-cp311-cp311-"
                                      "linux_x86_64.whl") and p.flash_attn.index_url is None


def test_torch_s_own_kernel_wins_over_a_wheel_of_the_same_class_on_the_same_torch(matrix):
    m = matrix(flash_attn=synthetic.flash_attn_release("9.1", ["3.0", "3.1"]))
    p = plan(m, "a100")
    assert (p.torch.version, p.attention, p.packing) == ("3.1.0", "sdpa", "varlen") and "flash-attn" not in p.packages
    assert "flash-attn 9.1 has a wheel, but torch 3.1.0's own varlen_attn runs the same kernels" in reasons(p)
    without = plan(matrix(flash_attn=synthetic.flash_attn_release("9.1", ["3.0", "3.1"]), builtin_varlen=""), "a100")
    assert (without.torch.version, without.flash_attn.version) == ("3.1.0", "9.1")


def test_varlen_needs_the_gpu_and_torch_its_kernel_runs_on(matrix):
    m = matrix()
    assert plan(m, "t4").packing == "mask"  # sm_75: below varlen_attn's sm_80
    assert plan(m, "a100", torch="3.0", no_flash_attn=True).packing == "mask"  # torch 3.0 has none
    assert plan(m, "cpu").packing == "mask"


def test_no_flash_attn_takes_the_newest_torch_the_driver_runs(matrix):
    m = matrix()
    assert plan(m, "a100", no_flash_attn=True).torch.version == "3.1.0"  # driver unknown: CUDA 12 builds
    p = plan(m, "a100", "580.65.06", no_flash_attn=True)
    assert (p.torch.version, p.torch.variant, p.attention, p.packing) == ("3.2.0", "cu130", "sdpa", "varlen")


def test_hopper_prefers_flash_attention_3_over_a_newer_torch(matrix):
    m = matrix(flash_attn=synthetic.flash_attn_release("3.9", ["3.0"], impl="fa3"))
    p = plan(m, "h100")
    assert (p.torch.version, p.attention) == ("3.0.0", "flash_attention_3")  # FA3 beats torch 3.1's varlen_attn
    assert plan(m, "a100").attention == "sdpa"  # FA3 is sm_90 only (attention.toml)


def test_flash_attention_3_from_the_pytorch_index_only_in_the_folders_that_hold_it(matrix):
    m = matrix(flash_attn=synthetic.fa3_index_release("3.0.0", "3.1", ["cu126", "cu130"]))
    p = plan(m, "h100", "580.65.06")
    assert (p.torch.version, p.torch.variant, p.attention) == ("3.2.0", "cu130", "flash_attention_3")
    assert p.flash_attn.filename == "flash_attn_3-3.0.0-cp39-abi3-manylinux_2_28_x86_64.whl"
    assert p.flash_attn.index_url == p.torch.index_url == "https://torch.test/whl/cu130"
    assert p.flash_attn.wheel_url == "https://torch.test/whl/cu130/flash_attn_3-3.0.0-cp39-abi3-manylinux_2_28_x86_64.whl"
    assert p.packages["flash-attn-3"] == "3.0.0"
    # every Python from the abi3 tag on, torch from min_torch on
    assert plan(m, "h100", "580.65.06", python="3.13").attention == "flash_attention_3"
    assert plan(m, "h100", torch="3.0").attention == "flash_attention_2"  # below min_torch: 3.0's FA2 wheel
    # a folder without the wheel: the build is passed over for one that has it, and the plan says why
    only12 = matrix(flash_attn=synthetic.fa3_index_release("3.0.0", "3.1", ["cu126"]))
    q = plan(only12, "h100", "580.65.06")
    assert (q.torch.version, q.torch.variant, q.attention) == ("3.1.0", "cu126", "flash_attention_3")
    assert "torch 3.2.0 is newer, but its fastest attention here is sdpa through torch's varlen_attn, slower than " \
        "flash_attention_3 through the flash-attn-3 3.0.0 wheel" in reasons(q)


def test_cudnn_sdpa_goes_off_for_masks_on_the_builds_that_default_to_it(matrix):
    m = matrix(torch=synthetic.cudnn_sdpa(torch=">=3.1", cuda=">=13.0", min_cc="9.0", max_cc="10.3"))
    b200 = plan(m, "b200", "580.65.06")
    assert (b200.torch.variant, b200.attention, b200.packing, b200.mask_without_cudnn) == ("cu130", "sdpa",
                                                                                             "varlen", True)
    assert "cuDNN SDPA off for masked calls (padding masks; mask_without_cudnn)" in reasons(b200)
    assert "synthetic mask bug" in reasons(b200)
    assert not plan(m, "h100", "580.65.06", cuda="12.6", no_flash_attn=True).mask_without_cudnn  # cu126: not first
    assert plan(m, "h100", "580.65.06", no_flash_attn=True).mask_without_cudnn
    assert not plan(m, "a100", "580.65.06").mask_without_cudnn  # sm_80: outside the GPUs it applies to
    assert not plan(m, "rtx5090", "580.65.06").mask_without_cudnn  # sm_120 too
    eager = plan(m, "b200", "580.65.06", attention="eager")  # no SDPA call: nothing to switch off
    assert not eager.mask_without_cudnn and eager.packing == "mask"
    masked = plan(m, "h100", "580.65.06", torch="3.1", cuda="13.0", attention="xformers")  # SDPA with a mask
    assert masked.packing == "mask" and masked.mask_without_cudnn
    assert "(padding masks and the packing mask; mask_without_cudnn)" in reasons(masked)


def test_hub_kernels_only_with_a_kernels_release_inside_transformers_range(matrix):
    hub = "kernels-community/vllm-flash-attn3"
    none_fits = matrix(packages=synthetic.kernels(">=1.2,<1.3", "1.1.0"))
    with pytest.raises(Unsatisfiable, match=r"transformers 9\.0\.0 loads Hub kernels through kernels>=1\.2,<1\.3, and "
                       r"no kernels release in that range exists \(PyPI's newest: 1\.1\.0\), so none installs "
                       r"beside it; use --attention flash_attention_3|use --attention sdpa"):
        plan(none_fits, "h100", attention=hub)
    fits = matrix(packages=synthetic.kernels(">=1.1,<1.3", "1.0.0", "1.1.0", "1.2.5"))
    p = plan(fits, "h100", attention=hub)
    assert p.attention == hub and p.packages["kernels"] == "1.2.5" and p.packing == "varlen"
    assert p.torch.version == "3.1.0"  # the newest torch: nothing lowered for a flash-attn wheel
    with pytest.raises(Unsatisfiable, match="records no kernels requirement for transformers 9.0.0"):
        plan(matrix(), "h100", attention=hub)


def test_explain_lists_every_candidate_not_taken_with_why(matrix):
    m = matrix()
    p = plan(m, "a100", "580.65.06")
    taken = (p.torch.version, p.torch.variant)
    builds = {(r.version, b.variant) for r in m.torch for b in r.build}
    assert {(r.torch, r.variant) for r in p.rejected} == builds - {taken}
    by = {(r.torch, r.variant): r for r in p.rejected}
    assert by[("3.0.0", "cu126")].rule == "preference" and "older than 3.2.0" in by[("3.0.0", "cu126")].reason


def test_turing_gets_sdpa_and_the_newest_torch(matrix):
    m = matrix()
    p = plan(m, "t4")
    assert (p.torch.version, p.torch.variant, p.attention, p.precision) == ("3.1.0", "cu126", "sdpa", "fp16")
    assert "torch 3.2.0 is newer but needs CUDA 13.0" in "\n".join(p.reasons)
    assert plan(m, "t4", "580.65.06").torch.variant == "cu130"


def test_volta_never_gets_a_build_without_its_code(matrix):
    m = matrix()
    p = plan(m, "v100", "580.65.06")
    assert p.torch.variant == "cu126" and p.features == {"torch_compile": False, "liger": False}
    with pytest.raises(Unsatisfiable, match="use --cuda 12.6"):
        plan(m, "v100", cuda="13.0")


def test_a_pin_that_excludes_every_wheel_names_the_pin_value_that_works(matrix):
    m = matrix()
    with pytest.raises(Unsatisfiable, match=r"use --torch 3\.0"):
        plan(m, "a100", torch="3.1", attention="flash_attention_2")
    with pytest.raises(Unsatisfiable, match="flash-attn-3 publishes no prebuilt wheel"):
        plan(m, "h100", attention="flash_attention_3")


def test_a_driver_too_old_for_every_build_is_refused_with_the_upgrade_advice(matrix):
    with pytest.raises(Unsatisfiable, match="driver 470.82.01 cannot run CUDA .*upgrade the NVIDIA driver"):
        plan(matrix(), "a100", "470.82.01")


def test_xformers_is_chosen_only_on_request_and_within_its_arch_list(matrix):
    m = matrix()
    assert plan(m, "t4").attention == "sdpa"
    assert plan(m, "t4", attention="xformers").packages["xformers"] == "0.9.0"
    with pytest.raises(Unsatisfiable, match=r"xformers 0.9.0 \(for torch 3.1.0\) carries kernels for sm_75\+ only, not sm_70"):
        plan(m, "v100", attention="xformers")


@pytest.mark.parametrize("gpu, driver, pins, held, by", [
    ("a100", None, {"attention": "flash_attention_2"}, "3.1.0", "the flash-attn wheel (--attention flash_attention_2)"),
    ("a100", None, {"torch": "3.0"}, "3.1.0", "the pin"),
    ("a100", "525.60.13", {}, "3.2.0", "the driver"),
])
def test_a_torch_held_back_names_what_holds_it_back_never_newest_build_with_the_gpus_code(matrix, gpu, driver,
                                                                                          pins, held, by):
    """The torch reason says "newest build that carries sm_XX code" only where it is true; where a newer build
    carries the GPU's code and a pin, the driver or the wheel an attention needs refused it, it names that."""
    p = plan(matrix(), gpu, driver, **pins)
    line = next(r for r in p.reasons if r.startswith(f"torch {p.torch.version}+"))
    assert "newest build that" not in line, line
    assert f"held back by {by}: torch {held} is newer and carries sm_80 code, but " in line, line
    free = plan(matrix(), "v100")  # nothing newer carries sm_70 code here: the plain sentence, true
    assert f"torch {free.torch.version}+cu126: newest build that carries sm_70 code" in reasons(free)
