"""`envtool train --emit slurm|k8s`: launchers for existing engines, checked as those engines would check them.

The PyTorchJob manifest is validated against the PyTorchJob CRD's own openAPIV3Schema (kubeflow/training-operator
v1.9.0, see data/pytorchjob-v1.schema.json), made strict the way `kubectl apply --validate=strict` is: a field
the schema does not declare is an error. The sbatch script must pass `bash -n`.
"""

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from .conftest import DATA, ENVTOOL

REPO = Path(__file__).resolve().parents[2]
A100 = ["--gpu", "a100", "--python", "3.11", "--platform", "x86_64"]


def strict(schema):
    """Unknown fields become errors (Kubernetes prunes them silently; strict validation refuses them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def schema():
    data = json.loads((DATA / "pytorchjob-v1.schema.json").read_text())
    assert "training-operator tag v1.9.0" in data.pop("$comment")
    return strict(data)


def emit(*args, cwd=REPO, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")}
    env["ENVTOOL_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([str(ENVTOOL), "train", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


@pytest.mark.slow
def test_k8s_manifest_validates_against_the_pytorchjob_schema(tmp_path, schema):
    out = emit("examples/a100.yml", *A100, "--nproc", "8", "--nnodes", "4", "--emit", "k8s", "--dry-run",
               tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    config_map, job = list(yaml.safe_load_all(out.stdout))
    jsonschema.validate(job, schema)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    pod = replicas["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch"
    # SIGTERM to the pod: 300 s to stop every rank after one step with a checkpoint; torchrun forwards and waits
    assert pod["terminationGracePeriodSeconds"] == 300
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" and env["PET_SHUTDOWN_TIMEOUT"] == "270"
    assert re.fullmatch(r"envtool-trainer:sm80-cu\d+-torch[\d.]+-py3\.11", container["image"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    command = container["command"]
    assert command[:3] == ["torchrun", "--nproc-per-node=8", "--nnodes=4"]
    assert "--rdzv-backend=c10d" in command and "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)" in command
    assert command[-1] == "/etc/envtool/a100.yml"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"} and mounts["dshm"] == "/dev/shm"
    assert mounts["hf-cache"] == "/home/trainer/.cache/huggingface"  # the image's HF_HOME, as `envtool run` mounts it
    assert config_map["kind"] == "ConfigMap" and config_map["data"]["a100.yml"] == (REPO / "examples/a100.yml").read_text()
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]


@pytest.mark.slow
def test_the_strict_schema_catches_what_a_cluster_would_refuse(tmp_path, schema):
    """The check can fail: a misspelt field, or a GPU count of the wrong type, is refused."""
    out = emit("examples/a100.yml", *A100, "--emit", "k8s", "--dry-run", tmp_path=tmp_path)
    job = list(yaml.safe_load_all(out.stdout))[1]
    jsonschema.validate(job, schema)
    assert "Worker" not in job["spec"]["pytorchReplicaSpecs"]  # one machine: a master alone
    typo = copy.deepcopy(job)
    typo["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)
    wrong = copy.deepcopy(job)
    wrong["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema)


def test_slurm_script_passes_bash_n_and_carries_the_rendezvous_and_gpus(tmp_path):
    script = tmp_path / "train.sbatch"
    out = emit("examples/a100.yml", *A100, "--nproc", "4", "--nnodes", "2", "--venv", str(tmp_path / "shared-venv"),
               "--emit", "slurm", "-o", str(script), "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert os.access(script, os.X_OK)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text and "#SBATCH --ntasks-per-node=1" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--rdzv-backend=c10d" in srun and '--rdzv-endpoint="$RDZV_ENDPOINT"' in srun
    assert "--nproc-per-node=4" in srun and "--nnodes=2" in srun
    assert str(tmp_path / "shared-venv" / "bin" / "python") in srun
    assert str(REPO / "examples" / "a100.yml") in srun
    assert re.search(r'^export RDZV_ENDPOINT="\$head_node:\d+"$', text, re.M)
    assert re.search(r"^export ENVTOOL_PLAN=\S+plan\.json$", text, re.M)


def test_the_slurm_script_runs_the_command_it_says(tmp_path):
    """Run the script's srun line with stand-ins for Slurm's commands: what reaches torchrun is what we meant
    (the $SLURM_* variables expanded on the node, the arguments intact)."""
    script = tmp_path / "train.sbatch"
    emit("examples/a100.yml", *A100, "--nnodes", "2", "--venv", str(tmp_path / "venv"), "--emit", "slurm", "-o",
         str(script), "--dry-run", tmp_path=tmp_path)
    bin_dir = tmp_path / "bin"
    (bin_dir / "../venv/bin").mkdir(parents=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for f in (bin_dir / "scontrol", bin_dir / "srun", python):
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "77",
           "SLURM_NODEID": "1"}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    assert args[:2] == ["-m", "torch.distributed.run"]
    assert {"--rdzv-endpoint=node-a:29500", "--rdzv-id=77", "--node-rank=1", "--nnodes=2"} <= set(args)
    assert args[-4:] == ["-m", "trainer", "train", str(REPO / "examples" / "a100.yml")]


def test_emit_refuses_what_it_cannot_write(tmp_path):
    out = emit("examples/a100.yml", *A100, "--emit", "nomad", tmp_path=tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == "envtool: error: --emit 'nomad': choose slurm or k8s"


def on_a_claim(pod: dict, path: str) -> str | None:
    """The PersistentVolumeClaim that holds `path` (as the trainer in the pod resolves it), if any."""
    import posixpath

    container = pod["containers"][0]
    where = posixpath.normpath(posixpath.join(container.get("workingDir", "/home/trainer"), path))
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    for mount in container["volumeMounts"]:
        if mount["name"] in claims and (where == mount["mountPath"] or where.startswith(mount["mountPath"] + "/")):
            return claims[mount["name"]]
    return None


@pytest.mark.slow
def test_k8s_pods_train_on_a_volume_so_outputs_and_prepared_data_outlive_them(tmp_path, schema):
    """A one-pod job keeps final/ (output_dir is on the claim, not in the container), and every node of a
    multi-node job reads the one prepared dataset; --pvc names the claim."""
    out = emit("examples/a100.yml", *A100, "--emit", "k8s", "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    config_map, job = list(yaml.safe_load_all(out.stdout))
    jsonschema.validate(job, schema)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    cfg = yaml.safe_load(config_map["data"]["a100.yml"])
    assert on_a_claim(pod, cfg["output_dir"] + "/final") == "envtool-work"
    assert on_a_claim(pod, cfg["dataset_prepared_path"]) == "envtool-work"
    assert "envtool-work" in out.stdout.split("apiVersion")[0]  # the header says the claim must exist
    assert out.stderr == ""  # a hub model and a hub dataset: nothing to copy, nothing to warn about

    out = emit("examples/a100.yml", *A100, "--nnodes", "3", "--emit", "k8s", "--pvc", "team-scratch", "--dry-run",
               tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    job = list(yaml.safe_load_all(out.stdout))[1]
    jsonschema.validate(job, schema)
    for role in ("Master", "Worker"):
        assert on_a_claim(job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"],
                          "last_run_prepared") == "team-scratch"
    assert "ReadWriteMany" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_k8s_warns_about_paths_the_pods_would_not_see(tmp_path):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.jsonl").write_text("{}\n")
    (work / "tiny-model").mkdir()
    cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    cfg.update(base_model="tiny-model", datasets=[{"path": "data/train.jsonl", "type": "alpaca"}],
               output_dir="/scratch/me/out", dataset_prepared_path="prepared")
    (work / "job.yml").write_text(yaml.safe_dump(cfg))
    out = emit("job.yml", "--gpu", "cpu", "--emit", "k8s", "--dry-run", cwd=work, tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    warnings = out.stderr.strip().splitlines()
    assert all(w.startswith("envtool: warning: job.yml: ") for w in warnings), warnings
    assert any("output_dir /scratch/me/out is outside the volume" in w and "lost with the pod" in w for w in warnings)
    assert any("base_model tiny-model is a local path: the pods read /work/tiny-model" in w for w in warnings)
    assert any("datasets[0].path data/train.jsonl is a local path: the pods read /work/data/train.jsonl" in w
               and "envtool-work" in w for w in warnings)
    assert len(warnings) == 3  # prepared (relative) is on the volume: no warning


@pytest.mark.parametrize("args, message", [
    (["--emit", "k8s", "--pvc", "Not_A_Name"], "--pvc 'Not_A_Name': a PersistentVolumeClaim name is lower-case"),
    (["--emit", "slurm", "--pvc", "scratch"], "--pvc goes with --emit k8s"),
    (["--pvc", "scratch"], "--pvc goes with --emit k8s"),
])
def test_pvc_is_checked(tmp_path, args, message):
    out = emit("examples/a100.yml", *A100, *args, "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_slurm_script_requeues_a_run_a_signal_stopped(tmp_path):
    """The script with stand-ins for srun/scontrol and a trainer that behaves as the real one does on SIGUSR1
    (tests/trainer/outputs/test_long_runs.py): it writes output_dir/stopped.json and exits non-zero. The script requeues
    the job exactly then; a run that fails without stopping, or a stopped.json from an earlier job, is not
    requeued. Its #SBATCH lines ask for the signal before the time limit and for requeueing."""
    config = tmp_path / "long.yml"
    config.write_text((REPO / "examples" / "a100.yml").read_text().replace("./outputs/qwen2.5-0.5b-lora",
                                                                          str(tmp_path / "out")))
    script = tmp_path / "train.sbatch"
    out = emit(str(config), *A100, "--venv", str(tmp_path / "venv"), "--emit", "slurm", "-o", str(script),
               "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    text = script.read_text()
    assert "#SBATCH --signal=USR1@300" in text.splitlines() and "#SBATCH --requeue" in text.splitlines()
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text.splitlines()
    bin_dir = tmp_path / "bin"
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    requeued = tmp_path / "requeued"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\n[ "$1" = requeue ] && echo "$2" >> {requeued}\n'
                                      "printf 'node-a\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    python = tmp_path / "venv" / "bin" / "python"
    for f in (bin_dir / "scontrol", bin_dir / "srun"):
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "77",
           "SLURM_NODEID": "0", "TMPDIR": str(tmp_path)}
    (tmp_path / "out").mkdir()
    for trainer, code, requeue in (
            (f'echo "{{}}" > {tmp_path}/out/stopped.json; exit 1', 1, ["77"]),  # stopped by a signal: requeued
            ("exit 1", 1, ["77"]),  # a failure, and stopped.json is from the earlier job: not requeued again
            ("exit 0", 0, ["77"])):
        python.write_text(f"#!/bin/sh\nsleep 0.01\n{trainer}\n")
        python.chmod(0o755)
        result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert result.returncode == code, result.stderr
        assert (requeued.read_text().split() if requeued.exists() else []) == requeue
