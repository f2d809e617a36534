"""GPU names and detection: aliases, compute capabilities, NVML, nvidia-smi, /proc, overrides."""

import re
from pathlib import Path

import pytest

from resolver import hardware
from resolver.errors import BadInput

from .conftest import DATA


@pytest.mark.parametrize("text, name, cc, arch", [
    ("t4", "Tesla T4", "7.5", "turing"),
    ("Tesla-T4", "Tesla T4", "7.5", "turing"),
    ("Tesla T4", "Tesla T4", "7.5", "turing"),
    ("V100", "Tesla V100", "7.0", "volta"),
    ("a10g", "NVIDIA A10G", "8.6", "ampere"),
    ("rtx_4090", "GeForce RTX 4090", "8.9", "ada"),
    ("sm_80", "sm_80 GPU", "8.0", "ampere"),
    ("sm120", "sm_120 GPU", "12.0", "blackwell"),
    ("9.0", "sm_90 GPU", "9.0", "hopper"),
])
def test_lookup_by_alias_name_or_compute_capability(m, text, name, cc, arch):
    gpu = hardware.lookup(text, m)
    assert (gpu.name, gpu.compute_capability, gpu.arch) == (name, cc, arch)


def test_cpu_target(m):
    gpu = hardware.lookup("cpu", m)
    assert gpu.is_cpu and gpu.arch == "cpu"


def test_unknown_gpu_names_the_closest(m):
    with pytest.raises(BadInput, match=r"unknown GPU 'a101'; did you mean .*a100"):
        hardware.lookup("a101", m)


def test_unknown_compute_capability_is_refused(m):
    with pytest.raises(BadInput, match="compute capability 3.5 .* not in the matrix"):
        hardware.lookup("sm_35", m)


@pytest.mark.parametrize("driver", ["abc", "550", "550.54.14.1.2", "-1"])
def test_malformed_driver(driver):
    with pytest.raises(BadInput, match="is not an NVIDIA driver version"):
        hardware.check_driver(driver)


def test_nvml_first(fake_nvml, m):
    fake_nvml("550.54.15", ("NVIDIA A100-SXM4-80GB", "8.0", 81920))
    found = hardware.detect(m)
    assert (found.gpu.name, found.gpu.compute_capability, found.gpu.source) == ("NVIDIA A100-SXM4-80GB", "8.0", "nvml")
    assert found.gpu.memory_gb == 80.0
    assert found.driver == "550.54.15"


@pytest.mark.parametrize("name, pci, row, memory_gb", [
    ("NVIDIA GeForce RTX 5070 Ti", 0x2C0510DE, "GeForce RTX 5070 Ti", 15.9),
    ("NVIDIA GeForce RTX 5060 Ti", 0x2D0410DE, "GeForce RTX 5060 Ti", 15.9),  # the 16 GB card: the device says so
    ("NVIDIA GH200 144G HBM3e", 0x234810DE, "NVIDIA GH200 144G HBM3e", 143.8),
    ("NVIDIA Graphics Device", 0x2C0510DE, "GeForce RTX 5070 Ti", 15.9),  # a driver too old to know the name
])
def test_nvml_names_a_gpu_by_its_pci_device_id(fake_nvml, m, name, pci, row, memory_gb):
    """Issue 43: the PCI device id (pci.ids 2026.10.24) picks the catalog row, whatever the name says; the memory
    stays the device's."""
    fake_nvml("580.95.05", (name, "12.0" if "GH200" not in name else "9.0", round(memory_gb * 1024), pci))
    found = hardware.detect(m)
    assert (found.gpu.name, found.gpu.source, found.gpu.memory_gb) == (row, "nvml", memory_gb)
    assert any(f"PCI device 10de:{pci >> 16:04x}" in n for n in found.notes) == (name == "NVIDIA Graphics Device")


def test_a_pci_id_the_catalog_lacks_or_another_vendors_keeps_the_name(fake_nvml, m):
    fake_nvml("580.95.05", ("NVIDIA GeForce RTX 5070 Ti", "12.0", 16303, 0x2C0510DF))  # not NVIDIA's vendor id
    assert hardware.detect(m).gpu.name == "NVIDIA GeForce RTX 5070 Ti"
    fake_nvml("580.95.05", ("NVIDIA B300", "10.3", 275000, 0x31B110DE))  # no row holds 31b1
    assert hardware.detect(m).gpu.name == "NVIDIA B300"


def test_every_pci_id_in_the_catalog_is_in_the_captured_pci_ids_under_the_rows_name(m):
    """Each gpus.toml pci_ids entry is an NVIDIA device line of the captured pci.ids excerpt whose bracketed name
    is the row's product (the words of the row's name, less NVIDIA/GeForce, appear in it)."""
    captured = Path(__file__).resolve().parents[1] / "support" / "captured" / "pci.ids-10de-excerpt.txt"
    lines = dict(re.findall(r"^\t([0-9a-f]{4})  (.*)$", captured.read_text(), flags=re.M))
    seen = 0
    for g in m.gpus:
        for device in g.pci_ids:
            seen += 1
            assert device in lines, (g.name, device)
            words = g.name.replace("GeForce ", "").replace("NVIDIA ", "").split()
            assert all(w.lower() in lines[device].lower() for w in words if not w.endswith("GB")), (g.name, lines[device])
    assert seen >= 20


def test_several_gpus_plan_for_the_lowest_and_say_so(fake_nvml, m):
    fake_nvml("560.35.03", ("NVIDIA A100-PCIE-40GB", "8.0", 40960), ("Tesla V100-PCIE-16GB", "7.0", 16384))
    found = hardware.detect(m)
    assert found.gpu.compute_capability == "7.0" and found.gpu.count == 2
    assert any("planning for the lowest" in n and "sm_70" in n for n in found.notes)


def test_nvidia_smi_when_nvml_library_is_missing(fake_smi, m):
    fake_smi("nvidia-smi-t4.csv")
    found = hardware.detect(m)
    assert (found.gpu.name, found.gpu.compute_capability, found.gpu.source) == ("Tesla T4", "7.5", "nvidia-smi")
    assert found.gpu.memory_gb == 15.0
    assert found.driver == "535.104.05"
    assert found.notes[0] == "NVML: NVML Shared Library Not Found"


def test_nvidia_smi_four_identical_gpus(fake_smi, m):
    fake_smi("nvidia-smi-4xa100.csv")
    found = hardware.detect(m)
    assert found.gpu.count == 4 and found.gpu.arch == "ampere"
    assert "4 × NVIDIA A100-SXM4-80GB detected" in found.notes


def test_broken_driver_falls_back_to_cpu_with_the_driver_from_proc(fake_smi, m, monkeypatch):
    fake_smi("nvidia-smi-no-driver.txt", exit_code=9)
    monkeypatch.setattr(hardware, "PROC_DRIVER_VERSION", str(DATA / "proc-driver-version-535.txt"))
    found = hardware.detect(m)
    assert found.gpu.is_cpu
    assert found.driver == "535.104.05"
    assert any(n.startswith("nvidia-smi: exit 9: NVIDIA-SMI has failed") for n in found.notes)
    assert "no NVIDIA, AMD, Intel or Apple GPU found: planning for CPU" in found.notes


def test_proc_driver_version_of_the_open_kernel_module():
    driver, note = hardware.probe_proc_driver(str(DATA / "proc-driver-version-open-550.txt"))
    assert driver == "550.54.14"


def test_no_gpu_at_all_means_cpu(no_gpu, m):
    found = hardware.detect(m)
    assert found.gpu.is_cpu and found.driver is None
    assert "nvidia-smi: not on PATH" in found.notes


def test_overrides_for_a_build_host_that_is_not_the_run_host(fake_smi, m, monkeypatch):
    fake_smi("nvidia-smi-t4.csv")  # the build host has a T4 ...
    monkeypatch.setenv("ENVTOOL_GPU", "a100")  # ... but the image is for an A100
    monkeypatch.setenv("ENVTOOL_DRIVER_VERSION", "550.54.14")
    found = hardware.detect(m)
    assert (found.gpu.name, found.driver, found.gpu.source) == ("NVIDIA A100", "550.54.14", "ENVTOOL_GPU")


def test_driver_override_keeps_detected_gpu(fake_smi, m, monkeypatch):
    fake_smi("nvidia-smi-t4.csv")
    monkeypatch.setenv("ENVTOOL_DRIVER_VERSION", "580.65.06")
    found = hardware.detect(m)
    assert found.gpu.name == "Tesla T4" and found.driver == "580.65.06"


def test_parse_nvidia_smi_skips_noise():
    seen, driver = hardware.parse_nvidia_smi("garbage\nTesla T4, 7.5, 15360 MiB, 535.104.05\n\n")
    assert [s.name for s in seen] == ["Tesla T4"] and driver == "535.104.05"


def test_a_driver_without_compute_cap_falls_back_to_the_gpu_name(no_gpu, m):
    # nvidia-smi of drivers before R510 rejects the compute_cap field; envtool asks again without it
    script = no_gpu / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *compute_cap*) /bin/cat "{DATA / "nvidia-smi-470-no-compute-cap.txt"}"; exit 2;; esac\n'
        f'/bin/cat "{DATA / "nvidia-smi-470-names.csv"}"\n')
    script.chmod(0o755)
    found = hardware.detect(m)
    assert (found.gpu.compute_capability, found.gpu.count, found.driver) == ("7.0", 2, "470.82.01")
    assert any("CC from the GPU names" in n for n in found.notes)


@pytest.mark.parametrize("name, cc", [
    ("Tesla V100-SXM2-32GB", "7.0"), ("Tesla T4", "7.5"), ("NVIDIA A100-SXM4-80GB", "8.0"),
    ("NVIDIA A10G", "8.6"), ("NVIDIA GeForce RTX 4090", "8.9"), ("NVIDIA H100 80GB HBM3", "9.0"),
    ("Quadro RTX 8000", None),
])
def test_compute_capability_from_a_gpu_name(m, name, cc):
    assert hardware.cc_from_name(name, m) == cc
