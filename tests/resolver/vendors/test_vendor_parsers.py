"""Vendor detection on damaged tool output (issue 33, item 4): every parser of what amd-smi, rocminfo, rocm-smi,
xpu-smi, nvidia-smi, the KFD topology and PCI sysfs print, fed the captured samples (tests/resolver/data, see
vendors/SOURCES.md) with bytes flipped, inserted, cut or repeated and fields replaced by values of other types.
What a user would notice: no exception out of `--gpu auto` (a GPU it cannot read is left out with a note), and an
answer in bounded time (hypothesis' deadline). And `--gpu` text of any length answers at once."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from resolver import hardware, vendors
from resolver.cli import app
from resolver.errors import BadInput
from resolver.vendors import amd, intel

from tests.resolver.conftest import DATA, run_envtool

CAPTURED = DATA / "vendors"
FUZZ = settings(max_examples=40, deadline=timedelta(seconds=1), suppress_health_check=[HealthCheck.too_slow])

# each captured text output and the parser that reads it
TEXT_SAMPLES = {
    "amd/amd-smi-static-mi350x.txt": lambda t: amd.parse_amd_smi(t)[0],
    "amd/amd-smi-static-asic-mi308x.txt": lambda t: amd.parse_amd_smi(t)[0],
    "amd/rocminfo-7xmi25.txt": lambda t: amd.parse_rocminfo(t)[0],
    "amd/rocm-smi-productname-2xmi100.csv": amd.parse_rocm_smi,
    "amd/rocm-smi-productname-mi250x.json": amd.parse_rocm_smi,
    "intel/xpu-smi-discovery-aurora-6xmax1550.txt": intel.parse_xpu_smi_table,
    "intel/xpu-smi-discovery-guide.txt": intel.parse_xpu_smi_table,
    "intel/xpu-smi-discovery-j-guide.json": intel.parse_xpu_smi_json,
}
NVIDIA_SAMPLES = sorted(p.name for p in DATA.glob("nvidia-smi-*"))


@pytest.fixture(scope="module")
def v():
    return vendors.load()


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """The sample with a few byte edits: flipped, inserted (invalid UTF-8 and digits among them), cut, repeated."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(out)))
        op = draw(st.sampled_from(["flip", "insert", "cut", "repeat"]))
        if op == "flip" and at < len(out):
            out[at] ^= draw(st.integers(1, 255))
        elif op == "insert":
            out[at:at] = draw(st.one_of(st.binary(min_size=1, max_size=8),
                                        st.sampled_from([b"\xff\xfe", b"\xc3", b"\x00", b"9" * 5000, b"0xzz",
                                                         "²".encode(), b"\n", b":"])))
        elif op == "cut":
            del out[at:at + draw(st.integers(1, 64))]
        elif op == "repeat":
            out[at:at] = out[at:at + draw(st.integers(1, 200))] * draw(st.integers(1, 20))
    return bytes(out)


def _identify(seen, parser_file: str, v):
    notes: list[str] = []
    if parser_file.startswith("amd/"):
        return vendors._count_amd(seen, "sample", v, notes), notes
    return vendors._count_intel(seen, "sample", v, notes), notes


@pytest.mark.parametrize("name", sorted(TEXT_SAMPLES))
@given(data=st.data())
@FUZZ
def test_damaged_tool_output_never_raises(v, name, data):
    raw = (CAPTURED / name).read_bytes()
    text = amd.decode(data.draw(mutated(raw)))
    parse = TEXT_SAMPLES[name]
    try:
        seen = parse(text)
    except ValueError:  # JSON that no longer parses: the probe reads the table / says "printed no JSON"
        assert name.endswith(".json")
        return
    for gpu in _identify(seen, name, v)[0]:
        assert isinstance(gpu.name, str) and gpu.count >= 1


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3), max_leaves=6)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, val in node.items():
            yield from _paths(val, (*prefix, k))
    elif isinstance(node, list):
        for i, val in enumerate(node):
            yield from _paths(val, (*prefix, i))


def _replace(node, path, value):
    if not path:
        return value
    node[path[0]] = _replace(node[path[0]], path[1:], value)
    return node


@pytest.mark.parametrize("name", [n for n in sorted(TEXT_SAMPLES) if n.endswith(".json")])
@given(data=st.data())
@FUZZ
def test_json_fields_of_another_type_never_raise(v, name, data):
    """A number where a name goes, a list where a card goes, a bare string for the whole document."""
    doc = json.loads((CAPTURED / name).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(_paths(doc))))
        doc = _replace(doc, path, data.draw(JSON_VALUES))
    seen = TEXT_SAMPLES[name](json.dumps(doc))
    for gpu in _identify(seen, name, v)[0]:
        assert isinstance(gpu.name, str)


def test_a_device_with_unreadable_ids_is_left_out_with_one_note(v):
    seen = intel.parse_xpu_smi_json(json.dumps({"device_list": [
        {"device_id": 0, "device_name": 12345, "pci_device_id": "0xZZZZ", "device_type": "GPU"},
        {"device_id": 1, "device_name": "Intel(R) Data Center GPU Max 1550", "pci_device_id": "0x0bd5"}]}))
    gpus, notes = _identify(seen, "intel/", v)
    assert [(g.name, g.count) for g in gpus] == [("Intel Data Center GPU Max 1550", 1)]
    assert notes == ["sample: a device with neither a name nor a PCI device ID it could read: ignored"]
    amd_seen = amd.parse_amd_smi("GPU: 0\n    ASIC:\n        MARKET_NAME: 42\n        DEVICE_ID: 0xnothex\n")[0]
    assert amd_seen == [amd.Seen("42", None, None, None)]
    gpus, notes = _identify(amd_seen, "amd/", v)
    assert gpus == [] and notes == ["sample: 42: it reports no gfx target and the catalog does not know it"]


@pytest.mark.parametrize("name", NVIDIA_SAMPLES)
@given(data=st.data())
@FUZZ
def test_damaged_nvidia_smi_output_never_raises_but_a_clear_line(m, name, data):
    text = amd.decode(data.draw(mutated((DATA / name).read_bytes())))
    for seen in (hardware.parse_nvidia_smi(text)[0], hardware.parse_old_nvidia_smi(text, m)[0]):
        for s in seen:
            try:
                hardware.from_cc(s.compute_capability, m, name=s.name, memory_gb=s.memory_gb, source="nvidia-smi")
            except BadInput as e:  # a compute capability the matrix lacks: one line, exit 2
                assert "\n" not in str(e)


@contextlib.contextmanager
def damaged_copy(source: Path, pattern: str, data):
    """A copy of the captured tree `source` with one to three of its files matching `pattern` damaged."""
    files = sorted(p.relative_to(source) for p in source.rglob(pattern) if p.is_file())
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / source.name
        shutil.copytree(source, copy)
        for rel in data.draw(st.lists(st.sampled_from(files), min_size=1, max_size=3, unique=True)):
            (copy / rel).write_bytes(data.draw(mutated((source / rel).read_bytes())))
        yield copy


@pytest.mark.parametrize("tree", ["amd/kfd-vega10", "amd/kfd-mi210-xgmi", "amd/kfd-mi308x-cpx"])
@given(data=st.data())
@settings(max_examples=20, deadline=timedelta(seconds=1), suppress_health_check=[HealthCheck.too_slow])
def test_damaged_kfd_topology_never_raises(v, tree, data):
    with damaged_copy(CAPTURED / tree, "properties", data) as nodes:
        seen, _ = amd.parse_kfd(nodes)
        for gpu in vendors._count_amd(seen, "kfd", v, []):
            assert gpu.target is None or gpu.target.startswith("gfx")


@pytest.mark.parametrize("tree", ["intel/pci-4xmax1550", "intel/pci-uhd770"])
@given(data=st.data())
@settings(max_examples=20, deadline=timedelta(seconds=1), suppress_health_check=[HealthCheck.too_slow])
def test_damaged_pci_sysfs_never_raises(v, tree, data):
    with damaged_copy(CAPTURED / tree, "*", data) as devices:
        gpus, _ = intel.parse_pci(devices)
        vendors._count_intel(gpus, "pci", v, [])


WORDS = st.sampled_from(["nvidia", "h100", "a100", "tesla", "t4", "x2", "2x", "amd", "instinct", "mi300x", "rtx",
                         "4090", "max", "1550", "gfx942", "word", "-", "/", "(", ")", "x", "2"])


@given(st.lists(WORDS, min_size=1, max_size=1500).map(" ".join) | st.lists(WORDS, max_size=60).map("".join))
@settings(max_examples=40, deadline=timedelta(seconds=1))
def test_any_gpu_text_is_named_or_refused_in_bounded_time(m, text):
    """Word runs of the catalog's words, long or glued ('2x2x2x...' once took 2^n lookups): a GPU or one line."""
    try:
        hardware.lookup(text, m)
    except BadInput as e:
        assert "\n" not in str(e)


def test_a_1500_word_gpu_is_refused_in_one_line():
    result = CliRunner().invoke(app, ["resolve", "--gpu", " ".join(["nvidia h100"] * 750)])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert "(8,999 characters): a GPU name is at most 100 characters" in line


def test_gpu_auto_reads_an_amd_smi_that_prints_invalid_utf8(no_gpu):
    """Through the command line: the GPU is planned for; the broken bytes become U+FFFD in what is echoed."""
    raw = (CAPTURED / "amd/amd-smi-static-mi350x.txt").read_bytes()
    capture = no_gpu / "amd-smi-output"
    capture.write_bytes(raw.replace(b"MARKET_NAME:", b"MARKET_NAME: \xff\xfe", 1))
    tool = no_gpu / "amd-smi"
    tool.write_text(f"#!/bin/sh\nexec /bin/cat '{capture}'\n")
    tool.chmod(0o755)
    result = run_envtool("resolve", "--gpu", "auto", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["gpu"]["target"] == "gfx950", plan["gpu"]
