"""Diffusion LM training (plugins: [axolotl.integrations.diffusion.DiffusionPlugin], diffusion: {...}).

Oracle: Axolotl's DiffusionTrainer._compute_diffusion_loss (src/axolotl/integrations/diffusion/trainer.py and
utils.py at 067b021c8b87) cannot be imported without Axolotl's trainer stack; `axolotl_loss` below re-derives
it from that file for an unpacked batch, given the masked positions and mask probabilities: a bidirectional
mask from the padding mask, logits shifted to the input positions, CE on masked tokens / p, each sample's
sum over its answer-token count, the mean over samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.helpers import read_metrics, run_cli, train_then_resume
from trainer.cli import main
from trainer.config import load_config

PLUGIN = "axolotl.integrations.diffusion.DiffusionPlugin"


def diffusion_config(make_config, name="config.yml", **diffusion):
    return make_config(name, plugins=[PLUGIN], diffusion={"mask_token_id": 5, "eps": 1e-3, **diffusion})


def build(config_path):
    from trainer import objectives
    from trainer.batch.collate import Collator
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model
    from trainer.objectives import prepare
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(config_path)
    runtime = adapt(cfg, gpu_from_name("cpu"))
    tokenizer = load_tokenizer(cfg)
    data = prepare(cfg, tokenizer, 0, log=lambda *_: None)
    model = load_model(cfg, runtime, tokenizer)
    objective = objectives.build(cfg, Collator(tokenizer.pad_token_id, runtime.attention), None)
    return cfg, tokenizer, data, model, objective


def axolotl_loss(model, input_ids, attention_mask, labels, masked, p_mask, mask_id, importance_weighting=True):
    noisy = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    bidirectional = ((attention_mask[:, :, None] == attention_mask[:, None, :]) & (attention_mask[:, :, None] > 0))
    logits = model(input_ids=noisy, attention_mask=bidirectional[:, None]).logits
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    per_sample = []
    for i in range(input_ids.shape[0]):
        where = masked[i]
        token_loss = F.cross_entropy(logits[i][where].float(), input_ids[i][where], reduction="none")
        if importance_weighting:
            token_loss = token_loss / p_mask[i][where]
        per_sample.append(token_loss.sum() / (labels[i] != -100).sum().clamp(min=1))
    return torch.stack(per_sample).mean()


@pytest.mark.parametrize("weighting", [True, False])
def test_loss_is_axolotls_on_a_fixed_batch(make_config, weighting):
    cfg, tokenizer, data, model, objective = build(diffusion_config(make_config, importance_weighting=weighting))
    rows = objective.rows(data.train)
    batch = objective.collate([rows[[0]], rows[[1]], rows[[2]]])  # three rows, padded, one sequence each
    objective.step = 3
    with torch.no_grad():
        loss, values = objective.loss(model, batch, {"sequences": 3})
        masked, p = objective.noise(batch, 3)
        # padding: Axolotl's attention_mask is 0 there; our sequence ids are -1
        attention = (batch["sequence_ids"] >= 0).long()
        labels = batch["labels"]
        expected = axolotl_loss(model, batch["input_ids"], attention, labels, masked, p, 5, weighting)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    # the masks follow Axolotl's rules: only answer tokens, never BOS/EOS/pad, with probability p per sequence
    specials = torch.tensor([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id])
    assert masked.any() and not (masked & (labels == -100)).any()
    assert not (masked & torch.isin(batch["input_ids"], specials)).any()
    for s in range(3):
        assert p[s][batch["sequence_ids"][s] >= 0].unique().numel() == 1
        assert 1e-3 <= float(p[s, 0]) <= 1
    assert int(values[2]) == int(masked.sum())


def test_packing_and_layout_do_not_change_the_loss(make_config):
    """The same three examples, packed in one row or one per row, at the same step: the same loss."""
    cfg, tokenizer, data, model, objective = build(diffusion_config(make_config))
    rows = objective.rows(data.train)
    objective.step = 1
    with torch.no_grad():
        apart, _ = objective.loss(model, objective.collate([rows[[0]], rows[[1]], rows[[2]]]), {"sequences": 3})
        packed, _ = objective.loss(model, objective.collate([rows[[0, 1, 2]]]), {"sequences": 3})
        objective.step = 2
        later, _ = objective.loss(model, objective.collate([rows[[0, 1, 2]]]), {"sequences": 3})
    assert float(packed) == pytest.approx(float(apart), rel=1e-5)
    assert float(later) != pytest.approx(float(apart), rel=1e-3)  # another step draws other masks


def test_attention_is_bidirectional(make_config):
    """Changing the last token of a sequence changes the logits at its first positions (causal attention would not)."""
    cfg, tokenizer, data, model, objective = build(diffusion_config(make_config))
    rows = objective.rows(data.train)
    batch = objective.collate([rows[[0, 1]]])
    end = int((batch["sequence_ids"][0] == 0).sum()) - 1
    changed = batch["input_ids"].clone()
    changed[0, end] = (changed[0, end] + 1) % 100 + 3
    with torch.no_grad():
        a = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = model(input_ids=changed, attention_mask=batch["attention_mask"]).logits
    assert not torch.allclose(a[0, :2], b[0, :2])
    assert torch.allclose(a[0, end + 1:end + 4], b[0, end + 1:end + 4], atol=1e-6)  # the next sequence is apart


@pytest.mark.slow
def test_trains_evaluates_and_resumes_exactly(make_config, tmp_path, capsys):
    full, _ = train_then_resume(main, make_config, tmp_path, checkpoint=2, plugins=[PLUGIN],
                                diffusion={"mask_token_id": 5}, sample_packing=True, gradient_accumulation_steps=2,
                                max_steps=4, save_steps=2, val_set_size=4, eval_steps=2)
    rows = read_metrics(full)
    train = [r for r in rows if "loss" in r]
    assert len(train) == 4 and all(r["num_masked_tokens"] > 0 and 0 <= r["accuracy"] <= 1 for r in train)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]  # same masks at every evaluation: it learns
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "full.yml"), "--json"]) == 0  # the final model, scored the same way
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["eval_loss"] == pytest.approx(evals[1], rel=1e-5)


def test_mask_token_is_added_when_the_id_is_not_in_the_vocabulary(make_config):
    """Axolotl's resolve_mask_token_id: an id >= tokenizer.vocab_size (or none) adds <|diffusion_mask|>."""
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(make_config(plugins=[PLUGIN], diffusion={"mask_token_id": 10**6}))
    tokenizer = load_tokenizer(cfg)
    assert cfg.diffusion.mask_token_id == tokenizer.convert_tokens_to_ids("<|diffusion_mask|>") == len(tokenizer) - 1
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), tokenizer)
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    cfg, _ = load_config(make_config(plugins=[PLUGIN]))
    assert load_tokenizer(cfg) and cfg.diffusion.mask_token_id == len(tokenizer) - 1


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", [
    (dict(diffusion={"eps": 0.1}), "diffusion: needs plugins"),
    (dict(plugins=[PLUGIN], diffusion={"min_mask_ratio": 0.9, "max_mask_ratio": 0.1}), "min_mask_ratio must be"),
    (dict(plugins=[PLUGIN], diffusion={"noise_schedule": "quadratic"}), "noise_schedule"),
    (dict(plugins=[PLUGIN], diffusion={"eps": 2}), "eps"),
    (dict(plugins=[PLUGIN], attn_implementation="flash_attention_2"), "bidirectional attention mask"),
    (dict(plugins=[PLUGIN], use_eaft=True), "use_eaft"),
])
def test_bad_values_are_one_line_config_errors(make_config, extra, message):
    result = run_cli("validate", str(make_config(**extra)), "--gpu", "cpu")
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_key_the_diffusion_block_does_not_have_is_named_and_ignored_as_axolotl_drops_it(make_config):
    result = run_cli("validate", str(make_config(plugins=[PLUGIN], diffusion={"mask_id": 3})), "--gpu", "cpu")
    assert result.returncode == 0, result.stderr
    assert "ignored: diffusion.mask_id (not Axolotl keys: Axolotl drops them too)" in result.stdout


def test_axolotls_sft_example_trains_with_only_model_and_data_swapped(tiny_llama, alpaca_file, tmp_path):
    """examples/llama-3/diffusion/sft-1b.yaml (packed, adamw_8bit, eval split, mask_token_id 128002): its id is
    not below a tokenizer's vocab_size (Llama 3's is 128000; the tiny one's smaller), so, as in Axolotl,
    <|diffusion_mask|> is added and used."""
    import yaml

    path = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "llama-3__diffusion__sft-1b.yaml"
    raw = yaml.safe_load(path.read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"), max_steps=2, sequence_len=256)
    raw["datasets"][0]["path"] = str(alpaca_file)
    config = tmp_path / "sft-1b.yml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_masked_tokens"] > 0 for r in rows)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "final")
    assert "<|diffusion_mask|>" in tokenizer.all_special_tokens


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_train_as_one_accumulating(make_config, tmp_path):
    """Masks keyed by (seed, step, example) and the loss averaged over the step's sequences on all ranks: two
    processes with one packed micro-batch each train exactly as one process accumulating two."""
    from tests.trainer.helpers import alpaca_rows, assert_same_training, torchrun_train, write_jsonl

    data = write_jsonl(tmp_path / "uneven.jsonl", alpaca_rows(80, seed=3, long_every=4))
    common = dict(datasets=[{"path": str(data), "type": "alpaca"}], sequence_len=400, sample_packing=True,
                  val_set_size=0.2, micro_batch_size=1, max_steps=3, eval_steps=2, plugins=[PLUGIN],
                  diffusion={"mask_token_id": 5})
    two = tmp_path / "two"
    result = torchrun_train(make_config("two.yml", output_dir=str(two), **common))
    assert result.returncode == 0, result.stderr[-3000:]
    one = tmp_path / "one"
    assert main(["train", str(make_config("one.yml", output_dir=str(one), gradient_accumulation_steps=2, **common))]) == 0
    assert_same_training(one, two)


def test_generate_samples_writes_samples_and_changes_no_training(make_config, tmp_path):
    from trainer.data.prepare import load_tokenizer

    """Every generation_interval steps the answers of validation examples are regenerated (Axolotl's reverse
    process) into samples.jsonl; the run's losses are those of a run without samples, and it resumes exactly."""
    gen = {"generation_interval": 2, "generation_steps": 4, "num_generation_samples": 2,
           "generation_temperature": 0.7}
    common = dict(plugins=[PLUGIN], max_steps=4, save_steps=2, val_set_size=4)
    full, _ = train_then_resume(main, make_config, tmp_path, checkpoint=2, diffusion=gen, **common)
    samples = [json.loads(line) for line in (full / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 4, 4]
    mask_id = len(load_tokenizer(load_config(tmp_path / "full.yml")[0])) - 1  # <|diffusion_mask|>, added
    for s in samples:
        prompt = s["total_tokens"] - s["masked_tokens"]
        assert 0 < s["masked_tokens"] < s["total_tokens"] and mask_id not in s["generated_ids"]
        assert s["generated_ids"][:prompt] == s["original_ids"][:prompt]  # the prompt is kept, the answer rewritten
        assert s["generated_ids"] != s["original_ids"] and s["masked"].count("<|diffusion_mask|>") == s["masked_tokens"]
    off = tmp_path / "off"
    assert main(["train", str(make_config("off.yml", output_dir=str(off), diffusion={**gen, "generate_samples": False},
                                          **common))]) == 0
    assert not (off / "samples.jsonl").exists()
    from tests.trainer.helpers import train_losses

    assert train_losses(off) == train_losses(full)
