"""EAFT (use_eaft, eaft_alpha, eaft_k) and cls_model_config.

Oracle: Axolotl's eaft_loss (src/axolotl/monkeypatch/loss/eaft.py at 067b021c8b87) cannot be imported without
Axolotl's package; `axolotl_eaft_loss` below re-derives it token by token from that file, with the HF Trainer's
num_items_in_batch (the step's target tokens) as its divisor, as transformers 5.x's Trainer passes it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.trainer.helpers import read_metrics, run_cli, train_losses, train_then_resume
from trainer.cli import main
from trainer.config import load_config
from trainer.objectives.eaft import EaftLossSum, weighted_loss_sum


def axolotl_eaft_loss(logits, labels, num_items_in_batch, alpha, k):
    """Axolotl's loss, one target token at a time: CE(token) * (entropy of softmax(top-k logits)) ** alpha,
    summed and divided by num_items_in_batch."""
    total = 0.0
    for b in range(labels.shape[0]):
        for i in range(1, labels.shape[1]):
            target = int(labels[b, i])
            if target == -100:
                continue
            row = [float(x) for x in logits[b, i - 1]]
            top = sorted(row, reverse=True)[:min(k, len(row))]
            z = sum(math.exp(x - top[0]) for x in top)
            probs = [math.exp(x - top[0]) / z for x in top]
            entropy = -sum(p * math.log(p + 1e-10) for p in probs)
            log_z = top[0] + math.log(sum(math.exp(x - top[0]) for x in row))
            total += (log_z - row[target]) * entropy ** alpha
    return total / num_items_in_batch


@pytest.mark.parametrize("alpha,k", [(1.0, 20), (0.5, 3), (2.0, 50)])
def test_weighted_sum_over_step_tokens_is_axolotls_loss(alpha, k):
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 40) * 3
    labels = torch.randint(0, 40, (2, 7))
    labels[0, :3] = -100
    labels[1, 5] = -100
    n = int((labels[:, 1:] != -100).sum())
    ours = weighted_loss_sum(logits, labels, alpha, k) / n
    assert float(ours) == pytest.approx(axolotl_eaft_loss(logits, labels, n, alpha, k), rel=1e-5)


def test_loss_of_a_real_batch_on_the_tiny_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ours = EaftLossSum(1.0, 20)(model, {"input_ids": ids, "labels": labels})
    assert float(ours) / 16 == pytest.approx(axolotl_eaft_loss(logits, labels, 16, 1.0, 20), rel=1e-5)


def test_alpha_zero_is_plain_sft_and_alpha_one_changes_training(make_config, tmp_path, capsys):
    """With eaft_alpha 0 every weight is 1: the same losses as SFT (so the normalisation is SFT's, the step's
    target tokens over accumulation); with alpha 1 the losses differ."""
    common = dict(gradient_accumulation_steps=2, micro_batch_size=1, max_steps=3, val_set_size=4, eval_steps=3)
    runs = {}
    for name, extra in [("sft", {}), ("a0", dict(use_eaft=True, eaft_alpha=0.0)), ("a1", dict(use_eaft=True))]:
        out = tmp_path / name
        assert main(["train", str(make_config(f"{name}.yml", output_dir=str(out), **common, **extra))]) == 0
        runs[name] = (train_losses(out), [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r])
    assert runs["a0"][0] == pytest.approx(runs["sft"][0], rel=1e-5)
    assert runs["a0"][1] == pytest.approx(runs["sft"][1], rel=1e-5)
    assert all(abs(runs["a1"][0][s] - runs["sft"][0][s]) > 1e-3 for s in runs["sft"][0])
    ratio = runs["a1"][1][0] / runs["sft"][1][0]  # eval is EAFT-weighted too: each weight is below log(20)
    assert 1.5 < ratio < math.log(20)
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "a1.yml"), "--json"]) == 0  # `evaluate` scores with EAFT too
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["eval_loss"] == pytest.approx(runs["a1"][1][-1], rel=1e-5)


def test_eaft_resumes_exactly(make_config, tmp_path):
    train_then_resume(main, make_config, tmp_path, checkpoint=2, use_eaft=True, eaft_k=5, max_steps=4, save_steps=2)


def test_cls_model_config_picks_the_architecture(make_config):
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(cls_model_config="MistralConfig"))
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), load_tokenizer(cfg))
    assert type(model).__name__ == "MistralForCausalLM"  # the tiny model's files say llama
    cfg, _ = load_config(make_config(cls_model_config="LlamaConfig", model_config={"rms_norm_eps": 1e-3}))
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), load_tokenizer(cfg))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.rms_norm_eps == 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", [
    (dict(use_eaft=True, eaft_k=1), "eaft_k"),
    (dict(use_eaft=True, eaft_alpha=-1), "eaft_alpha"),
    (dict(cls_model_config="NoSuchConfig"), "cls_model_config: 'NoSuchConfig' is not a transformers config class"),
    (dict(cls_model_config="LlamaForCausalLM"), "cls_model_config"),
])
def test_bad_values_are_one_line_config_errors(make_config, extra, message):
    result = run_cli("validate", str(make_config(**extra)), "--gpu", "cpu")
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
