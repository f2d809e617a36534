"""AMD, Intel and Apple GPUs: the facts in matrices/amd.toml, rocm.toml, intel.toml, apple.toml, what `--gpu`
names, and detection from captured tool outputs and sysfs trees (tests/resolver/data/vendors/SOURCES.md)."""

import shutil
import textwrap

import pytest

from matrices import catalog
from resolver import vendors
from resolver.errors import MatrixError
from resolver.matrix import matrix_dir
from resolver.vendors import amd, apple, facts, intel

from tests.resolver.conftest import DATA

CAPTURED = DATA / "vendors"


@pytest.fixture(scope="module")
def v():
    return vendors.load()


# ---------------------------------------------------------------------------- what --gpu names


@pytest.mark.parametrize("text, vendor, name, target, memory, bf16, fp8", [
    ("mi300x", "amd", "AMD Instinct MI300X", "gfx942", 192.0, True, "fnuz"),
    ("MI300A", "amd", "AMD Instinct MI300A", "gfx942", 128.0, True, "fnuz"),
    ("mi325x", "amd", "AMD Instinct MI325X", "gfx942", 256.0, True, "fnuz"),
    ("mi355x", "amd", "AMD Instinct MI355X", "gfx950", 288.0, True, "ocp"),
    ("mi250x", "amd", "AMD Instinct MI250X", "gfx90a", 64.0, True, ""),  # per GCD: torch sees two devices
    ("mi210", "amd", "AMD Instinct MI210", "gfx90a", 64.0, True, ""),
    ("mi100", "amd", "AMD Instinct MI100", "gfx908", 32.0, True, ""),
    ("rx7900xtx", "amd", "AMD Radeon RX 7900 XTX", "gfx1100", 24.0, True, ""),
    ("Radeon RX 9070 XT", "amd", "AMD Radeon RX 9070 XT", "gfx1201", 16.0, True, "ocp"),
    ("w6800", "amd", "AMD Radeon PRO W6800", "gfx1030", 32.0, True, ""),
    ("strix-halo", "amd", "AMD Radeon 8060S", "gfx1151", None, True, ""),  # an APU: system memory
    ("gfx942", "amd", "AMD gfx942 GPU", "gfx942", None, True, "fnuz"),
    ("GFX90A", "amd", "AMD gfx90a GPU", "gfx90a", None, True, ""),
    ("gfx803", "amd", "AMD gfx803 GPU", "gfx803", None, False, ""),
    ("max1550", "intel", "Intel Data Center GPU Max 1550", "pvc", None, None, ""),
    ("xpu", "intel", "Intel GPU", None, None, None, ""),
    ("mps", "apple", "Apple silicon", "mps", None, None, ""),
    ("m2-max", "apple", "Apple M2 Max", "mps", None, None, ""),
])
def test_gpu_names_aliases_and_targets(v, text, vendor, name, target, memory, bf16, fp8):
    a = vendors.lookup(text, v)
    assert (a.vendor, a.name, a.target, a.memory_gb, a.bf16, a.fp8) == (vendor, name, target, memory, bf16, fp8)


@pytest.mark.parametrize("text", ["AMD Instinct MI300X VF", "AMD Instinct MI300X OAM", "Instinct MI300X"])
def test_tool_names_longer_than_an_alias_still_name_the_gpu(v, text):
    """Names as Azure's VFs and amd-smi print them: the longest alias spelled by their words wins."""
    assert vendors.lookup(text, v).name == "AMD Instinct MI300X"


def test_rocminfo_s_shared_mi250_name_is_the_gcd_of_either(v):
    a = vendors.lookup("AMD Instinct MI250X/MI250", v)
    assert (a.target, a.memory_gb) == ("gfx90a", 64.0)


@pytest.mark.parametrize("text", ["t4", "a100", "sm_80", "gfx000", "gfx9999", "mi400", "cpu"])
def test_names_that_are_not_these_vendors_gpus(v, text):
    assert vendors.lookup(text, v) is None


def test_rocm_alone_is_not_a_gpu_and_says_what_to_write(v):
    assert vendors.lookup("rocm", v) is None
    assert "name the GPU (mi300x, rx7900xtx) or its target (gfx942)" in vendors.backend_hint("rocm")
    assert vendors.backend_hint("mi300x") is None


@pytest.mark.parametrize("text, gfx", [
    ("gfx942", "gfx942"), ("gfx942:sramecc+:xnack-", "gfx942"), ("amdgcn-amd-amdhsa--gfx90a:xnack-", "gfx90a"),
    ("gfx1100", "gfx1100"), ("gfx1151", "gfx1151"), ("gfx1250", "gfx1250"),
    ("gfx000", None), ("gfx9010", None), ("sm_80", None), ("", None),
])
def test_gfx_names(text, gfx):
    assert catalog.gfx_from_text(text) == gfx


@pytest.mark.parametrize("version, gfx", [
    (90402, "gfx942"), (90010, "gfx90a"), (90500, "gfx950"), (100300, "gfx1030"), (110000, "gfx1100"),
    (110501, "gfx1151"), (120001, "gfx1201"), (90006, "gfx906"), (80003, "gfx803"), (0, None),
])
def test_kfd_gfx_target_version(version, gfx):
    assert catalog.gfx_from_kfd(version) == gfx


def test_rocm_smi_prints_the_stepping_in_decimal():
    assert [amd.gfx_from_rocm_smi(t) for t in ("gfx9010", "gfx942", "gfx1030", "gfx9016")] == \
        ["gfx90a", "gfx942", "gfx1030", None]


# ---------------------------------------------------------------------------- the facts


def test_every_gpu_row_s_target_is_a_torch_target_or_refused_by_name(v):
    """Each GPU of the catalog is either covered by some recorded torch ROCm build or is one of the old GCN
    targets no current build carries: gfx803 (MI8) has no build at all."""
    for g in v.amd_gpus:
        builds = v.rocm_builds_for(g.gfx)
        assert builds or g.gfx == "gfx803", g.name
    assert v.rocm_builds_for("gfx803") == []


def test_gfx950_arrives_with_rocm7_builds_and_gfx900_leaves_with_rocm7_14(v):
    assert {b.torch for b in v.rocm_builds_for("gfx950")} == {"2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1"}
    assert "2.14.1" not in {b.torch for b in v.rocm_builds_for("gfx900")}
    assert "2.4.1" in {b.torch for b in v.rocm_builds_for("gfx900")}


def test_bitsandbytes_rocm_libraries_start_at_rocm_6_4_and_skip_gfx906(v):
    assert sorted({b.rocm for b in v.bnb_rocm}, key=lambda r: tuple(map(int, r.split(".")))) == \
        ["6.4", "7.0", "7.1", "7.2", "7.14", "7.15"]
    assert all("gfx906" not in b.gfx and "gfx942" in b.gfx for b in v.bnb_rocm)


def _copy_matrices(tmp_path, monkeypatch):
    target = tmp_path / "matrices"
    shutil.copytree(matrix_dir(), target)
    monkeypatch.setenv("ENVTOOL_MATRIX_DIR", str(target))
    facts.load.cache_clear()
    return target


@pytest.mark.parametrize("file, old, new, error", [
    ("amd.toml", 'gfx = "gfx942"\nmemory_gb = 192', 'gfx = "gfx941"\nmemory_gb = 192',
     r"\(AMD Instinct MI300X\): no \[\[target\]\] row for gfx941"),
    ("amd.toml", 'aliases = ["mi100", ', 'aliases = ["a100", ', r"alias 'a100' also names NVIDIA A100"),
    ("rocm.toml", 'torch = "2.13.0"', 'torch = "2.13.7"', r"torch 2.13.7 has no torch.toml \[\[release\]\] row"),
    ("rocm.toml", '"gfx90a", "gfx942"', '"gfx90a", "sm_90"', r"'sm_90' is not a gfx target"),
    ("apple.toml", 'macos = "14.0"\npython = ["3.11"', 'macos = "fourteen"\npython = ["3.11"', "is not a version"),
])
def test_malformed_rows_are_refused_naming_the_row(tmp_path, monkeypatch, file, old, new, error):
    target = _copy_matrices(tmp_path, monkeypatch)
    text = (target / file).read_text()
    assert old in text
    (target / file).write_text(text.replace(old, new, 1))
    try:
        with pytest.raises(MatrixError, match=error):
            facts.load(target)
    finally:
        facts.load.cache_clear()


# ---------------------------------------------------------------------------- parsers on captured outputs


def test_rocminfo_on_seven_mi25():
    seen, driver = amd.parse_rocminfo((CAPTURED / "amd/rocminfo-7xmi25.txt").read_text())
    assert len(seen) == 7  # the CPU agent is not a GPU
    assert {(s.name, s.gfx, s.pci_id) for s in seen} == {("Radeon Instinct MI25", "gfx900", "0x6860")}
    assert {s.memory_gb for s in seen} == {16.0}  # 16760832 KB in the first coarse-grained pool
    assert driver is None  # this ROCm prints 'ROCk module is loaded' without a version


def test_rocminfo_header_carries_the_kernel_driver_version():
    text = "ROCk module version 6.12.12 is loaded\n" + (CAPTURED / "amd/rocminfo-7xmi25.txt").read_text()
    assert amd.parse_rocminfo(text)[1] == "6.12.12"


def test_amd_smi_static_on_an_mi350x():
    seen, driver = amd.parse_amd_smi((CAPTURED / "amd/amd-smi-static-mi350x.txt").read_text())
    assert seen == [amd.Seen("AMD Instinct MI350X", "gfx950", None, "0x75a0")]
    assert driver == "6.18.3"


def test_amd_smi_names_a_gpu_the_catalog_lacks_by_its_own_name_and_target(v):
    seen, _ = amd.parse_amd_smi((CAPTURED / "amd/amd-smi-static-asic-mi308x.txt").read_text())
    notes = []
    (a,) = vendors._count_amd(seen, "amd-smi", v, notes)
    assert (a.name, a.target, a.family, a.fp8) == ("MI308X", "gfx942", "CDNA3", "fnuz") and notes == []


def test_amd_smi_vram_size_in_mb_is_read_where_printed():
    text = "GPU: 0\n    ASIC:\n        TARGET_GRAPHICS_VERSION: gfx942\n    VRAM:\n        TYPE: HBM3\n" \
           "        SIZE: 196592 MB\n"
    assert amd.parse_amd_smi(text)[0][0].memory_gb == 192.0


def test_rocm_smi_csv_of_an_old_release_names_the_gpu_in_brackets(v):
    seen = amd.parse_rocm_smi((CAPTURED / "amd/rocm-smi-productname-2xmi100.csv").read_text())
    notes = []
    (a,) = vendors._count_amd(seen, "rocm-smi", v, notes)
    # 'Card model' 0x0c34 is the subsystem on this release, not the device: it is not taken as the PCI ID
    assert [s.pci_id for s in seen] == [None, None]
    assert (a.name, a.target, a.count) == ("AMD Instinct MI100", "gfx908", 2)
    assert notes == ["rocm-smi: AMD Instinct MI100: gfx target gfx908 from its name (the source reports none)"]


def test_rocm_smi_json_names_the_gpu_by_pci_id_when_the_series_is_a_board_name(v):
    seen = amd.parse_rocm_smi((CAPTURED / "amd/rocm-smi-productname-mi250x.json").read_text())
    assert seen == [amd.Seen("AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2", "gfx90a", None, "0x7408")]
    (a,) = vendors._count_amd(seen, "rocm-smi", v, [])
    assert (a.name, a.target) == ("AMD Instinct MI250X", "gfx90a")


def test_kfd_topology_of_eight_mi210(v):
    seen, skipped = amd.parse_kfd(CAPTURED / "amd/kfd-mi210-xgmi")
    (a,) = vendors._count_amd(seen, "kfd", v, [])
    assert (a.name, a.target, a.count, a.memory_gb) == ("AMD Instinct MI210", "gfx90a", 8, None) and skipped == []


def test_kfd_topology_of_a_partitioned_mi308x_is_planned_by_its_target(v):
    seen, _ = amd.parse_kfd(CAPTURED / "amd/kfd-mi308x-cpx")
    (a,) = vendors._count_amd(seen, "kfd", v, [])
    # nodes 0-9 of the capture: two CPU nodes and eight CPX partitions (two MI308X of four XCDs each).
    # 0x74a2 is not in the catalog: the target still makes the plan; a partition reports local_mem_size 0
    assert (a.name, a.target, a.count, a.memory_gb) == ("AMD gfx942 GPU", "gfx942", 8, None)


def test_kfd_topology_of_an_mi300x_in_cpx_mode_does_not_claim_the_package_memory(v):
    seen, _ = amd.parse_kfd(CAPTURED / "amd/kfd-mi300x-cpx")
    (a,) = vendors._count_amd(seen, "kfd", v, [])
    # nodes 0-9 of the capture: two CPU nodes and the eight XCDs of one MI300X; no memory is reported per node
    assert (a.name, a.target, a.count, a.memory_gb) == ("AMD Instinct MI300X", "gfx942", 8, None)


def test_kfd_of_a_kernel_without_gfx_target_version_says_so(v):
    seen, _ = amd.parse_kfd(CAPTURED / "amd/kfd-vega10")
    notes = []
    assert vendors._count_amd(seen, "kfd", v, notes) == []
    assert notes == ["kfd: AMD GPU 0x6860: it reports no gfx target and the catalog does not know it"]
    assert {s.memory_gb for s in seen} == {16.0}  # local_mem_size 17163091968


def test_xpu_smi_table_on_an_aurora_node(v):
    seen = intel.parse_xpu_smi_table((CAPTURED / "intel/xpu-smi-discovery-aurora-6xmax1550.txt").read_text())
    (a,) = vendors._count_intel(seen, "xpu-smi", v)
    assert (a.name, a.target, a.count, a.backend) == ("Intel Data Center GPU Max 1550", "pvc", 6, "xpu")


def test_xpu_smi_json_and_table_agree_on_a_device_the_driver_does_not_name(v):
    table = intel.parse_xpu_smi_table((CAPTURED / "intel/xpu-smi-discovery-guide.txt").read_text())
    js = intel.parse_xpu_smi_json((CAPTURED / "intel/xpu-smi-discovery-j-guide.json").read_text())
    assert table == js == [intel.Seen("Intel(R) Graphics [0x020a]", "0x020a")]
    (a,) = vendors._count_intel(js, "xpu-smi", v)
    assert (a.name, a.target) == ("Intel(R) Graphics [0x020a]", None)


def test_pci_sysfs_plans_for_data_center_gpus_and_names_vga_controllers(v):
    gpus, vga = intel.parse_pci(CAPTURED / "intel/pci-4xmax1550")
    (a,) = vendors._count_intel(gpus, "pci", v)
    assert (a.name, a.target, a.count) == ("Intel Data Center GPU Max 1550", "pvc", 4) and vga == []
    gpus, vga = intel.parse_pci(CAPTURED / "intel/pci-uhd770")
    assert gpus == [] and vga == ["0000:00:02.0 0x4680"]


def test_apple_sysctl_values():
    chip, memory = apple.parse_sysctl((CAPTURED / "apple/sysctl-machdep.cpu.brand_string-m1.txt").read_text(),
                                      (CAPTURED / "apple/sysctl-hw.memsize-m1-16gb.txt").read_text())
    assert (chip, memory) == ("Apple M1", 16.0)


# ---------------------------------------------------------------------------- detection, end to end


def _tool(bin_dir, name, script):
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(script))
    path.chmod(0o755)


@pytest.fixture
def bare(no_gpu, monkeypatch, tmp_path):
    """No vendor tools on PATH, no KFD, no Intel PCI devices, Linux: what this machine is."""
    monkeypatch.setenv("ENVTOOL_KFD_NODES", str(tmp_path / "no-kfd"))
    monkeypatch.setenv("ENVTOOL_PCI_DEVICES", str(tmp_path / "no-pci"))
    monkeypatch.setattr("platform.system", lambda: "Linux")
    return no_gpu


def test_nothing_found_says_why_for_every_source(bare):
    found = vendors.detect()
    assert found.gpus == []
    for said in ("amd-smi: not on PATH", "rocminfo: not on PATH", "no-kfd: not present", "rocm-smi: not on PATH",
                 "xpu-smi: not on PATH", "no-pci: not present", "platform: Linux, not macOS"):
        assert any(said in n for n in found.notes), said


def test_amd_smi_is_asked_first(bare):
    _tool(bare, "amd-smi", f'exec /bin/cat "{CAPTURED}/amd/amd-smi-static-mi350x.txt"\n')
    _tool(bare, "rocminfo", f'exec /bin/cat "{CAPTURED}/amd/rocminfo-7xmi25.txt"\n')
    found = vendors.detect()
    (a,) = found.gpus
    assert (a.name, a.target, a.source, found.driver) == ("AMD Instinct MI350X", "gfx950", "amd-smi", "6.18.3")


def test_a_failing_amd_smi_falls_through_to_rocminfo(bare):
    _tool(bare, "amd-smi", 'echo "ERROR:root:Unable to get devices, driver not initialized (amdgpu not found in modules)" >&2\nexit 1\n')
    _tool(bare, "rocminfo", f'exec /bin/cat "{CAPTURED}/amd/rocminfo-7xmi25.txt"\n')
    found = vendors.detect()
    (a,) = found.gpus
    assert (a.name, a.target, a.count, a.memory_gb, a.source) == ("AMD Instinct MI25", "gfx900", 7, 16.0, "rocminfo")
    assert any(n.startswith("amd-smi: exit 1: ERROR:root:Unable to get devices") for n in found.notes)


def test_without_tools_the_kfd_topology_finds_the_gpus(bare, monkeypatch):
    monkeypatch.setenv("ENVTOOL_KFD_NODES", str(CAPTURED / "amd/kfd-mi210-xgmi"))
    (a,) = vendors.detect().gpus
    assert (a.name, a.target, a.count, a.source) == ("AMD Instinct MI210", "gfx90a", 8, "kfd")


def test_intel_gpus_from_xpu_smi_json(bare):
    _tool(bare, "xpu-smi", f'exec /bin/cat "{CAPTURED}/intel/xpu-smi-discovery-j-guide.json"\n')
    (a,) = vendors.detect().gpus
    assert (a.vendor, a.name, a.source) == ("intel", "Intel(R) Graphics [0x020a]", "xpu-smi")


def test_an_xpu_smi_without_json_is_read_as_its_table(bare):
    _tool(bare, "xpu-smi", f'''case "$*" in
      *-j*) echo "unknown option -j"; exit 0 ;;
      *) exec /bin/cat "{CAPTURED}/intel/xpu-smi-discovery-aurora-6xmax1550.txt" ;;
    esac
    ''')
    (a,) = vendors.detect().gpus
    assert (a.name, a.count) == ("Intel Data Center GPU Max 1550", 6)


def test_integrated_intel_graphics_is_named_but_not_planned_for(bare, monkeypatch):
    monkeypatch.setenv("ENVTOOL_PCI_DEVICES", str(CAPTURED / "intel/pci-uhd770"))
    found = vendors.detect()
    assert found.gpus == []
    assert any("Intel VGA controller(s) 0000:00:02.0 0x4680" in n and "--gpu xpu" in n for n in found.notes)


def test_an_arm64_mac_is_an_mps_device_with_bf16_from_macos_14(bare, monkeypatch):
    _tool(bare, "sysctl", f'''case "$*" in
      *brand_string*) exec /bin/cat "{CAPTURED}/apple/sysctl-machdep.cpu.brand_string-m1.txt" ;;
      *memsize*) exec /bin/cat "{CAPTURED}/apple/sysctl-hw.memsize-m1-16gb.txt" ;;
    esac
    ''')
    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr("platform.machine", lambda: "arm64")
    monkeypatch.setattr("platform.mac_ver", lambda: ("26.3", ("", "", ""), "arm64"))
    (a,) = vendors.detect().gpus
    assert (a.vendor, a.name, a.target, a.memory_gb, a.bf16, a.backend) == \
        ("apple", "Apple M1", "mps", 16.0, True, "mps")
    monkeypatch.setattr("platform.mac_ver", lambda: ("13.6", ("", "", ""), "arm64"))
    found = vendors.detect()
    assert found.gpus[0].bf16 is False
    assert any("older than 14.0, which torch's MPS support needs" in n for n in found.notes)


def test_an_intel_mac_has_no_mps(bare, monkeypatch):
    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    found = vendors.detect()
    assert found.gpus == [] and any("no torch wheels for Intel Macs after 2.2.2" in n for n in found.notes)
