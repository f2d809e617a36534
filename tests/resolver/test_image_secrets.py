"""`envtool train --image`: the credentials a run reads (resolver/launch.py SECRET_KEYS: the Hub's token, wandb's key)
reach the container by name when the user's environment has them (docker reads their values; envtool never writes
them), and only those that are set; the same names --emit k8s takes from its Secret."""

from __future__ import annotations

import types

import pytest

from resolver import emit, launch


@pytest.mark.parametrize("present", [(), ("HF_TOKEN",), ("HF_TOKEN", "WANDB_API_KEY")])
def test_train_in_an_image_passes_the_credentials_that_are_set(monkeypatch, present):
    seen = {}

    def docker_run(image, command, options, **more):
        seen.update(vars(options), image=image)
        return 0

    import resolver.docker

    monkeypatch.setattr(resolver.docker, "run", docker_run)
    for name in launch.SECRET_KEYS:
        monkeypatch.delenv(name, raising=False)
    for name in present:
        monkeypatch.setenv(name, "a-value-envtool-must-not-copy")
    image = launch.Launch(kind="image", path="envtool/train:t4", ready=True, python="python",
                          command=["python", "-m", "trainer", "train", "c.yml"], env={}, why="", mounts=())
    assert launch.run(image, types.SimpleNamespace(on_gpu=False)) == 0
    assert seen["env_names"] == present
    assert "a-value-envtool-must-not-copy" not in repr(seen)
    assert emit.SECRET_KEYS == launch.SECRET_KEYS  # one list of credentials for images, sbatch and k8s
