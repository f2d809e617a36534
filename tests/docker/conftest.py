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


@pytest.fixture(autouse=True)
def remove_the_images_a_test_built(request):
    """Each image test builds a 0.4-1.9 GB image; remove what it added (tags, and the build stages left dangling)
    when it ends, so a run holds one image at a time on a CI machine's small disk."""
    if not {"docker_client", "docker_host"} & set(request.fixturenames):
        yield
        return
    client = request.getfixturevalue("docker_client")
    before = {image.id for image in client.images.list(all=True)}
    yield
    for image in client.images.list():
        if image.id not in before:
            for tag in image.tags:
                client.images.remove(tag, force=True)
    client.images.prune(filters={"dangling": True})
