"""ARM hosts and edge GPUs (issue 34): Grace superchips, DGX Spark, Jetson, and the catalog's gaps, each through
the input that exposed it: Thor's JetPack 7 driver `580.00`, a GB200 on an R570 driver, `--torch 2.11` on a
GH200, GB300 by name, Orin on JetPack 6 (nvidia-smi's `Orin (nvgpu)`, driver 540.4.0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from resolver.errors import Unsatisfiable
from resolver.matrix import load
from resolver.pipeline import PlanOptions, make_plans

from .conftest import run_envtool

REPO = Path(__file__).resolve().parents[2]


def resolve(*args: str) -> tuple[int, dict | list | None, str]:
    out = run_envtool("resolve", *args, "--python", "3.12", "--json")
    return out.returncode, (json.loads(out.stdout) if out.returncode == 0 else None), out.stderr.strip()


@pytest.mark.slow
def test_thor_with_jetpack_7s_driver_580_00_gets_a_cuda_13_plan():
    """JetPack 7 prints driver 580.00 (vllm#34470's collect_env), below the desktop CUDA 13 floor 580.65.06:
    JetPack's own numbering, which runs CUDA 13.0."""
    for gpu in ("sm_110", "NVIDIA Thor"):
        rc, plan, err = resolve("--gpu", gpu, "--platform", "aarch64", "--driver", "580.00")
        assert rc == 0, err
        assert plan["torch"]["cuda"] == "13.0" and plan["platform"] == "aarch64"
    # a JetPack driver runs no newer CUDA than its JetPack's: --cuda 13.2 is refused naming it
    out = run_envtool("resolve", "--gpu", "thor", "--driver", "580.00", "--cuda", "13.2")
    assert out.returncode == 2 and "JetPack's driver 580.00 runs CUDA ≤ 13.0" in out.stderr


def test_a_gb200_on_an_r570_driver_gets_torch_2_11s_aarch64_cu128_build():
    rc, plan, err = resolve("--gpu", "gb200", "--driver", "570.86.15")
    assert rc == 0, err
    assert (plan["torch"]["version"], plan["torch"]["variant"], plan["platform"]) == ("2.11.0", "cu128", "aarch64")


def test_torch_2_11_on_a_gh200():
    rc, plan, err = resolve("--gpu", "gh200", "--torch", "2.11")
    assert rc == 0, err
    assert plan["torch"]["version"] == "2.11.0" and plan["platform"] == "aarch64"


@pytest.mark.slow
def test_orin_on_jetpack_6_is_refused_in_one_line_naming_l4t_and_nvidias_jetson_wheels():
    for args in (("--gpu", "Orin (nvgpu)", "--driver", "540.4.0"), ("--gpu", "sm_87")):
        out = run_envtool("resolve", *args)
        assert out.returncode == 2, out.stdout
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        assert "L4T" in out.stderr and "SBSA" in out.stderr and "jetson-ai-lab" in out.stderr


def test_an_x86_64_platform_for_a_grace_gpu_is_refused_naming_the_host_cpu_not_the_driver():
    out = run_envtool("resolve", "--gpu", "gh200", "--platform", "x86_64", "--driver", "570.86.15")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert "comes only with an aarch64 host CPU" in out.stderr and "driver" not in out.stderr.lower()


ARM_ONLY = [g.name for g in load().gpus if g.platforms == ["aarch64"] and not g.l4t]


@pytest.mark.parametrize("name", ARM_ONLY)
def test_a_gpu_that_only_comes_on_arm_hosts_implies_the_platform(name):
    """Every catalog GPU sold only with an aarch64 host: planned for aarch64 without --platform (wherever the
    command runs), with a note saying so, and refused with --platform x86_64."""
    (plan,) = make_plans(PlanOptions(gpu=name, python="3.12"))
    assert plan.platform == "aarch64"
    with pytest.raises(Unsatisfiable, match="comes only with an aarch64 host CPU"):
        make_plans(PlanOptions(gpu=name, python="3.12", platform="x86_64"))


def _readme_gpus() -> list[str]:
    """The first column of every table whose header starts with `| GPU |` in README.md and docs/."""
    names = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        if not path.exists():
            continue
        in_table = False
        for line in path.read_text().splitlines():
            if re.match(r"\|\s*GPU\s*\|", line):
                in_table = True
                continue
            if not line.startswith("|"):
                in_table = False
            elif in_table and not set(line) <= set("|-: "):
                names.append(line.split("|")[1].strip())
    return names


def _user_config_gpus() -> list[str]:
    """Every `gpu:` a user config names (a number is a GPU count, not a name)."""
    names = []
    for path in sorted((REPO / "tests" / "trainer" / "fixtures" / "user_configs").glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("gpu"), str):
            names.append(doc["gpu"])
    return names


@pytest.mark.slow
def test_every_gpu_the_readme_tables_and_user_configs_name_resolves_and_the_new_ones_too():
    names = set(_readme_gpus()) | set(_user_config_gpus())
    assert "Tesla T4" in names  # the tables were read
    # the catalog gaps, by the names nvidia-smi prints
    names |= {"gb300", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA GeForce RTX 5080",
              "NVIDIA GeForce RTX 5070", "NVIDIA Thor", "NVIDIA H100 NVL"}
    out = run_envtool("resolve", "--gpu", ",".join(sorted(names)), "--python", "3.12", "--json")
    assert out.returncode == 0, out.stderr
    plans = {p["target"]: p for p in json.loads(out.stdout)}
    assert set(plans) == names
    assert plans["NVIDIA H100 NVL"]["gpu"]["memory_gb"] == 94
    assert plans["gb300"]["gpu"]["compute_capability"] == "10.3" and plans["gb300"]["platform"] == "aarch64"
    assert plans["NVIDIA RTX PRO 6000 Blackwell Workstation Edition"]["gpu"]["memory_gb"] == 96
