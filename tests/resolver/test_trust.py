"""Trust and damage (issue 22), the resolver's side: nothing runs from data, no secret is written, no value
reaches a Dockerfile, a script or a manifest unchecked, and every bad value is one line through the command."""

import json
import os
import pickle
from pathlib import Path

import pytest

from resolver import matrix

from .conftest import run_envtool


class Payload:
    """Unpickling this runs `touch MARKER`: what a planted cache would do if envtool unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_matrix_cache_runs_nothing_and_is_rebuilt(tmp_path, monkeypatch):
    cache_home = tmp_path / "cache"
    with monkeypatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache_home))
        where = matrix._cache_path(matrix.matrix_dir())
    where.parent.mkdir(parents=True)
    marker = tmp_path / "pwned"
    # a pickle where the old envtool kept it (same key, .pickle), and a JSON in the current place shaped like
    # what object-rebuilding JSON readers (jsonpickle) execute
    where.with_suffix(".pickle").write_bytes(pickle.dumps(Payload(marker)))
    where.write_text(json.dumps({"py/reduce": [{"py/function": "os.system"}, {"py/tuple": [f"touch {marker}"]}],
                                 "version": "planted"}))
    out = run_envtool("resolve", "--gpu", "t4", "--json", XDG_CACHE_HOME=str(cache_home))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gpu"]["compute_capability"] == "7.5"
    assert not marker.exists()
    rebuilt = json.loads(where.read_text())  # replaced by the real matrix, as data
    assert rebuilt["version"] == matrix.load().version and rebuilt["gpus"]
    # a cache of the right shape but a wrong type in a row is not trusted either
    rebuilt["gpus"][0]["memory_gb"] = {"py/function": "os.system"}
    where.write_text(json.dumps(rebuilt))
    out = run_envtool("resolve", "--gpu", "t4", "--json", XDG_CACHE_HOME=str(cache_home))
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(where.read_text())["gpus"][0]["memory_gb"], float)
    assert not marker.exists()
