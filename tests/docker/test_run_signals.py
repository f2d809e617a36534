"""`envtool run` and `train --image` (issue 22): signals reach the container, the container is removed however envtool
ends, mounts are what the run needs (read-only unless it writes there), and bad values are one line before anything
starts."""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.resolver.conftest import ENVTOOL

from .conftest import BASE_IMAGE

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.docker
def test_signals_reach_the_container_which_is_removed_and_ro_mounts_stay_read_only(tmp_path, docker_host,
                                                                                    docker_client):
    """Before: SIGTERM to envtool exited 143 and left the container running for good; `-v H:C:ro` was a traceback."""
    data = tmp_path / "data"
    data.mkdir()
    env = {**os.environ, "DOCKER_HOST": docker_host}
    script = "echo started; touch /data/new 2>/dev/null && echo WRITABLE; exec sleep 300"
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        proc = subprocess.Popen([str(ENVTOOL), "run", "--image", BASE_IMAGE, "-v", f"{data}:/data:ro", "--",
                                 "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        assert proc.stdout.readline().strip() == "started"  # the container runs
        mine = {"label": f"io.envtool.run={proc.pid}"}
        assert len(docker_client.containers.list(filters=mine)) == 1
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err
        assert "Traceback" not in err and "WRITABLE" not in out
        assert docker_client.containers.list(all=True, filters=mine) == []  # removed, not orphaned
    assert list(data.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--gpus", "abc"], "--gpus 'abc': give 'all' or a count of GPUs"),
    (["--gpus", "0"], "--gpus '0': give 'all' or a count of GPUs"),
    (["-v", "{tmp}:/data:rx"], "the mode after the second ':' is ro or rw, not 'rx'"),
    (["-v", "{tmp}:data"], "the path in the container must be absolute"),
    (["-v", "{tmp}/absent:/data"], "/absent does not exist on this host"),
    (["--shm-size", ""], "--shm-size '': give a size such as 8g"),
    (["-e", "HF_TOKEN=hf_x"], "-e 'HF_TOKEN=hf_x': give the name of an environment variable"),
])
def test_bad_run_values_are_one_line_before_anything_starts(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # no engine is even asked
    out = subprocess.run([str(ENVTOOL), "run", "--image", "any", *args, "--", "true"], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


def test_train_image_mounts_the_work_dir_read_only_and_writes_only_outputs(tmp_path):
    """What `train --image` will mount, as --dry-run --json says (the run uses the same list; the real run is
    test_train_image.py): never the home directory."""
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(REPO / "examples" / "data" / "tiny-alpaca.jsonl", work / "data.jsonl")
    cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    cfg.update(datasets=[{"path": "data.jsonl", "type": "alpaca"}], dataset_prepared_path="prepared",
               output_dir=str(tmp_path / "elsewhere" / "out"))
    (work / "config.yml").write_text(yaml.safe_dump(cfg))
    cpu = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64", "--image"]
    env = {**{k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}, "DOCKER_HOST": "unix:///nonexistent",
           "ENVTOOL_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}
    out = subprocess.run([str(ENVTOOL), "train", "config.yml", *cpu, "--dry-run", "--json"], capture_output=True,
                         text=True, env=env, cwd=work, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["environment"]["mounts"] == [
        {"host": str(work), "container": "/work", "read_only": True},
        {"host": str(tmp_path / "elsewhere" / "out"), "container": str(tmp_path / "elsewhere" / "out"),
         "read_only": False},
        {"host": str(work / "prepared"), "container": "/work/prepared", "read_only": False}]
    # run from the home directory (or above it): refused in one line, before any image is built
    out = subprocess.run([str(ENVTOOL), "train", "config.yml", *cpu, "--dry-run"], capture_output=True,
                         text=True, env={**env, "HOME": str(work)}, cwd=work, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "holds your home directory" in out.stderr
