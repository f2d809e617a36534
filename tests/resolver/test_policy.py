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
    def make(**extra):
        return matrix_module.load(synthetic.make(tmp_path / "m", **extra))

    return make


def plan(m, gpu, driver=None, python="3.11", **pins):
    return solve(Request(gpu=hardware.lookup(gpu, m), driver=driver, python=python, target=gpu, **pins), m)


def test_flash_attn_gpu_takes_the_newest_torch_with_a_wheel_and_names_the_newer_one(matrix):
    m = matrix()
    p = plan(m, "a100")
    assert (p.torch.version, p.attention, p.flash_attn.version) == ("3.0.0", "flash_attention_2", "9.0")
    assert "torch 3.1.0 is newer but flash-attn publishes no prebuilt wheel for it" in "\n".join(p.reasons)
    assert p.flash_attn.wheel_url == ("https://fa.test/v9.0/flash_attn-9.0+cu12torch3.0cxx11abiTRUE-cp311-cp311-"
                                      "linux_x86_64.whl")


def test_a_new_flash_attn_release_moves_the_plan_to_the_newer_torch(matrix):
    m = matrix(flash_attn=synthetic.flash_attn_release("9.1", ["3.0", "3.1"]))
    p = plan(m, "a100")
    assert (p.torch.version, p.flash_attn.version) == ("3.1.0", "9.1")


def test_no_flash_attn_takes_the_newest_torch_the_driver_runs(matrix):
    m = matrix()
    assert plan(m, "a100", no_flash_attn=True).torch.version == "3.1.0"  # driver unknown: CUDA 12 builds
    p = plan(m, "a100", "580.65.06", no_flash_attn=True)
    assert (p.torch.version, p.torch.variant, p.attention) == ("3.2.0", "cu130", "sdpa")


def test_hopper_prefers_flash_attention_3_when_its_wheel_exists(matrix):
    m = matrix(flash_attn=synthetic.flash_attn_release("3.9", ["3.0"], impl="fa3"))
    assert plan(m, "h100").attention == "flash_attention_3"
    assert plan(m, "a100").attention == "flash_attention_2"  # FA3 is sm_90 only (attention.toml)


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
    with pytest.raises(Unsatisfiable, match="flash-attn publishes no prebuilt wheel"):
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
