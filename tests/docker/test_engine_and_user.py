"""`envtool run` (and so `envtool train --image`, `build`) with the engine `.ci/setup` started and no DOCKER_HOST
exported, and containers that run as the invoking user: a directory only root (or a cluster uid, a CI runner)
can write is writable in the container, and what it writes belongs to that user."""

import os
import subprocess

import pytest

from tests.resolver.conftest import ENVTOOL

from .conftest import BASE_IMAGE

pytestmark = pytest.mark.docker


def envtool(*args, env_extra=None, drop=("DOCKER_HOST", "DOCKER_CONTEXT"), docker_config=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if docker_config is not None:
        env["DOCKER_CONFIG"] = str(docker_config)  # the docker CLI's config: no current context unless one is made
    env.update(env_extra or {})
    return subprocess.run([str(ENVTOOL), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_run_finds_the_set_ups_engine_without_docker_host_and_runs_as_the_invoking_user(tmp_path, docker_host):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # only its owner (this uid) may write: uid 1000 may not
    out = envtool("run", "--image", BASE_IMAGE, "-v", f"{private}:/work", "--", "sh", "-c",
                  "id -u; id -g; touch /work/.lock && echo wrote", docker_config=tmp_path / "docker-config")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(os.getuid()), str(os.getgid()), "wrote"]
    lock = private / ".lock"
    assert (lock.stat().st_uid, lock.stat().st_gid) == (os.getuid(), os.getgid())

    # uid 1000, the trainer images' own user (`--user image` there), cannot write it: what every --image run hit
    refused = envtool("run", "--image", BASE_IMAGE, "--user", "1000:1000", "-v", f"{private}:/work", "--", "sh", "-c",
                      "touch /work/other", docker_config=tmp_path / "docker-config")
    assert refused.returncode != 0 and "Permission denied" in refused.stdout + refused.stderr


def test_run_as_another_uid_writes_files_that_uid_owns(tmp_path, docker_host):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4321, 4321)  # a cluster account's directory
    out = envtool("run", "--image", BASE_IMAGE, "--user", "4321:4321", "-v", f"{theirs}:/work", "--", "sh", "-c",
                    # torch, triton and the HF hub keep caches under HOME
                  'touch /work/out && echo "$HOME" && mkdir -p "$HOME/.cache" && echo ok',
                  docker_config=tmp_path / "docker-config")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/tmp/envtool-home", "ok"]
    assert (theirs / "out").stat().st_uid == 4321


def test_an_explicit_engine_that_does_not_answer_is_named_and_not_replaced(tmp_path, docker_host):
    dead = f"unix://{tmp_path / 'dead.sock'}"
    out = envtool("run", "--image", BASE_IMAGE, "--", "true", env_extra={"DOCKER_HOST": dead}, drop=())
    assert out.returncode == 1
    assert out.stderr.strip() == (f"envtool: error: no Docker engine answers at {dead} (DOCKER_HOST: no such socket): "
                                  "point DOCKER_HOST at an engine that answers, or unset it")
    # a docker context chosen with `docker context use` is explicit too, read as the docker CLI reads it
    config = tmp_path / "docker-config"
    for args in (["context", "create", "elsewhere", "--docker", f"host={dead}"], ["context", "use", "elsewhere"]):
        subprocess.run(["docker", *args], check=True, capture_output=True, env={**os.environ, "DOCKER_CONFIG": str(config)})
    out = envtool("run", "--image", BASE_IMAGE, "--", "true", docker_config=config)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert f"at {dead} (docker context elsewhere: no such socket)" in out.stderr


def test_a_bad_user_is_refused_before_anything_runs(tmp_path):
    out = envtool("run", "--image", BASE_IMAGE, "--user", "root; rm -rf /", "--", "true",
                  env_extra={"DOCKER_HOST": f"unix://{tmp_path / 'none.sock'}"}, drop=())
    assert out.returncode == 2
    assert out.stderr.strip() == ("envtool: error: --user 'root; rm -rf /': give UID[:GID], a user name, 'invoking' "
                                  "or 'image'")
