"""peft.loftq_config (LoftQ): the base weights become their NF4 quantization, LoRA holds the best rank-r
approximation of what quantization lost, training resumes exactly, and `evaluate` rebuilds that base."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.helpers import read_metrics, run_cli, train_then_resume
from trainer.cli import main
from trainer.config import load_config, parse_config
from trainer.errors import ConfigError

LOFTQ = dict(adapter="lora", lora_r=8, lora_alpha=8, lora_target_linear=True, peft={"loftq_config": {"loftq_bits": 4}})


def nf4_roundtrip(w):
    import bitsandbytes.functional as F

    q, state = F.quantize_4bit(w.float(), quant_type="nf4", blocksize=64, compress_statistics=False)
    return F.dequantize_4bit(q, state)


def test_loftq_initialisation(make_config, tiny_llama):
    from peft.tuners.lora import Linear
    from transformers import AutoModelForCausalLM

    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(**LOFTQ))
    original = dict(AutoModelForCausalLM.from_pretrained(tiny_llama).named_parameters())
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), load_tokenizer(cfg))
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    assert len(layers) == 2 * 7  # every linear layer of both blocks
    for name, layer in layers:
        key = name.removeprefix("base_model.model.") + ".weight"
        w, base = original[key].detach(), layer.get_base_layer().weight.detach()
        assert torch.equal(base, nf4_roundtrip(w))  # the base is W's NF4 quantization
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        residual = w - base
        s = torch.linalg.svdvals(residual)
        # B @ A is the best rank-8 approximation of the residual (Eckart-Young: what is left is the tail)
        left = torch.linalg.norm(residual - b @ a) ** 2
        assert float(left) == pytest.approx(float((s[8:] ** 2).sum()), rel=1e-3)
        assert torch.linalg.norm(w - base - layer.scaling["default"] * b @ a) < 0.9 * torch.linalg.norm(w - base)


@pytest.mark.slow
def test_loftq_trains_resumes_and_evaluates(make_config, tmp_path):
    full, _ = train_then_resume(main, make_config, tmp_path, checkpoint=2, max_steps=4, save_steps=2,
                                val_set_size=8, **LOFTQ)
    final_eval = [r["eval_loss"] for r in read_metrics(full) if "eval_loss" in r][-1]
    result = run_cli("evaluate", str(tmp_path / "full.yml"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["eval_loss"] == pytest.approx(final_eval, rel=1e-5)


def test_cpu_port_matches_peft():
    """peft's loftq_init itself is the oracle. Before peft 0.22 it computed on CUDA (or XPU) only, so its source runs
    here with the compute device set to the CPU and nothing else changed; from 0.22 it takes peft's infer_device(),
    the CPU here, and runs as it is. Any other form fails: peft changed, re-check the port."""
    import inspect
    import textwrap

    from peft.utils import loftq_utils

    from trainer.model.loftq import decompose

    source = textwrap.dedent(inspect.getsource(loftq_utils.loftq_init))
    device_lines = ('compute_device = "xpu" if is_xpu_available() else "cuda"', "compute_device = infer_device()")
    (device_line,) = [line for line in device_lines if line in source] or [None]
    assert device_line, "peft's loftq_init changed: re-check trainer/model/loftq.py against it"
    namespace = dict(vars(loftq_utils))
    exec(source.replace(device_line, 'compute_device = "cpu"'), namespace)
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    ours = decompose(w, 8)
    theirs = namespace["loftq_init"](w, num_bits=4, reduced_rank=8, num_iter=1)
    assert len(ours) == len(theirs) == 3
    for x, y in zip(ours, theirs):
        assert x.shape == y.shape and torch.allclose(x.cpu(), y.cpu(), atol=1e-4)


@pytest.mark.parametrize("extra", [{"adapter": None}, {"adapter": "lora", "load_in_8bit": True}])
def test_loftq_refusals(extra):
    raw = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], "peft": {"loftq_config": {"loftq_bits": 4}},
           **extra}
    with pytest.raises(ConfigError, match="loftq_config needs adapter: lora"):
        parse_config({k: v for k, v in raw.items() if v is not None})
