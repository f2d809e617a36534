"""Issue 43: the catalog covers NVIDIA's CUDA GPU tables (compute capability 5.0 and newer), names a GPU by its whole
model name, and plans an unknown NVIDIA name of a known family by the family's compute capability, with a note.

The tables are tests/support/captured/nvidia/cuda-gpus-tables.txt (developer.nvidia.com/cuda-gpus and
/cuda-legacy-gpus, read through the docs corpus on 2026-12-08); scripts/gen_gpu_catalog.py writes their rows."""

import importlib.util
import json
from pathlib import Path

import pytest

from matrices import catalog
from resolver import hardware
from trainer.runtime.hardware import gpu_from_name

from .conftest import run_envtool

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_gpu_catalog", ROOT / "scripts" / "gen_gpu_catalog.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
TABLES = [(name, cc) for name, cc, _ in GEN.read_tables(GEN.CAPTURE.read_text()) if catalog.cc_tuple(cc) >= (5, 0)]


def test_the_captured_tables_are_read_whole():
    """Every compute capability section as read, the wrapped and run-together names split as NVIDIA lists them."""
    assert len(TABLES) >= 120
    assert {cc for _, cc in TABLES} == {"12.1", "12.0", "11.0", "10.3", "10.0", "9.0", "8.9", "8.7", "8.6", "7.2",
                                        "7.0", "6.2", "6.1", "6.0", "5.3", "5.2", "5.0"}
    names = dict(TABLES)
    assert names["NVIDIA RTX PRO 4500 Blackwell Server Edition"] == "12.0"  # wrapped over two lines on the page
    assert names["P520"] == names["Quadro P400"] == "6.1"  # run together in one cell
    assert names["Quadro M6000 24GB"] == "5.2"
    assert not any(n.startswith("GeForce RTX 3") or n.startswith("GeForce 940M") for n in names)  # cut by the excerpt


@pytest.mark.parametrize("name, cc", TABLES)
def test_every_gpu_on_nvidias_tables_is_named_at_its_compute_capability(m, name, cc):
    """`--gpu NAME` (hardware.lookup is what it calls) for every name of NVIDIA's tables gives the table's compute
    capability, as the trainer's --gpu does."""
    assert hardware.lookup(name, m).compute_capability == cc
    assert gpu_from_name(name).compute_capability == cc


@pytest.mark.parametrize("name, cc, memory_gb", [
    ("NVIDIA GeForce RTX 5050", "12.0", None),
    ("Tesla P40", "6.1", None),
    ("NVIDIA RTX PRO 4500 Blackwell", "12.0", None),
    ("Quadro M6000 24GB", "5.2", 24),
])
def test_envtool_resolve_plans_gpus_it_used_to_call_unknown(name, cc, memory_gb):
    out = run_envtool("resolve", "--gpu", name, "--json")
    assert out.returncode == 0, out.stderr
    gpu = json.loads(out.stdout)["gpu"]
    assert (gpu["compute_capability"], gpu["memory_gb"], gpu["source"]) == (cc, memory_gb, "catalog")


def test_a_jetson_on_l4t_is_recognised_and_refused_with_why():
    out = run_envtool("resolve", "--gpu", "Jetson Orin Nano")
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Jetson Orin Nano (sm_87, Ampere): Jetson Orin Nano runs JetPack's L4T CUDA stack" in out.stderr


@pytest.mark.parametrize("text, row", [
    ("NVIDIA GeForce RTX 4070 Ti", "GeForce RTX 4070 Ti"),
    ("NVIDIA GeForce RTX 4070", "GeForce RTX 4070"),
    ("NVIDIA RTX PRO 4000 Blackwell SFF Edition", "NVIDIA RTX PRO 4000 Blackwell SFF Edition"),
    ("NVIDIA RTX PRO 4000 Blackwell", "NVIDIA RTX PRO 4000 Blackwell"),
    ("NVIDIA RTX 5000 Ada Generation", "NVIDIA RTX 5000 Ada"),  # as nvidia-smi prints it
    ("Jetson Orin NX", "Jetson Orin NX"),  # not the AGX Orin (its 'orin' alias is shorter)
    ("NVIDIA TITAN X", "NVIDIA TITAN X"),  # the Pascal card (6.1), not the Maxwell GeForce GTX TITAN X (5.2)
])
def test_the_longest_whole_name_picks_the_row(m, text, row):
    assert hardware.lookup(text, m).name == row


def test_ti_super_is_not_taken_for_the_ti(m):
    """'RTX 4070 Ti SUPER' shares the 4070 Ti's chip generation (8.9), not its product row: the plan names what was
    typed, not the 4070 Ti."""
    out = run_envtool("resolve", "--gpu", "NVIDIA GeForce RTX 4070 Ti SUPER", "--json")
    assert out.returncode == 0, out.stderr
    gpu = json.loads(out.stdout)["gpu"]
    assert (gpu["name"], gpu["compute_capability"]) == ("NVIDIA GeForce RTX 4070 Ti SUPER", "8.9")


@pytest.mark.parametrize("text, cc, memory_gb, family", [
    ("NVIDIA L20", "8.9", None, "NVIDIA L40"),
    ("NVIDIA A800 80GB PCIe", "8.0", 80, "NVIDIA A100"),
    ("NVIDIA GeForce RTX 5055 Laptop GPU", "12.0", None, "GeForce RTX 5090"),
])
def test_an_unknown_name_of_a_known_family_is_planned_with_a_note(text, cc, memory_gb, family):
    out = run_envtool("resolve", "--gpu", text, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["gpu"]["name"], plan["gpu"]["compute_capability"], plan["gpu"]["memory_gb"], plan["gpu"]["source"]) \
        == (text, cc, memory_gb, "catalog-family")
    assert f"{text!r} is not in the catalog: planned as compute capability {cc}, that of every catalog GPU of its " \
           f"family (" in plan["reasons"][0] and family in plan["reasons"][0]
    assert gpu_from_name(text).compute_capability == cc  # the trainer's --gpu follows the same rule


@pytest.mark.parametrize("text", ["NVIDIA GeForce GTX 1650", "NVIDIA B100", "Tesla T5", "A800"])
def test_no_family_fits_keeps_the_one_line_refusal(text):
    """GTX 16xx: no row (10xx is Pascal, 16xx Turing); B100: the B200 (10.0) and B300 (10.3) differ; T5: a one-digit
    model number is a product, not a family; a bare 'A800' could be another vendor's."""
    out = run_envtool("resolve", "--gpu", text)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"unknown GPU {text!r}" in out.stderr


def test_the_family_rule_never_contradicts_nvidias_tables(m):
    """Leave each table GPU out of the catalog and ask its family: the answer is its own compute capability or none
    (38 right, 89 without a family, 0 wrong when written)."""
    right = 0
    for name, cc in TABLES:
        row = catalog.find_gpu(name, m.gpus)
        text = name if name.startswith("NVIDIA") else f"NVIDIA {name}"
        found = catalog.family_cc(text, [g for g in m.gpus if g is not row])
        assert found is None or found[0] == cc, (name, cc, found)
        right += found is not None
    assert right >= 30


def test_the_generated_rows_are_what_the_captured_tables_give():
    """matrices/gpus.toml's generated block is scripts/gen_gpu_catalog.py's output for the capture (rerun it after
    a new capture or a hand row)."""
    gpus = ROOT / "matrices" / "gpus.toml"
    text = gpus.read_text()
    assert GEN.render(text, GEN.CAPTURE.read_text(), GEN.PCI_IDS.read_text()) == text
    block = text.split(GEN.BEGIN)[1]
    assert block.count("[[gpu]]") == block.count("read through the search tool's docs corpus on 2026-12-08")
