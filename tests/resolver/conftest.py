import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resolver import matrix as matrix_module

HERE = Path(__file__).parent
DATA = HERE / "data"
FAKES = HERE / "fakes"
ENVTOOL = Path(sys.executable).parent / "envtool"


@pytest.fixture(scope="session")
def m():
    return matrix_module.load()


@pytest.fixture
def no_gpu(monkeypatch, tmp_path):
    """A machine like this one: no NVML library, no nvidia-smi, no kernel module, no overrides."""
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.delenv("FAKE_NVML", raising=False)
    monkeypatch.delenv("ENVTOOL_GPU", raising=False)
    monkeypatch.delenv("ENVTOOL_DRIVER_VERSION", raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr("resolver.hardware.PROC_DRIVER_VERSION", str(tmp_path / "no-such-proc-file"))
    # nor AMD's KFD topology or Intel's PCI devices, whatever this machine has
    monkeypatch.setenv("ENVTOOL_KFD_NODES", str(tmp_path / "no-kfd"))
    monkeypatch.setenv("ENVTOOL_PCI_DEVICES", str(tmp_path / "no-pci"))
    return bin_dir


@pytest.fixture
def fake_nvml(no_gpu, monkeypatch):
    def install(driver, *gpus):
        # (name, cc, memory MiB[, NVML pciDeviceId])
        spec = {"driver": driver, "gpus": [{"name": g[0], "cc": g[1], "memory_mib": g[2],
                                            **({"pci_device_id": g[3]} if len(g) > 3 else {})} for g in gpus]}
        monkeypatch.setenv("FAKE_NVML", json.dumps(spec))

    return install


def write_nvidia_smi(bin_dir: Path, capture: str, exit_code: int = 0) -> None:
    """An `nvidia-smi` that answers the query envtool sends with a captured output, like the real one."""
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--query-gpu=name,compute_cap,memory.total,driver_version*--format=csv,noheader*) ;;\n'
        '  *) echo "unexpected arguments: $*" >&2; exit 64;; esac\n'
        f"/bin/cat '{DATA / capture}'\nexit {exit_code}\n"
    )
    script.chmod(0o755)


@pytest.fixture
def fake_smi(no_gpu):
    return lambda capture, exit_code=0: write_nvidia_smi(no_gpu, capture, exit_code)


def run_envtool(*args, env=None, timeout=120, **extra_env):
    """Run the envtool command; `NAME=None` in extra_env removes NAME from its environment."""
    environment = dict(os.environ if env is None else env)
    for name, value in extra_env.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return subprocess.run([str(ENVTOOL), *args], capture_output=True, text=True, timeout=timeout, env=environment)
