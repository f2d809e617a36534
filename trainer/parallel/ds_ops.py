"""DeepSpeed's compiled ops a run builds on first use: said before the build starts, and a stale build lock cleared.

DeepSpeed compiles an op it was not installed with (DS_BUILD_CPU_ADAM=1 and the like, which envtool's images set at
image-build time) the first time a run needs it, through torch's JIT extension loader (torch.utils.cpp_extension
.load): cpu_adam for `offload_optimizer: {device: cpu|nvme}` (DeepSpeedCPUAdam), async_io for NVMe offload, and on the
CPU accelerator deepspeed_shm_comm, which DeepSpeed's TorchBackend loads in `init_distributed` for every run (its
shared-memory all-reduce). That build takes minutes (3½ for cpu_adam, 1 to 3 for deepspeed_shm_comm on a 2-core
machine) and prints nothing. torch serialises builds with a lock
file, `<extensions dir>/<op>/lock` (torch.utils.file_baton.FileBaton: created with O_EXCL, its descriptor held open
by the building process, removed when the build ends). A build killed before it ends leaves the file, and every later
load waits for it to disappear, forever and silently.

`prepare(ds_config, say)` (local rank 0 of each machine, before DeepSpeed builds anything):
1. for each op the config needs that DeepSpeed was not installed with, the extension's folder: TORCH_EXTENSIONS_DIR/
   <op>, else torch's default root (~/.cache/torch_extensions/py311_cu128/<op>, as torch computes it);
2. a `lock` there that a live process on this machine holds open (found in /proc/*/fd) is a build under way: named
   with its process, and the run waits for it; one that no process holds is a stale lock of a killed build:
   removed, with a note naming it (one that cannot be removed: one line, exit 1; a build running on another machine over a shared home cannot be seen; set
   TORCH_EXTENSIONS_DIR to a local folder there);
3. an op with no built library in that folder is built now: "building DeepSpeed's cpu_adam once, a few minutes".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def needed_ops(ds_config: dict, device: str = "cuda") -> list[str]:
    """The JIT ops a DeepSpeed config makes DeepSpeed load on this device (see the module doc)."""
    zero = ds_config.get("zero_optimization") or {}
    optimizer = (zero.get("offload_optimizer") or {}).get("device") if isinstance(zero, dict) else None
    params = (zero.get("offload_param") or {}).get("device") if isinstance(zero, dict) else None
    ops = []
    if optimizer in ("cpu", "nvme"):
        ops.append("cpu_adam")
    if "nvme" in (optimizer, params):
        ops.append("async_io")
    if device == "cpu":  # DeepSpeed's CPU accelerator: TorchBackend.__init__ builds its shared-memory all-reduce
        ops.append(SHM_COMM)
    return ops


SHM_COMM = "deepspeed_shm_comm"  # deepspeed/ops/op_builder/cpu/comm.py ShareMemCommBuilder.NAME


def extensions_root() -> Path:
    """Where torch builds JIT extensions (torch.utils.cpp_extension._get_build_directory, without creating it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    # heavy: torch loads only when this runs
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def installed(op: str) -> bool:
    """Whether DeepSpeed was installed with this op built (then nothing is compiled at run time)."""
    try:
        # heavy: deepspeed loads only when this runs
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(op))


def loaded_by_deepspeed(op: str) -> bool:
    """False for deepspeed_shm_comm where DeepSpeed finds it incompatible here (build_shm_op then skips it)."""
    if op != SHM_COMM:
        return True
    try:
        # heavy: deepspeed loads only when this runs
        from deepspeed.ops import __compatible_ops__
    except ImportError:
        return False
    return bool(__compatible_ops__.get(op, False))


def holders(lock: Path) -> list[int]:
    """The processes on this machine that hold `lock` open (a build under way holds its lock's descriptor)."""
    target = str(lock.resolve())
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        found.append(int(fd_dir.parent.name))
                        break
                except OSError:
                    continue
        except OSError:  # ended meanwhile, or another user's process
            continue
    return found


def command_of(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(w.decode("utf-8", "replace") for w in words if w)[:120] or "?"


def build(op: str) -> Path:
    """Build `op` now, as DeepSpeed itself would at its first use (its accelerator's op builder, torch's JIT loader);
    the folder it is in. For a set-up step (.ci/setup), so that no run spends its first minutes compiling."""
    # heavy: deepspeed loads only when this runs
    from deepspeed.accelerator import get_accelerator

    builder = {SHM_COMM: "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder"}[op]
    get_accelerator().create_op_builder(builder).load()
    return extensions_root() / op


def prepare(ds_config: dict, say=print, device: str = "cuda") -> list[str]:
    """Check each JIT op the config needs on this device (see the module doc); return the notes said."""
    notes = []
    for op in needed_ops(ds_config, device):
        if installed(op) or not loaded_by_deepspeed(op):
            continue
        folder = extensions_root() / op
        lock = folder / "lock"
        if lock.exists():
            live = holders(lock)
            if live:
                notes.append(f"DeepSpeed's {op} is being built by process {live[0]} ({command_of(live[0])}): this run "
                             f"waits for it to finish (lock {lock})")
            else:
                try:
                    lock.unlink()
                    notes.append(f"note: removed {lock}, the lock of a DeepSpeed {op} build that was killed before it "
                                 "ended (no process holds it); building again")
                except FileNotFoundError:  # its build ended meanwhile
                    pass
                except OSError as err:  # waiting on it would hang forever
                    # start-up: trainer.errors imported only when this runs
                    from trainer.errors import TrainingError

                    raise TrainingError(f"{lock} is the lock of a DeepSpeed {op} build that was killed before it "
                                        f"ended (no process holds it) and cannot be removed ({err.strerror or err}): "
                                        "remove it (or set TORCH_EXTENSIONS_DIR to a folder of your own)") from None
        if not any(folder.glob("*.so")):
            notes.append(f"building DeepSpeed's {op} once, a few minutes (in {folder}; later runs load it)")
    for line in notes:
        say(line)
    return notes
