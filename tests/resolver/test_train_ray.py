"""`envtool train` with a use_ray config: one trainer process (Ray Train starts the workers), never torchrun."""

import json
from pathlib import Path

import pytest

from resolver.errors import BadInput
from resolver.launch import Distribution, launcher_nproc
from resolver.pipeline import PlanOptions, one_plan
from trainer.config import parse_config

from .test_train_cmd import CPU, config, env, tiny_model, train  # noqa: F401 (fixtures)

A100 = PlanOptions(gpu="a100", python="3.11", platform="x86_64")


def ray_config(**keys):
    """The trainer's own Config, as envtool train reads it (one reader)."""
    return parse_config({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], **keys})[0]


def test_a_multi_gpu_plan_launches_torchrun_but_one_process_for_use_ray():
    plan = one_plan(A100)
    eight = plan._replace(gpu={**plan.gpu, "count": 8})
    path = Path("ray.yml")
    assert launcher_nproc(eight, ray_config(), path, Distribution()) == 8  # torchrun, one per GPU
    assert launcher_nproc(eight, ray_config(use_ray=True, ray_num_workers=8), path, Distribution()) == 1
    with pytest.raises(BadInput, match="sets use_ray: the trainer starts its ray_num_workers Ray Train workers"):
        launcher_nproc(eight, ray_config(use_ray=True), path, Distribution(nproc=4))
    with pytest.raises(BadInput, match="drop --nproc/--nnodes"):
        launcher_nproc(eight, ray_config(use_ray=True), path, Distribution(nnodes=2, rdzv_endpoint="h:1"))


@pytest.mark.slow
def test_dry_run_json_is_one_trainer_process_with_a_note(tmp_path, config, env):  # noqa: F811
    out = train(str(config(use_ray=True, ray_num_workers=2)), *CPU, "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["command"][1:] == ["-m", "trainer", "train", str(tmp_path / "config.yml")]
    assert any(n.startswith("use_ray: one trainer process, which starts 2 Ray Train worker(s)") for n in result["notes"])
    refused = train(str(config(use_ray=True)), *CPU, "--nproc", "2", "--dry-run", "--json", env=env)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "sets use_ray" in refused.stderr
    emitted = train(str(config(use_ray=True)), "--gpu", "a100", "--python", "3.11", "--emit", "slurm", "--dry-run",
                    env=env)
    assert emitted.returncode == 2 and "these launchers run torchrun: set use_ray: false" in emitted.stderr
