"""The Plan is typed both ways: what `to_json` writes, `from_json` reads back equal; the version is checked on
both sides (resolver and trainer), and the trainer finds the plan by one rule."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resolver.errors import BadInput
from resolver.pipeline import PlanOptions, make_plans
from resolver.plan import PLAN_VERSION, Plan

from .conftest import run_envtool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plans():
    return make_plans(PlanOptions(gpu="t4,a100,h100,cpu", python="3.11", platform="x86_64"))


def test_every_plan_reads_back_equal_with_its_types(plans):
    assert any(p.flash_attn for p in plans) and any(p.flash_attn is None for p in plans)
    for plan in plans:
        back = Plan.from_json(plan.to_json(explain=True))
        assert back == plan
        assert type(back.torch).__name__ == "TorchChoice" and back.torch.variant == plan.torch.variant
        assert back.flash_attn is None or back.flash_attn.wheel_url == plan.flash_attn.wheel_url
        assert all(type(r).__name__ == "Rejected" for r in back.rejected)
        assert json.loads(back.to_json()) == json.loads(plan.to_json())


@pytest.fixture(scope="module")
def vendor_plans():
    return make_plans(PlanOptions(gpu="mi300x,gfx950,max1550", python="3.11", platform="x86_64")) + \
        make_plans(PlanOptions(gpu="mps", python="3.11"))


def test_amd_intel_and_apple_plans_read_back_equal(vendor_plans):
    for plan in vendor_plans:
        assert Plan.from_json(plan.to_json(explain=True)) == plan
    assert [(p.device, p.torch.backend, p.gpu["vendor"], p.gpu["target"]) for p in vendor_plans] == [
        ("cuda", "rocm", "amd", "gfx942"), ("cuda", "rocm", "amd", "gfx950"), ("xpu", "xpu", "intel", "pvc"),
        ("mps", "mps", "apple", "mps")]
    assert vendor_plans[1].env == {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"} and vendor_plans[0].env == {}


def test_a_1_1_plan_reads_as_nvidia_or_cpu(plans):
    for plan in plans:
        data = plan.to_dict()
        old = {k: v for k, v in data.items() if k not in ("device", "env")}
        old["plan_version"] = "1.1"
        old["gpu"] = {k: v for k, v in data["gpu"].items() if k not in ("vendor", "target")}
        old["torch"] = {k: v for k, v in data["torch"].items() if k not in ("backend", "rocm")}
        assert Plan.from_dict(old) == plan._replace(rejected=[])


def test_plan_version_is_written_and_an_unknown_major_is_a_clear_error(plans):
    data = plans[0].to_dict()
    assert data["plan_version"] == PLAN_VERSION == "1.2"
    newer_minor = {**data, "plan_version": "1.7", "a_field_from_the_future": 1}
    newer_minor["torch"] = {**newer_minor["torch"], "another": "field"}
    assert Plan.from_dict(newer_minor) == plans[0]._replace(rejected=[])  # minor: new fields ignored
    older = {k: v for k, v in data.items() if k != "plan_version"}  # written before the field: 1.0
    assert Plan.from_dict(older) == plans[0]._replace(rejected=[])  # (rejected: only with --explain)
    # a 1.0 plan (before `packing`): flash-attn plans packed by cu_seqlens, the others by a mask
    for plan in plans:
        old = {k: v for k, v in plan.to_dict().items() if k not in ("packing", "mask_without_cudnn")}
        read = Plan.from_dict({**old, "plan_version": "1.0"})
        assert read.packing == ("varlen" if plan.attention.startswith("flash_attention") else "mask")
        assert read.mask_without_cudnn is False
    with pytest.raises(BadInput, match=r"has plan_version 2\.0; this envtool reads 1\.x plans"):
        Plan.from_dict({**data, "plan_version": "2.0"}, "plan.json")
    with pytest.raises(BadInput, match="lacks torch"):
        Plan.from_dict({k: v for k, v in data.items() if k != "torch"})


def test_install_refuses_a_lock_whose_plan_has_another_major_version(tmp_path, plans):
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "plan.json").write_text(json.dumps({**plans[0].to_dict(), "plan_version": "2.1"}))
    out = run_envtool("install", str(env_dir), "--venv", str(tmp_path / "venv"))
    assert out.returncode == 2
    assert "has plan_version 2.1; this envtool reads 1.x plans" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def find(cwd, env, *extra):
    """Which plan the trainer finds (its `source`), run as the trainer runs: a separate interpreter."""
    code = ("import json; from trainer.runtime.planfile import find_plan; f = find_plan(); "
            "print(json.dumps(None if f is None else [f[0]['target'], f[1]]))")
    out = subprocess.run([sys.executable, *extra, "-c", code], capture_output=True, text=True, cwd=cwd,
                         env={**{k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"},
                              "PYTHONPATH": str(REPO), **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_trainer_finds_the_plan_by_one_rule(tmp_path, plans):
    t4, a100, _, cpu = plans
    (tmp_path / "plan.json").write_text(cpu.to_json())
    (tmp_path / "explicit.json").write_text(a100.to_json())
    assert find(tmp_path, {}) == ["cpu", "./plan.json"]
    assert find(tmp_path, {"ENVTOOL_PLAN": str(tmp_path / "explicit.json")})[0] == "a100"
    # the environment's own copy, <sys.prefix>/plan.json, comes before ./plan.json
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    (venv / "plan.json").write_text(t4.to_json())
    python = str(venv / "bin" / "python")
    out = subprocess.run([python, "-c", "from trainer.runtime.planfile import find_plan; p, s = find_plan(); "
                          "print(p['target'], s)"], capture_output=True, text=True, cwd=tmp_path,
                         env={**{k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}, "PYTHONPATH": str(REPO)})
    assert out.stdout.split()[0] == "t4" and str(venv / "plan.json") in out.stdout, out.stderr
    out = subprocess.run([python, "-c", "from trainer.runtime.planfile import find_plan; print(find_plan()[0]['target'])"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO), "ENVTOOL_PLAN": str(tmp_path / "explicit.json")})
    assert out.stdout.strip() == "a100"


def test_the_trainer_refuses_an_unknown_major_version_in_one_line(tmp_path, plans):
    (tmp_path / "plan.json").write_text(json.dumps({**plans[0].to_dict(), "plan_version": "3.0"}))
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", "examples/tiny-cpu.yml"],
                         capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "ENVTOOL_PLAN": str(tmp_path / "plan.json")})
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: plan file {tmp_path / 'plan.json'} has plan_version 3.0; this trainer reads 1.x plans: "
                                  "make the plan again with this envtool, or train with the envtool that wrote it")


def test_resolve_still_imports_nothing_heavy_with_the_pipeline_module():
    script = ("import sys, runpy; sys.argv = ['envtool', 'resolve', '--gpu', 'a100', '--json']\n"
              "try:\n    runpy.run_module('resolver', run_name='__main__')\nexcept SystemExit:\n    pass\n"
              "heavy = {'torch', 'docker', 'requests', 'transformers', 'pydantic', 'rich', 'jinja2', 'yaml'}\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
    assert Plan.from_json(out.stdout).gpu["name"] == "NVIDIA A100"
