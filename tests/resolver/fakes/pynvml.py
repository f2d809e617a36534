"""A stand-in for nvidia-ml-py's `pynvml`, for machines without an NVIDIA driver.

It answers with the GPUs described in $FAKE_NVML (JSON: {"driver": "...", "gpus": [{"name", "cc",
"memory_mib", optionally "pci_device_id": NVML's 32-bit pciDeviceId}]}) and, when that variable is unset, fails at nvmlInit exactly as the real module does when
libnvidia-ml.so is missing. Names, signatures and return types follow nvidia-ml-py 12+.
"""

import json
import os


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    def __str__(self):
        return "NVML Shared Library Not Found"


class _Memory:
    def __init__(self, total):
        self.total, self.free, self.used = total, total, 0


def _spec():
    raw = os.environ.get("FAKE_NVML")
    if raw is None:
        raise NVMLError_LibraryNotFound()
    return json.loads(raw)


def nvmlInit():
    _spec()


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return _spec()["driver"]


def nvmlDeviceGetCount():
    return len(_spec()["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    return _spec()["gpus"][index]


def nvmlDeviceGetName(handle):
    return handle["name"]


def nvmlDeviceGetCudaComputeCapability(handle):
    major, minor = handle["cc"].split(".")
    return int(major), int(minor)


def nvmlDeviceGetMemoryInfo(handle):
    return _Memory(handle["memory_mib"] * 2**20)


class _PciInfo:
    def __init__(self, device_id):
        self.pciDeviceId = device_id


def nvmlDeviceGetPciInfo(handle):
    if "pci_device_id" not in handle:
        raise NVMLError("Not Supported")
    return _PciInfo(handle["pci_device_id"])
