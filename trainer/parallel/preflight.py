"""The multi-GPU preflight, `python -m trainer preflight`: in seconds, what the first collective finds in minutes.

Run under torchrun with the job's own launch settings (`envtool doctor --multi-gpu` and a multi-process
`envtool train` start it that way, in the environment that trains), every rank:

1. **joins**: writes its host facts to the rendezvous store (torchrun's agent store, or rank 0's TCPStore under
   another launcher) and waits at most `timeout` seconds for every other rank's. A rank that never arrives (stuck
   before its first collective, never started, a machine that did not come up) is *named*: "rank 1 (machine 0,
   local rank 1) did not join within 10 s". The store is the side channel: it answers even when a collective would
   hang, so nothing here waits on a collective to learn who is missing.
2. **shared storage**, across machines: rank 0 writes a marker into `output_dir` and `dataset_prepared_path`; the
   first rank of every other machine must find it at the same path, as the trainer will (rank 0 prepares the
   data the others read; sharded checkpoints are written by every rank).
3. **a timed all-reduce** of 4 MiB over the backend training uses (gloo on the CPU, NCCL on NVIDIA GPUs, RCCL on
   ROCm), with a watchdog: past `timeout` seconds the ranks that never entered it are named, or, when all entered
   and none finished, the transport is (P2P, IOMMU/ACS, the network interface). The sum is checked.
4. **host facts** per machine: `/dev/shm` (NCCL's shared-memory transport and DataLoader workers live there;
   containers default to 64 MB), `ulimit -l` (InfiniBand/RoCE pins its buffers), the RDMA devices.

Every rank writes its view (all ranks' facts, what was missing, the findings) to `--report DIR/rank-N.json`; the
lowest rank that joined prints the findings. Exit 0 when no check failed, 1 when one did, 2 for bad input.
`ENVTOOL_PREFLIGHT_STALL_RANKS` ("1", or "1:all-reduce") makes those ranks stall before that phase: a rehearsal of
the fault, used by the tests; `ENVTOOL_PREFLIGHT_SHM_DF` (a file holding a captured `df` output) makes /dev/shm's size
the one that output shows, as a container's would be.

The trainer runs the same checks before its first step when torchrun starts it (`check_before_training`): quiet
when all is well, one error line (exit 1) naming the rank or the host fact otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from trainer.errors import ConfigError
from trainer.errors import TrainingError
from trainer.errors import readable, record

STORE_PREFIX = "envtool-preflight"
STALL_ENV = "ENVTOOL_PREFLIGHT_STALL_RANKS"
SHM_DF_ENV = "ENVTOOL_PREFLIGHT_SHM_DF"
PHASES = ("join", "all-reduce")
SHM_PATH = "/dev/shm"
RDMA_SYSFS = "/sys/class/infiniband"
# DeepSpeed's env_report warns below 512 MiB; NCCL's troubleshooting guide asks containers for --shm-size=1g
SHM_MIN_BYTES = 512 * 2**20
REDUCE_ELEMENTS = 2**20  # 4 MiB of float32: past NCCL's small-message protocols, seconds on any transport
POLL_S = 0.05

SHM_FIX = ("docker run --shm-size=1g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory at /dev/shm "
           "(envtool run and --emit k8s give 8g)")
MEMLOCK_FIX = ("docker run --ulimit memlock=-1; on the host: memlock unlimited in /etc/security/limits.conf "
               "(Slurm: PropagateResourceLimits, or LimitMEMLOCK=infinity for slurmd)")
HANG_FIX = ("NCCL_DEBUG=INFO shows the transport NCCL picked; GPUs without P2P: NCCL_P2P_DISABLE=1; PCIe with "
            "IOMMU/ACS on: NCCL's troubleshooting guide (ACS); across machines: NCCL_SOCKET_IFNAME=<interface>")


class Layout(NamedTuple):
    """Where this process sits in the job, from the launcher's environment (torchrun's names)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    machine: int  # torchrun's GROUP_RANK (the order its rendezvous gave the machines)
    machines: int
    master: str
    port: int
    agent_store: bool

    def where(self, rank: int) -> str:
        """'rank 3 (machine 1, local rank 1)': torchrun numbers ranks machine by machine."""
        if self.machines == 1:
            return f"rank {rank}"
        return f"rank {rank} (machine {rank // self.local_world}, local rank {rank % self.local_world})"


def layout(environ=os.environ) -> Layout:
    def number(name: str, default: int) -> int:
        try:
            return int(environ.get(name, default))
        except ValueError:
            raise ConfigError(f"{name}={environ[name]!r} is not a number (set by the launcher)") from None

    world = number("WORLD_SIZE", 1)
    rank = number("RANK", 0)
    local_world = max(number("LOCAL_WORLD_SIZE", world), 1)
    machines = number("GROUP_WORLD_SIZE", max(world // local_world, 1))
    return Layout(rank, world, number("LOCAL_RANK", rank % local_world), local_world,
                  number("GROUP_RANK", rank // local_world), machines, environ.get("MASTER_ADDR", "127.0.0.1"),
                  number("MASTER_PORT", 29500), environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def host_facts(shm_path: str = SHM_PATH, rdma_sysfs: str = RDMA_SYSFS) -> dict:
    """This machine as the collectives meet it: /dev/shm's size, the locked-memory limit (None: unlimited), the
    RDMA devices (InfiniBand/RoCE), the host name."""
    # start-up: resource imported only when this runs
    import resource

    captured = os.environ.get(SHM_DF_ENV)
    if captured:
        shm = shm_from_df(Path(captured).read_text(), shm_path)
    else:
        try:
            stat = os.statvfs(shm_path)
            shm = stat.f_frsize * stat.f_blocks
        except OSError:
            shm = None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        rdma = sorted(os.listdir(rdma_sysfs))
    except OSError:
        rdma = []
    return {"host": socket.gethostname(), "pid": os.getpid(), "shm_bytes": shm,
            "memlock_bytes": None if soft == resource.RLIM_INFINITY else soft, "rdma_devices": rdma}


DF_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def shm_from_df(text: str, mount: str = SHM_PATH) -> int | None:
    """The size `df` (bytes, or -h's 64M) shows for the filesystem mounted at `mount`; None when none is.
    Lines starting with '#' (a capture's source note) are skipped."""
    for line in text.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 6 or fields[-1] != mount:
            continue
        number = fields[1].rstrip("iB").upper()
        unit = number[-1] if number[-1:] in DF_UNITS and not number[-1:].isdigit() else ""
        try:
            return int(float(number[: len(number) - len(unit)]) * DF_UNITS[unit])
        except ValueError:
            return None
    return None


def size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def finding(level: str, check: str, message: str, fix: str | None = None) -> dict:
    return {"level": level, "check": check, "message": message, "fix": fix}


# ---------------------------------------------------------------------------- verdicts (pure: the tests call them)


def host_findings(machines: dict[int, dict], backend: str) -> list[dict]:
    """/dev/shm and memlock, one finding per check naming the machines that fail it. `machines`: machine -> the
    facts of its first rank that answered; `backend`: gloo | nccl | rccl."""
    found = []
    one = len(machines) == 1

    def where(m: int, facts: dict) -> str:
        return "this machine" if one else f"machine {m} ({facts['host']})"

    small = [(m, f) for m, f in sorted(machines.items()) if f.get("shm_bytes") is not None
             and f["shm_bytes"] < SHM_MIN_BYTES]
    if small:
        gpu = backend != "gloo"
        use = ("NCCL's shared-memory transport between the GPUs of a machine fails to set up in it ('failed to "
               "extend /dev/shm/nccl-*'), and DataLoader workers die with a bus error") if gpu else \
            "gloo does not use it, but DataLoader workers (dataloader_num_workers) and NCCL on GPUs do"
        found.append(finding("error" if gpu else "warning", "shm",
                             "; ".join(f"/dev/shm on {where(m, f)} is {size(f['shm_bytes'])}" for m, f in small)
                             + f" (under {size(SHM_MIN_BYTES)}: a container's 64 MB default?): {use}", SHM_FIX))
    else:
        sizes = sorted({size(f["shm_bytes"]) for f in machines.values() if f.get("shm_bytes") is not None})
        found.append(finding("ok", "shm", f"/dev/shm: {', '.join(sizes) or 'not mounted'}"))

    limited = [(m, f) for m, f in sorted(machines.items()) if f.get("memlock_bytes") is not None]
    rdma = [(m, f) for m, f in limited if f.get("rdma_devices")]
    if rdma:
        found.append(finding("error", "memlock", "; ".join(
            f"{where(m, f)} has RDMA devices ({', '.join(f['rdma_devices'])}) and ulimit -l {size(f['memlock_bytes'])}"
            for m, f in rdma) + ": NCCL's InfiniBand/RoCE transport pins its buffers and fails to register them "
            "('ibv_reg_mr failed'); NCCL's docs ask for unlimited", MEMLOCK_FIX))
    elif limited:
        values = ", ".join(sorted({size(f["memlock_bytes"]) for _, f in limited}))
        found.append(finding("ok", "memlock", f"ulimit -l {values}: enough without RDMA devices (InfiniBand/RoCE "
                             "needs it unlimited; none here)"))
    else:
        found.append(finding("ok", "memlock", "ulimit -l unlimited"))
    return found


def join_findings(lay: Layout, missing: list[int], timeout: float, waited: float,
                  knob: str = "--timeout") -> list[dict]:
    machines = f" on {lay.machines} machines" if lay.machines > 1 else ""
    if not missing:
        return [finding("ok", "ranks", f"{lay.world} ranks{machines} joined in {waited:.1f} s")]
    names = ", ".join(lay.where(r) for r in missing)
    return [finding("error", "ranks", f"{names} did not join within {timeout:g} s: stuck before its first "
                    "collective, or never started (see its log); the other ranks stopped instead of waiting for it "
                    "in a collective",
                    "look at that rank's log (torchrun --tee 3 --log-dir DIR keeps one per rank); on another machine: "
                    f"start it with the same --rdzv-endpoint; slow to start: raise {knob}")]


def reduce_findings(lay: Layout, backend: str, entered: list[int], finished: list[int], timeout: float,
                    result: dict | None) -> list[dict]:
    everyone = set(range(lay.world))
    if result is not None and result.get("ok") and set(finished) == everyone:
        return [finding("ok", "all-reduce", f"{size(REDUCE_ELEMENTS * 4)} over {backend} across {lay.world} ranks in "
                        f"{result['seconds']:.3f} s; the sum is right")]
    if result is not None and not result.get("ok") and result.get("error"):
        return [finding("error", "all-reduce", f"the all-reduce over {backend} failed on {lay.where(lay.rank)}: "
                        f"{result['error']}", HANG_FIX)]
    if result is not None and not result.get("ok"):
        return [finding("error", "all-reduce", f"the all-reduce over {backend} returned {result['got']}, not "
                        f"{result['expected']}: the transport corrupts data", HANG_FIX)]
    absent = sorted(everyone - set(entered))
    if absent:
        return [finding("error", "all-reduce", f"{', '.join(lay.where(r) for r in absent)} joined but did not reach "
                        f"the all-reduce within {timeout:g} s; the others waited for it there",
                        "look at that rank's log: it is stuck between joining and its first collective")]
    unfinished = sorted(everyone - set(finished))
    if len(unfinished) == lay.world:
        return [finding("error", "all-reduce", f"every rank entered the all-reduce over {backend} and none finished "
                        f"within {timeout:g} s: the transport between them hangs", HANG_FIX)]
    return [finding("error", "all-reduce", f"{', '.join(lay.where(r) for r in unfinished)} entered the all-reduce "
                    f"over {backend} and did not finish within {timeout:g} s while the others did", HANG_FIX)]


def shared_findings(dirs: list[dict], answers: dict[int, dict | None], lay: Layout) -> list[dict]:
    """`dirs`: what rank 0 marked ([{key, path, absolute}]); `answers`: machine -> {key: "seen" | why not}, None for
    a machine that did not answer."""
    if lay.machines == 1:
        return []
    if not dirs:
        return [finding("warning", "shared-storage", "no output_dir or dataset_prepared_path to check (give the "
                        "config): every machine must see the data rank 0 prepares and the checkpoints")]
    bad = []
    for machine, answer in sorted(answers.items()):
        if answer is None:
            bad.append(f"machine {machine} did not answer")
            continue
        for d in dirs:
            if answer.get(d["key"]) != "seen":
                bad.append(f"machine {machine} does not see {d['key']} {d['path']} ({answer.get(d['key'])})")
    if bad:
        return [finding("error", "shared-storage", "; ".join(bad) + f"; rank 0 wrote its marker in "
                        f"{', '.join(d['absolute'] for d in dirs)}: the machines must share that filesystem (the "
                        "others read the data rank 0 prepares and write their checkpoint shards there)",
                        "put output_dir and dataset_prepared_path on a filesystem every machine mounts at the same "
                        "path (NFS, Lustre, a ReadWriteMany volume), or give absolute paths that are")]
    return [finding("ok", "shared-storage", f"all {lay.machines} machines see "
                    f"{' and '.join(d['key'] + ' ' + d['path'] for d in dirs)}")]


def catalog_p2p(device_name: str | None, driver: str | None) -> dict | None:
    """gpus.toml's p2p columns for this GPU and driver, as a finding (matrices/catalog.py p2p_advice)."""
    # start-up: matrices.catalog, trainer.facts imported only when this runs
    from matrices import catalog
    from trainer import facts

    if not device_name:
        return None
    advice = catalog.p2p_advice(catalog.find_gpu(device_name, facts.rows("gpus", "gpu")), driver)
    return None if advice is None else finding(advice[0], "p2p", advice[1], advice[2])


def peer_findings(ranks: dict[int, dict]) -> list[dict]:
    """What the CUDA driver says about peer access between a machine's GPUs (each machine's local rank 0 asks),
    and what the catalog knows about the card (gpus.toml's p2p columns)."""
    found = []
    for facts in ranks.values():
        if facts.get("peer_access") is not None:
            advice = catalog_p2p(facts.get("device_name"), facts.get("driver"))
            if advice is not None:
                advice["message"] = f"{facts['host']}: {advice['message']}"
                found.append(advice)
        pairs = facts.get("peer_access") or []
        without = [f"{a}-{b}" for a, b, ok in pairs if not ok]
        if without:
            found.append(finding("warning", "p2p", f"{facts['host']}: the driver gives no peer access between GPUs "
                                 f"{', '.join(without)} ({facts.get('device_name')}): NCCL moves their data through "
                                 "host memory (/dev/shm), slower; NCCL_P2P_DISABLE=1 makes that explicit",
                                 "export NCCL_P2P_DISABLE=1"))
        elif pairs:
            found.append(finding("ok", "p2p", f"{facts['host']}: peer access between all {len(pairs) // 2 + 1} "
                                 f"GPUs ({facts.get('device_name')})"))
    return found


# ---------------------------------------------------------------------------- the run, on every rank


class Store:
    """The rendezvous store under this preflight's own prefix: set, get, and wait for keys with a deadline."""

    def __init__(self, lay: Layout, timeout: float, client: bool = False):
        """`client`: a second connection (the watchdog's), never the one that hosts the store."""
        # heavy: torch loads only when this runs
        from datetime import timedelta

        import torch.distributed as dist

        # under torchrun its agent hosts the store; under another launcher rank 0 does, as env:// does
        hosting = not lay.agent_store and lay.rank == 0 and not client
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            raw = dist.TCPStore(lay.master, lay.port, None, hosting, timedelta(seconds=timeout),
                                wait_for_workers=False)
        except (RuntimeError, dist.DistError) as err:
            host = "torchrun's agent" if lay.agent_store else "rank 0"
            raise Unreachable(f"cannot reach the rendezvous store at {lay.master}:{lay.port} (hosted by {host}) within "
                              f"{timeout:g} s: {str(err).splitlines()[0]}") from None
        self.raw = raw
        self.store = dist.PrefixStore(f"{STORE_PREFIX}/{restart}/", raw)

    def set(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str):
        return json.loads(self.store.get(key))

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def wait(self, keys: list[str], deadline: float) -> list[str]:
        """Poll until every key is there or the deadline passes; the keys still missing."""
        missing = list(keys)
        while True:
            missing = [k for k in missing if not self.has(k)]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)


class Unreachable(Exception):
    pass


class Preflight:
    def __init__(self, timeout: float, device: str, dirs: list[tuple[str, str]], report_dir: Path | None,
                 json_out: bool, log=print, trainer: bool = False):
        """`trainer`: the trainer's own check before its first step: only what is wrong is printed, and a
        failure the watchdog finds ends the process with the trainer's one error line."""
        self.timeout, self.dirs, self.report_dir, self.json_out, self.log = timeout, dirs, report_dir, json_out, log
        self.trainer = trainer
        self.lay = layout()
        self.facts = {**host_facts(), "machine": self.lay.machine, "local_rank": self.lay.local_rank}
        self.device = device
        self.backend = "gloo"
        self.store: Store | None = None
        self.lock = threading.Lock()
        self.done = False
        self.before_reduce: list[dict] = []
        self.report = {"rank": self.lay.rank, "world_size": self.lay.world, "machines": self.lay.machines,
                       "timeout_s": timeout, "backend": None, "device": None, "joined": [], "missing": [],
                       "ranks": {}, "all_reduce": None, "shared": [], "findings": [], "ok": False}

    # --- phases ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        lay = self.lay
        self.pick_backend()
        if lay.world == 1:
            self.report.update(joined=[0], ranks={"0": self.facts})
            return self.finish(host_findings({lay.machine: self.facts}, self.backend) + [finding(
                "warning", "ranks", "one process: nothing to all-reduce (run it under torchrun with --nproc-per-node "
                "N, as envtool doctor --multi-gpu does)")])
        self.stall("join")
        start = time.monotonic()
        try:
            self.store = Store(lay, self.timeout)
        except Unreachable as err:
            return self.finish([finding("error", "ranks", str(err), "start every machine with the same "
                                        "--rdzv-endpoint; check that rank 0's machine is up and reachable")])
        self.store.set(f"joined/{lay.rank}", self.facts)
        keys = [f"joined/{r}" for r in range(lay.world)]
        missing = [int(k.split("/")[1]) for k in self.store.wait(keys, start + self.timeout)]
        joined = [r for r in range(lay.world) if r not in missing]
        self.report.update(joined=joined, missing=missing, ranks={str(r): self.store.get(f"joined/{r}") for r in joined})
        found = join_findings(lay, missing, self.timeout, time.monotonic() - start,
                              "preflight_timeout" if self.trainer else "--timeout")
        if missing:
            return self.finish(found + self.machine_findings())
        found += self.shared_storage()
        self.before_reduce = list(found)  # what the watchdog reports beside a hung all-reduce
        found += self.all_reduce()
        return self.finish(found + self.machine_findings())

    def pick_backend(self) -> None:
        # heavy: torch loads only when this runs
        import torch

        cuda = torch.cuda.is_available() if self.device in ("auto", "cuda") else False
        if self.device == "cuda" and not cuda:
            raise ConfigError("--device cuda: torch sees no GPU here")
        self.report["device"] = "cuda" if cuda else "cpu"
        self.backend = ("rccl" if torch.version.hip else "nccl") if cuda else "gloo"
        self.report["backend"] = self.backend
        if cuda:
            count = torch.cuda.device_count()
            self.facts["device_name"] = torch.cuda.get_device_name(self.lay.local_rank % count)
            if self.lay.local_rank == 0 and count > 1:  # what the driver says about each pair of this machine's GPUs
                self.facts["driver"] = driver_version()
                self.facts["peer_access"] = [[a, b, bool(torch.cuda.can_device_access_peer(a, b))]
                                             for a in range(count) for b in range(count) if a != b]

    def machine_findings(self) -> list[dict]:
        ranks = {int(r): f for r, f in self.report["ranks"].items()}
        machines: dict[int, dict] = {}
        for r in sorted(ranks):
            machines.setdefault(ranks[r].get("machine", 0), ranks[r])
        return host_findings(machines, self.backend) + peer_findings(ranks)

    def shared_storage(self) -> list[dict]:
        """Across machines: every machine's first rank finds the marker rank 0 wrote in each directory."""
        lay, store = self.lay, self.store
        if lay.machines == 1:
            return []
        deadline = time.monotonic() + self.timeout
        markers, created = [], []
        if lay.rank == 0:
            nonce = f"{os.getpid()}-{time.time_ns()}"
            for key, path in self.dirs:
                absolute = os.path.abspath(path)
                marker = Path(absolute) / f".envtool-preflight-{nonce}"
                try:
                    missing = [d for d in (Path(absolute), *Path(absolute).parents) if not d.exists()]
                    Path(absolute).mkdir(parents=True, exist_ok=True)
                    created += missing  # removed again below when still empty: the check leaves nothing behind
                    marker.write_text(nonce)
                    markers.append(marker)
                except OSError as err:
                    return [finding("error", "shared-storage", f"rank 0 cannot write in {key} {absolute}: "
                                    f"{err.strerror}")]
                self.report["shared"].append({"key": key, "path": path, "absolute": absolute, "marker": marker.name,
                                              "nonce": nonce})
            store.set("shared/dirs", self.report["shared"])
        elif store.wait(["shared/dirs"], deadline):
            return [finding("error", "shared-storage", f"rank 0 did not say where it wrote within {self.timeout:g} s")]
        else:
            self.report["shared"] = store.get("shared/dirs")
        dirs = self.report["shared"]
        if lay.local_rank == 0 and lay.machine != 0:
            answer = {}
            for d in dirs:
                marker = Path(os.path.abspath(d["path"])) / d["marker"]
                while True:  # NFS may show a new file to another client after a moment: look until the deadline
                    try:
                        seen = marker.read_text() == d["nonce"]
                        why = "seen" if seen else "a different file at that path"
                    except OSError as err:
                        seen, why = False, f"{os.path.abspath(d['path'])} here: {err.strerror.lower()}"
                    if seen or time.monotonic() >= deadline:
                        break
                    time.sleep(0.2)
                answer[d["key"]] = why
            store.set(f"shared/machine/{lay.machine}", answer)
        others = [f"shared/machine/{m}" for m in range(1, lay.machines)]
        store.wait(others, deadline + 1)
        answers = {m: store.get(f"shared/machine/{m}") if store.has(f"shared/machine/{m}") else None
                   for m in range(1, lay.machines)}
        for path in [*markers, *created]:
            try:
                path.unlink() if path in markers else path.rmdir()
            except OSError:
                pass
        self.report["shared_answers"] = {str(m): a for m, a in answers.items()}
        return shared_findings(dirs, answers, lay)

    def all_reduce(self) -> list[dict]:
        # heavy: torch loads only when this runs
        import torch
        import torch.distributed as dist
        from datetime import timedelta

        lay, store = self.lay, self.store
        self.stall("all-reduce")
        store.set(f"entered/{lay.rank}", True)
        watchdog = threading.Thread(target=self.watch, args=(time.monotonic() + self.timeout,), daemon=True)
        watchdog.start()
        result = {"ok": False, "seconds": None}
        try:
            device = torch.device("cpu")
            if self.backend != "gloo":
                device = torch.device("cuda", lay.local_rank % torch.cuda.device_count())
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if self.backend != "gloo" else "gloo",
                                    store=dist.PrefixStore("pg/", store.store), rank=lay.rank, world_size=lay.world,
                                    timeout=timedelta(seconds=self.timeout + 30))  # the watchdog fires first
            values = torch.full((REDUCE_ELEMENTS,), float(lay.rank + 1), device=device)
            begin = time.perf_counter()
            dist.all_reduce(values)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - begin
            expected = lay.world * (lay.world + 1) / 2
            got = float(values[0])
            result = {"ok": bool((values == expected).all()), "seconds": seconds, "got": got, "expected": expected}
        except (RuntimeError, dist.DistError) as err:
            result = {"ok": False, "seconds": None, "error": str(err).splitlines()[0]}
        with self.lock:
            if self.done:  # the watchdog has reported already and is ending this process
                time.sleep(3600)
            self.report["all_reduce"] = result
        store.set(f"finished/{lay.rank}", result)
        store.wait([f"finished/{r}" for r in range(lay.world)], time.monotonic() + self.timeout)
        finished = [r for r in range(lay.world) if store.has(f"finished/{r}")]
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a group that failed to form: nothing to tear down)
            pass
        if result.get("ok"):  # every rank's own verdict: one wrong sum anywhere is an error
            bad = [store.get(f"finished/{r}") for r in finished if not store.get(f"finished/{r}").get("ok")]
            result = bad[0] if bad else result
        return reduce_findings(lay, self.backend, list(range(lay.world)), finished, self.timeout, result)

    def watch(self, deadline: float) -> None:
        """The all-reduce's watchdog: past the deadline, say who never entered it (or that all did and it hangs),
        from a store connection of its own, and end this process (a hung collective cannot be interrupted)."""
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            if self.report["all_reduce"] is not None:
                return
        with self.lock:
            if self.report["all_reduce"] is not None:
                return
            self.done = True
        try:
            store = Store(self.lay, 10, client=True)  # the main thread's connection may be blocked in a wait
            entered = [r for r in range(self.lay.world) if store.has(f"entered/{r}")]
            finished = [r for r in range(self.lay.world) if store.has(f"finished/{r}")]
        except Unreachable:
            entered, finished = [self.lay.rank], []
        found = reduce_findings(self.lay, self.backend, entered, finished, self.timeout, None)
        self.report["all_reduce"] = {"ok": False, "seconds": None, "entered": entered, "finished": finished}
        code = self.finish(self.before_reduce + found + self.machine_findings())
        if self.trainer and code:
            rank = self.lay.rank
            line = readable(("error: " if rank == 0 else f"error (rank {rank}): ") + failure_line(self.report))
            if not record(line, code):
                print(line, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # --- the report ------------------------------------------------------------------------------------------
    def stall(self, phase: str) -> None:
        """The rehearsal switch: ENVTOOL_PREFLIGHT_STALL_RANKS=1 (before joining) or 1:all-reduce."""
        for item in filter(None, os.environ.get(STALL_ENV, "").split(",")):
            rank, _, at = item.partition(":")
            if rank.strip() == str(self.lay.rank) and (at or "join") == phase:
                time.sleep(3600)

    def finish(self, found: list[dict]) -> int:
        seen = set()
        unique = []
        for f in found:
            key = (f["check"], f["message"])
            if key not in seen:
                seen.add(key)
                unique.append(f)
        self.report["findings"] = unique
        self.report["ok"] = not any(f["level"] == "error" for f in unique)
        if self.report_dir is not None:
            path = self.report_dir / f"rank-{self.lay.rank}.json"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.report))
            os.replace(tmp, path)
        if self.lay.rank == min(self.report["joined"] or [self.lay.rank]):
            if self.trainer:  # before training: the warnings; the errors become the trainer's one line
                for f in unique:
                    if f["level"] == "warning":
                        self.log(f"preflight warning: {f['check']}: {f['message']}"
                                 + (f" (fix: {f['fix']})" if f["fix"] else ""))
            elif self.json_out:
                print(json.dumps(self.report), flush=True)
            else:
                marks = {"ok": "ok", "warning": "warning", "error": "error"}
                for f in unique:
                    self.log(f"preflight {marks[f['level']]}: {f['check']}: {f['message']}"
                             + (f" (fix: {f['fix']})" if f["fix"] and f["level"] != "ok" else ""))
        return 0 if self.report["ok"] else 1


def driver_version() -> str | None:
    """The NVIDIA driver's version through NVML (nvidia-ml-py); None on ROCm or where NVML does not answer."""
    try:
        # optional: pynvml is imported only where it is used
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 (no NVML: the catalog's advice then says the driver is unknown)
        return None


def failure_line(report: dict) -> str:
    """The first error of a report as the trainer's one line."""
    first = next(f for f in report["findings"] if f["level"] == "error")
    return f"preflight: {first['message']}" + (f" (fix: {first['fix']})" if first["fix"] else "")


def check_before_training(cfg, device: str, log=print) -> None:
    """The trainer's preflight under torchrun (several processes, torchrun's agent hosting the store): every rank
    joins within cfg.preflight_timeout seconds, a timed all-reduce, /dev/shm, ulimit -l, and across machines the
    output_dir and dataset_prepared_path. Raises TrainingError naming the rank or the fact; quiet when all is well.
    Skipped with preflight_timeout: 0, with one process, and under other launchers (Ray Train's workers: rank 0
    would host a store on the port the process group is about to take)."""
    lay = layout()
    if not cfg.preflight_timeout or lay.world < 2 or not lay.agent_store:
        return
    dirs = [("output_dir", str(cfg.output_dir)), ("dataset_prepared_path", str(cfg.dataset_prepared_path))]
    check = Preflight(float(cfg.preflight_timeout), "cuda" if device == "cuda" else "cpu", dirs, None, False, log,
                      trainer=True)
    if check.run():
        raise TrainingError(failure_line(check.report))


def config_dirs(config: str | None) -> list[tuple[str, str]]:
    """The directories every machine must see: the config's output_dir and dataset_prepared_path."""
    if not config:
        return []
    # start-up: trainer.config imported only when this runs
    from trainer.config import load_config

    cfg, _ = load_config(config)
    return [("output_dir", str(cfg.output_dir)), ("dataset_prepared_path", str(cfg.dataset_prepared_path))]


def main(timeout: float, device: str, config: str | None, report_dir: str | None, json_out: bool, log=print) -> int:
    if timeout <= 0:
        raise ConfigError(f"--timeout {timeout:g}: give a number of seconds above 0")
    folder = Path(report_dir) if report_dir else None
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"--report {report_dir}: not a directory")
    return Preflight(timeout, device, config_dirs(config), folder, json_out, log).run()
