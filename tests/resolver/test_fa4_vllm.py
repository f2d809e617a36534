"""FlashAttention-4 and vLLM as planned components (issue 43).

FlashAttention-4 (`flash-attn-4`, `import flash_attn.cute`) is a beta backend: an H100 or B200 plan takes it when
asked (`--attention flash_attention_4`, or `fa4`), a plan that could run it says where it would be the default once a
final release is recorded, and the lock never installs it beside flash-attn 2 (both own `flash_attn/cute`). vLLM is
planned for GRPO configs with `trl.use_vllm: true`: the newest release whose torch pin, transformers range, Python and
CUDA major fit the plan, the plan made again on the torch a release pins where none fits, one line where none can.

The facts are checked against what PyPI served (tests/support/captured/, tests/resolver/data/upstream/: captured by
tests/resolver/data/upstream/capture.py and by hand, see SOURCES.md), never against typed copies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from email.parser import Parser
from pathlib import Path

import pytest
import tomlkit
import yaml
from packaging.version import Version

from resolver import hardware
from resolver import matrix as matrix_module
from resolver.errors import BadInput
from resolver.lock import Sources, pyproject_text, requirements
from resolver.matrix import load
from resolver.pipeline import PlanOptions, one_plan
from resolver.solve import Request, solve
from trainer import facts
from trainer.features import pin

from .conftest import ENVTOOL, run_envtool

CAPTURED = Path(__file__).parents[1] / "support" / "captured"
UPSTREAM = Path(__file__).parent / "data" / "upstream"
REPO_MATRICES = Path(matrix_module.__file__).resolve().parents[1] / "matrices"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def _fa4_info() -> dict:
    return json.loads((CAPTURED / "pypi.org-pypi-flash-attn-4-json-info.json").read_text())


def _wheel_members(filename: str) -> dict[str, str]:
    return json.loads((UPSTREAM / "wheels" / f"{filename}.json").read_text())


def _plan(gpu: str, driver: str | None = None, **opts):
    return one_plan(PlanOptions(gpu=gpu, driver=driver, python="3.11", platform="x86_64", **opts))


# ---------------------------------------------------------------------------- FlashAttention-4: the facts


def test_the_fa4_rows_are_what_pypi_says_of_flash_attn_4():
    """Version, beta, Requires-Python, no torch pin, CUDA 12 and 13 (its cu13 extra), and the GPUs its backward
    asserts (interface.py) -- each from the captured PyPI answer or wheel."""
    info = _fa4_info()
    m = load()
    impl = m.flash_attn_impl("fa4")
    release = m.newest_flash_attn("fa4")
    assert impl.package == info["name"] and release.version == info["version"]
    assert Version(release.version).is_prerelease and "Development Status :: 3 - Alpha" in info["classifiers"]
    assert release.min_python == re.search(r">=(\d+\.\d+)", info["requires_python"]).group(1)
    assert "torch" in info["requires_dist"] and not release.torch and not release.min_torch  # no version on torch
    assert release.cuda.get("13") == "cu13" and any('extra == "cu13"' in r for r in info["requires_dist"])
    assert "Hopper and Blackwell" in info["description_excerpt"]
    assert "from flash_attn.cute import" in info["description_excerpt"] and m.backend(impl.attention).module == \
        "flash_attn.cute"
    backward = (CAPTURED / "flash_attn_4-4.0.0b40-interface.py-arch-asserts.txt").read_text().splitlines()
    majors = [int(x) for x in re.search(r"in \[([\d, ]+)\]", next(b for b in backward if "Supported: 9.x, 10.x, 11.x, 12.x" in b)).group(1)
              .split(",")]
    backend = m.backend("flash_attention_4")
    assert (int(backend.min_cc.split(".")[0]), int(backend.max_cc.split(".")[0])) == (min(majors), max(majors))
    assert m.beta(backend) is release and not m.is_auto(backend)


def test_flash_attn_2_and_flash_attn_4_own_the_same_files():
    """flash_attn.toml `owns`: FA4's wheel RECORD and FA2's sdist file list both hold flash_attn/cute/__init__.py."""
    record = next(v for k, v in _wheel_members("flash_attn_4-4.0.0b40-py3-none-any.whl").items()
                  if k.endswith("RECORD"))
    fa4 = {line.split(",")[0] for line in record.splitlines() if line}
    fa2 = set((CAPTURED / "flash_attn-2.8.3.post1.tar.gz-SOURCES-flash_attn.txt").read_text().split())
    shared = {p.rsplit("/", 1)[0] for p in fa4 & fa2}
    assert shared == {"flash_attn/cute"}
    assert "flash_attn/__init__.py" not in fa4  # FA4 installs the namespace only: flash_attn/cute is the clash
    m = load()
    assert set(m.flash_attn_impl("fa4").owns) & set(m.flash_attn_impl("fa2").owns) == shared


# ---------------------------------------------------------------------------- FlashAttention-4: the plans


@pytest.mark.parametrize("gpu, name", [("h100", "fa4"), ("b200", "flash_attention_4")])
def test_an_h100_or_b200_plan_takes_fa4_when_asked(gpu, name):
    out = run_envtool("resolve", "--gpu", gpu, "--python", "3.11", "--platform", "x86_64", "--attention", name,
                      "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["attention"], plan["packing"]) == ("flash_attention_4", "varlen")
    assert plan["flash_attn"]["package"] == "flash-attn-4" and plan["packages"]["flash-attn-4"] == "4.0.0b40"
    assert plan["flash_attn"]["filename"] == "flash_attn_4-4.0.0b40-py3-none-any.whl"
    assert "flash-attn" not in plan["packages"] and "flash-attn-3" not in plan["packages"]
    assert any(r.startswith("flash_attention_4 (beta: flash-attn-4 4.0.0b40 is a pre-release") for r in plan["reasons"])


def test_fa4_below_its_floor_is_refused_in_one_line():
    out = run_envtool("resolve", "--gpu", "a100", "--python", "3.11", "--attention", "fa4")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "flash_attention_4 needs sm_90 to sm_121" in out.stderr and "NVIDIA A100" in out.stderr


def test_fa4_needs_a_transformers_that_runs_it():
    """transformers runs flash_attention_4 from 5.4.0 on: a torch whose stack row takes 4.57.6 gets no FA4."""
    out = run_envtool("resolve", "--gpu", "h100", "--python", "3.10", "--torch", "2.5", "--attention", "fa4")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "flash_attention_4 needs transformers >= 5.4.0; torch 2.5 + Python 3.10 takes transformers 4.57.6" \
        in out.stderr


def test_matrix_verify_checks_the_fa4_wheel_on_pypi():
    from resolver.verify import checks, wheel_matches

    found = [c for c in checks(load(), torch_index="https://torch.test/whl/{variant}", pypi="https://pypi.test")
             if c.match and c.match[0] == "flash-attn-4"]
    assert found and {c.kind for c in found} == {"pypi"}
    assert {c.url for c in found} == {"https://pypi.test/pypi/flash-attn-4/json"}
    assert {c.match[4] for c in found} == {"x86_64", "aarch64"}
    filename = _fa4_info()["urls"][0]["filename"]
    assert all(wheel_matches(filename, *c.match) for c in found), filename


def test_default_plans_say_where_fa4_would_be_the_default():
    b200 = "\n".join(_plan("b200").reasons)
    assert _plan("b200").attention != "flash_attention_4"
    assert ("flash_attention_4 (beta): not picked on its own while flash-attn-4's newest release 4.0.0b40 is a "
            "pre-release; it would be chosen by default on NVIDIA B200 (sm_100, Blackwell), before ") in b200
    h100 = _plan("h100")
    assert h100.attention == "flash_attention_3"
    assert ("on NVIDIA H100 (sm_90, Hopper) it would not be chosen by default even once final: it ranks after "
            "flash_attention_3") in "\n".join(h100.reasons)
    assert not any("flash_attention_4" in r for r in _plan("a100").reasons)  # below its floor: nothing to say


def test_a_final_flash_attn_4_release_makes_it_the_default_on_blackwell_not_on_hopper(tmp_path):
    """What the beta line promises: the same matrix with a final release recorded (as `matrix update` writes it)."""
    for name in matrix_module.FILES:
        shutil.copy2(REPO_MATRICES / f"{name}.toml", tmp_path / f"{name}.toml")
    doc = tomlkit.parse((tmp_path / "flash_attn.toml").read_text())
    next(r for r in doc["release"] if r["impl"] == "fa4")["version"] = "4.0.0"
    (tmp_path / "flash_attn.toml").write_text(tomlkit.dumps(doc))
    m = matrix_module.load(tmp_path)

    def plan(gpu):
        return solve(Request(gpu=hardware.lookup(gpu, m), driver=None, python="3.11", platform="x86_64",
                             target=gpu), m)

    b200 = plan("b200")
    assert (b200.attention, b200.flash_attn.package, b200.flash_attn.version) == ("flash_attention_4", "flash-attn-4",
                                                                                  "4.0.0")
    assert not any("(beta" in r for r in b200.reasons)
    assert plan("h100").attention == "flash_attention_3"  # FA3 ranks first where it runs
    assert plan("a100").attention != "flash_attention_4"


def test_the_lock_takes_fa4_from_the_environments_index_with_its_cuda_13_extra():
    m = load()
    plan = _plan("b200", driver="580.65.06", attention="fa4")
    assert plan.torch.cuda.startswith("13.")
    assert "flash-attn-4[cu13]==4.0.0b40" in requirements(plan, m)
    text = pyproject_text(plan, Sources(), "envtool_llm-0-py3-none-any.whl", m.no_build, m)
    assert "pypi.org" not in text and "flash-attn-4 =" not in text  # no source of its own: PyPI or --index-url
    cu12 = _plan("b200", driver="575.51.03", attention="fa4")
    assert cu12.torch.cuda.startswith("12.") and "flash-attn-4==4.0.0b40" in requirements(cu12, m)


def test_the_lock_refuses_flash_attn_2_beside_flash_attn_4():
    plan = _plan("h100", attention="fa4")
    both = plan._replace(packages={**plan.packages, "flash-attn": "2.8.3.post1"})
    with pytest.raises(BadInput, match=r"both install flash_attn/cute .*--attention flash_attention_2 or "
                                       r"--attention flash_attention_4"):
        requirements(both, load())


# ---------------------------------------------------------------------------- vLLM: the facts


def _vllm_metadata(version: str):
    path = next((UPSTREAM / "wheels").glob(f"vllm-{version}-*x86_64.whl.json"))
    members = json.loads(path.read_text())
    return Parser().parsestr(next(v for k, v in members.items() if k.endswith("METADATA")))


def test_the_vllm_rows_are_what_each_wheel_requires():
    rows = [r for r in facts.rows("packages", "package") if r["name"] == "vllm"]
    assert rows
    for row in rows:
        metadata = _vllm_metadata(row["version"])
        base = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
        assert f"torch{row['torch']}" in base, row["version"]
        transformers = next(r for r in base if r.startswith("transformers"))
        assert sorted(row["requires"]["transformers"].split(",")) == sorted(transformers[len("transformers"):]
                                                                             .split(","))
        assert row["python"] == metadata["Requires-Python"]
        assert row["cuda"] == "13" and any("[cu13]" in r for r in base)  # its kernels: CUDA 13 builds
    # the newest release of each (torch, transformers, Python) group: PyPI's 0.34.0 and 0.29.0 .. 0.31.0 included
    assert {r["version"] for r in rows} >= {"0.34.0", "0.30.0"}
    assert "0.29.0" not in {r["version"] for r in rows}  # the same pins as 0.30.0


def _plan_dict(torch: str, cuda: str | None, transformers: str = "5.23.0", python: str = "3.11") -> dict:
    return {"torch": {"version": torch, "cuda": cuda, "backend": "cuda" if cuda else "cpu"}, "python": python,
            "packages": {"torch": torch, "transformers": transformers}}


def test_vllm_pins_the_newest_release_whose_torch_stack_and_cuda_admit_the_plan():
    assert pin("vllm", _plan_dict("2.13.0", "13.0")).version == "0.30.0"  # 0.31/0.32 cap transformers < 5.18/5.20
    assert pin("vllm", _plan_dict("2.13.0", "13.0", transformers="5.19.0")).version == "0.32.0"
    assert pin("vllm", _plan_dict("2.11.0", "13.0")).version == "0.26.0"
    no = pin("vllm", _plan_dict("2.13.0", "12.9"))  # vLLM's kernels are built for PyPI's CUDA 13 torch
    assert no.version is None and "torch 2.13.0 (CUDA 12.9), transformers 5.23.0 and Python 3.11" in no.why
    assert "0.34.0: torch ==2.14.0, transformers<5.23.0,>=5.16.1, CUDA 13" in no.why
    cpu = pin("vllm", _plan_dict("2.15.0", None))
    assert cpu.version is None and cpu.why.startswith("vllm does not install on cpu (vLLM's PyPI wheels are CUDA")


# ---------------------------------------------------------------------------- vLLM: through `envtool train --dry-run`


def _grpo(tmp_path: Path, **trl) -> Path:
    path = tmp_path / "grpo.yml"
    path.write_text(yaml.safe_dump({
        "base_model": "org/model", "rl": "grpo", "adapter": "lora", "learning_rate": 1e-5, "micro_batch_size": 8,
        "datasets": [{"path": "org/prompts", "type": "rewards.prompt"}], "output_dir": str(tmp_path / "out"),
        "trl": {"use_vllm": True, "vllm_lora_sync": True, "reward_funcs": ["rewards.length"], **trl}}))
    return path


def _dry_run(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENVTOOL), "train", str(path), "--python", "3.11", "--platform", "x86_64", "--dry-run",
                           "--json", "--isolated", *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **OFFLINE}, cwd=path.parent)


@pytest.mark.slow  # four `envtool train --dry-run` runs
def test_a_grpo_config_with_use_vllm_gets_vllm_in_its_plan(tmp_path):
    path = _grpo(tmp_path)
    out = _dry_run(path, "--gpu", "h100", "--driver", "580.65.06")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    plan = found["plan"]
    assert plan["packages"]["vllm"] == "0.30.0" and plan["torch"]["version"] == "2.13.0"
    assert plan["torch"]["variant"] == "cu130" and plan["packages"]["transformers"] == "5.23.0"
    assert any(r.startswith("torch 2.13.0+cu130: for vllm 0.30.0, which trl.use_vllm: true in") and
               "its Requires-Dist pins torch==2.13.0, built for CUDA 13" in r for r in plan["reasons"])
    assert "trl.use_vllm: true: vllm 0.30.0, added to the plan for this config" in found["notes"]
    assert "torch" not in (plan.get("pinned") or {})  # the torch was vLLM's, not the command line's

    # no vLLM release fits a --torch 2.14 plan (vLLM pins 2.14.0, the matrix's 2.14 is 2.14.1): one line, trains
    out = _dry_run(path, "--gpu", "h100", "--torch", "2.14")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert "vllm" not in found["plan"]["packages"]
    line = next(n for n in found["notes"] if n.startswith("trl.use_vllm: true: vllm not in the plan"))
    assert "no recorded vllm release installs beside torch 2.14.1 (CUDA" in line and "0.34.0: torch ==2.14.0" in line

    # the CPU: vLLM is not installed, the server runs elsewhere
    out = _dry_run(path, "--gpu", "cpu")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert "vllm" not in found["plan"]["packages"]
    assert any(n.startswith("trl.use_vllm: true: vllm not in the plan for the CPU") and "CUDA builds" in n
               for n in found["notes"])

    # without use_vllm no vLLM
    out = _dry_run(_grpo(tmp_path, use_vllm=False, vllm_lora_sync=False), "--gpu", "h100")
    assert out.returncode == 0, out.stderr
    assert "vllm" not in json.loads(out.stdout)["plan"]["packages"]
