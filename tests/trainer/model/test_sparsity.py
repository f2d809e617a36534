"""Sparse fine-tuning (plugins: [LLMCompressorPlugin], llmcompressor: ConstantPruningModifier): the targeted
weights keep exactly the zeros they start with, everything else trains, resume is exact, the final model is sparse.

llmcompressor cannot be installed next to the tested transformers (it pins transformers<=5.17), so the oracle
for its mask handling (weight *= mask after each optimizer step, mask = |w| > 1e-8 taken at train begin) is
the same run without the plugin: after the first step the sparse run's weights are exactly the dense run's
times the mask."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.trainer.helpers import read_metrics, run_cli, train_then_resume
from trainer.cli import main
from trainer.config import parse_config
from trainer.config.sparsity import PLUGIN
from trainer.errors import ConfigError

EXAMPLE = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "llama-3__sparse-finetuning.yaml"
RECIPE = yaml.safe_load(EXAMPLE.read_text())["llmcompressor"]  # Axolotl's example recipe, unchanged
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = 5e-9  # below llmcompressor's epsilon (1e-8): counts as a zero


def targeted(name: str) -> bool:
    return name.split(".")[-2] in PROJ and name.endswith(".weight")


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def is_2_of_4(w: torch.Tensor) -> bool:
    return bool(((w.reshape(w.shape[0], -1, 4) != 0).sum(-1) <= 2).all())


@pytest.fixture(scope="module")
def sparse_llama(tmp_path_factory) -> Path:
    """The tiny llama with every q/k/v/o/gate/up/down weight made 2:4 sparse (the 2 smallest of each 4
    inputs zeroed, as a 2:4 checkpoint such as neuralmagic's Sparse-Llama-3.1-8B-2of4 has), and one kept value
    per weight set to 5e-9, which llmcompressor's mask (|w| > 1e-8) also counts as a zero."""
    from transformers import AutoModelForCausalLM

    from trainer.model.tiny import make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("sparse-llama"), family="llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if targeted(name):
                groups = p.view(p.shape[0], -1, 4)
                smallest = groups.abs().argsort(-1)[..., :2]
                groups.scatter_(-1, smallest, 0.0)
                kept = (p != 0).nonzero()[0]
                p[tuple(kept)] = TINY
                assert is_2_of_4(p)
    model.save_pretrained(out)
    return out


def sparse(**extra) -> dict:
    return {"plugins": [PLUGIN], "llmcompressor": RECIPE, **extra}


def test_targeted_weights_keep_exactly_their_zeros_and_the_rest_trains(make_config, sparse_llama, tmp_path):
    out = tmp_path / "out"
    config = make_config(base_model=str(sparse_llama), output_dir=str(out), max_steps=4, save_steps=2,
                         weight_decay=0.1, **sparse())
    assert main(["train", str(config)]) == 0
    start = weights(sparse_llama)
    assert sum(targeted(k) for k in start) == 14  # 7 projections x 2 layers
    for saved in (out / "checkpoint-2", out / "checkpoint-4", out / "final"):
        now = weights(saved)
        for k, w in start.items():
            assert not torch.equal(w, now[k]), (saved.name, k)  # every weight trained
            if targeted(k):
                keep = w.abs() > 1e-8
                assert torch.equal(now[k] != 0, keep), (saved.name, k)  # zeros exactly where they were (and TINY)
                assert is_2_of_4(now[k])
    final = weights(out / "final")
    assert any((start[k] == TINY).any() and not (final[k] == TINY).any() for k in start if targeted(k))


def test_without_the_plugin_the_zeros_are_lost(make_config, sparse_llama, tmp_path):
    out = tmp_path / "dense"
    assert main(["train", str(make_config(base_model=str(sparse_llama), output_dir=str(out), max_steps=2))]) == 0
    start, final = weights(sparse_llama), weights(out / "final")
    for k in start:
        if targeted(k):
            zeros = start[k] == 0
            assert (final[k][zeros] != 0).float().mean() > 0.9, k  # AdamW moves (almost) every zero
            assert not is_2_of_4(final[k])


def test_the_first_step_is_the_dense_step_times_the_mask(make_config, sparse_llama, tmp_path):
    """llmcompressor's ConstantPruningModifier.on_update at OPTIM_POST_STEP: weight *= mask, nothing else."""
    common = dict(base_model=str(sparse_llama), max_steps=1, save_steps=1, weight_decay=0.1)
    assert main(["train", str(make_config("dense.yml", output_dir=str(tmp_path / "d"), **common))]) == 0
    assert main(["train", str(make_config("sparse.yml", output_dir=str(tmp_path / "s"), **common, **sparse()))]) == 0
    start = weights(sparse_llama)
    dense, masked = weights(tmp_path / "d" / "checkpoint-1"), weights(tmp_path / "s" / "checkpoint-1")
    for k in start:
        expected = dense[k] * (start[k].abs() > 1e-8) if targeted(k) else dense[k]
        assert torch.equal(masked[k], expected), k


def test_a_checkpoint_resumes_exactly(make_config, sparse_llama, tmp_path):
    full, resumed = train_then_resume(main, make_config, tmp_path, checkpoint=2, base_model=str(sparse_llama),
                                      max_steps=4, save_steps=2, **sparse())
    a, b = weights(full / "final"), weights(resumed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_axolotls_example_trains_with_only_model_and_data_swapped(sparse_llama, alpaca_file, tmp_path):
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw.update(base_model=str(sparse_llama), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"), max_steps=2, sequence_len=256)
    raw["datasets"][0]["path"] = str(alpaca_file)
    config = tmp_path / "sparse-finetuning.yml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]
    start, final = weights(sparse_llama), weights(tmp_path / "out" / "final")
    for k in start:
        if targeted(k):
            assert is_2_of_4(final[k]) and torch.equal(final[k] != 0, start[k].abs() > 1e-8), k


def test_save_compressed_writes_the_model_dense_with_a_note():
    _, notes = parse_config({"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], **sparse()})
    assert any("save_compressed" in n and "dense" in n for n in notes)


BASE = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}]}
ONE = {"ConstantPruningModifier": {"targets": ["Linear"], "start": 0}}
LINEAR = {"x_stage": {"finetuning_modifiers": ONE}}


@pytest.mark.parametrize("raw, message", [
    ({"llmcompressor": {"recipe": {"s_stage": {"m_modifiers": ONE}}}}, "needs plugins"),
    ({"plugins": [PLUGIN]}, "needs an llmcompressor: block"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"m_modifiers": {"SparseGPTModifier": {"sparsity": 0.5}}}}}),
     "SparseGPTModifier: only ConstantPruningModifier"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"m_modifiers": {"ConstantPruningModifier": {
        "targets": ["Linear"], "start": 1}}}}}), "start: set start: 0"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"m_modifiers": {"ConstantPruningModifier": {
        "targets": ["Linear"]}}}}}), "never starts a modifier without a start"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"m_modifiers": {"ConstantPruningModifier": {
        "targets": ["Linear"], "start": 0, "end": -1}}}}}), "end: not supported"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"m_modifiers": {"ConstantPruningModifier": {
        "targets": ["Linear"], "mask_structure": "2:4"}}}}}), "mask_structure not supported"),
    (sparse(llmcompressor={"recipe": "recipe.yaml"}), "recipe files and strings are not supported"),
    (sparse(llmcompressor={"recipe": {"finetuning_modifiers": ONE}}), "finetuning_modifiers: expected a <name>_stage"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"pruning": ONE}}}), "s_stage.pruning: expected a <name>_modifiers"),
    (sparse(llmcompressor={"recipe": {"s_stage": {"m_modifiers": {"ConstantPruningModifier": ["Linear"]}}}}),
     "expected a mapping of its options"),
    (sparse(adapter="lora"), "LoRA update is dense"),
    (sparse(fsdp_version=2), "not with DeepSpeed, FSDP"),
])
def test_refusals_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, **raw})


def test_class_name_targets_and_the_examples_weight_name_regexes(sparse_llama):
    """"Linear" (a class name, as compressed-tensors matches targets) takes every linear weight, lm_head included;
    the Axolotl example's "re:.*q_proj.weight" regexes take the projections by their weights' names."""
    from transformers import AutoModelForCausalLM

    from trainer.model.sparsity import Pruning

    model = AutoModelForCausalLM.from_pretrained(sparse_llama)
    module_path = "axolotl.integrations.llm_compressor.plugin.LLMCompressorPlugin"  # accepted as the short one
    cfg, _ = parse_config({**BASE, **sparse(llmcompressor={"recipe": LINEAR}, plugins=[module_path])})
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(w)] for w, _ in Pruning(cfg, model, lambda *_: None).masks} == {
        n for n, p in model.named_parameters() if targeted(n) or n == "lm_head.weight"}
    cfg, _ = parse_config({**BASE, **sparse()})
    assert {names[id(w)] for w, _ in Pruning(cfg, model, lambda *_: None).masks} == {
        n for n, _ in model.named_parameters() if targeted(n)}


@pytest.mark.slow
def test_targets_matching_nothing_is_one_line_exit_2(make_config, sparse_llama, tmp_path):
    modifier = {"ConstantPruningModifier": {"targets": ["re:.*nothing"], "start": 0}}
    recipe = {"recipe": {"s_stage": {"m_modifiers": modifier}}}
    config = make_config(base_model=str(sparse_llama), **sparse(llmcompressor=recipe))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "match no layer" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_keep_the_zeros_and_train_as_one_accumulating(make_config, sparse_llama, tmp_path):
    """DDP: every rank holds whole weights and applies the same mask after its (identical) optimizer step."""
    from tests.trainer.helpers import assert_same_training, torchrun_train

    common = dict(base_model=str(sparse_llama), micro_batch_size=1, max_steps=3, **sparse())
    two = tmp_path / "two"
    result = torchrun_train(make_config("two.yml", output_dir=str(two), **common))
    assert result.returncode == 0, result.stderr[-3000:]
    one = tmp_path / "one"
    assert main(["train", str(make_config("one.yml", output_dir=str(one), gradient_accumulation_steps=2,
                                          **common))]) == 0
    assert_same_training(one, two)
    start, final = weights(sparse_llama), weights(two / "final")
    for k in start:
        if targeted(k):
            assert torch.equal(final[k] != 0, start[k].abs() > 1e-8), k
