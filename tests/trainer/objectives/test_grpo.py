"""rl: grpo / gdpo: online RL with generation (trainer/objectives/grpo.py), TRL's GRPOTrainer as the oracle.

A tiny local model, a local GSM8K-shaped prompt file, and an Axolotl-style `rwd.py` (a dataset transform, a
format reward and a correctness reward) written beside the config, as Axolotl's qlora-1b-gdpo.yaml expects.
"""

from __future__ import annotations

import json
import random
import sys
import textwrap

import pytest
import torch

from tests.trainer.helpers import read_metrics, train_then_resume, write_jsonl
from trainer.cli import main

RWD = textwrap.dedent('''
    def gsm8k_transform(cfg, *args, **kwargs):
        def transform_fn(example, tokenizer=None):
            label = example["answer"].split("####")[-1].strip()
            return {"prompt": [{"role": "system", "content": "Count the words. Answer in <answer> tags."},
                               {"role": "user", "content": example["question"]}], "answer": label}
        return transform_fn, {"remove_columns": ["question"]}


    def format_reward(completions, **kwargs):
        """Share of the letter e in the completion (a graded stand-in for a format check)."""
        texts = [c[0]["content"] for c in completions]
        return [sum(ch == "e" for ch in t) / max(len(t), 1) for t in texts]


    def correctness_reward(completions, answer, **kwargs):
        texts = [c[0]["content"] for c in completions]
        return [1.0 if a in t else -abs(len(t.split()) - int(a)) / 10 for t, a in zip(texts, answer)]
''')
WORDS = "the quick brown fox jumps over the lazy dog".split()


@pytest.fixture
def grpo_config(make_config, tmp_path):
    """A config shaped like Axolotl's examples/llama-3/qlora-1b-gdpo.yaml, on the tiny model and local prompts."""
    (tmp_path / "rwd.py").write_text(RWD)
    sys.modules.pop("rwd", None)  # each test's own rwd.py (imported from its config's directory)
    rng = random.Random(0)
    rows = []
    for _ in range(24):
        n = rng.randint(1, 5)
        rows.append({"question": f"How many words: {' '.join(rng.choice(WORDS) for _ in range(n))}?",
                     "answer": f"count them #### {n}"})
    data = write_jsonl(tmp_path / "gsm8k.jsonl", rows)

    def make(name="gdpo.yml", trl=None, **overrides):
        block = {"beta": 0.001, "max_completion_length": 6, "num_generations": 2, "temperature": 0.7, "top_p": 0.95,
                 "use_vllm": False, "multi_objective_aggregation": "normalize_then_sum",
                 "reward_funcs": ["rwd.format_reward", "rwd.correctness_reward"], "reward_weights": [1.0, 2.0],
                 "log_completions": True, "num_completions_to_print": 3, "scale_rewards": True, **(trl or {})}
        base = {"rl": "gdpo", "trl": block, "chat_template": "chatml", "val_set_size": 0.0,
                "datasets": [{"path": str(data), "type": "rwd.gsm8k_transform"}], "micro_batch_size": 1,
                "gradient_accumulation_steps": 4, "max_steps": 4, "save_steps": 2, "logging_steps": 1,
                "learning_rate": 1e-3, "weight_decay": 0.01, "lr_scheduler": "cosine", "seed": 42}
        return make_config(name, **{**base, **overrides})

    return make


def test_validate_takes_the_gdpo_example_keys(grpo_config, capsys):
    assert main(["validate", str(grpo_config())]) == 0
    out = capsys.readouterr().out
    assert "objective:  gdpo (2 completions per prompt, up to 6 tokens; beta 0.001; rewards rwd.format_reward" in out


@pytest.mark.slow
def test_axolotls_gdpo_example_trains_with_only_model_data_and_steps_swapped(grpo_config, tiny_llama, tmp_path, capsys):
    """examples/llama-3/qlora-1b-gdpo.yaml as Axolotl ships it (128-token completions, accumulation 8, llama3
    template, adamw_torch_fused, gradient checkpointing), on the tiny model and local GSM8K-shaped rows."""
    import yaml

    from tests.trainer.helpers import REPO

    grpo_config()  # writes rwd.py and the prompt file into tmp_path
    raw = yaml.safe_load((REPO / "tests/trainer/fixtures/axolotl_examples/llama-3__qlora-1b-gdpo.yaml").read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"), max_steps=2)
    raw["datasets"] = [{**raw["datasets"][0], "path": str(tmp_path / "gsm8k.jsonl"), "name": None, "split": "train"}]
    raw["datasets"][0] = {k: v for k, v in raw["datasets"][0].items() if v is not None}
    config = tmp_path / "qlora-1b-gdpo.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions"] == 8 for r in rows)
    assert all("kl" in r and "rewards/correctness_reward/mean" in r for r in rows)  # beta 0.001: a reference
    assert "completions at step 2" in capsys.readouterr().err and (tmp_path / "out" / "final").is_dir()


def test_gdpo_trains_logs_trls_metrics_and_resumes_exactly(grpo_config, tmp_path, capsys):
    """Four GDPO steps (full fine-tune, beta > 0: a frozen reference copy); the run resumed from checkpoint-2 draws
    the same completions and reaches the same losses and rewards."""
    full, resumed = train_then_resume(main, lambda name, **kw: grpo_config(name, **kw), tmp_path)
    err = capsys.readouterr().err
    assert "keeps a frozen copy of the starting model as the reference" in err
    assert "completions at step 1" in err  # the rich table (num_completions_to_print rows)
    rows = [r for r in read_metrics(full) if "loss" in r]
    assert [r["completions"] for r in rows] == [4] * 4  # micro_batch_size x accumulation completions per step
    for r in rows:
        for key in ("reward", "reward_std", "rewards/format_reward/mean", "rewards/format_reward/std",
                    "rewards/correctness_reward/mean", "rewards/correctness_reward/std", "kl",
                    "completions/mean_length", "frac_reward_zero_std", "clip_ratio/region_mean"):
            assert key in r and r[key] == r[key], key  # present and not NaN
        assert 1 <= r["completions/mean_length"] <= 6
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0.0  # the policy moves away from the reference
    later = [r for r in read_metrics(resumed) if "loss" in r]
    assert [r["reward"] for r in later] == [r["reward"] for r in rows[2:]]
    logged = [json.loads(line) for line in (full / "completions.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (resumed / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in again] == [r["completion"] for r in logged if r["step"] > 2]
    assert {r["step"] for r in logged} == {1, 2, 3, 4} and len(logged) == 16


def test_grpo_raises_the_reward_it_is_trained_on(grpo_config, tmp_path):
    """rl: grpo with one reward (the share of the letter e): training moves the policy towards it."""
    out = tmp_path / "learn"
    config = grpo_config("learn.yml", rl="grpo", output_dir=str(out), max_steps=16, learning_rate=1e-2,
                         gradient_accumulation_steps=1, micro_batch_size=8, save_steps=None, lr_scheduler="constant",
                         trl={"multi_objective_aggregation": None, "reward_funcs": ["rwd.format_reward"],
                              "reward_weights": None, "beta": 0.0, "num_generations": 4, "temperature": 1.0,
                              "top_p": 1.0, "log_completions": False})
    assert main(["train", str(config)]) == 0
    rewards = [r["reward"] for r in read_metrics(out) if "loss" in r]
    assert "kl" not in read_metrics(out)[0]  # beta 0: no reference at all
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards


def test_lora_reference_is_the_base_with_the_adapter_off(grpo_config, tmp_path, capsys):
    out = tmp_path / "lora"
    config = grpo_config("lora.yml", output_dir=str(out), adapter="lora", lora_r=4, lora_alpha=8,
                         lora_target_linear=True, max_steps=3, save_steps=None, learning_rate=1e-2,
                         trl={"beta": 0.1})
    assert main(["train", str(config)]) == 0
    assert "frozen copy" not in capsys.readouterr().err
    kls = [r["kl"] for r in read_metrics(out) if "loss" in r]
    assert kls[0] == 0.0 and kls[-1] > 0.0  # the adapter starts at zero (the base), then moves


@pytest.mark.parametrize("trl, message", [
    ({"sync_ref_model": True, "beta": 0.0}, "trl.sync_ref_model: with trl.beta 0 (TRL's default) there is no "
                                             "reference model to sync"),
    ({"sync_ref_model": True, "_lora": True}, "trl.sync_ref_model: with adapter: lora the reference is the base with "
                                              "the adapter disabled"),
    ({"sync_ref_model": True, "ref_model_mixup_alpha": 0}, "trl.ref_model_mixup_alpha: 0 would keep the reference "
                                                           "fixed, but Axolotl passes only a non-zero alpha"),
    ({"sync_ref_model": True, "ref_model_sync_steps": 0}, "trl.ref_model_sync_steps: 0; the reference is mixed "
                                                          "after every that many optimizer steps: at least 1"),
    ({"reward_funcs": ["rwd.no_such_reward", "rwd.format_reward"]}, "has no function no_such_reward"),
    ({"reward_funcs": ["nomodule.reward", "rwd.format_reward"]}, "trl.reward_funcs: cannot import nomodule.reward: no module nomodule.py in"),
    ({"reward_weights": [1.0]}, "reward_weights: 1 weights for 2 reward_funcs"),
    ({"multi_objective_aggregation": "sum_then_normalize"}, "sum_then_normalize is GRPO, but rl: gdpo"),
    ({"num_generations": 3}, "must be a multiple of trl.num_generations (3)"),
    ({"_fsdp": True}, "rl: gdpo with FSDP or DeepSpeed ZeRO-3 is not supported"),
    ({"_zero3": True}, "rl: gdpo with FSDP or DeepSpeed ZeRO-3 is not supported"),
])
def test_bad_input_is_one_line_and_exit_2(grpo_config, tmp_path, capsys, trl, message):
    extra = {}
    if trl.pop("_fsdp", False):
        extra = {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}
    if trl.pop("_zero3", False):
        extra = {"deepspeed": "deepspeed_configs/zero3.json"}
    if trl.pop("_lora", False):
        extra = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True}
    config = grpo_config("bad.yml", trl=trl, output_dir=str(tmp_path / "bad"), **extra)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error")]) == 1 and message in err[-1], err


# --- TRL's GRPOTrainer as the oracle: same completions -> same advantages and the same loss ---------------------

@pytest.fixture
def trl_trainer(tmp_path_factory, tiny_llama):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    where = tmp_path_factory.mktemp("trl-grpo")
    (where / "rwd.py").write_text(RWD)
    sys.path.insert(0, str(where))
    sys.modules.pop("rwd", None)
    import rwd

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [{"prompt": [{"role": "user", "content": f"How many words: the {w}?"}], "answer": str(n)}
               for w, n in (("fox", 2), ("dog", 3))]
    lengths = {len(tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) for p in prompts}
    assert len(lengths) == 1  # no left padding in TRL's batch: its forward and ours see the same positions
    args = GRPOConfig(output_dir=str(where / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      num_generations=2, max_completion_length=6, temperature=0.7, beta=0.1, report_to="none",
                      use_cpu=True, bf16=False, reward_weights=[1.0, 2.0], save_strategy="no", seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    trainer = GRPOTrainer(model=model, reward_funcs=[rwd.format_reward, rwd.correctness_reward], args=args,
                          train_dataset=datasets.Dataset.from_list(prompts * 4), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():  # a reference apart from the policy, so the KL term (and its gradient) is not zero
        trainer.ref_model.lm_head.weight.add_(0.05 * torch.randn(trainer.ref_model.lm_head.weight.shape,
                                                                 generator=torch.Generator().manual_seed(0)))
    sys.path.remove(str(where))
    return trainer, [prompts[0], prompts[0], prompts[1], prompts[1]], rwd


@pytest.mark.parametrize("rl, aggregation, scale, loss_type, level", [
    ("grpo", "sum_then_normalize", True, None, "token"),  # TRL's defaults: group scaling, dapo
    ("grpo", "sum_then_normalize", "batch", "grpo", "token"),
    ("grpo", "sum_then_normalize", False, "dr_grpo", "token"),
    ("gdpo", "normalize_then_sum", True, "bnpo", "token"),
    ("grpo", "sum_then_normalize", True, "grpo", "sequence"),  # GSPO's sequence-level ratio
])
def test_advantages_and_loss_match_trls_grpo_trainer(trl_trainer, tiny_llama, rl, aggregation, scale, loss_type,
                                                     level):
    from trainer.batch.collate import Collator
    from trainer.config import parse_config
    from trainer.objectives.grpo import GRPO, LossSettings, aggregate, compute_advantages, grpo_per_token_loss

    trainer, batch, rwd = trl_trainer
    trainer.multi_objective_aggregation = aggregation
    trainer.scale_rewards = {True: "group", False: "none"}.get(scale, scale)
    trainer.loss_type = loss_type or "dapo"
    trainer.importance_sampling_level = level
    torch.manual_seed(0)
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, out)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()

    cfg, _ = parse_config({
        "base_model": str(tiny_llama), "rl": rl, "datasets": [{"path": "x.jsonl"}], "micro_batch_size": 4,
        "trl": {"beta": 0.1, "max_completion_length": 6, "num_generations": 2, "temperature": 0.7,
                "reward_funcs": ["rwd.format_reward", "rwd.correctness_reward"], "reward_weights": [1.0, 2.0],
                "scale_rewards": scale, "multi_objective_aggregation": aggregation, "loss_type": loss_type,
                "importance_sampling_level": level}})
    objective = GRPO(cfg, Collator(trainer.processing_class.pad_token_id, "sdpa"),
                     [rwd.format_reward, rwd.correctness_reward], ["format_reward", "correctness_reward"])
    objective.before_training(trainer.model, tokenizer=trainer.processing_class, dtype=None, rank=0, timeout=60.0,
                              output_dir=None, say=lambda *_: None)
    objective.ref_model = trainer.ref_model
    samples = [{"example": {"prompt_ids": prompt.tolist(), "row": json.dumps(row)},
                "completion_ids": ids[mask.bool()].tolist(), "truncated": False}
               for prompt, ids, mask, row in zip(out["prompt_ids"], out["completion_ids"], out["completion_mask"], batch)]
    rewards = objective.rewards(samples, 0)
    advantages, _ = compute_advantages(rewards, objective.weights, 2, objective.aggregation, cfg.trl.scaling)
    torch.testing.assert_close(advantages, out["advantages"], rtol=1e-5, atol=1e-5)

    for s, a in zip(samples, advantages.tolist()):
        s["advantage"], s["zero_std"] = a, False
    ours = objective.tensors(samples, torch.device("cpu"))
    ours["ref_logps"] = objective.reference_logps(trainer.model, ours)
    mask = ours["completion_mask"]
    torch.testing.assert_close(ours["ref_logps"] * mask, out["ref_per_token_logps"][:, :mask.shape[1]] * mask,
                               rtol=1e-4, atol=1e-5)
    totals = {"completions": 4, "completion_tokens": float(mask.sum()), "micro_batches": 1}
    loss, _ = objective.loss(trainer.model, ours, totals)
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-4, abs=1e-6)
    loss.backward()  # the same gradient too (the KL's importance weight carries one even where its value is 1)
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert grads.keys() == trl_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-3, atol=1e-6, msg=name)

    # the clipped importance ratio: old log-probs that differ from the current ones (TRL reads them if given)
    logps = objective.token_logps(trainer.model, ours).detach()
    old = logps + 0.3 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    width = out["completion_ids"].shape[1]
    out["old_per_token_logps"] = torch.nn.functional.pad(old, (0, width - old.shape[1]))
    trl_clipped = float(trainer._compute_loss(trainer.model, out).detach())
    per_token, _, clipped = grpo_per_token_loss(logps, old, ours["ref_logps"], ours["advantages"], mask,
                                                LossSettings(0.1, 0.2, 0.2, level))
    assert bool((clipped * mask.bool()).any())  # the clip is exercised
    assert float(aggregate(per_token, mask, trainer.loss_type, totals, 6)) == pytest.approx(trl_clipped, rel=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_train_as_one_with_twice_the_accumulation(grpo_config, tmp_path):
    """Completions are drawn per prompt (seed, step, prompt index), groups stay on one process, GDPO's batch
    statistics and dapo's token count are summed over processes: 2 processes x accumulation 1 == 1 x 2, and so
    are the evaluations of the held-out prompts (val_set_size)."""
    from tests.trainer.helpers import assert_same_training, torchrun_train

    common = {"micro_batch_size": 2, "max_steps": 3, "save_steps": None, "learning_rate": 1e-2, "val_set_size": 4,
              "eval_steps": 2}
    one = grpo_config("one.yml", output_dir=str(tmp_path / "one"), gradient_accumulation_steps=2, **common)
    two = grpo_config("two.yml", output_dir=str(tmp_path / "two"), gradient_accumulation_steps=1, **common)
    assert main(["train", str(one)]) == 0
    result = torchrun_train(two)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_training(tmp_path / "one", tmp_path / "two", rel=1e-4)
    rewards = [[r["reward"] for r in read_metrics(tmp_path / d) if "loss" in r] for d in ("one", "two")]
    assert rewards[1] == pytest.approx(rewards[0], rel=1e-6)
    evals = [[r for r in read_metrics(tmp_path / d) if "eval_loss" in r] for d in ("one", "two")]
    assert [r["step"] for r in evals[0]] == [2, 3] and all(r["eval_completions"] == 8 for r in evals[0])
    assert [r["eval_reward"] for r in evals[1]] == pytest.approx([r["eval_reward"] for r in evals[0]], rel=1e-6)


def test_mask_truncated_completions_drops_cut_completions_from_the_loss(tiny_llama):
    from trainer.batch.collate import Collator
    from trainer.config import parse_config
    from trainer.objectives.grpo import GRPO

    def mask_for(flag):
        cfg, _ = parse_config({"base_model": str(tiny_llama), "rl": "grpo", "datasets": [{"path": "x.jsonl"}],
                               "micro_batch_size": 2, "trl": {"num_generations": 2, "reward_funcs": ["rwd.f"],
                                                              "mask_truncated_completions": flag}})
        objective = GRPO(cfg, Collator(0, "sdpa"), [len], ["f"])
        samples = [{"example": {"prompt_ids": [5, 6, 7]}, "completion_ids": [8, 9, 2], "truncated": False,
                    "advantage": 1.0, "zero_std": False, "rewards": [0.0]},
                   {"example": {"prompt_ids": [5, 6, 7]}, "completion_ids": [8, 9, 10, 11], "truncated": True,
                    "advantage": -1.0, "zero_std": False, "rewards": [1.0]}]
        return objective.tensors(samples, torch.device("cpu"))["completion_mask"].tolist()

    assert mask_for(False) == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert mask_for(True) == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_trl_chat_template_kwargs_reach_the_prompts_as_trl_renders_them():
    """trl.chat_template_kwargs: TRL's GRPOTrainer renders each prompt with apply_chat_template(prompt,
    add_generation_prompt=True, **chat_template_kwargs); transformers' own render is the reference."""
    from trainer.model.tiny import build_tokenizer
    from trainer.objectives.grpo_data import prompt_ids

    tok = build_tokenizer()
    tok.chat_template = ("{% if mood is defined %}{{ mood }} {% endif %}{% for m in messages %}{{ m.content }}"
                         "{% endfor %}{% if add_generation_prompt %} A:{% endif %}")
    prompt = [{"role": "user", "content": "How many words: the fox?"}]
    want = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True, mood="calm")
    assert prompt_ids(prompt, tok, {"mood": "calm"}) == list(want["input_ids"])
    assert prompt_ids(prompt, tok) != prompt_ids(prompt, tok, {"mood": "calm"})


@pytest.mark.slow
def test_trl_chat_template_kwargs_train_through_the_cli(grpo_config, tmp_path):
    config = grpo_config(trl={"chat_template_kwargs": {"enable_thinking": False}}, max_steps=2, save_steps=None,
                         output_dir=str(tmp_path / "out"))
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]


def test_trl_generation_kwargs_update_the_sampling_settings_as_trl_does(grpo_config):
    """trl.generation_kwargs: TRL's GRPOTrainer updates its generation_kwargs dict with them (user values win)."""
    from trainer.config import load_config
    from trainer.objectives.grpo import GRPO

    cfg, _ = load_config(grpo_config(trl={"generation_kwargs": {"top_k": 7, "no_repeat_ngram_size": 2}}))
    method = GRPO.__new__(GRPO)
    method.trl, method.G, method.pad_id, method.eos_ids = cfg.trl, 2, 0, [1]
    method.tokenizer = type("T", (), {"bos_token_id": 2})()
    config = method.generation_config()
    assert (config.top_k, config.no_repeat_ngram_size, config.temperature) == (7, 2, 0.7)


@pytest.mark.slow
def test_trl_generation_kwargs_train_through_the_cli(grpo_config, tmp_path):
    config = grpo_config(trl={"generation_kwargs": {"top_k": 5}}, max_steps=2, save_steps=None,
                         output_dir=str(tmp_path / "out"))
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]


def test_the_fast_async_trainers_options_are_not_read_without_the_async_mode(grpo_config, capsys):
    """trl.replay_buffer_size, reroll_*, skip_zero_advantage_batches, replay_recompute_logps: options of Axolotl's
    fast asynchronous GRPO trainer, which its builder blocks unless async_prefetch / use_data_producer: not read
    here either, said in one note; in that mode refused (not implemented here yet)."""
    from trainer.config import load_config
    from trainer.errors import ConfigError

    keys = {"replay_buffer_size": 64, "skip_zero_advantage_batches": False, "reroll_max_groups": 2}
    _, notes = load_config(grpo_config(trl=keys))
    assert any(n.startswith("trl.replay_buffer_size, trl.reroll_max_groups, trl.skip_zero_advantage_batches: not "
                            "read without async_prefetch") for n in notes), notes
    with pytest.raises(ConfigError, match="replay_buffer_size: with async_prefetch / use_data_producer"):
        load_config(grpo_config("b.yml", trl={**keys, "use_vllm": True, "vllm_lora_sync": True,
                                                "async_prefetch": True}, adapter="lora"))


def test_tr_dpos_sync_keys_are_not_read_without_sync_ref_model(grpo_config):
    from trainer.config import load_config

    _, notes = load_config(grpo_config(trl={"ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 64}))
    assert any(n.startswith("trl.ref_model_mixup_alpha, trl.ref_model_sync_steps: not read without "
                            "trl.sync_ref_model") for n in notes), notes


# --- trl.sync_ref_model: TR-DPO's reference sync, as TRL's SyncRefModelCallback ---------------------------------

def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_sync_ref_model_mixes_the_policy_into_the_reference_every_n_steps_and_resumes_with_it(
        grpo_config, tiny_llama, tmp_path, capsys):
    """trl.sync_ref_model with ref_model_sync_steps 2, ref_model_mixup_alpha 0.5 over four steps: after steps 2 and 4
    (TRL's on_step_end: global_step % 2 == 0) the reference each checkpoint keeps is 0.5 x that step's policy (the
    checkpoint's weights) + 0.5 x the reference before, computed here by hand from the saved weights, and not
    changed in between; a run resumed from checkpoint-3 trains step 4 against that reference (the same loss)."""
    from trainer.objectives.grpo_ref_sync import REFERENCE_FILE

    sync = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5, "beta": 0.5}
    full, _ = train_then_resume(main, lambda name, **kw: grpo_config(name, **kw), tmp_path, checkpoint=3,
                                trl=sync, save_steps=1, learning_rate=3e-2)
    err = capsys.readouterr().err
    assert ("gdpo: trl.sync_ref_model: the reference becomes 0.5 x policy + 0.5 x reference every 2 steps (TR-DPO, "
            "TRL's SyncRefModelCallback); checkpoints keep it") in err
    start = _weights(tiny_llama / "model.safetensors")
    policy = {k: _weights(full / f"checkpoint-{k}" / "model.safetensors") for k in (1, 2, 3, 4)}
    ref = {k: _weights(full / f"checkpoint-{k}" / REFERENCE_FILE) for k in (1, 2, 3, 4)}
    assert ref[1].keys() == start.keys() == policy[2].keys()
    moved = [n for n in start if not torch.equal(policy[2][n], start[n])]
    assert moved  # the policy trained
    for name in start:
        torch.testing.assert_close(ref[1][name], start[name], rtol=0, atol=0)  # no sync after step 1
        mixed_2 = 0.5 * policy[2][name] + 0.5 * start[name]
        torch.testing.assert_close(ref[2][name], mixed_2, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ref[3][name], ref[2][name], rtol=0, atol=0)  # none after step 3
        torch.testing.assert_close(ref[4][name], 0.5 * policy[4][name] + 0.5 * ref[2][name], rtol=1e-6, atol=1e-7)
    resumed_ref = _weights(tmp_path / "resumed" / "checkpoint-4" / REFERENCE_FILE)
    assert all(torch.equal(resumed_ref[n], ref[4][n]) for n in start)


def test_validate_says_the_reference_is_synced(grpo_config, capsys):
    config = grpo_config(trl={"sync_ref_model": True, "off_policy_mask_threshold": 0.5})
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert ("the reference synced every 64 steps (alpha 0.9); off-policy sequences masked above KL 0.5" in out), out
    from trainer.config.grpo import TrlConfig

    # Axolotl's defaults 0.9 / 64 when not given; null: Axolotl passes nothing, so TRL's own 0.6 / 512
    nulls = TrlConfig(reward_funcs=["rwd.f"], sync_ref_model=True, ref_model_mixup_alpha=None, ref_model_sync_steps=None)
    assert (nulls.mixup_alpha, nulls.sync_steps) == (0.6, 512)


# --- trl.off_policy_mask_threshold: TRL's off-policy sequence mask -----------------------------------------------

def test_off_policy_mask_is_trls_on_a_hand_made_batch():
    """Four completions, advantages +/-, sampling log-probs near and far from the policy's, padding and a token the
    server gave no log-prob for (NaN): the same keep/drop as TRL's GRPOTrainer.get_off_policy_mask."""
    from trl import GRPOTrainer

    from trainer.objectives.grpo import off_policy_mask

    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0], [-1.5, -1.0, -2.0]])
    sampling = torch.tensor([[-0.2, -1.0, -0.1], [-0.2, -1.0, -0.1], [-0.3, -0.9, 0.0], [float("nan"), -0.9, -1.9]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([0.7, -0.7, -0.1, -1.2])
    for threshold in (0.1, 0.5, 1.0, -0.01):
        ours = off_policy_mask(advantages, logps, sampling, mask, threshold)
        trl = GRPOTrainer.get_off_policy_mask(advantages.unsqueeze(1), logps, sampling, mask, threshold)
        assert torch.equal(ours, trl), threshold
    assert off_policy_mask(advantages, logps, sampling, mask, 0.5).squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0]


def test_off_policy_mask_threshold_loss_matches_trls_grpo_trainer(trl_trainer, tiny_llama):
    """TRL's _compute_loss with off_policy_mask_threshold and sampling log-probs apart from the policy's (as a
    vLLM server's): the same loss and gradients as ours with the same log-probs in the batch, some completions
    masked."""
    from trainer.batch.collate import Collator
    from trainer.config import parse_config
    from trainer.objectives.grpo import GRPO, compute_advantages, off_policy_mask

    trainer, batch, rwd = trl_trainer
    trainer.multi_objective_aggregation, trainer.scale_rewards = "sum_then_normalize", "group"
    trainer.loss_type, trainer.importance_sampling_level = "dapo", "token"
    trainer.off_policy_mask_threshold = 0.05
    torch.manual_seed(0)
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    cfg, _ = parse_config({
        "base_model": str(tiny_llama), "rl": "grpo", "datasets": [{"path": "x.jsonl"}], "micro_batch_size": 4,
        "trl": {"beta": 0.1, "max_completion_length": 6, "num_generations": 2, "temperature": 0.7,
                "reward_funcs": ["rwd.format_reward", "rwd.correctness_reward"], "reward_weights": [1.0, 2.0],
                "off_policy_mask_threshold": 0.05}})
    objective = GRPO(cfg, Collator(trainer.processing_class.pad_token_id, "sdpa"),
                     [rwd.format_reward, rwd.correctness_reward], ["format_reward", "correctness_reward"])
    objective.before_training(trainer.model, tokenizer=trainer.processing_class, dtype=None, rank=0, timeout=60.0,
                              output_dir=None, say=lambda *_: None)
    objective.ref_model = trainer.ref_model
    samples = [{"example": {"prompt_ids": prompt.tolist(), "row": json.dumps(row)},
                "completion_ids": ids[mask.bool()].tolist(), "truncated": False}
               for prompt, ids, mask, row in zip(out["prompt_ids"], out["completion_ids"], out["completion_mask"], batch)]
    advantages, _ = compute_advantages(objective.rewards(samples, 0), objective.weights, 2, objective.aggregation,
                                       "group")
    for s, a in zip(samples, advantages.tolist()):
        s["advantage"], s["zero_std"] = a, False
    ours = objective.tensors(samples, torch.device("cpu"))
    ours["ref_logps"] = objective.reference_logps(trainer.model, ours)
    mask = ours["completion_mask"]
    with torch.no_grad():
        logps = objective.token_logps(trainer.model, ours)
    ours["sampling_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(3)).abs()
    out["sampling_per_token_logps"] = torch.nn.functional.pad(ours["sampling_logps"],
                                                             (0, out["completion_ids"].shape[1] - logps.shape[1]))
    keep = off_policy_mask(ours["advantages"], logps, ours["sampling_logps"], mask, 0.05)
    assert 0 < float(keep.sum()) < 4, keep  # some completions are masked, some kept
    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, out)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    totals = {"completions": 4, "completion_tokens": float(mask.sum()), "micro_batches": 1}
    loss, _ = objective.loss(trainer.model, ours, totals)
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-4, abs=1e-6)
    loss.backward()
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, trl_grads[name], rtol=1e-3, atol=1e-6, msg=name)
