"""The command line as a user and a script see it: the --json contract, tables, errors, exit codes."""

import json

import pytest

from .conftest import DATA, FAKES, run_envtool, write_nvidia_smi

# The --json contract (README, "The --json contract"): exactly these keys, so an addition is a decision
# recorded here and in the README, never an accident.
TOP_LEVEL = {"gpu", "driver", "python", "platform", "torch", "attention", "flash_attn", "precision", "triton",
             "features", "packages", "reasons", "matrix_version", "target", "packing", "mask_without_cudnn",
             "device", "env", "plan_version"}
CONTRACT = {
    "gpu": {"name", "compute_capability", "arch", "count", "memory_gb", "source", "bf16", "vendor", "target"},
    "driver": {"version", "max_cuda"},
    "torch": {"version", "cuda", "variant", "index_url", "min_driver", "backend", "rocm"},
    "features": {"torch_compile", "liger"},
}
FLASH_ATTN = {"version", "package", "filename", "wheel_url", "index_url"}


def resolve_json(*args, **env):
    out = run_envtool("resolve", "--json", *args, **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_json_contract_for_t4():
    plan = resolve_json("--gpu", "t4", "--python", "3.11")
    assert set(plan) == TOP_LEVEL
    for key, fields in CONTRACT.items():
        assert set(plan[key]) == fields, (key, plan[key])
    assert plan["gpu"]["compute_capability"] == "7.5" and plan["gpu"]["arch"] == "turing"
    assert plan["torch"]["cuda"] == "12.6" and plan["torch"]["variant"] == "cu126"
    assert plan["attention"] == "sdpa" and plan["flash_attn"] is None and plan["precision"] == "fp16"
    assert plan["packing"] == "mask" and plan["mask_without_cudnn"] is False  # Turing: no varlen kernel runs
    assert isinstance(plan["reasons"], list) and all(isinstance(r, str) for r in plan["reasons"])
    assert "rejected" not in plan


def test_json_for_sm80_with_a_driver():
    plan = resolve_json("--gpu", "sm_80", "--driver", "550.54.14", "--python", "3.11")
    assert plan["driver"] == {"version": "550.54.14", "max_cuda": "12.4"}
    assert (plan["attention"], plan["packing"], plan["precision"]) == ("sdpa", "varlen", "bf16")
    assert plan["flash_attn"] is None


def test_json_for_hopper_names_the_flash_attn_3_wheel_and_its_index():
    plan = resolve_json("--gpu", "h100", "--driver", "580.65.06", "--python", "3.11")
    assert (plan["attention"], plan["packing"]) == ("flash_attention_3", "varlen")
    assert set(plan["flash_attn"]) == FLASH_ATTN
    fa = plan["flash_attn"]
    assert fa["package"] == "flash-attn-3" and fa["index_url"] == plan["torch"]["index_url"]
    assert fa["wheel_url"] == f"https://download.pytorch.org/whl/{plan['torch']['variant']}/{fa['filename']}"
    fa2 = resolve_json("--gpu", "a100", "--attention", "flash_attention_2", "--python", "3.11")["flash_attn"]
    assert fa2["index_url"] is None  # a release asset: uv takes the URL
    assert fa2["wheel_url"].startswith("https://github.com/Dao-AILab/flash-attention/releases/download/")


def test_several_targets_give_a_list():
    plans = resolve_json("--gpu", "t4,v100,a100", "--python", "3.11")
    assert [p["gpu"]["arch"] for p in plans] == ["turing", "volta", "ampere"]
    assert [p["target"] for p in plans] == ["t4", "v100", "a100"]


def test_github_matrix_format():
    out = run_envtool("resolve", "--gpu", "t4,v100,a100", "--python", "3.11", "--format", "github")
    assert out.returncode == 0, out.stderr
    matrix = json.loads(out.stdout)
    rows = {row["target"]: row for row in matrix["include"]}
    assert set(rows) == {"t4", "v100", "a100"}
    assert rows["t4"]["image"] == f"envtool-trainer:sm75-{rows['t4']['variant']}-torch" \
        f"{'.'.join(rows['t4']['torch'].split('.')[:2])}-py3.11"
    assert rows["a100"]["attention"] == "sdpa" and rows["v100"]["precision"] == "fp16"


def test_table_output_shows_choices_and_reasons():
    out = run_envtool("resolve", "--gpu", "v100", "--torch", "2.8", "--explain", "--python", "3.11",
                      COLUMNS="200")
    assert out.returncode == 0, out.stderr
    assert "envtool plan for Tesla V100" in out.stdout
    assert "2.8.0+cu12" in out.stdout
    assert "Candidates not taken" in out.stdout and "--torch 2.8 excludes" in out.stdout
    assert "triton kernels (torch.compile, liger) are off" in out.stdout


def test_explain_json_lists_rejections():
    plan = resolve_json("--gpu", "v100", "--explain", "--python", "3.11")
    assert any("cu130" == r["variant"] and r["rule"] == "cuda_major_supports_gpu" and "sm_70" in r["reason"]
               for r in plan["rejected"])


@pytest.mark.parametrize("args, message", [
    (["--gpu", "a101"], "envtool: error: unknown GPU 'a101'; did you mean"),
    (["--gpu", "v100", "--cuda", "13.0"], "CUDA 13 torch builds carry no sm_70 code"),
    (["--gpu", "t4", "--driver", "550.x"], "--driver '550.x' is not an NVIDIA driver version"),
    (["--gpu", "t4", "--torch", "latest"], "--torch 'latest' is not a version"),
    (["--gpu", "t4", "--format", "yaml"], "--format 'yaml': choose table, json, github or markdown"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = run_envtool("resolve", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_debug_shows_the_traceback():
    out = run_envtool("--debug", "resolve", "--gpu", "a101")
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "BadInput" in out.stderr


def test_auto_detects_through_nvidia_smi(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_nvidia_smi(bin_dir, "nvidia-smi-t4.csv")
    plan = resolve_json("--gpu", "auto", "--python", "3.11", PATH=f"{bin_dir}:/usr/bin:/bin",
                        PYTHONPATH=str(FAKES))
    assert plan["gpu"]["source"] == "nvidia-smi" and plan["gpu"]["name"] == "Tesla T4"
    assert plan["driver"]["version"] == "535.104.05"
    assert plan["torch"]["variant"] == "cu126"
    assert "NVML: NVML Shared Library Not Found" in plan["reasons"]


def test_auto_through_nvml_with_mixed_gpus():
    spec = {"driver": "560.35.03", "gpus": [{"name": "NVIDIA A100-PCIE-40GB", "cc": "8.0", "memory_mib": 40960},
                                            {"name": "Tesla V100-PCIE-16GB", "cc": "7.0", "memory_mib": 16384}]}
    plan = resolve_json("--gpu", "auto", "--python", "3.11", PYTHONPATH=str(FAKES), FAKE_NVML=json.dumps(spec))
    assert plan["gpu"]["compute_capability"] == "7.0" and plan["gpu"]["count"] == 2
    assert plan["attention"] == "sdpa"
    assert any("planning for the lowest" in r for r in plan["reasons"])


def test_auto_without_gpu_is_a_cpu_plan(tmp_path):
    plan = resolve_json("--gpu", "auto", "--python", "3.11", PATH="/usr/bin:/bin", PYTHONPATH=str(FAKES),
                        ENVTOOL_GPU=None)
    assert plan["torch"]["variant"] == "cpu" and plan["precision"] == "fp32"


def test_env_overrides_for_another_run_host():
    plan = resolve_json("--gpu", "auto", "--python", "3.11", ENVTOOL_GPU="v100", ENVTOOL_DRIVER_VERSION="550.54.14")
    assert plan["gpu"]["name"] == "Tesla V100" and plan["driver"]["version"] == "550.54.14"


def test_gpus_lists_the_catalog():
    out = run_envtool("gpus", "--json")
    rows = json.loads(out.stdout)
    t4 = next(r for r in rows if r["name"] == "Tesla T4")
    assert t4["compute_capability"] == "7.5" and "t4" in t4["aliases"] and t4["bf16"] is False
    table = run_envtool("gpus", COLUMNS="200")
    assert "Tesla T4" in table.stdout and "turing" in table.stdout


def test_help_explains():
    out = run_envtool("resolve", "--help", COLUMNS="200")
    assert out.returncode == 0
    assert "--gpu" in out.stdout and "compute capability" in out.stdout and "--explain" in out.stdout


def test_mirror_urls_replace_the_public_ones():
    mirrors = {"ENVTOOL_TORCH_INDEX_URL": "http://127.0.0.1:8080/torch/{variant}/",
               "ENVTOOL_FLASH_ATTN_URL": "http://127.0.0.1:8080/fa/{version}/{filename}"}
    plan = resolve_json("--gpu", "a100", "--attention", "flash_attention_2", "--python", "3.11", **mirrors)
    assert plan["torch"]["index_url"] == f"http://127.0.0.1:8080/torch/{plan['torch']['variant']}/"
    assert plan["flash_attn"]["wheel_url"] == (f"http://127.0.0.1:8080/fa/{plan['flash_attn']['version']}/"
                                               f"{plan['flash_attn']['filename']}")
    hopper = resolve_json("--gpu", "h100", "--python", "3.11", **mirrors)  # FA3 lives on the torch index: its mirror
    assert hopper["flash_attn"]["index_url"] == hopper["torch"]["index_url"] == (
        f"http://127.0.0.1:8080/torch/{hopper['torch']['variant']}/")


def test_resolve_imports_nothing_heavy():
    """resolve must start fast: no torch, docker, requests, transformers, pydantic or rich on its path."""
    script = ("import sys, runpy; sys.argv = ['envtool', 'resolve', '--gpu', 't4', '--json']\n"
              "try:\n    runpy.run_module('resolver', run_name='__main__')\nexcept SystemExit:\n    pass\n"
              "heavy = {'torch', 'docker', 'requests', 'transformers', 'pydantic', 'rich', 'jinja2'}\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy), file=sys.stderr)")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
    assert json.loads(out.stdout)["gpu"]["name"] == "Tesla T4"


def test_readme_plan_table_is_what_the_matrices_give_today():
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = list(re.finditer(r"<!-- plans:begin -->\n(.*?)\n<!-- plans:end -->", readme, re.S))
    assert len(blocks) == 2  # driver unknown; a CUDA 13 driver
    for block in blocks:  # each table is the output of the last `envtool resolve ... --format markdown` before it
        command = re.findall(r"`envtool resolve --gpu\s+([^`]*?--format markdown)`", readme[:block.start()])[-1]
        out = run_envtool("resolve", "--gpu", *command.split())
        assert out.returncode == 0, out.stderr
        assert block.group(1) == out.stdout.strip(), (f"README's plan table for `{command}` is stale: paste the "
                                                      f"command's output between the markers")
