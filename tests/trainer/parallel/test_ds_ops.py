"""DeepSpeed's JIT op builds (issue 33, item 10): a run that will build cpu_adam says so before the minutes of
silence, and the lock a killed build leaves (torch's FileBaton: `<TORCH_EXTENSIONS_DIR>/<op>/lock`) is found and
removed, where before every later ZeRO-offload run waited on it forever. The locks here are torch's own FileBaton,
taken in a real process (alive: a build under way; killed with SIGKILL: a stale lock), in a temporary
TORCH_EXTENSIONS_DIR; no op is built.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.parallel import ds_ops

REPO = Path(__file__).resolve().parents[3]
ZERO2 = json.loads((REPO / "trainer" / "deepspeed_configs" / "zero2.json").read_text())  # offload_optimizer: cpu
ZERO1 = json.loads((REPO / "trainer" / "deepspeed_configs" / "zero1.json").read_text())

HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("file_baton", sys.argv[2])  # torch's own, without importing torch
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
baton = module.FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def _hold(lock: Path) -> subprocess.Popen:
    """A process holding `lock` as torch's JIT build does while it compiles."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    import torch.utils.file_baton as baton

    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), baton.__file__], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(ds_ops, "installed", lambda op: False)  # as DeepSpeed from PyPI: no op prebuilt
    return tmp_path / "ext"


def test_which_configs_build_which_ops():
    assert ds_ops.needed_ops(ZERO2) == ["cpu_adam"]
    assert ds_ops.needed_ops(ZERO1) == []
    assert ds_ops.needed_ops({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}) == ["cpu_adam", "async_io"]
    assert ds_ops.needed_ops({"zero_optimization": {"offload_param": {"device": "nvme"}}}) == ["async_io"]
    assert ds_ops.needed_ops({"zero_optimization": {"offload_optimizer": {"device": "none"}}}) == []


def test_a_first_build_is_announced_and_a_built_op_is_not(extensions):
    said = []
    ds_ops.prepare(ZERO2, said.append)
    assert said == [f"building DeepSpeed's cpu_adam once, a few minutes (in {extensions / 'cpu_adam'}; later runs "
                    "load it)"]
    (extensions / "cpu_adam").mkdir(parents=True)
    (extensions / "cpu_adam" / "cpu_adam.so").write_bytes(b"\x7fELF")
    said.clear()
    ds_ops.prepare(ZERO2, said.append)
    assert said == []
    assert ds_ops.prepare(ZERO1, said.append) == []


def test_the_lock_of_a_killed_build_is_removed_and_named(extensions):
    lock = extensions / "cpu_adam" / "lock"
    holder = _hold(lock)
    holder.send_signal(signal.SIGKILL)  # the build killed mid-way: torch's release() never runs
    holder.wait()
    assert lock.exists()
    said = []
    ds_ops.prepare(ZERO2, said.append)
    assert not lock.exists()
    assert said[0] == (f"note: removed {lock}, the lock of a DeepSpeed cpu_adam build that was killed before it ended "
                       "(no process holds it); building again")
    assert said[1].startswith("building DeepSpeed's cpu_adam once")


def test_a_build_under_way_is_named_and_its_lock_kept(extensions):
    lock = extensions / "cpu_adam" / "lock"
    holder = _hold(lock)
    try:
        said = []
        ds_ops.prepare(ZERO2, said.append)
        assert lock.exists()
        assert said[0].startswith(f"DeepSpeed's cpu_adam is being built by process {holder.pid} (")
        assert said[0].endswith(f"): this run waits for it to finish (lock {lock})")
    finally:
        holder.kill()
        holder.wait()


def test_the_default_extensions_folder_is_torchs(monkeypatch, tmp_path):
    """Without TORCH_EXTENSIONS_DIR, the folder torch itself would build in (its private helper as the oracle)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert ds_ops.extensions_root() / "cpu_adam" == Path(_get_build_directory("cpu_adam", False))


def test_the_cpu_accelerator_builds_the_shared_memory_all_reduce(extensions, monkeypatch):
    """On the CPU every DeepSpeed run loads deepspeed_shm_comm in init_distributed (DeepSpeed's TorchBackend): its
    build is said, and a killed build's lock is removed, where before every later DeepSpeed run on this machine waited
    on it until the test's timeout killed it (CI, 2026-11-28: ZeRO-1 and ZeRO-3 runs, 240 s each)."""
    monkeypatch.setattr(ds_ops, "loaded_by_deepspeed", lambda op: True)
    assert ds_ops.needed_ops(ZERO1, "cpu") == ["deepspeed_shm_comm"]
    assert ds_ops.needed_ops(ZERO1, "cuda") == []
    lock = extensions / "deepspeed_shm_comm" / "lock"
    holder = _hold(lock)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    said = []
    ds_ops.prepare(ZERO1, said.append, device="cpu")
    assert said[0].startswith(f"note: removed {lock}, the lock of a DeepSpeed deepspeed_shm_comm build")
    assert said[1].startswith("building DeepSpeed's deepspeed_shm_comm once")
    assert not lock.exists()
