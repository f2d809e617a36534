"""Launchers for existing cluster engines: an sbatch script (Slurm) and a Kubeflow PyTorchJob (Kubernetes).

Both start the same thing `envtool train` starts on one machine: torchrun over the plan's environment, one
process per GPU, machines joined by a c10d rendezvous. The Kubernetes job runs the plan's image with what
`envtool run` gives a container: the GPUs, shared memory for data-loader workers and NCCL (an in-memory
emptyDir at /dev/shm) and the Hugging Face cache (a volume at the image's HF_HOME), and it works in a
persistent volume mounted at /work: the config's relative output_dir and dataset_prepared_path land there, so
the trained model outlives the pod and every node reads the one prepared dataset.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import BadInput
from .files import write_atomic
from .launch import SECRET_KEYS, Distribution, Launch, Training, check_claim, default_nproc, prepare
from .launch import TORCHRUN_ENV
from .plan import Plan

HF_HOME = "/home/trainer/.cache/huggingface"  # the image's HF_HOME (dockerfiles/Dockerfile.j2)
# Tokens a run may need (a gated model, hub_model_id, W&B): never written into a launcher. The k8s job takes them
# from a Secret (secretKeyRef, optional: a run that needs none starts without it); the sbatch script from the
# environment it is submitted from (sbatch exports it to the job).
DEFAULT_SECRET = "envtool-secrets"
RDZV_PORT = 29500
WORK = "/work"  # where the job's volume is mounted, and the trainer's working directory
DEFAULT_PVC = "envtool-work"
# Long runs (README "Long runs"): the trainer stops every rank after the same step on SIGTERM/SIGUSR1, saves one
# checkpoint and leaves output_dir/stopped.json; the next start of the same command resumes from it.
SIGNAL_LEAD_S = 300  # sbatch: SIGUSR1 this long before the time limit
GRACE_S = 300  # k8s: terminationGracePeriodSeconds, the time between SIGTERM and SIGKILL


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Request:
    """What `envtool train --emit` asks for: the launcher (slurm or k8s), the file to write it to (None: stdout), and
    for k8s the PersistentVolumeClaim for data and outputs and the Secret the tokens come from (None: the defaults)."""

    kind: str
    output: Path | None = None
    pvc: str | None = None
    secret: str | None = None


def render(training: Training, request: Request, dist: Distribution, warn: Callable[[str], None] = _stderr) -> str:
    """The launcher text for a config resolver/launch.py has read (once, through the trainer's reader:
    `training.cfg`) and checked (use_ray is refused there). `request.pvc` (k8s): the PersistentVolumeClaim for data
    and outputs (default envtool-work); `warn` gets one line per path in the config that the pods would not see."""
    plan, launch, config, cfg = training.plan, training.launch, training.config, training.cfg
    if request.kind == "slurm":
        if request.pvc is not None:
            raise BadInput("--pvc goes with --emit k8s (a Slurm job uses the filesystem its nodes share)")
        if request.secret is not None:
            raise BadInput("--secret goes with --emit k8s (a Slurm job takes tokens from the environment it is "
                           "submitted from)")
        return sbatch(plan, launch, config, dist, output_dir=str(cfg.output_dir))
    claim = DEFAULT_PVC if request.pvc is None else check_claim(request.pvc)
    secret = DEFAULT_SECRET if request.secret is None else check_claim(request.secret, "--secret", "Secret")
    for line in volume_warnings(config, cfg, claim, dist):
        warn(f"envtool: warning: {line}")
    return pytorchjob(plan, launch, config, dist, work_claim=claim, secret=secret)


def comment(text: str) -> str:
    """Text for a `#` comment line of a script or manifest: one line, whatever it quotes (a config's file name
    may hold a line break, which would end the comment and start a command)."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def config_key(config: Path) -> str:
    """The ConfigMap key (and file name in the pod) of the config: Kubernetes allows [-._a-zA-Z0-9]+."""
    return re.sub(r"[^-._a-zA-Z0-9]", "_", config.name).lstrip(".") or "config.yml"


def _looks_local(value: str) -> bool:
    """A dataset or model path the trainer reads from disk (it exists here, or is written as a path), not a
    Hugging Face Hub id like `yahma/alpaca-cleaned`."""
    return (Path(value).exists() or value.startswith(("/", "./", "../", "~"))
            or value.endswith((".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")))


def volume_warnings(config: Path, cfg, claim: str, dist: Distribution) -> list[str]:
    """What the pods would not find or would lose: outputs written outside the volume, and local files (data,
    a local model) that must be copied onto it first. `cfg`: the trainer's Config, as envtool train read it."""
    lines = []
    for key in ("output_dir", "dataset_prepared_path"):
        value = str(getattr(cfg, key))
        if value.startswith("/") and not (value == WORK or value.startswith(WORK + "/")):
            lines.append(f"{config}: {key} {value} is outside the volume (the claim {claim} is mounted at {WORK}): "
                         f"what is written there is lost with the pod; use a relative path")
    local = []
    if _looks_local(cfg.base_model):
        local.append(("base_model", cfg.base_model))
    for i, ds in enumerate(cfg.datasets):
        if _looks_local(ds.path):
            local.append((f"datasets[{i}].path", ds.path))
    for key, value in local:
        inside = value if value.startswith("/") else f"{WORK}/{value.removeprefix('./')}"
        lines.append(f"{config}: {key} {value} is a local path: the pods read {inside}; copy it onto the claim "
                     f"{claim} first (e.g. kubectl cp into a pod that mounts it)")
    if dist.nnodes > 1:
        lines.append(f"--nnodes {dist.nnodes}: every pod mounts the claim {claim}, so it must be ReadWriteMany "
                     f"(rank 0 prepares the dataset there and the other nodes read it)")
    return lines


def write(path: Path, text: str, executable: bool = False) -> None:
    write_atomic(path, text, executable)


def job_name(config: Path) -> str:
    """A DNS-1123 name from the config's file name (Kubernetes object names; Slurm job names)."""
    name = re.sub(r"[^a-z0-9-]+", "-", config.stem.lower()).strip("-") or "train"
    return f"envtool-{name}"[:50].rstrip("-")


def _gpus(plan: Plan, dist: Distribution) -> int:
    return default_nproc(plan, dist) if plan.on_gpu else 0


def k8s_resource(plan: Plan) -> str:
    """The extended resource a pod asks for: nvidia.com/gpu, or the vendor's device plugin's (rocm.toml /
    intel.toml [container] k8s_resource: amd.com/gpu, gpu.intel.com/i915)."""
    vendor = plan.gpu.get("vendor")
    if vendor in ("amd", "intel"):
        # start-up: resolver.vendors imported only when this runs
        from .vendors import load

        v = load()
        return (v.rocm_container if vendor == "amd" else v.xpu_container).k8s_resource
    return "nvidia.com/gpu"


def sbatch(plan: Plan, launch: Launch, config: Path, dist: Distribution, output_dir: str = "outputs") -> str:
    """One task per node; each runs torchrun with --nproc-per-node = GPUs per node, all meeting at a c10d
    rendezvous on the first node of the allocation. `$SLURM_*` are expanded on each node by srun's shell."""
    gpus = _gpus(plan, dist)
    nproc = default_nproc(plan, dist)
    name = job_name(config)
    lines = [
        "#!/bin/bash",
        comment(f"# Written by `envtool train {config} --emit slurm` for {plan.gpu['name']}: torch "
                f"{plan.torch.version}+{plan.torch.variant}, {plan.attention}, {plan.precision}."),
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={dist.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines += [
        f"#SBATCH --cpus-per-task={max(4, 4 * nproc)}",
        f"#SBATCH --output={name}-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --export=ALL",
        f"# Before the time limit ({SIGNAL_LEAD_S} s) every task gets SIGUSR1: each rank stops after the same step "
        "with a checkpoint (exit 138);",
        "# the job is requeued and, started again, resumes from it. Preemption's SIGTERM does the same.",
        f"#SBATCH --signal=USR1@{SIGNAL_LEAD_S}",
        "#SBATCH --requeue",
        f"# {', '.join(SECRET_KEYS)}: from the environment sbatch runs in (exported to the job), never written here.",
        "set -euo pipefail",
        "",
        "# The rendezvous: the first node of the allocation hosts the c10d store.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export RDZV_ENDPOINT=\"$head_node:{RDZV_PORT}\"",
    ]
    for key, value in launch.env.items():
        lines.append(f"export {key}={shlex.quote(value)}")

    lines += ["# torchrun forwards SIGUSR1 too, and gives the ranks time to save before it kills them.",
              *(f"export {key}={shlex.quote(value if key != 'PET_SHUTDOWN_TIMEOUT' else str(SIGNAL_LEAD_S - 30))}"
                for key, value in TORCHRUN_ENV.items()),
              "# This shell outlives the signals (the tasks save, then it requeues the job).",
              "trap 'echo \"signal: the training saves a checkpoint and stops\"' TERM USR1",
              'started=$(mktemp "${TMPDIR:-/tmp}/envtool-start.XXXXXX")']
    config_path = str(config.resolve())
    torchrun = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={dist.nnodes}",
                "--rdzv-backend=c10d", '--rdzv-endpoint="$RDZV_ENDPOINT"', '--rdzv-id="$SLURM_JOB_ID"',
                '--node-rank="$SLURM_NODEID"', "-m", "trainer", "train"]
    if launch.kind == "image":
        lines += ["", f"# In the plan's image (pyxis/enroot), the working directory mounted at /work.",
                  f"srun --kill-on-bad-exit=1 --container-image={shlex.quote(launch.path)} "
                  f"--container-mounts=\"$PWD:/work\" --container-workdir=/work bash -c "
                  + shlex.quote(" ".join(["exec python", *torchrun,
                                          shlex.quote(str(config.resolve().relative_to(Path.cwd().resolve())))]))]
    else:
        lines += ["", comment(f"# The environment built for the plan ({launch.kind}: {launch.path}); it must be on a "
                              "shared filesystem."), f"cd {shlex.quote(str(Path.cwd()))}",
                  "srun --kill-on-bad-exit=1 bash -c "
                  + shlex.quote(" ".join([f"exec {shlex.quote(launch.python)}", *torchrun, shlex.quote(config_path)]))]
    lines[-1] += " || code=$?"
    stopped = shlex.quote(str(Path(output_dir) / "stopped.json"))
    lines += ["", "# Stopped by a signal (a checkpoint and output_dir/stopped.json written in this job): requeue; the "
              "next start resumes.",
              f'if [ {stopped} -nt "$started" ]; then',
              '    echo "stopped with a checkpoint: requeueing $SLURM_JOB_ID"',
              '    scontrol requeue "$SLURM_JOB_ID"',
              "fi",
              'exit "${code:-0}"']
    return "\n".join(lines) + "\n"


def quantity(size: str) -> str:
    """docker's shm size (8g, 512m) as a Kubernetes quantity (8Gi, 512Mi)."""
    m = re.fullmatch(r"(\d+)([kmgKMG])?[bB]?", size)
    if not m:
        raise BadInput(f"--shm-size {size}: use e.g. 8g or 512m")
    return m[1] + {"k": "Ki", "m": "Mi", "g": "Gi"}.get((m[2] or "").lower(), "")


def pytorchjob(plan: Plan, launch: Launch, config: Path, dist: Distribution, *, shm_size: str = "8g",
               hf_cache_claim: str = "envtool-hf-cache", work_claim: str = DEFAULT_PVC,
               secret: str = DEFAULT_SECRET) -> str:
    """A ConfigMap with the config and a kubeflow.org/v1 PyTorchJob: Master (node rank 0) and nnodes-1
    Workers, each a pod running torchrun with --nproc-per-node GPUs, joined by c10d at the master's service.
    The training operator sets MASTER_ADDR / MASTER_PORT / RANK in every replica. Every pod works in the claim
    `work_claim` at /work: the config's relative paths (output_dir, dataset_prepared_path, local data) are there."""
    # start-up: yaml, textwrap imported only when this runs
    import yaml

    gpus = _gpus(plan, dist)
    nproc = default_nproc(plan, dist)
    name = job_name(config)
    config_in_pod = f"/etc/envtool/{config_key(config)}"
    command = ["torchrun", f"--nproc-per-node={nproc}", f"--nnodes={dist.nnodes}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)", f"--rdzv-id={name}", "-m", "trainer", "train",
               config_in_pod]
    resources = {"limits": {k8s_resource(plan): gpus}} if gpus else {}
    container = {
        "name": "pytorch",  # the training operator finds the container by this name
        "image": launch.path,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": [{"name": "HF_HOME", "value": HF_HOME}, *({"name": k, "value": v} for k, v in plan.env.items()),
                *({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
                  for key in SECRET_KEYS)],
        "resources": resources,
        "workingDir": WORK,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "hf-cache", "mountPath": HF_HOME},
                         {"name": "work", "mountPath": WORK},
                         {"name": "config", "mountPath": "/etc/envtool", "readOnly": True}],
    }
    container["env"] += [{"name": k, "value": v if k != "PET_SHUTDOWN_TIMEOUT" else str(GRACE_S - 30)}
                         for k, v in TORCHRUN_ENV.items()]
    # SIGTERM (a drained node, a preempted pod) gives the ranks GRACE_S seconds to stop after the same step and save;
    # the restarted pod resumes from that checkpoint (output_dir/stopped.json on the work volume)
    pod = {"spec": {"terminationGracePeriodSeconds": GRACE_S, "containers": [container], "volumes": [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(shm_size)}},
        {"name": "hf-cache", "persistentVolumeClaim": {"claimName": hf_cache_claim}},
        {"name": "work", "persistentVolumeClaim": {"claimName": work_claim}},
        {"name": "config", "configMap": {"name": f"{name}-config"}},
    ]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if dist.nnodes > 1:
        replicas["Worker"] = {"replicas": dist.nnodes - 1, "restartPolicy": "OnFailure", "template": pod}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "envtool"},
                     "annotations": {"io.envtool.target": plan.target,
                                     "io.envtool.plan": f"{plan.gpu['name']}: torch {plan.torch.version}+"
                                                        f"{plan.torch.variant}, {plan.attention}, {plan.precision}"}},
        "spec": {"nprocPerNode": str(nproc), "runPolicy": {"cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": replicas},
    }
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
                  "data": {config_key(config): config.read_text()}}
    access = "ReadWriteMany: every pod mounts it" if dist.nnodes > 1 else "ReadWriteOnce is enough for one pod"
    import textwrap

    header = "".join(f"# {line}\n" for line in textwrap.wrap(comment(
        f"Written by `envtool train {config} --emit k8s` for {plan.gpu['name']}. Needs the Kubeflow training "
        f"operator, the image {launch.path} in a registry the cluster pulls from (envtool build --push), a "
        f"PersistentVolumeClaim {hf_cache_claim} for the Hugging Face cache, and the PersistentVolumeClaim "
        f"{work_claim} ({access}) mounted at {WORK}, the working directory: the config's relative paths "
        f"(output_dir, dataset_prepared_path, local data) are on it, so the model outlives the pods. Tokens "
        f"({', '.join(SECRET_KEYS)}) come from the Secret {secret}, when it has them: kubectl create secret "
        f"generic {secret} --from-literal=HF_TOKEN=...; they are never written here."), 110))
    return header + yaml.safe_dump_all([config_map, job], sort_keys=False)


def emit(training: Training, request: Request, dist: Distribution, sources, *, dry_run: bool, quiet: bool = False,
         say: Callable[[str], None] = lambda s: None) -> str | None:
    """Write the launcher for an existing engine (its environment built first unless dry_run). Returns the text
    when there is no `request.output` to write it to."""
    if not dry_run:
        prepare(training.launch, training.plan, sources, quiet=quiet, say=say)
    text = render(training, request, dist, warn=say)
    output, kind = request.output, request.kind
    if output is None:
        return text
    write(output, text, executable=kind == "slurm")
    say(f"wrote {output} ({'sbatch ' + str(output) if kind == 'slurm' else 'kubectl apply -f ' + str(output)})")
    return None
