"""Reward models (reward_model: Bradley-Terry on a sequence-classification head; process_reward_model: token
classification of step separators), as Axolotl configures them and TRL trains them:

- the losses against TRL's own code on identical batches (RewardTrainer.compute_loss, center term included;
  PRMTrainer, gone from TRL 1.16, trained with the token-classification model's own loss, used here);
- the data types (bradley_terry.chat_template, stepwise_supervised) build what Axolotl's strategies build;
- a tiny model trains a few steps, logs accuracy/margin, resumes exactly, and the saved model (or LoRA adapter
  with its trained head) loads as AutoModelForSequenceClassification / AutoModelForTokenClassification and
  scores the validation split exactly as training last did.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.trainer.helpers import WORDS, read_metrics, run_cli, train_then_resume, write_jsonl
from trainer.batch.collate import Collator
from trainer.batch.labels import IGNORE
from trainer.cli import main
from trainer.config import DatasetConfig, parse_config
from trainer.errors import ConfigError
from trainer.hooks import Run

TOL = dict(rtol=1e-5, atol=1e-6)


def bt_rows(n: int, seed: int = 0) -> list[dict]:
    """Axolotl's bradley_terry.chat_template rows (argilla/distilabel-intel-orca-dpo-pairs' columns)."""
    rng = random.Random(seed)
    return [{"system": "Answer briefly." if i % 2 else "", "input": f"Name a capital {i % 5}.",
             "chosen": "Paris is the capital of France.",
             "rejected": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))} for i in range(n)]


def step_rows(n: int, seed: int = 0) -> list[dict]:
    """stepwise_supervised rows (trl-lib/math_shepherd's columns): prompt, completions, labels per step."""
    rng = random.Random(seed)
    return [{"prompt": f"Add {i} and {i + 1}.", "completions": [f"{i} plus {i + 1}", "is two" if i % 2 else "is nine",
                                                              " ".join(rng.choice(WORDS) for _ in range(2))],
             "labels": [True, i % 2 == 1, i % 3 == 0]} for i in range(n)]


@pytest.fixture
def rm_config(make_config, tmp_path):
    bt = write_jsonl(tmp_path / "bt.jsonl", bt_rows(40))
    steps = write_jsonl(tmp_path / "steps.jsonl", step_rows(40))

    def make(name="rm.yml", kind="reward", **overrides):
        if kind == "reward":
            extra = dict(reward_model=True, chat_template="chatml",
                         datasets=[{"path": str(bt), "type": "bradley_terry.chat_template"}])
        else:
            extra = dict(process_reward_model=True,
                         datasets=[{"path": str(steps), "type": "stepwise_supervised", "step_separator": "\n"}])
        return make_config(name, **{"sequence_len": 128, "learning_rate": 5e-3, **extra, **overrides})

    return make


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# --- losses against TRL ------------------------------------------------------------------------------------

@pytest.mark.parametrize("center", [None, 0.01])
def test_reward_loss_and_metrics_are_trls_reward_trainer(tiny_llama, center):
    from transformers import AutoModelForSequenceClassification
    from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

    from tests.trainer.pref_helpers import trl_object
    from trainer.objectives.reward import Reward

    tok = tokenizer_of(tiny_llama)
    rng = random.Random(3)
    pairs = [{"chosen_input_ids": [rng.randrange(5, 300) for _ in range(rng.randint(3, 12))],
              "rejected_input_ids": [rng.randrange(5, 300) for _ in range(rng.randint(3, 12))]} for _ in range(5)]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.score.weight.mul_(30)  # rewards of a few units, so the loss and both terms are far from trivial
    objective = Reward(Collator(tok.pad_token_id, "sdpa"), center)
    batch = objective.collate([pairs[:2], pairs[2:]])  # two rows of pairs: one micro-batch of 5 pairs
    loss, values = objective.loss(model, batch, {"pairs": 5.0})
    report = objective.report(dict(zip(objective.metric_names, values.tolist())), {"pairs": 5.0})

    trl_inputs = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(
        [{"chosen_ids": p["chosen_input_ids"], "rejected_ids": p["rejected_input_ids"]} for p in pairs])
    assert torch.equal(trl_inputs["input_ids"], batch["input_ids"])  # the same layout: chosen rows, then rejected
    trl = trl_object(RewardTrainer, model, args=SimpleNamespace(center_rewards_coefficient=center))
    expected = trl.compute_loss(model, dict(trl_inputs))
    torch.testing.assert_close(loss, expected, **TOL)
    logged = trl._metrics["train" if model.training else "eval"]  # from_pretrained: eval mode
    for name in ("accuracy", "margin", "mean_reward"):
        assert report[name] == pytest.approx(logged[name][0], abs=1e-5), name
    assert 0 < report["accuracy"] < 1  # both outcomes occur, so the comparison means something
    if center:  # the centering term is really there
        plain = objective.__class__(Collator(tok.pad_token_id, "sdpa"), None).loss(model, batch, {"pairs": 5.0})[0]
        assert loss.item() > plain.item() + 1e-4


def test_prm_loss_is_the_token_classification_loss_trls_prm_trainer_trains(tiny_llama):
    """PRMTrainer (TRL <= 0.2x, trl/experimental/prm; gone from TRL 1.16) uses the plain Trainer loss: the
    token-classification model's own cross-entropy over labels != -100, with DataCollatorForTokenClassification."""
    from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification

    from trainer.objectives.prm import PRM
    from trainer.objectives.reward_data import stepwise

    tok = tokenizer_of(tiny_llama)
    ds = DatasetConfig(path="steps.jsonl", type="stepwise_supervised")
    examples = [dict(zip(("input_ids", "labels"), stepwise(r, ds, tok, 2))) for r in step_rows(4, seed=5)]
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_llama, num_labels=2, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.score.weight.mul_(20)
    objective = PRM(Collator(tok.pad_token_id, "sdpa"))
    batch = objective.collate([[e] for e in examples])
    totals = {"target_tokens": float(sum(objective.step_stats(model, batch)))}
    loss, values = objective.loss(model, batch, totals)

    hf = DataCollatorForTokenClassification(tok)([dict(e) for e in examples])
    out = model(input_ids=hf["input_ids"], attention_mask=hf["attention_mask"], labels=hf["labels"])
    torch.testing.assert_close(loss, out.loss, **TOL)
    labelled = hf["labels"] != IGNORE  # TRL's compute_accuracy: argmax against the label, labelled tokens only
    accuracy = (out.logits.argmax(-1)[labelled] == hf["labels"][labelled]).float().mean().item()
    report = objective.report(dict(zip(objective.metric_names, values.tolist())), totals)
    assert report["accuracy"] == pytest.approx(accuracy) and totals["target_tokens"] == 12  # 4 rows x 3 steps


# --- data --------------------------------------------------------------------------------------------------

def test_stepwise_rows_label_each_steps_separator(tiny_llama):
    from trainer.objectives.reward_data import stepwise

    tok = tokenizer_of(tiny_llama)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = {"prompt": "Add 2 and 2.", "completions": ["2 plus 2", "is four"], "labels": [True, False]}
    sep = enc("\n")
    ids, labels = stepwise(row, DatasetConfig(path="x", type="stepwise_supervised"), tok, 2)
    prompt = [tok.bos_token_id] + enc("Add 2 and 2.")
    s1, s2 = enc("2 plus 2") + sep, enc("is four") + sep
    assert ids == prompt + s1 + s2
    assert labels == [IGNORE] * (len(prompt) + len(s1) - 1) + [1] + [IGNORE] * (len(s2) - 1) + [0]
    last = DatasetConfig(path="x", type="stepwise_supervised", train_on_last_step_only=True, step_separator=" ;")
    ids, labels = stepwise(row, last, tok, 2)
    assert [t for t in labels if t != IGNORE] == [0] and ids[-len(enc(" ;")):] == enc(" ;")
    cut = DatasetConfig(path="x", type="stepwise_supervised", max_completion_length=len(s1))
    ids, labels = stepwise(row, cut, tok, 2)
    assert ids == prompt + s1 and [t for t in labels if t != IGNORE] == [1]


def test_bradley_terry_rows_render_the_conversation_with_the_chat_template(tiny_llama):
    from trainer.objectives.reward_data import bradley_terry

    tok = tokenizer_of(tiny_llama)
    row = {"system": "Be brief.", "input": "Capital of France?", "chosen": "Paris.", "rejected": "Rome."}
    chosen, rejected = bradley_terry(row, DatasetConfig(path="x", type="bradley_terry.chat_template"), tok)
    for ids, answer in ((chosen, "Paris."), (rejected, "Rome.")):
        expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Capital of France?"},
                                            {"role": "assistant", "content": answer}], tokenize=False)
        assert tok.decode(ids) == expected
    no_system = bradley_terry({**row, "system": ""}, DatasetConfig(path="x", type="bradley_terry.chat_template"), tok)
    assert "system" not in tok.decode(no_system[0])


# --- config ------------------------------------------------------------------------------------------------

BASE = {"base_model": "org/model"}


@pytest.mark.parametrize("raw, message", [
    ({"reward_model": True, "rl": "dpo", "datasets": [{"path": "d", "type": "bradley_terry.chat_template"}]},
     "reward_model is not an rl method"),
    ({"datasets": [{"path": "d", "type": "bradley_terry.chat_template"}]}, "set reward_model: true"),
    ({"rl": "dpo", "datasets": [{"path": "d", "type": "stepwise_supervised"}]}, "set process_reward_model: true"),
    ({"reward_model": True, "datasets": [{"path": "d", "type": "chat_template"}]}, "not a reward_model dataset type"),
    ({"process_reward_model": True, "datasets": [{"path": "d", "type": "bradley_terry.chat_template"}]},
     "use stepwise_supervised"),
    ({"reward_model": True, "num_labels": 2, "datasets": [{"path": "d", "type": "bradley_terry.chat_template"}]},
     "num_labels: 2 with reward_model"),
    ({"reward_model": True, "sample_packing": True, "datasets": [{"path": "d", "type": "bradley_terry.chat_template"}]},
     "sample_packing: not supported with reward_model"),
    ({"num_labels": 1, "datasets": [{"path": "d", "type": "alpaca"}]}, "num_labels: only with reward_model"),
    ({"datasets": [{"path": "d", "type": "alpaca", "train_on_last_step_only": True}]},
     "datasets.0.train_on_last_step_only: only with type: stepwise_supervised"),
    ({"center_rewards_coefficient": 0.01, "datasets": [{"path": "d", "type": "alpaca"}]},
     "center_rewards_coefficient: only with reward_model"),
    ({"reward_model": True, "process_reward_model": True,
      "datasets": [{"path": "d", "type": "stepwise_supervised"}]}, "choose one"),
])
def test_inconsistent_reward_keys_are_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, **raw})


def test_reward_keys_route_to_their_objectives_not_rl():
    cfg, _ = parse_config({**BASE, "reward_model": True, "center_rewards_coefficient": 0.01,
                           "datasets": [{"path": "d", "type": "bradley_terry.chat_template"}]})
    assert cfg.objective == "reward" and cfg.rl is None
    cfg, _ = parse_config({**BASE, "process_reward_model": True,
                           "datasets": [{"path": "d", "type": "stepwise_supervised", "step_separator": "\n\n",
                                         "max_completion_length": None, "train_on_last_step_only": False}]})
    assert cfg.objective == "prm" and cfg.datasets[0].step_separator == "\n\n"


@pytest.mark.slow
def test_refusal_is_one_line_exit_2(rm_config):
    result = run_cli("validate", str(rm_config(rl="dpo")), "--gpu", "a100")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "reward_model is not an rl method" in result.stderr


# --- training ------------------------------------------------------------------------------------------------

def eval_rows(out):
    return [r for r in read_metrics(out) if "eval_loss" in r]


def score_validation(cfg_path, model):
    """The objective's evaluation of cfg's validation split with a given (loaded) model."""
    from trainer import objectives
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer
    from trainer.objectives import prepare

    cfg, _ = load_config(cfg_path)
    tok = load_tokenizer(cfg)
    objective = objectives.build(cfg, Collator(tok.pad_token_id, "sdpa"), None)
    data = prepare(cfg, tok, log=lambda *_: None)
    return objective.evaluate(model, data.validation, 2, objectives.capacity(cfg, False), Run(cfg, timeout_s=60.0))


@pytest.mark.slow
def test_reward_model_trains_logs_accuracy_resumes_and_loads_as_sequence_classification(rm_config, tmp_path):
    from transformers import AutoModelForSequenceClassification

    common = dict(max_steps=4, save_steps=2, val_set_size=0.2, eval_steps=2, center_rewards_coefficient=0.01)
    full, _ = train_then_resume(main, rm_config, tmp_path, checkpoint=2, **common)
    steps = [r for r in read_metrics(full) if "loss" in r]
    assert {"accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected"} <= set(steps[0])
    last = eval_rows(full)[-1]
    assert last["eval_accuracy"] == 1.0 and last["eval_margin"] > 0.3  # the preference was learned

    model = AutoModelForSequenceClassification.from_pretrained(full / "final")
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer_of(full / "final").pad_token_id
    again = score_validation(tmp_path / "full.yml", model.eval())
    for key in ("eval_loss", "eval_accuracy", "eval_margin"):
        assert again[key] == pytest.approx(last[key], rel=1e-5), key


@pytest.mark.slow
def test_center_rewards_coefficient_changes_what_is_trained(rm_config, tmp_path):
    for name, coefficient in (("plain", None), ("centered", 1.0)):
        assert main(["train", str(rm_config(f"{name}.yml", output_dir=str(tmp_path / name), max_steps=2,
                                            center_rewards_coefficient=coefficient))]) == 0
    plain, centered = ([r for r in read_metrics(tmp_path / n) if "loss" in r] for n in ("plain", "centered"))
    assert centered[0]["loss"] > plain[0]["loss"]  # same first batch and weights: the added squared term


@pytest.mark.slow
def test_lora_reward_model_trains_its_score_head_and_the_adapter_loads(rm_config, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "lora"
    config = rm_config(output_dir=str(out), adapter="lora", lora_r=4, lora_target_linear=True, max_steps=3,
                       val_set_size=0.2, eval_steps=3, learning_rate=1e-2)
    assert main(["train", str(config)]) == 0
    saved = load_file(out / "final" / "adapter_model.safetensors")
    heads = [k for k in saved if ".score." in k]
    assert heads and not any("lora_" in k for k in heads)  # the head is saved whole (modules_to_save), not LoRA'd
    raw = yaml.safe_load(config.read_text())
    base = AutoModelForSequenceClassification.from_pretrained(raw["base_model"], num_labels=1,
                                                              pad_token_id=tokenizer_of(out / "final").pad_token_id)
    model = PeftModel.from_pretrained(base, out / "final").eval()
    again = score_validation(config, model)
    assert again["eval_loss"] == pytest.approx(eval_rows(out)[-1]["eval_loss"], rel=1e-5)  # the trained head came back
    # as training builds it: the head is a trained copy (modules_to_save), the rest LoRA on a frozen base
    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(config)
    trained = [n for n, p in load_model(cfg, adapt(cfg, gpu_from_name("cpu")), tokenizer_of(raw["base_model"]))
               .named_parameters() if p.requires_grad]
    assert any("score.modules_to_save" in n for n in trained) and any("lora_A" in n for n in trained)
    assert not any("embed_tokens" in n for n in trained)


@pytest.mark.slow
def test_process_reward_model_trains_resumes_and_loads_as_token_classification(rm_config, tmp_path):
    from transformers import AutoModelForTokenClassification

    common = dict(kind="prm", max_steps=4, save_steps=2, val_set_size=0.2, eval_steps=2)
    full, _ = train_then_resume(main, rm_config, tmp_path, checkpoint=2, **common)
    steps = [r for r in read_metrics(full) if "loss" in r]
    assert all("accuracy" in r and r["target_tokens"] == 6 for r in steps)  # 2 rows x 3 labelled steps
    model = AutoModelForTokenClassification.from_pretrained(full / "final")
    assert model.config.num_labels == 2
    last = eval_rows(full)[-1]
    again = score_validation(tmp_path / "full.yml", model.eval())
    assert again["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert again["eval_accuracy"] == pytest.approx(last["eval_accuracy"])


def test_packed_process_reward_model_batches_give_the_unpacked_loss(tiny_llama):
    """Packed rows (sample_packing) isolate each sequence behind the block-diagonal mask: same loss."""
    from transformers import AutoModelForTokenClassification

    from trainer.objectives.prm import PRM
    from trainer.objectives.reward_data import stepwise

    tok = tokenizer_of(tiny_llama)
    ds = DatasetConfig(path="steps.jsonl", type="stepwise_supervised")
    examples = [dict(zip(("input_ids", "labels"), stepwise(r, ds, tok, 2))) for r in step_rows(4, seed=7)]
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_llama, num_labels=2, pad_token_id=tok.pad_token_id)
    objective = PRM(Collator(tok.pad_token_id, "sdpa"))
    losses = []
    for rows in ([[e] for e in examples], [examples[:3], examples[3:]]):
        batch = objective.collate(rows)
        losses.append(objective.loss(model, batch, {"target_tokens": 12.0})[0])
    assert objective.collate([examples[:3], examples[3:]])["input_ids"].shape[0] == 2
    torch.testing.assert_close(losses[1], losses[0], **TOL)


@pytest.mark.slow
def test_packed_process_reward_model_trains(rm_config, tmp_path):
    assert main(["train", str(rm_config(kind="prm", output_dir=str(tmp_path / "p"), max_steps=2,
                                        sample_packing=True))]) == 0
    assert all(r["target_tokens"] > 6 for r in read_metrics(tmp_path / "p") if "loss" in r)  # bins of several rows


@pytest.mark.slow
def test_axolotl_reward_model_example_trains_with_only_model_and_data_swapped(tiny_llama, tmp_path):
    """examples/qwen2/reward-model.yaml as Axolotl ships it (bf16, flash-attention 2, adamw_bnb_8bit, gradient
    checkpointing): only base_model, the dataset path, outputs and a step limit are swapped."""
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    example = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "qwen2__reward-model.yaml"
    raw = yaml.safe_load(example.read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"), max_steps=2, sequence_len=128,
               dataset_prepared_path=str(tmp_path / "prepared"))
    raw["datasets"][0]["path"] = str(write_jsonl(tmp_path / "bt.jsonl", bt_rows(24)))
    config = tmp_path / "reward-model.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["pairs"] == 8 for r in rows)  # 2 pairs x accumulation 4
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "final").config.num_labels == 1


@pytest.mark.slow
def test_lora_process_reward_model_trains_its_classifier_head(rm_config, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "lora"
    assert main(["train", str(rm_config(kind="prm", output_dir=str(out), adapter="lora", lora_r=4,
                                        lora_target_linear=True, max_steps=2))]) == 0
    saved = load_file(out / "final" / "adapter_model.safetensors")
    assert any(".score." in k and "lora_" not in k for k in saved) and any("lora_A" in k for k in saved)
    # TRL's disable_dropout (RewardConfig/PRMConfig default): the head's dropout and lora_dropout are off
    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(rm_config("d.yml", kind="prm", adapter="lora", lora_r=4, lora_dropout=0.1))
    model = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), tokenizer_of(cfg.base_model))
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0 for m in dropouts)


@pytest.mark.slow
def test_qlora_reward_model_keeps_a_trainable_full_precision_head(rm_config, tmp_path, capsys):
    """QLoRA (4-bit base through bitsandbytes' CPU backend): the score head is not quantized and is trained;
    `evaluate` scores the trained adapter as the run's last evaluation did."""
    import json

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    out = tmp_path / "qlora"
    config = rm_config(output_dir=str(out), adapter="qlora", load_in_4bit=True, lora_r=4, max_steps=2,
                       val_set_size=0.2, eval_steps=2, learning_rate=1e-2)
    assert main(["train", str(config)]) == 0
    cfg, _ = load_config(config)
    head = load_model(cfg, adapt(cfg, gpu_from_name("cpu")), tokenizer_of(cfg.base_model)).base_model.model.score
    trained = head.modules_to_save["default"]
    assert type(trained) is torch.nn.Linear and trained.weight.requires_grad and trained.weight.dtype == torch.float32
    capsys.readouterr()
    assert main(["evaluate", str(config), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    last = eval_rows(out)[-1]
    # evaluate re-quantizes the base and loads the adapter afresh; on 4-bit weights its loss agrees with the
    # run's to ~1e-3 (measured: 6e-4), not bitwise as full-precision models do (see the tests above)
    assert result["eval_loss"] == pytest.approx(last["eval_loss"], rel=5e-3)
    assert result["eval_accuracy"] == last["eval_accuracy"]


@pytest.mark.parametrize("kind", ["reward", "prm"])
def test_a_new_head_on_a_bf16_base_is_initialised(kind, rm_config):
    """Axolotl re-initialises heads that transformers 5.8 left as uninitialised memory on bf16 bases; with the
    transformers here the head comes out initialised (normal, initializer_range), and the same for a given seed."""
    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(rm_config(kind=kind, adapter="lora", lora_r=4, bf16=True))
    runtime = adapt(cfg, gpu_from_name("cpu"))
    heads = [load_model(cfg, runtime, tokenizer_of(cfg.base_model)).base_model.model.score.modules_to_save["default"]
             .weight.detach() for _ in range(2)]
    assert torch.isfinite(heads[0]).all() and 0.01 < heads[0].float().std().item() < 0.04
    assert torch.equal(heads[0], heads[1])


@pytest.mark.slow
def test_a_template_that_refuses_system_turns_is_one_clear_line(rm_config, tmp_path):
    """gemma's template raises on a system turn: one line naming the fix, exit 2, not a traceback."""
    gemma_like = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    config = rm_config(chat_template="jinja", chat_template_jinja=gemma_like)
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "System role not supported; set drop_system_message: true" in result.stderr
