"""rl: ebft, ebft.mode: structured (trainer/objectives/ebft_structured.py): GRPO whose reward is EBFT's feature
matching. Through `python -m trainer train`: the logged rewards equal the formulas of Axolotl's rewards.py / trainer.py
recomputed here from the tiny model's hidden states, the advantages are GRPO's of those rewards, and a rl: grpo run
fed those very rewards trains the same losses. Axolotl's five structured examples validate, on tiny stand-ins."""

from __future__ import annotations

import json
import random
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from tests.trainer.helpers import WORDS, read_metrics, write_jsonl
from trainer.cli import main

EXAMPLES = Path(__file__).parents[1] / "fixtures" / "axolotl_examples"
STRUCTURED_EXAMPLES = ["ebft__llama-1b-ebft-opencode-novllm.yaml", "ebft__llama-1b-ebft-opencode.yaml",
                       "ebft__qwen35-4b-ebft-structured.yaml", "ebft__qwen35-4b-ebft-structured-async.yaml",
                       "ebft__qwen35-9b-ebft-structured.yaml"]
TRL = {"num_generations": 2, "max_completion_length": 6, "temperature": 1.0, "use_vllm": False, "scale_rewards": True,
       "loss_type": "grpo", "epsilon": 0.2, "log_completions": True, "num_completions_to_print": 0}
# a rl: grpo run's reward: the rewards the EBFT run logged for the same (prompt, completion), and the same transform
LOOKUP = textwrap.dedent('''
    import json

    LOGGED = {}


    def opencode(cfg, **kwargs):
        return (lambda ex: {"prompt": [{"role": "user", "content": ex["input"]}], "ground_truth": ex["output"]}), {
            "remove_columns": "__all__"}


    def logged(prompts, completions, **kwargs):
        if not LOGGED:
            for line in open(PATH):
                row = json.loads(line)
                LOGGED[json.dumps([row["step"], row["prompt"], row["completion"]])] = row["feature_matching"]
        step = kwargs["trainer_state"].global_step + 1
        return [LOGGED[json.dumps([step, p, c[0]["content"]])] for p, c in zip(prompts, completions)]
''')


@pytest.fixture
def structured_config(make_config, tmp_path):
    rng = random.Random(3)
    rows = [{"input": "Repeat: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))),
             "output": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))} for _ in range(16)]
    data = write_jsonl(tmp_path / "opencode.jsonl", rows)

    def make(name="ebft.yml", ebft=None, trl=None, **extra):
        keys = dict(rl="ebft", ebft={"feature_layers": [0.5, 1.0], "embed_method": "last_token", "use_whitening": False,
                                     "alignment_coef": 1.0, "diversity_coef": 1.0, "ce_coef": 0.0, **(ebft or {})},
                    trl={**TRL, **(trl or {})}, chat_template="chatml",
                    datasets=[{"path": str(data), "type": "ebft_opencode.transform"}], micro_batch_size=2,
                    gradient_accumulation_steps=2, max_steps=2, save_steps=None, learning_rate=1e-3,
                    lr_scheduler="constant", val_set_size=0.0, seed=7, ddp=False)
        keys.update(extra)
        return make_config(name, **keys)

    return make


def embedding(model, tok, text: str, layers: list[int], method: str, prompt_len: int) -> torch.Tensor:
    """One text alone through the model: hidden states at `layers` concatenated, pooled by `method`."""
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    h = torch.cat([hidden[i][0].double() for i in layers], dim=-1)  # [S, D]
    if method == "last_token":
        return h[-1]
    return h[prompt_len:].mean(0)  # completion_mean


def oracle(cfg, logged: list[dict], G: int, whitening: bool = False) -> list[dict]:
    """Axolotl's _feature_matching_reward, recomputed per group from separate forwards, in float64."""
    # heavy: transformers, the trainer's tokenizer loading (its chat_template setting)
    from transformers import AutoModelForCausalLM

    from trainer.data.prepare import load_tokenizer

    tok = load_tokenizer(cfg)
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=torch.float32).eval()
    L = model.config.num_hidden_layers
    layers = [int(f * L) for f in cfg.ebft.feature_layers]
    out = []
    for g in range(0, len(logged), G):
        group = logged[g:g + G]
        prompt = tok.apply_chat_template(group[0]["prompt"], tokenize=False, add_generation_prompt=True)
        plen = len(tok(prompt, add_special_tokens=False)["input_ids"])
        gen = torch.stack([embedding(model, tok, prompt + r["completion"], layers, cfg.ebft.embed_method, plen)
                           for r in group])
        gt = embedding(model, tok, prompt + group[0]["ground_truth"], layers, cfg.ebft.embed_method, plen)
        if whitening:  # W = U S^-1 U^T from the eigendecomposition of gen^T gen (= the SVD of gen^T)
            vals, vecs = torch.linalg.eigh(gen.T @ gen)
            s = vals.clamp(min=0).sqrt()
            keep = s > 1e-5 * s.max()
            w = (vecs[:, keep] / s[keep]) @ vecs[:, keep].T
            gen, gt = gen @ w, gt @ w
        else:
            gen, gt = gen / gen.norm(dim=-1, keepdim=True), gt / gt.norm()
        for j in range(G):
            align = 2 * float(gen[j] @ gt / (gen[j].norm() * gt.norm()))
            div = 2 * sum(float(gen[j] @ gen[k]) for k in range(G) if k != j) / (G - 1)
            out.append({"alignment": align, "diversity": div,
                        "reward": cfg.ebft.alignment_coef * align - cfg.ebft.diversity_coef * div,
                        "cfm": float(((gen.mean(0) - gt) ** 2).sum())})
    return out


def grpo_advantages(rewards: list[float], G: int) -> list[float]:
    """TRL's: (r - group mean) / (group std, Bessel-corrected, + 1e-4)."""
    out = []
    for g in range(0, len(rewards), G):
        r = torch.tensor(rewards[g:g + G], dtype=torch.float64)
        out += ((r - r.mean()) / (r.std() + 1e-4)).tolist()
    return out


def logged_completions(output_dir: Path, data: Path) -> list[dict]:
    truths = {json.dumps([{"role": "user", "content": r["input"]}]): r["output"]
              for r in map(json.loads, data.read_text().splitlines())}
    rows = [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]
    for r in rows:
        r["ground_truth"] = truths[json.dumps(r["prompt"])]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("ebft,trl", [
    ({}, {}),
    # beta > 0 with a full fine-tune: the reference copy is also the feature network (the starting model)
    ({"embed_method": "completion_mean", "use_whitening": True, "alignment_coef": 0.7, "diversity_coef": 1.3},
     {"beta": 0.05, "loss_type": "dapo"}),
], ids=["last_token", "whitened-beta"])
def test_rewards_are_ebfts_formulas_and_the_loss_is_grpos(structured_config, tmp_path, ebft, trl):
    from trainer.config import load_config

    config = structured_config(ebft=ebft, trl=trl)
    assert main(["train", str(config)]) == 0
    cfg, _ = load_config(config)
    logged = logged_completions(tmp_path / "out", tmp_path / "opencode.jsonl")
    assert [r["step"] for r in logged] == [1] * 4 + [2] * 4  # 2 prompts x 2 completions per step
    want = oracle(cfg, logged, 2, whitening=cfg.ebft.use_whitening)
    assert len({round(r["feature_matching"], 6) for r in logged}) >= 6  # distinct completions, distinct rewards
    assert max(abs(r["advantage"]) for r in logged) > 0.5
    for got, expect in zip(logged, want):
        assert got["alignment"] == pytest.approx(expect["alignment"], abs=2e-4)
        assert got["diversity"] == pytest.approx(expect["diversity"], abs=2e-4)
        assert got["feature_matching"] == pytest.approx(expect["reward"], abs=4e-4)
        assert got["cfm_loss"] == pytest.approx(expect["cfm"], abs=4e-4)
    assert [r["advantage"] for r in logged] == pytest.approx(
        grpo_advantages([r["feature_matching"] for r in logged], 2), abs=1e-5)
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        mine = [x for x in logged if x["step"] == r["step"]]
        assert r["reward"] == pytest.approx(sum(x["feature_matching"] for x in mine) / 4, abs=1e-5)
        assert r["ebft/alignment"] == pytest.approx(sum(x["alignment"] for x in mine) / 4, abs=1e-5)
        assert r["ebft/cfm_loss"] == pytest.approx(sum(x["cfm_loss"] for x in mine) / 4, abs=1e-5)

    # the GRPO path given those rewards: rl: grpo, same data, seed and trl: keys, its reward the logged one
    (tmp_path / "rwd.py").write_text(f"PATH = {str(tmp_path / 'out' / 'completions.jsonl')!r}\n" + LOOKUP)
    sys.modules.pop("rwd", None)
    grpo = structured_config("grpo.yml", rl="grpo", ebft=None, output_dir=str(tmp_path / "grpo"),
                             trl={**trl, "reward_funcs": ["rwd.logged"]},
                             datasets=[{"path": str(tmp_path / "opencode.jsonl"), "type": "rwd.opencode"}])
    raw = yaml.safe_load(grpo.read_text())
    raw.pop("ebft")
    grpo.write_text(yaml.safe_dump(raw))
    assert main(["train", str(grpo)]) == 0
    again = [json.loads(line) for line in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in again] == [r["completion"] for r in logged]  # the same draws
    assert [r["advantage"] for r in again] == pytest.approx([r["advantage"] for r in logged], abs=1e-6)
    theirs = [r for r in read_metrics(tmp_path / "grpo") if "loss" in r]
    assert [r["loss"] for r in theirs] == pytest.approx([r["loss"] for r in rows], abs=1e-6)


@pytest.mark.slow
def test_lora_uses_the_base_as_feature_network_and_validate_says_so(structured_config, tmp_path, capsys):
    config = structured_config(adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True, max_steps=1,
                               trl={"reward_funcs": ["rwd.ignored"], "importance_sampling_level": "sequence"},
                               ebft={"ce_coef": 0.1})
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert ("objective:  ebft structured (2 completions per prompt from model.generate, up to 6 tokens; beta 0; "
            "reward 1 x alignment - 1 x diversity of the hidden states at depths 0.5, 1 (last_token); feature "
            "network: the base, adapter disabled)") in out
    assert ("trl.reward_funcs, trl.importance_sampling_level: not read with rl: ebft (Axolotl's EBFT builder does "
            "not pass them") in out
    assert "ebft.ce_coef: not read in ebft.mode: structured" in out
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert len(rows) == 1 and -2.0 <= rows[0]["ebft/alignment"] <= 2.0


@pytest.mark.parametrize("extra,message", [
    ({"trl": {"sync_ref_model": True, "beta": 0.1}}, "trl.sync_ref_model: not implemented with rl: ebft"),
    ({"trl": {"async_prefetch": True}}, "Axolotl's asynchronous EBFT trainer generates with vLLM"),
    ({"trl": {"num_generations": 3}}, "must be a multiple of trl.num_generations (3)"),
    ({"ebft": {"feature_layers": [1.5]}}, "ebft.feature_layers"),
    ({"val_set_size": 0.25}, "val_set_size: no evaluation for rl: ebft"),
    ({"ebft": None}, "rl: ebft needs an ebft: block"),
    ({"ebft": {"mode": "strided"}}, "trl: not read with ebft.mode: strided"),
])
def test_unimplemented_options_are_one_line_refusals(structured_config, extra, message, capsys):
    extra = dict(extra)
    config = structured_config(ebft=extra.pop("ebft", {}), trl=extra.pop("trl", None), **extra)
    if message.startswith("rl: ebft needs"):
        raw = yaml.safe_load(config.read_text())
        raw.pop("ebft")
        config.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(config), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err


@pytest.mark.slow
def test_adaptive_max_tokens_caps_asynchronous_completions(structured_config, tmp_path, capsys):
    """With async_prefetch and use_vllm (Axolotl's asynchronous EBFT trainer), each batch's completions are capped
    at max(64, min(int(1.5 x ground-truth tokens), max_completion_length)): the ground truths here are a few tokens,
    so 64 of the 80 allowed (min_new_tokens, through trl.generation_kwargs, keeps every completion to its cap)."""
    long = {"max_completion_length": 80, "use_vllm": True, "generation_kwargs": {"min_new_tokens": 80}}
    config = structured_config(max_steps=1, trl={**long, "async_prefetch": True})
    assert main(["train", str(config)]) == 0
    captured = capsys.readouterr()
    assert "ebft.adaptive_max_tokens: each step's completions are capped at max(64" in captured.out + captured.err
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert rows[0]["completions/mean_length"] == 64
    plain = structured_config("plain.yml", max_steps=1, output_dir=str(tmp_path / "plain"),
                              trl=long)
    assert main(["train", str(plain)]) == 0
    assert [r for r in read_metrics(tmp_path / "plain") if "loss" in r][0]["completions/mean_length"] == 80


def test_a_row_without_a_ground_truth_is_one_line(structured_config, tmp_path, capsys):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "say hi"}] * 4)
    assert main(["train", str(structured_config(datasets=[{"path": str(data)}]))]) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: datasets.0: rows have no 'ground_truth' column after loading (columns: prompt)"]


def stand_in(name: str, tiny_llama, data: Path, tmp_path: Path) -> Path:
    """Axolotl's example with only the model, the data's path and split and output_dir swapped for local ones."""
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"))
    raw["datasets"] = [{**raw["datasets"][0], "path": str(data), "split": "train"}]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("name", STRUCTURED_EXAMPLES)
def test_axolotls_structured_examples_validate_on_stand_ins(name, tiny_llama, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "opencode.jsonl", [{"input": "Write a function.", "output": "def f(): pass"}] * 4)
    config = stand_in(name, tiny_llama, rows, tmp_path)
    assert main(["validate", str(config), "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    assert "objective:  ebft structured (4 completions per prompt from model.generate" in out


@pytest.mark.slow
def test_the_novllm_example_trains_on_a_stand_in(tiny_llama, tmp_path, monkeypatch):
    """examples/ebft/llama-1b-ebft-opencode-novllm.yaml (LoRA, llama3 template, 128-token completions, gradient
    checkpointing), two steps on the tiny model and a local OpenCodeInstruct-shaped file."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    rows = [{"input": f"Write a function that returns {i}.", "output": f"def f():\n    return {i}\n"} for i in range(8)]
    config = stand_in(STRUCTURED_EXAMPLES[0], tiny_llama, write_jsonl(tmp_path / "oc.jsonl", rows), tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw.update(max_steps=2, wandb_project=None)
    config.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}, sort_keys=False))
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions"] == 4 for r in rows)
