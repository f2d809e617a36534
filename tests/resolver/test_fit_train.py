"""The fit estimate where a run starts, through the commands users type: `python -m trainer validate --json`'s "fit",
`envtool train --dry-run --json`'s "fit", `envtool train` stopping (exit 2) on does_not_fit, and
`micro_batch_size: auto` backing off from a real torch.OutOfMemoryError at the first step (raised by a forward
hook in the trainer's own process: the OOM a GPU raises, on the CPU) with the step's batch kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ENVTOOL

REPO = Path(__file__).resolve().parents[2]

# Meta-Llama-3-8B's config.json (https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json): the
# estimate reads nothing else, so a directory holding it stands for the model.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
             "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
             "use_cache": True, "vocab_size": 128256}

# Raises the error the CUDA caching allocator raises whenever the embedding sees more rows than OOM_ROWS, and
# logs every forward's rows: loaded by the trainer's Python at start (sitecustomize on PYTHONPATH).
INJECT = '''
import os
if os.environ.get("OOM_ROWS"):
    import torch

    def _oom(module, args):
        if isinstance(module, torch.nn.Embedding) and args and args[0].dim() == 2:
            rows = args[0].shape[0]
            with open(os.environ["OOM_LOG"], "a") as f:
                f.write(f"{rows}\\n")
            if rows > int(os.environ["OOM_ROWS"]):
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows * 2} GiB (injected)")

    torch.nn.modules.module.register_module_forward_pre_hook(_oom)
'''


def env_for(tmp_path, **extra):
    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU", "HF_HUB_OFFLINE")}
    environment.update(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                       TOKENIZERS_PARALLELISM="false", HF_HOME=str(tmp_path / "hf"), **extra)
    return environment


def big_config(tmp_path) -> Path:
    model = tmp_path / "llama3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    path = tmp_path / "big.yml"
    path.write_text(yaml.safe_dump({
        "base_model": str(model), "learning_rate": 2e-5, "datasets": [{"path": str(REPO / "examples/data/tiny-alpaca.jsonl"),
                                                 "type": "alpaca"}],
        "sequence_len": 2048, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "bf16": "auto",
        "output_dir": str(tmp_path / "big-out")}))
    return path


@pytest.mark.slow
def test_a_full_fine_tune_that_does_not_fit_is_stopped_before_anything_is_built(tmp_path):
    """Llama-3-8B full fine-tune, micro-batch 2 x 2048 tokens, no checkpointing, on an A100 80GB: validate and the
    dry run print the estimate (the same static terms; the dry run on the plan's attention); `envtool train` stops
    in one line naming the cheapest change, and with that change the run goes through."""
    config, env = big_config(tmp_path), env_for(tmp_path)
    validate = subprocess.run([sys.executable, "-m", "trainer", "validate", str(config), "--gpu", "a100-80gb",
                               "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert validate.returncode == 0, validate.stderr
    dry = subprocess.run([str(ENVTOOL), "train", str(config), "--gpu", "a100-80gb", "--dry-run", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert dry.returncode == 0, dry.stderr
    fit = json.loads(validate.stdout)["fit"]  # `envtool fit --json`'s object (tests/resolver/test_fit_cmd.py)
    planned = json.loads(dry.stdout)["fit"]  # on the plan's attention (validate and fit take the GPU's best)
    assert fit["verdict"] == planned["verdict"] == "does_not_fit"
    assert [fit["breakdown"][k] for k in ("weights", "gradients", "optimizer", "logits")] == \
        [planned["breakdown"][k] for k in ("weights", "gradients", "optimizer", "logits")]
    # Axolotl's regime under bf16: 2 + 2 + 4 (AdamW's states in bf16) bytes per parameter
    params = 8_030_261_248  # Meta-Llama-3-8B's parameter count (its model card: 8.03B)
    assert abs(fit["breakdown"]["weights"] + fit["breakdown"]["optimizer"] - 6 * params / 2 ** 30) < 0.01

    out = subprocess.run([str(ENVTOOL), "train", str(config), "--gpu", "a100-80gb"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    line, = out.stderr.splitlines()
    assert line.startswith(f"envtool: error: {config} does not fit: peak {planned['peak_gb']:.1f} GB per GPU")
    first = next(s for s in planned["suggestions"] if not s["kind"].startswith("max_"))
    assert f"cheapest change that fits: {first['text']}" in line and "--no-fit-check" in line
    assert not (tmp_path / "cache" / "envs").exists()  # nothing was built

    # the change it names fits, and the run is then let through to its dry run
    data = yaml.safe_load(config.read_text())
    data.update(first["change"])
    config.write_text(yaml.safe_dump(data))
    dry = subprocess.run([str(ENVTOOL), "train", str(config), "--gpu", "a100-80gb", "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert dry.returncode == 0 and "fit: peak" in dry.stdout and "does not fit" not in dry.stdout


@pytest.mark.slow
def test_micro_batch_size_auto_backs_off_from_an_out_of_memory_error_keeping_the_step_batch(tmp_path):
    """micro_batch_size: auto with gradient_accumulation_steps 4 on the CPU starts with the whole step's batch in
    one micro-batch; the forward raises torch.OutOfMemoryError above 1 row, so the trainer backs off 4 -> 2 -> 1
    (accumulation 1 -> 2 -> 4), trains, and records the split; every optimizer step still sees 4 rows."""
    from trainer.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-model", family="llama", seed=0)
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(INJECT)
    cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    cfg.update(base_model=str(model), datasets=[{"path": str(REPO / "examples/data/tiny-alpaca.jsonl"),
                                                 "type": "alpaca"}],
               dataset_prepared_path=str(tmp_path / "prepared"), output_dir=str(tmp_path / "out"), max_steps=2,
               micro_batch_size="auto", gradient_accumulation_steps=4, sample_packing=False, val_set_size=0,
               eval_sample_packing=False)
    for key in ("saves_per_epoch", "evals_per_epoch", "save_total_limit"):
        cfg.pop(key)
    config = tmp_path / "auto.yml"
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "rows.log"
    env = env_for(tmp_path, OOM_ROWS="1", OOM_LOG=str(log))
    env["PYTHONPATH"] = f"{tmp_path / 'inject'}{os.pathsep}{REPO}"
    out = subprocess.run([str(ENVTOOL), "train", str(config), "--gpu", "cpu"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "out of memory at micro_batch_size 4" in out.stderr and "out of memory at micro_batch_size 2" in out.stderr
    record = json.loads((tmp_path / "out" / "micro_batch.json").read_text())
    assert (record["micro_batch_size"], record["gradient_accumulation_steps"], record["batch_per_step"]) == (1, 4, 4)
    assert [b["micro_batch_size"] for b in record["backoffs"]] == [4, 2]
    assert "CUDA out of memory" in record["backoffs"][0]["error"]
    rows = [int(r) for r in log.read_text().split()]
    # the chunked loss's probe first (trainer/objectives/chunked_loss.py: the model's own logits and the head on the
    # swapped forward, one row of a few tokens each, once per model), then two refused forwards, then 2 steps x 4
    # micro-batches of 1 row
    assert rows == [1, 1] + [4, 2] + [1] * 8
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]
    assert (tmp_path / "out" / "final").is_dir()

    # without auto the same error is one line naming the split and the key that finds one, exit 1
    cfg.update(micro_batch_size=2, output_dir=str(tmp_path / "fixed"))
    config.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([str(ENVTOOL), "train", str(config), "--gpu", "cpu"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "error: out of memory at step 1 with micro_batch_size 2 x gradient_accumulation_steps 4: set "
        "micro_batch_size: auto to find the largest that fits (torch: CUDA out of memory. Tried to allocate 4 GiB "
        "(injected))")
