"""Axolotl's own example configs (copies in data/axolotl_examples/, each naming its source) validate unchanged
with no network, one trains with only the model and data swapped for local ones, and the long-tail keys of
Axolotl's examples do what they say: lora_model_dir, resize_token_embeddings_to_32x, use_reentrant,
ddp_find_unused_parameters, the legacy dtype keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import REPO, run_cli, train_losses
from trainer.cli import main
from trainer.config import parse_config

EXAMPLES = sorted((Path(__file__).parents[1] / "fixtures" / "axolotl_examples").glob("*.y*ml"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def test_each_copy_names_its_source():
    assert len(EXAMPLES) >= 8
    for path in EXAMPLES:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# source: github.com/axolotl-ai-cloud/axolotl/blob/") and "/examples/" in first


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_axolotl_example_validates_unchanged_offline(path, tmp_path):
    """validate reads no tokenizer or model: hub ids need no download, so it works with no network."""
    result = run_cli("validate", str(path), "--gpu", "a100", env=OFFLINE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "is valid" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3__qlora-1b.yml", "llama-3__instruct-lora-8b.yml", "gemma3__gemma-3-1b-qlora.yml"])
def test_qlora_and_8bit_examples_validate_for_a_t4(name, tmp_path):
    result = run_cli("validate", str(EXAMPLES[0].parent / name), "--gpu", "t4", env=OFFLINE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "bf16: auto -> fp16" in result.stdout and "bitsandbytes" in result.stdout


@pytest.mark.slow  # runs the bench script in a subprocess (~5 s of CPU: at the fast tier's limit under load)
def test_the_bench_script_counts_and_groups(tmp_path):
    """bench/axolotl_examples.py over a tiny git repo shaped like Axolotl's (no fetch)."""
    import subprocess

    repo = tmp_path / "axolotl"
    (repo / "examples" / "llama-3").mkdir(parents=True)
    (repo / "examples" / "archived").mkdir()
    (repo / "examples" / "cloud").mkdir()
    good = (EXAMPLES[0].parent / "llama-3__qlora-1b.yml").read_text()
    (repo / "examples" / "llama-3" / "qlora.yml").write_text(good)
    (repo / "examples" / "llama-3" / "dora.yml").write_text(good + "\nsage_attention: true\n")
    (repo / "examples" / "llama-3" / "vision.yml").write_text(good + "\nprocessor_type: AutoProcessor\n")
    (repo / "examples" / "archived" / "old.yml").write_text(good)
    (repo / "examples" / "cloud" / "modal.yaml").write_text("provider: modal\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    result = subprocess.run([__import__("sys").executable, str(REPO / "bench" / "axolotl_examples.py"),
                             str(repo / ".git")], capture_output=True, text=True, cwd=tmp_path,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO), **OFFLINE}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "1/2 example configs validate for --gpu a100 (50.0%)" in result.stdout
    assert "1 archived" in result.stdout and "1 vision/audio model" in result.stdout
    assert "   1  sage_attention: e.g. examples/llama-3/dora.yml" in result.stdout


@pytest.mark.slow
def test_qlora_example_trains_with_only_model_and_data_swapped(tiny_llama, alpaca_file, tmp_path):
    raw = yaml.safe_load((EXAMPLES[0].parent / "llama-3__qlora-1b.yml").read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"), max_steps=3, sequence_len=256,
               # a random tiny model starts at loss ln(vocab) ~ 6, above the example's watchdog threshold of 5
               loss_watchdog_threshold=20.0)
    raw["datasets"][0]["path"] = str(alpaca_file)
    config = tmp_path / "qlora-1b.yml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    assert sorted(train_losses(tmp_path / "out")) == [1, 2, 3]
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_lora_model_dir_starts_from_a_trained_adapter(make_config, tmp_path, capsys):
    import json

    first = tmp_path / "first"
    lora = dict(adapter="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"], val_set_size=0.25)
    assert main(["train", str(make_config("a.yml", output_dir=str(first), max_steps=3, **lora))]) == 0
    capsys.readouterr()
    # evaluating the first adapter, and a run that starts from it, see the same eval loss before any step
    assert main(["evaluate", str(make_config("a.yml", output_dir=str(first), **lora)), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)["eval_loss"]
    second = tmp_path / "second"
    config = make_config("b.yml", output_dir=str(second), max_steps=1, lora_model_dir=str(first / "final"),
                         eval_steps=1, learning_rate=1e-12, **lora)
    assert main(["train", str(config)]) == 0
    evals = [r["eval_loss"] for r in map(json.loads, (second / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    assert evals[-1] == pytest.approx(trained, rel=1e-5)  # lr 1e-12: one step leaves the adapter as it was
    base = tmp_path / "base"
    assert main(["train", str(make_config("c.yml", output_dir=str(base), max_steps=1, learning_rate=1e-12,
                                          **lora))]) == 0
    base_eval = [r["eval_loss"] for r in map(json.loads, (base / "metrics.jsonl").read_text().splitlines())
                 if "eval_loss" in r][-1]
    assert base_eval != pytest.approx(trained, rel=1e-5)  # and a fresh adapter is not the trained one
    bad = make_config("bad.yml", lora_model_dir=str(tmp_path / "nope"), **lora)
    assert main(["train", str(bad)]) == 2
    assert "lora_model_dir: cannot load an adapter from" in capsys.readouterr().err


@pytest.mark.slow
def test_resize_token_embeddings_to_32x(make_config, tmp_path):
    import json

    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), max_steps=1, tokens=["<x1>", "<x2>", "<x3>"],
                                          resize_token_embeddings_to_32x=True))]) == 0
    vocab = json.loads((out / "final" / "config.json").read_text())["vocab_size"]
    from transformers import AutoTokenizer

    assert vocab % 32 == 0 and len(AutoTokenizer.from_pretrained(out / "final")) <= vocab < len(
        AutoTokenizer.from_pretrained(out / "final")) + 32


@pytest.mark.slow
def test_use_reentrant_true_is_honoured_and_trains_the_same(make_config, tmp_path):
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    lora = dict(adapter="lora", lora_r=4, lora_target_linear=True, max_steps=2)
    plain, reentrant = tmp_path / "plain", tmp_path / "reentrant"
    assert main(["train", str(make_config("a.yml", output_dir=str(plain), **lora))]) == 0
    config = make_config("b.yml", output_dir=str(reentrant), gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": True}, **lora)
    assert main(["train", str(config)]) == 0
    a, b = train_losses(plain), train_losses(reentrant)
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a)
    cfg, _ = load_config(config)
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), AutoTokenizer.from_pretrained(cfg.base_model))
    layer = model.base_model.model.model.layers[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords["use_reentrant"] is True


def test_ddp_find_unused_parameters_reaches_ddp(make_config):
    from trainer.config import load_config
    from trainer.parallel.accelerator import make_accelerator
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(ddp_find_unused_parameters=True))
    accelerator = make_accelerator(cfg, adapt(cfg, gpu_from_name("cpu")))
    assert accelerator.ddp_handler.find_unused_parameters is True


def test_legacy_dtype_keys():
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}
    cfg, notes = parse_config({**base, "bfloat16": True})
    assert cfg.bf16 is True and any("bfloat16: true is the legacy spelling of bf16" in n for n in notes)
    assert parse_config({**base, "float16": True})[0].fp16 is True
    assert parse_config({**base, "float32": True})[0].bf16 is False
    assert parse_config({**base, "torch_dtype": "bfloat16"})[0].bf16 is True
    assert parse_config({**base, "torch_dtype": "torch.float16"})[0].fp16 is True


@pytest.mark.slow
def test_unsupported_keys_are_one_line_naming_key_and_reason(make_config, tmp_path):
    config = make_config(sage_attention=True)
    result = run_cli("validate", str(config), "--gpu", "a100")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: sage_attention: SageAttention is a quantized attention kernel")
    result = run_cli("validate", str(make_config("p.yml", plugins=["my.custom.Plugin"])), "--gpu", "a100")
    assert result.returncode == 2 and "plugins: my.custom.Plugin is a plugin module of your own" in result.stderr


@pytest.mark.slow
def test_lora_target_parameters_trains_lora_on_bare_parameters(make_config, tmp_path):
    """Axolotl's MoE examples put LoRA on expert parameters (peft's target_parameters); here on a dense weight."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), adapter="lora", lora_r=4, max_steps=2,
                                          lora_target_parameters=["mlp.down_proj.weight"]))]) == 0
    saved = load_file(out / "final" / "adapter_model.safetensors")
    assert saved and all("down_proj" in k and "lora_" in k for k in saved)


def test_rslora_and_dora_reach_peft(make_config):
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(adapter="lora", lora_r=4, lora_alpha=8, peft_use_rslora=True, peft_use_dora=True,
                                     lora_target_modules=["q_proj"]))
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), AutoTokenizer.from_pretrained(cfg.base_model))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(8 / 4 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    assert "default" in q.lora_magnitude_vector  # DoRA's magnitude


@pytest.mark.slow
@pytest.mark.parametrize("gpu, on", [("cpu", False), ("v100", False), ("t4", True), ("a100", True)])
def test_liger_and_cce_follow_where_triton_runs(make_config, gpu, on):
    config = make_config(plugins=["axolotl.integrations.liger.LigerPlugin",
                                  "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"],
                         liger_rope=True, liger_rms_norm=True, liger_glu_activation=True, cut_cross_entropy=True,
                         lora_mlp_kernel=True)
    result = run_cli("validate", str(config), "--gpu", gpu)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "lora_mlp_kernel: off (Axolotl's own LoRA triton kernels" in out
    assert "cut_cross_entropy: served by the trainer's own chunked cross-entropy" in out  # on every GPU and CPU
    if on:
        assert "liger_rope, liger_rms_norm, liger_glu_activation: on (liger-kernel's triton kernels)" in out
    else:
        why = "triton kernels need a GPU; running on CPU" if gpu == "cpu" else "triton's kernels need sm_75+"
        assert f"liger_rope, liger_rms_norm, liger_glu_activation: off ({why}" in out


@pytest.mark.slow
def test_the_plan_decides_liger(make_config, tmp_path):
    import json

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"gpu": {"name": "NVIDIA A100", "compute_capability": "8.0", "count": 1},
                                "precision": "bf16", "attention": "sdpa", "features": {"liger": False}}))
    result = run_cli("validate", str(make_config(liger_rms_norm=True)), "--plan", str(plan))
    assert result.returncode == 0, result.stderr
    assert "liger_rms_norm: off (the plan switches triton kernels off for this GPU" in result.stdout


@pytest.mark.slow
def test_liger_keys_train_on_cpu_with_the_kernels_off(make_config, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", str(make_config(output_dir=str(out), max_steps=1, liger_rms_norm=True,
                                          plugins=["axolotl.integrations.liger.LigerPlugin"]))]) == 0
    assert "note: liger_rms_norm: off (triton kernels need a GPU; running on CPU" in capsys.readouterr().err
