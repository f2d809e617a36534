"""`envtool train --image`: the tiny example trained inside the plan's image (real engine, real CPU torch)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.resolver.conftest import ENVTOOL
from tests.support.pypi import MIRROR

from .test_images import build_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
CPU = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64"]


def test_train_in_the_plans_image(tmp_path, docker_host, docker_client):
    from trainer.model.tiny import make_tiny_model

    plan, built = build_image(tmp_path / "build", docker_host, CPU, next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
    work = tmp_path / "work"
    work.mkdir()
    make_tiny_model(work / "tiny-model", family="llama", seed=0)
    shutil.copy(REPO / "examples" / "data" / "tiny-alpaca.jsonl", work / "data.jsonl")
    cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    cfg.update(base_model="tiny-model", datasets=[{"path": "data.jsonl", "type": "alpaca"}],
               dataset_prepared_path="prepared", output_dir="out", max_steps=3)
    for key in ("saves_per_epoch", "evals_per_epoch", "save_total_limit"):
        cfg.pop(key)
    (work / "config.yml").write_text(yaml.safe_dump(cfg))
    work.chmod(0o700)  # only this uid may write here (root's, a cluster account's, a CI runner's directory)
    # no DOCKER_HOST: envtool finds the engine .ci/setup started (.ci-cache/docker-host)
    env = {**{k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "DOCKER_HOST")},
           "ENVTOOL_CACHE_DIR": str(tmp_path / "cache"), "DOCKER_CONFIG": str(tmp_path / "docker-config")}
    dry = subprocess.run([str(ENVTOOL), "train", "config.yml", *CPU, "--image", "--dry-run", "--json"],
                         capture_output=True, text=True, env=env, cwd=work)
    assert dry.returncode == 0, dry.stderr
    launch = json.loads(dry.stdout)
    assert launch["environment"] == {"kind": "image", "path": built["tag"], "ready": True,
                                     "why": f"the plan's image {built['tag']}",
                                     "mounts": [{"host": str(work), "container": "/work", "read_only": True},
                                                {"host": str(work / "out"), "container": "/work/out",
                                                 "read_only": False},
                                                {"host": str(work / "prepared"), "container": "/work/prepared",
                                                 "read_only": False}]}
    assert launch["command"] == ["python", "-m", "trainer", "train", "config.yml"]
    out = subprocess.run([str(ENVTOOL), "train", "config.yml", *CPU, "--image"], capture_output=True, text=True,
                         env=env, cwd=work, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert (work / "out" / "final").is_dir()
    # the container ran as the invoking user: what it wrote is theirs
    written = [work / "out" / "final", *(work / "out").rglob("*"), *(work / "prepared").rglob("*")]
    assert {(p.stat().st_uid, p.stat().st_gid) for p in written} == {(os.getuid(), os.getgid())}
    # a config the trainer refuses: read by the trainer's reader before any container starts, its one line, exit 2
    (work / "bad.yml").write_text(yaml.safe_dump({**cfg, "learning_rate": "fast"}))
    bad = subprocess.run([str(ENVTOOL), "train", "bad.yml", *CPU, "--image"], capture_output=True, text=True,
                         env=env, cwd=work, timeout=600)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("envtool: error: bad.yml: learning_rate")
    assert len(bad.stderr.strip().splitlines()) == 1
    # two processes in the container, a data error they meet there: the trainer's line once and its exit code, as
    # with one process (no torchrun report, no traceback); then the next commands for the run that finished above
    # (a row past the first rows envtool checks before it starts: tests/resolver/test_dry_run_inputs.py)
    from trainer.data.inputs import FIRST_ROWS

    text = (work / "data.jsonl").read_text().splitlines()
    rows = (text * FIRST_ROWS)[:FIRST_ROWS]
    (work / "broken.jsonl").write_text("\n".join([*rows, '{"question": "no instruction"}']) + "\n")
    (work / "two.yml").write_text(yaml.safe_dump({**cfg, "datasets": [{"path": "broken.jsonl", "type": "alpaca"}],
                                                  "output_dir": "out-two"}))
    two = subprocess.run([str(ENVTOOL), "train", "two.yml", *CPU, "--image", "--nproc", "2"], capture_output=True,
                         text=True, env=env, cwd=work, timeout=600)
    assert two.returncode == 2, two.stderr[-3000:]
    errors = [line for line in two.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and re.fullmatch(r"error: dataset broken.jsonl: a row has no 'instruction' field "
                                             r"\(type alpaca\); columns are \[.*\]; map the field in the dataset's "
                                             r"config", errors[0]), two.stderr[-3000:]
    assert "ChildFailedError" not in two.stdout + two.stderr and "Traceback" not in two.stdout + two.stderr
    # a malformed row anywhere in the file: envtool's one line before any container starts
    (work / "malformed.jsonl").write_text("\n".join([*text[:2], text[2][:-1], *text[3:]]) + "\n")
    (work / "three.yml").write_text(yaml.safe_dump({**cfg, "datasets": [{"path": "malformed.jsonl", "type": "alpaca"}],
                                                    "output_dir": "out-three"}))
    three = subprocess.run([str(ENVTOOL), "train", "three.yml", *CPU, "--image", "--nproc", "2"], capture_output=True,
                           text=True, env=env, cwd=work, timeout=600)
    assert three.returncode == 2 and len(three.stderr.strip().splitlines()) == 1, three.stderr[-3000:]
    assert re.fullmatch(r"envtool: error: three.yml: dataset malformed.jsonl line 3, column \d+: not valid JSON "
                        r"\(Expecting ',' delimiter\)", three.stderr.strip()), three.stderr
    assert not (work / "out-three").exists()  # no container wrote (or made) its output_dir
    assert "envtool: next" in out.stderr and (
        f"envtool run --image {built['tag']} -v {work}:/work -w /work -- python -m trainer export config.yml "
        "--format gguf") in out.stderr
