import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "envtool-test-base:bookworm"


@pytest.fixture(scope="session")
def docker_host():
    """The engine .ci/docker-up started (CI runs it in .ci/setup). A missing engine fails the tests: never a skip."""
    host = os.environ.get("DOCKER_HOST")
    recorded = ROOT / ".ci-cache" / "docker-host"
    if not host and recorded.is_file():
        host = recorded.read_text().strip()
    assert host, "no Docker engine: run `bash .ci/setup` (it runs .ci/docker-up)"
    import docker

    client = docker.DockerClient(base_url=host, version="auto")
    client.ping()
    assert client.images.list(name=BASE_IMAGE), f"{BASE_IMAGE} missing: run `bash .ci/docker-up`"
    return host


@pytest.fixture(scope="session")
def docker_client(docker_host):
    import docker

    return docker.DockerClient(base_url=docker_host, version="auto", timeout=600)
