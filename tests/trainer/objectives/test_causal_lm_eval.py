"""do_causal_lm_eval: eval_causal_lm_metrics at every evaluation, logged as eval_<metric>.

perplexity: Axolotl's perplexity of the reference answers. The oracle is Axolotl's Perplexity.compute, written
out here (axolotl/utils/callbacks/perplexity.py): one padded batch, windows of max_seq_len with stride 512, the
model's own loss.

sacrebleu, ter, chrf: greedy generations from each validation prompt, scored against the reference answers. The
oracle is the sacrebleu package's own corpus scores on the generations the run wrote (output_dir/
eval_generations.jsonl), called as evaluate's metric scripts call it; the last evaluation's generations are the
final model's own greedy continuations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import read_metrics, write_jsonl
from trainer.cli import main
from trainer.config import load_config, parse_config
from trainer.errors import ConfigError
from trainer.objectives.causal_lm_eval import metrics, perplexity, references


def axolotl_perplexity(model, tokenizer, refs, max_seq_len, stride=512):
    input_ids = tokenizer(refs, return_tensors="pt", padding=True, truncation=True)["input_ids"]
    length, losses, prev_end = input_ids.size(1), [], 0
    for begin in range(0, length, stride):
        end = min(begin + max_seq_len, length)
        trg_len = end - prev_end
        ids = input_ids[:, begin:end]
        labels = ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=labels).loss)
        prev_end = end
        if end == length:
            break
    return torch.exp(torch.stack(losses).mean()).item()


@pytest.mark.parametrize("window", [6, 64])
def test_perplexity_is_axolotls(tiny_llama, window):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    refs = ["the quick brown fox", "paris", "two plus four nine water boils the lazy dog while cats sleep"] * 7
    ours = perplexity(model, tokenizer, refs, window, "cpu", chunk=4)  # rows in chunks: same value
    assert ours == pytest.approx(axolotl_perplexity(model, tokenizer, refs, window), rel=1e-5)


def test_training_logs_eval_perplexity(make_config, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.data.prepare import load_tokenizer, prepare

    config = make_config(val_set_size=8, eval_steps=2, max_steps=4, do_causal_lm_eval=True,
                         eval_causal_lm_metrics=["perplexity"], eval_max_new_tokens=8)
    assert main(["train", str(config)]) == 0
    cfg, _ = load_config(config)
    rows = [r for r in read_metrics(cfg.output_dir) if "eval_loss" in r]
    assert [r["step"] for r in rows] == [2, 4] and rows[0]["eval_perplexity"] != rows[1]["eval_perplexity"]
    # the last one is the final model's perplexity of the validation split's answers
    tokenizer = load_tokenizer(cfg)
    refs = references(prepare(cfg, tokenizer).validation, tokenizer)
    assert all(refs) and len(refs) == 8
    final = AutoModelForCausalLM.from_pretrained(f"{cfg.output_dir}/final").eval()
    assert rows[1]["eval_perplexity"] == pytest.approx(axolotl_perplexity(final, tokenizer, refs, 8), rel=1e-4)


def answers_file(path):
    """Alpaca rows whose answers a tiny model learns in a few steps: a fixed phrase, then a word per instruction."""
    words = ["red", "blue", "green", "cat"]
    return write_jsonl(path, [{"instruction": f"Name {i % 4}.", "input": "",
                               "output": f"the answer to this one is {words[i % 4]}"} for i in range(48)])


@pytest.mark.slow
def test_training_logs_sacrebleu_ter_chrf_of_its_generations(make_config, tmp_path):
    import json

    import sacrebleu
    from transformers import AutoModelForCausalLM

    from trainer.data.prepare import load_tokenizer, prepare

    common = dict(datasets=[{"path": str(answers_file(tmp_path / "answers.jsonl")), "type": "alpaca"}],
                  val_set_size=8, eval_steps=6, save_steps=6, max_steps=12, learning_rate=1e-2, micro_batch_size=4,
                  eval_batch_size=3, do_causal_lm_eval=True, eval_max_new_tokens=10,
                  eval_causal_lm_metrics=["sacrebleu", "ter", "chrf", "perplexity"])
    config = make_config(**common)
    assert main(["train", str(config)]) == 0
    cfg, _ = load_config(config)
    rows = [r for r in read_metrics(cfg.output_dir) if "eval_loss" in r]
    assert [r["step"] for r in rows] == [6, 12]
    written = [json.loads(line) for line in (Path(cfg.output_dir) / "eval_generations.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(cfg)
    refs = references(prepare(cfg, tokenizer).validation, tokenizer)
    for row in rows:
        mine = [w for w in written if w["step"] == row["step"]]
        assert [w["reference"] for w in mine] == refs and len(refs) == 8
        predictions = [w["prediction"] for w in mine]
        assert row["eval_sacrebleu"] == sacrebleu.corpus_bleu(predictions, [refs]).score
        assert row["eval_ter"] == sacrebleu.TER().corpus_score(predictions, [refs]).score
        assert row["eval_chrf"] == sacrebleu.CHRF().corpus_score(predictions, [refs]).score
    assert rows[1]["eval_sacrebleu"] > 0 and rows[1]["eval_ter"] < 100  # the answers were learnt
    # the last evaluation's predictions are the final model's greedy continuations of the prompts, one at a time
    final = AutoModelForCausalLM.from_pretrained(f"{cfg.output_dir}/final").eval()
    for w in written[-8:]:
        prompt = tokenizer(w["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = final.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True) == w["prediction"]
    assert "Response:" in written[0]["prompt"] and "Response:" not in written[0]["reference"]
    # resumed from checkpoint-6, the run cuts its generations back to step 6, as metrics.jsonl: each evaluation once
    assert main(["train", str(make_config("resumed.yml", resume_from_checkpoint=f"{cfg.output_dir}/checkpoint-6",
                                          **common))]) == 0
    again = [json.loads(line) for line in (Path(cfg.output_dir) / "eval_generations.jsonl").read_text().splitlines()]
    assert [w["step"] for w in again] == [6] * 8 + [12] * 8 and again[:8] == written[:8]


BASE = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}]}


def test_comet_is_refused_and_left_out_of_the_default_list(make_config, capsys):
    config = make_config(do_causal_lm_eval=True, eval_causal_lm_metrics=["sacrebleu", "comet"])
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert ("eval_causal_lm_metrics: comet not supported (it needs the unbabel-comet package and the "
            "Unbabel/wmt22-comet-da model from the Hugging Face Hub, which this trainer does not fetch)") in err
    assert "Traceback" not in err
    # unset: Axolotl's default list (sacrebleu, comet, ter, chrf) less comet, said in one note
    assert main(["validate", str(make_config(val_set_size=4, do_causal_lm_eval=True))]) == 0
    out = capsys.readouterr()
    assert ("eval_causal_lm_metrics: unset, so sacrebleu, ter and chrf (Axolotl's default list without comet"
            in out.out + out.err)
    assert "sacrebleu (do_causal_lm_eval: sacrebleu, ter, chrf)" in out.out  # the package the plan installs
    cfg, _ = parse_config({**BASE, "do_causal_lm_eval": True})
    assert metrics(cfg, None).metrics == ["sacrebleu", "ter", "chrf"]
    # perplexity alone needs no package; comet listed without do_causal_lm_eval is not read (as in Axolotl)
    assert main(["validate", str(make_config(val_set_size=4, do_causal_lm_eval=True,
                                             eval_causal_lm_metrics=["perplexity"]))]) == 0
    assert "sacrebleu" not in capsys.readouterr().out
    parse_config({**BASE, "eval_causal_lm_metrics": ["comet"]})


def test_a_run_without_sacrebleu_stops_before_training_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # not installed: `import sacrebleu` raises ImportError
    cfg, _ = parse_config({**BASE, "do_causal_lm_eval": True, "eval_causal_lm_metrics": ["perplexity", "chrf"]})
    with pytest.raises(ConfigError, match=r"^eval_causal_lm_metrics: chrf need the sacrebleu package, which is not "
                                          r"installed in this environment; install the eval extra: pip install "
                                          r"'envtool-llm\[eval\]' \(sacrebleu\)$"):
        metrics(cfg, None)
    assert metrics(parse_config({**BASE, "do_causal_lm_eval": True, "eval_causal_lm_metrics": ["perplexity"]})[0],
                   None).metrics == ["perplexity"]  # perplexity alone does not need it


def test_table_logging_is_a_note():
    _, notes = parse_config({**BASE, "eval_table_size": 2, "wandb_project": "p"})  # a tracker's output, not training
    assert any(n.startswith("eval_table_size: ignored (no prediction tables are logged") for n in notes)
    _, notes = parse_config({**BASE, "eval_table_size": 2, "eval_max_new_tokens": 32})
    assert any(n.startswith("eval_table_size: ignored") for n in notes)
