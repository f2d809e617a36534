"""The multi-GPU preflight as a user meets it: `envtool doctor --multi-gpu` and the check a multi-process
`envtool train` runs before its first step, both under the real torchrun with gloo ranks on 127.0.0.1.

A rank that never joins, or joins and never reaches the all-reduce, is rehearsed with
ENVTOOL_PREFLIGHT_STALL_RANKS (that rank sleeps where a stuck one would hang); a container's small /dev/shm with a
captured `df` (tests/trainer/fixtures/preflight/docker-default-shm.df, its source in its header); the GPU's P2P with
the catalog's rows (matrices/gpus.toml p2p columns) and the driver a user gives.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from matrices import catalog
from trainer import facts
from trainer.parallel.preflight import SHM_MIN_BYTES, host_findings, shm_from_df

from .conftest import ENVTOOL, run_envtool
from .test_train_cmd import CPU, config, env, free_port, tiny_model, train  # noqa: F401 (fixtures)

DOCKER_DF = Path(__file__).resolve().parents[1] / "trainer" / "fixtures" / "preflight" / "docker-default-shm.df"
TORCHRUN_NOISE = ("ChildFailedError", "Traceback", "torch.distributed.elastic")


def by_check(result: dict) -> dict:
    return {f["check"]: f for f in result["findings"]}


@pytest.mark.slow
@pytest.mark.distributed
def test_doctor_multi_gpu_passes_a_healthy_pair_and_names_a_rank_that_never_joins(env):
    healthy = run_envtool("doctor", "--multi-gpu", *CPU, "--json", env=env, timeout=300)
    assert healthy.returncode == 0, healthy.stdout[-3000:] + healthy.stderr[-3000:]
    result = json.loads(healthy.stdout)
    pre = result["multi_gpu"]
    assert (pre["nproc"], pre["backend"], pre["joined"], pre["missing"], pre["ok"]) == (2, "gloo", [0, 1], [], True)
    assert pre["all_reduce"]["ok"] and pre["all_reduce"]["got"] == pre["all_reduce"]["expected"] == 3.0
    checks = by_check(result)
    assert checks["ranks"]["level"] == checks["all-reduce"]["level"] == "ok"
    assert {"shm", "memlock"} <= set(checks)

    # rank 1 never joins; /dev/shm is Docker's default; planning for two RTX 4090s on a driver that claims P2P
    stuck = run_envtool("doctor", "--multi-gpu", "--gpu", "rtx4090", "--driver", "535.54.03", "--nproc", "2",
                        "--timeout", "5", "--json", env=env, timeout=300, ENVTOOL_PREFLIGHT_STALL_RANKS="1",
                        ENVTOOL_PREFLIGHT_SHM_DF=str(DOCKER_DF))
    assert stuck.returncode == 1, stuck.stdout[-3000:] + stuck.stderr[-3000:]
    result = json.loads(stuck.stdout)
    assert (result["multi_gpu"]["joined"], result["multi_gpu"]["missing"]) == ([0], [1])
    checks = by_check(result)
    assert checks["ranks"]["level"] == "error"
    assert checks["ranks"]["message"].startswith("rank 1 did not join within 5 s")
    assert checks["shm"]["level"] == "warning" and "/dev/shm on this machine is 64 MiB" in checks["shm"]["message"]
    assert "--shm-size" in checks["shm"]["fix"]
    assert checks["p2p"]["level"] == "error" and "older than 550.40.07" in checks["p2p"]["message"]
    assert checks["p2p"]["fix"].startswith("export NCCL_P2P_DISABLE=1")


@pytest.mark.slow
@pytest.mark.distributed
def test_train_names_the_rank_that_never_reaches_the_first_collective_in_one_line(config, env, tmp_path):
    """Rank 1 joins and then hangs before any collective: without the preflight the run would wait ddp_timeout
    (30 min) in its first collective; with it, one line naming rank 1, exit 1, nothing trained."""
    path = config(preflight_timeout=15)
    out = train(str(path), *CPU, "--nproc", "2", env={**env, "ENVTOOL_PREFLIGHT_STALL_RANKS": "1:all-reduce"})
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert errors == [out.stderr.rstrip().splitlines()[-1]], out.stderr[-3000:]
    assert errors[0].startswith("error: preflight: rank 1 joined but did not reach the all-reduce within 15 s")
    assert not any(noise in out.stderr for noise in TORCHRUN_NOISE), out.stderr[-3000:]
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_doctor_across_machines_finds_the_output_dir_another_machine_does_not_see(config, env, tmp_path):
    """Two launchers on one host form a 2-machine job (c10d rendezvous), each in its own working directory, as
    machines without a shared filesystem are: the config's relative output_dir and dataset_prepared_path are
    not the same directories on machine 1. (The same check passing is part of every multi-machine train, e.g.
    test_train_cmd's two launchers.)"""
    path = config(output_dir="out", dataset_prepared_path="prepared")
    endpoint = f"127.0.0.1:{free_port()}"
    homes = [tmp_path / "machine-a", tmp_path / "machine-b"]
    launchers = []
    for rank, home in enumerate(homes):
        home.mkdir()
        launchers.append(subprocess.Popen(
            [str(ENVTOOL), "doctor", "--multi-gpu", *CPU, "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
             "--rdzv-endpoint", endpoint, "--config", str(path), "--timeout", "15", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=home))
    results = [p.communicate(timeout=420) for p in launchers]
    for p, (out, err) in zip(launchers, results):
        assert p.returncode == 1, out[-2000:] + err[-2000:]
        checks = by_check(json.loads(out))
        assert checks["ranks"]["level"] == checks["all-reduce"]["level"] == "ok"
        assert checks["shared-storage"]["level"] == "error"
        message = checks["shared-storage"]["message"]
        # c10d's rendezvous numbers the machines in the order they join, not by --node-rank: either may be machine 1
        assert any(f"machine 1 does not see output_dir out ({one / 'out'} here" in message and str(zero / "out") in message
                   for zero, one in (homes, homes[::-1])), message
    assert not any(home.joinpath(name).exists() for home in homes for name in ("out", "prepared"))  # nothing left


def test_a_containers_shm_is_read_from_df_and_judged_by_the_backend():
    shm = shm_from_df(DOCKER_DF.read_text())
    assert shm == 64 * 2**20 < SHM_MIN_BYTES
    assert shm_from_df("Filesystem 1B-blocks Used Available Use% Mounted on\n"
                       "tmpfs 8589934592 0 8589934592 0% /dev/shm\n") == 8 * 2**30
    facts_ = {"host": "node-a", "shm_bytes": shm, "memlock_bytes": 65536, "rdma_devices": ["mlx5_0"]}
    on_gpus = {f["check"]: f for f in host_findings({0: facts_}, "nccl")}
    assert on_gpus["shm"]["level"] == "error" and "failed to extend /dev/shm" in on_gpus["shm"]["message"]
    assert on_gpus["memlock"]["level"] == "error" and "mlx5_0" in on_gpus["memlock"]["message"]
    on_cpu = {f["check"]: f for f in host_findings({0: {**facts_, "rdma_devices": []}}, "gloo")}
    assert (on_cpu["shm"]["level"], on_cpu["memlock"]["level"]) == ("warning", "ok")


@pytest.mark.parametrize("name, driver, level", [
    ("NVIDIA GeForce RTX 4090", "535.54.03", "error"),  # claims P2P it lacks: NCCL hangs
    ("NVIDIA GeForce RTX 4080", None, "warning"),  # driver unknown: cannot be ruled out
    ("NVIDIA GeForce RTX 4090", "550.40.07", "ok"),  # says no P2P: NCCL goes through host memory itself
    ("NVIDIA GeForce RTX 5090", None, "ok"),
    ("NVIDIA H100 80GB HBM3", "535.54.03", None),  # nothing recorded: the driver's own answer is reported
])
def test_the_catalog_p2p_column_advises(name, driver, level):
    advice = catalog.p2p_advice(catalog.find_gpu(name, facts.rows("gpus", "gpu")), driver)
    assert (advice[0] if advice else None) == level
    if level == "error":
        assert "NCCL_P2P_DISABLE=1" in advice[2]
