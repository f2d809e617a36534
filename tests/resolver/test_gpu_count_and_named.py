"""A count in --gpu, more processes than GPUs, and a GPU only named (issue 27, item 6): "T4 x2" plans two T4s (the
plan's count: torchrun's processes), --nproc above the GPUs is warned about, and a named GPU is said to be named,
never "this machine has" on a machine that has none."""

from __future__ import annotations

import json
import os

import pytest

from resolver import hardware
from resolver.errors import BadInput
from resolver.matrix import load
from resolver.vendors import names as vendor_names

from .conftest import run_envtool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OFFLINE = {"HF_HUB_OFFLINE": "1", "ENVTOOL_PLAN": None, "ENVTOOL_GPU": None}


def every_name() -> list[str]:
    m = load()
    return sorted({a for g in m.gpus for a in (g.name, *g.aliases)} | set(vendor_names()))


@pytest.mark.parametrize("spelling", ["{name} x{n}", "{name} X {n}", "{name}×{n}", "{name} × {n}", "{n}x {name}",
                                      "{n} x {name}", "{n}×{name}"])
def test_a_count_with_any_catalog_name_is_that_gpu_that_many_times(spelling):
    """Over every name and alias the catalogs know: the count is split off and the name means what it means alone;
    and no name alone is ever read as a count (names ending in x and digits stay names)."""
    m = load()
    for name in every_name():
        alone = hardware.lookup(name, m)
        assert alone.count == 1, name
        if spelling.startswith("{n}x") and name[:1].isdigit():
            continue  # "2x" + a name starting with a digit: a name of its own (see COUNTED)
        counted = hardware.lookup(spelling.format(name=name, n=3), m)
        assert counted == alone._replace(count=3), (spelling, name)


@pytest.mark.parametrize("text", ["t4 x0", "cpu x2", "2x cpu"])
def test_a_count_that_is_no_machine_is_refused_in_one_line(text):
    with pytest.raises(BadInput) as refused:
        hardware.lookup(text, load())
    assert text in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_train_plans_the_count_and_warns_of_more_processes_than_gpus(tmp_path):
    env = {"ENVTOOL_CACHE_DIR": str(tmp_path / "cache"), **OFFLINE}
    two = run_envtool("train", "examples/t4.yml", "--gpu", "T4 x2", "--dry-run", "--json", **env)
    assert two.returncode == 0, two.stderr[-2000:]
    summary = json.loads(two.stdout)
    assert summary["plan"]["gpu"]["count"] == 2 and "--nproc-per-node=2" in summary["command"]
    assert not [n for n in summary["notes"] if n.startswith("warning: --nproc")]
    crowded = run_envtool("train", "examples/t4.yml", "--gpu", "t4", "--nproc", "4", "--dry-run", **env)
    assert crowded.returncode == 0, crowded.stderr[-2000:]
    assert ("config: warning: --nproc 4 starts more processes than the 1 × Tesla T4 named: ranks would share a GPU"
            in crowded.stdout), crowded.stdout
    assert "this machine has" not in crowded.stdout
    assert "Tesla T4 (sm_75, Turing) is named (--gpu, not detected here)" in crowded.stdout


@pytest.mark.slow
def test_doctor_says_named_for_a_named_gpu_on_a_machine_without_one(no_gpu):
    out = run_envtool("doctor", "--gpu", "t4", "--json", **OFFLINE)
    findings = json.loads(out.stdout)["findings"]
    said = " ".join(f["message"] for f in findings)
    assert "this machine has" not in said and "Tesla T4 (sm_75, Turing) is named (--gpu" in said, findings
