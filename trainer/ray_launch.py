"""`use_ray: true`: `python -m trainer train` runs the training loop on Ray Train workers instead of torchrun's.

As Axolotl's `cli/train.py` does it: a `ray.train.torch.TorchTrainer` with `ScalingConfig(num_workers=
ray_num_workers, use_gpu=..., resources_per_worker=...)` and `RunConfig(name=ray_run_name, storage_path=
output_dir)`. Each worker is one rank. Ray Train creates the process group before the training function runs
(`ray/train/torch/config.py`: `_TorchBackend.on_start` sets MASTER_ADDR/MASTER_PORT on every worker, then RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and ACCELERATE_TORCH_DEVICE, then calls `dist.init_process_group`:
gloo without GPUs, nccl with them); accelerate (`PartialState`) and DeepSpeed (`deepspeed.comm`) reuse a group
that is already initialised, so the loop is the one torchrun runs, DDP, FSDP and ZeRO included, and rank 0
alone writes metrics, checkpoints and the final model.

The cluster is a local one started for the run and stopped after it: `ray.init(address="local")` (never a
RAY_ADDRESS from the environment), no dashboard, no usage statistics, and Ray's own loopback mode
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the mode Ray uses on laptops), so Ray and the process group listen on and
talk to 127.0.0.1 only. Each worker writes `<output_dir>/<ray_run_name>/workers/rank-N.json` (rank, world size,
backend, pid) so the driver can say which ranks really ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer.errors import ConfigError, HardwareError, TrainerError, TrainingError

WORKER_ENV = "ENVTOOL_RAY_WORKER"  # set inside Ray workers: `train` there runs the loop, never Ray again
INSTALL_HINT = "pip install 'envtool-llm[ray]' (ray[train])"
AXOLOTL_DEFAULT_RESOURCES = {"GPU": 1.0}  # Axolotl's resources_per_worker default
# Set before Ray starts, so that its processes (which inherit them) see them too.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage statistics sent anywhere
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # local-only mode: the node's address is 127.0.0.1
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # worker output once, as the trainer prints it
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # one machine: nothing to preempt
}


def in_worker() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def run_dir(cfg) -> Path:
    return Path(cfg.output_dir).absolute() / (cfg.ray_run_name or "ray")


def scaling(cfg, runtime, gpus_here: int | None = None) -> tuple[bool, dict[str, float], list[str]]:
    """(use_gpu, resources per worker, notes) for this run. GPUs are asked for where the run is on GPUs;
    on the CPU a GPU entry (Axolotl's default asks for one) is dropped with a note. Raises HardwareError when
    the workers need more GPUs than this machine has (Ray would wait for them forever)."""
    given = cfg.resources_per_worker
    resources = {k: float(v) for k, v in (AXOLOTL_DEFAULT_RESOURCES if given is None else given).items()}
    notes = []
    if runtime.device != "cuda":
        if resources.pop("GPU", 0):
            notes.append("resources_per_worker: GPU left out: this run is on the CPU (each worker takes "
                         f"{resources.get('CPU', 1):g} CPU, gloo)")
        return False, {k: v for k, v in resources.items() if v}, notes
    resources["GPU"] = resources.get("GPU") or 1.0
    if gpus_here is not None:
        need = cfg.ray_num_workers * resources["GPU"]
        if need > gpus_here:
            raise HardwareError(f"ray_num_workers: {cfg.ray_num_workers} workers x {resources['GPU']:g} GPU need "
                                f"{need:g} GPUs, and this machine has {gpus_here}: lower ray_num_workers or "
                                "resources_per_worker.GPU")
    return True, {k: v for k, v in resources.items() if v}, notes


def describe(cfg, runtime) -> str:
    """validate's line: how `train` will launch this config."""
    use_gpu, resources, notes = scaling(cfg, runtime)
    each = ", ".join(f"{v:g} {k}" for k, v in resources.items()) or "1 CPU"
    return (f"Ray Train, {cfg.ray_num_workers} worker(s) of {each} on a local Ray cluster (127.0.0.1), "
            f"{'nccl' if use_gpu else 'gloo'}; `train` starts them (no torchrun)" + "".join(f"; {n}" for n in notes))


def require_ray(launched_by_torchrun: bool = False) -> None:
    """Import Ray Train (ConfigError naming the extra when it is missing), with RAY_ENV set first: Ray reads
    some of it at import, and the processes it starts inherit it. Under torchrun every process would start its
    own Ray cluster: refused."""
    if launched_by_torchrun:
        raise ConfigError("use_ray: launch this config as one process (python -m trainer train), not with torchrun: "
                          "Ray Train starts its ray_num_workers workers itself")
    for key, value in RAY_ENV.items():
        os.environ[key] = value
    os.environ.pop("RAY_ADDRESS", None)  # a local cluster, whatever the shell points at
    try:
        # optional: ray is imported only where it is used
        import ray  # noqa: F401
        from ray.train.torch import TorchTrainer  # noqa: F401
    except ImportError:
        raise ConfigError(f"use_ray: Ray Train is not installed in this environment; install the ray extra: "
                          f"{INSTALL_HINT}") from None


def launch(config_path: str, plan_path: str | None, cfg, runtime, log, debug: bool = False) -> None:
    """Start a local Ray cluster, train on ray_num_workers workers, stop the cluster. Raises the first failed
    rank's TrainerError (same exit code as under torchrun), TrainingError for anything else. Ray Train's own
    report of a failed worker (with its traceback) is shown with --debug only, as the trainer's tracebacks are."""
    require_ray()
    # heavy: torch loads only when this runs
    import torch

    use_gpu, resources, notes = scaling(cfg, runtime, torch.cuda.device_count() if runtime.device == "cuda" else None)
    for note in notes:
        log(f"note: {note}")

    import ray
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    workers = cfg.ray_num_workers
    cpus = max(os.cpu_count() or 1, int(workers * resources.get("CPU", 1) + 0.999))  # Ray's CPU counts are
    # scheduling labels: more workers than cores share them, as torchrun's processes would
    where = run_dir(cfg)
    markers = where / "workers"
    if markers.exists():
        for old in markers.glob("rank-*.json"):
            old.unlink()
    spec = {"cwd": os.getcwd(), "config": str(Path(config_path).absolute()),
            "plan": str(Path(plan_path).absolute()) if plan_path else None, "markers": str(markers)}
    log(f"ray: starting a local Ray cluster (127.0.0.1) for {workers} worker(s), each {resources or {'CPU': 1}}")
    # The workers import the trainer this process runs (a checkout run with `python -m trainer` included: Ray
    # starts its workers elsewhere, where another installed copy could come first)
    here = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here])
    # The workers' output reaches this terminal as torchrun's would; Ray Train's INFO lines stay in Ray's session
    # logs, and so do its placement-group cleaner's warnings (it polls the state API, which lives in the dashboard
    # that is left out): _quiet_ray runs in every Ray process as it starts
    ray.init(address="local", include_dashboard=False, num_cpus=cpus, log_to_driver=True,
             configure_logging=True, logging_level="WARNING",
             runtime_env={"worker_process_setup_hook": f"{__name__}._quiet_ray", "env_vars": {"PYTHONPATH": path}})
    try:
        trainer = TorchTrainer(
            _worker, train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources or None),
            torch_config=TorchConfig(timeout_s=int(cfg.ddp_timeout)),
            run_config=RunConfig(name=where.name, storage_path=str(where.parent),
                                 failure_config=FailureConfig(max_failures=0),
                                 logging_config=LoggingConfig(log_level="ERROR" if debug else "CRITICAL")),
        )
        try:
            trainer.fit()
        except Exception as err:  # Ray's TrainingFailedError: the workers' own exceptions, by rank
            raise _worker_error(err) from None
    finally:
        ray.shutdown()
    ranks = sorted(json.loads(p.read_text())["rank"] for p in markers.glob("rank-*.json"))
    if ranks != list(range(workers)):
        raise TrainingError(f"ray: {workers} workers asked for, but ranks {ranks} ran")
    log(f"ray: {workers} worker(s) trained, ranks {', '.join(map(str, ranks))}")


CLEANER_LOG = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def _quiet_ray() -> None:
    """In every Ray process as it starts: Ray Train's placement-group cleaner says little. Its monitor thread asks
    Ray's state API for the controller with no address; where another Ray cluster runs on the machine (another
    user's, or another run's) that ends the thread with "Found multiple active Ray instances" and a traceback on
    the run's terminal. The cleaner only tidies up after a controller that died, and this run stops its own
    cluster at the end, so that one failure goes to its log instead; any other is printed as before."""
    # start-up: logging, threading imported only when this runs
    import logging
    import threading

    logging.getLogger(CLEANER_LOG).setLevel(logging.ERROR)
    previous = threading.excepthook

    def excepthook(args) -> None:
        if isinstance(args.exc_value, ConnectionError) and "multiple active Ray instances" in str(args.exc_value):
            logging.getLogger(CLEANER_LOG).error("placement-group cleaner stopped: %s", args.exc_value)
            return
        previous(args)

    threading.excepthook = excepthook


def _worker_error(err: Exception) -> TrainerError:
    failures = getattr(err, "worker_failures", None) or {}
    for rank in sorted(failures):
        if isinstance(failures[rank], TrainerError):  # the trainer's own error, already one line
            return failures[rank]
    if failures:
        rank = min(failures)
        cause = failures[rank]
        return TrainingError(f"ray worker {rank}: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
    cause = getattr(err, "controller_failure", err)
    return TrainingError(f"ray: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}")


def _stderr(message: str) -> None:
    """A worker's lines, as `python -m trainer train` prints them (Ray forwards workers' stderr to the driver)."""
    print(message, file=sys.stderr, flush=True)


def _worker(spec: dict) -> None:
    """One Ray Train worker: the same `train` as one torchrun process, in the driver's working directory (Ray
    starts workers in its own session directory; the config's relative paths are the driver's)."""
    os.chdir(spec["cwd"])
    os.environ[WORKER_ENV] = "1"
    # heavy: torch loads only when this runs
    import torch.distributed as dist

    from trainer.setup import start
    from trainer.train import train

    rank, world = dist.get_rank(), dist.get_world_size()
    markers = Path(spec["markers"])
    markers.mkdir(parents=True, exist_ok=True)
    marker = {"rank": rank, "world_size": world, "backend": dist.get_backend(), "pid": os.getpid(),
              "local_rank": int(os.environ.get("LOCAL_RANK", rank))}
    tmp = markers / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(marker))
    tmp.replace(markers / f"rank-{rank}.json")
    try:
        cfg, _, runtime = start(spec["config"], None, spec["plan"])
        train(cfg, runtime, log=_stderr)
    except TrainerError as err:  # the driver re-raises it: one line, the exit code torchrun's run would have
        raise type(err)(str(err)) from None  # (a fresh instance: picklable, no chained traceback)
