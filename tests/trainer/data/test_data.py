"""Prompt formats, label masking, length filtering, and the preprocessing cache."""

from __future__ import annotations

import json
import threading

import pytest
from transformers import AutoTokenizer

import trainer.data.prepare as data_mod
from tests.trainer.helpers import alpaca_rows, run_cli, write_jsonl
from trainer.batch.labels import IGNORE
from trainer.config import DatasetConfig, load_config
from trainer.data.formats.prompts import tokenize_row
from trainer.data.prepare import default_workers, load_tokenizer, prepare
from trainer.errors import DataError, TrainerError


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def trained_text(tokenizer, out) -> str:
    return tokenizer.decode([t for t, l in zip(out["input_ids"], out["labels"]) if l != IGNORE])


def test_alpaca_trains_on_the_response_only(tokenizer):
    ds = DatasetConfig(path="x.jsonl", type="alpaca")
    row = {"instruction": "Name the capital.", "input": "France", "output": "The capital is Paris."}
    out = tokenize_row(row, ds, tokenizer, train_on_inputs=False)
    assert out["input_ids"][0] == tokenizer.bos_token_id
    assert trained_text(tokenizer, out) == "The capital is Paris.</s>"
    assert "### Input:\nFrance" in tokenizer.decode(out["input_ids"])
    everything = tokenize_row(row, ds, tokenizer, train_on_inputs=True)
    assert everything["labels"] == everything["input_ids"]


def test_alpaca_field_mapping_and_missing_field(tokenizer):
    ds = DatasetConfig(path="x.jsonl", type="alpaca", field_instruction="q", field_output="a")
    out = tokenize_row({"q": "Say hi.", "a": "hi"}, ds, tokenizer, False)
    assert trained_text(tokenizer, out) == "hi</s>"
    with pytest.raises(DataError, match=r"a row has no 'a' field .*columns are \['q'\]"):
        tokenize_row({"q": "Say hi."}, ds, tokenizer, False)


def test_chat_template_trains_on_assistant_turns_without_their_header(tokenizer):
    ds = DatasetConfig(path="x.jsonl", type="chat_template", field_messages="conversations",
                       message_property_mappings={"role": "from", "content": "value"},
                       roles={"user": ["human"], "assistant": ["gpt"]})
    row = {"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Capital of France?"},
        {"from": "gpt", "value": "Paris."},
        {"from": "human", "value": "And Italy?"},
        {"from": "gpt", "value": "Rome."},
    ]}
    out = tokenize_row(row, ds, tokenizer, train_on_inputs=False)
    assert trained_text(tokenizer, out) == "Paris.<|im_end|>\nRome.<|im_end|>\n"
    full = tokenizer.decode(out["input_ids"])
    assert full.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "<|im_start|>user\nAnd Italy?" in full


def test_sharegpt_roles_map_without_a_roles_key_as_in_axolotl(tokenizer):
    """No `roles`: human/gpt are user/assistant (Axolotl's default), so the gpt turns are the trained ones."""
    ds = DatasetConfig(path="x.jsonl", type="chat_template", field_messages="conversations",
                       message_property_mappings={"role": "from", "content": "value"})
    row = {"conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]}
    out = tokenize_row(row, ds, tokenizer, train_on_inputs=False)
    assert trained_text(tokenizer, out) == "Paris.<|im_end|>\n"
    assert "<|im_start|>user\nCapital of France?" in tokenizer.decode(out["input_ids"])


def test_chat_template_needs_a_template(tokenizer):
    bare = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    ds = DatasetConfig(path="x.jsonl", type="chat_template")
    with pytest.raises(DataError, match="has no chat template; set chat_template: chatml"):
        tokenize_row({"messages": [{"role": "user", "content": "hi"}]}, ds, bare, False)


def test_completion_and_input_output(tokenizer):
    out = tokenize_row({"text": "the quick fox"}, DatasetConfig(path="x", type="completion"), tokenizer, False)
    assert trained_text(tokenizer, out) == "the quick fox</s>"
    segments = [{"text": "Q: two plus two?", "label": False}, {"text": " A: four", "label": True},
                {"text": " (checked)", "label": False}]
    out = tokenize_row({"segments": segments}, DatasetConfig(path="x", type="input_output"), tokenizer, False)
    assert tokenizer.decode(out["input_ids"]) == "Q: two plus two? A: four (checked)"  # no special tokens added
    assert trained_text(tokenizer, out) == " A: four"


def test_default_worker_count_is_capped(monkeypatch, make_config):
    cfg, _ = load_config(make_config())
    monkeypatch.setattr(data_mod.os, "cpu_count", lambda: 96)
    assert default_workers(cfg) == 8
    monkeypatch.setattr(data_mod.os, "cpu_count", lambda: 2)
    assert default_workers(cfg) == 2
    cfg.dataset_processes = 3
    assert default_workers(cfg) == 3


def test_too_long_rows_are_dropped_or_truncated_and_counted(make_config, tmp_path):
    rows = alpaca_rows(40, long_every=5)  # 8 rows of ~60 words
    path = write_jsonl(tmp_path / "skewed.jsonl", rows)
    cfg, _ = load_config(make_config(datasets=[{"path": str(path), "type": "alpaca"}], sequence_len=200))
    tok = load_tokenizer(cfg)
    logged = []
    dropped = prepare(cfg, tok, log=logged.append)
    assert dropped.stats["dropped_too_long"] == 8 and dropped.stats["train_rows"] == 32
    assert max(dropped.train["length"]) <= 200
    assert any("8 of 40 rows are longer than sequence_len 200: dropped" in m for m in logged)
    cfg.excess_length_strategy = "truncate"
    truncated = prepare(cfg, tok, log=logged.append)
    assert truncated.stats["truncated"] == 8 and truncated.stats["train_rows"] == 40
    assert max(truncated.train["length"]) == 200
    assert truncated.path != dropped.path  # the strategy is part of the cache key


def test_cache_is_reused_and_keyed_by_data_tokenizer_and_config(make_config, alpaca_file, monkeypatch):
    cfg, _ = load_config(make_config(val_set_size=0.25))
    tok = load_tokenizer(cfg)
    first = prepare(cfg, tok)
    assert (first.stats["train_rows"], first.stats["validation_rows"]) == (36, 12)
    built = []
    monkeypatch.setattr(data_mod, "build", lambda *a: built.append(1) or pytest.fail("cache not reused"))
    again = prepare(cfg, tok)
    assert again.path == first.path and again.train["input_ids"] == first.train["input_ids"] and not built
    monkeypatch.undo()
    cfg.sequence_len = 300
    assert prepare(cfg, tok).path != first.path
    write_jsonl(alpaca_file, alpaca_rows(48, seed=1))  # same file name, new content
    cfg.sequence_len = 256
    assert prepare(cfg, tok).path != first.path
    tok.add_tokens(["<new>"])
    assert prepare(cfg, tok).path != first.path


def test_other_ranks_wait_for_rank_zero(make_config, monkeypatch):
    cfg, _ = load_config(make_config())
    tok = load_tokenizer(cfg)
    calls = []
    real_build = data_mod.build
    monkeypatch.setattr(data_mod, "build", lambda *a: calls.append(1) or real_build(*a))
    results = {}
    waiter = threading.Thread(target=lambda: results.update(rank1=prepare(cfg, tok, rank=1)))
    waiter.start()  # rank 1 starts first and must not prepare
    results["rank0"] = prepare(cfg, tok, rank=0)
    waiter.join(timeout=60)
    assert calls == [1]
    assert results["rank1"].train["input_ids"] == results["rank0"].train["input_ids"]


def test_waiting_rank_times_out_with_a_clear_message(make_config):
    cfg, _ = load_config(make_config(dataset_prepare_timeout=1))
    with pytest.raises(TrainerError, match=r"rank 1 waited 1s for rank 0 to prepare the dataset cache"):
        prepare(cfg, load_tokenizer(cfg), rank=1)


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_parquet_and_csv_files(make_config, tmp_path, suffix):
    import pandas as pd

    frame = pd.DataFrame(alpaca_rows(12))
    path = tmp_path / f"data.{suffix}"
    frame.to_parquet(path) if suffix == "parquet" else frame.to_csv(path, index=False)
    cfg, _ = load_config(make_config(datasets=[{"path": str(path), "type": "alpaca"}]))
    assert prepare(cfg, load_tokenizer(cfg)).stats["train_rows"] == 12


@pytest.mark.slow
def test_preprocess_cli_reports_and_bad_rows_exit_2(make_config, tmp_path):
    result = run_cli("preprocess", str(make_config()), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["train_rows"] == 48
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "answer": "y"}])
    result = run_cli("preprocess", str(make_config("bad.yml", datasets=[{"path": str(bad), "type": "alpaca"}])))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: dataset ")
    assert "has no 'instruction' field" in result.stderr and "Traceback" not in result.stderr


def test_exact_duplicates_are_dropped_when_asked_and_counted(make_config, tmp_path):
    rows = alpaca_rows(12)
    path = write_jsonl(tmp_path / "dupes.jsonl", rows + rows[:5])  # 5 rows twice
    config = make_config(datasets=[{"path": str(path), "type": "alpaca"}])
    cfg, _ = load_config(config)
    tok = load_tokenizer(cfg)
    assert prepare(cfg, tok).stats["train_rows"] == 17
    cfg.dataset_exact_deduplication = True
    deduped = prepare(cfg, tok)
    assert deduped.stats["dropped_duplicates"] == 5 and deduped.stats["train_rows"] == 12
    assert len({tuple(ids) for ids in deduped.train["input_ids"]}) == 12


@pytest.mark.slow
def test_a_damaged_cache_is_rebuilt_leftovers_go_and_a_full_disk_is_one_line(make_config, tmp_path):
    """Issue 22, through `python -m trainer preprocess`: bytes overwritten inside the prepared .arrow (same size),
    a deleted stats.json, a killed run's temp directory; then a full and a read-only dataset_prepared_path
    (small tmpfs mounts in a user+mount namespace of their own: `unshare -rm`, no privileges needed)."""
    import hashlib
    import subprocess
    import sys

    config = make_config()
    first = run_cli("preprocess", str(config), "--json")
    assert first.returncode == 0, first.stderr
    cache = tmp_path / "prepared" / json.loads(first.stdout)["path"].rsplit("/", 1)[-1]
    arrow = next((cache / "train").glob("*.arrow"))
    digest = hashlib.sha256(arrow.read_bytes()).hexdigest()
    with open(arrow, "r+b") as f:  # 4 KB of other bytes inside the file: its size stays
        f.seek(arrow.stat().st_size // 2)
        f.write(bytes(4096))
    leftover = cache.with_name(f".{cache.name}.tmp-4194301")  # what a SIGKILLed preparation leaves
    (leftover / "train").mkdir(parents=True)
    again = run_cli("preprocess", str(config), "--json")
    assert again.returncode == 0, again.stderr
    assert f"the dataset cache {cache} is damaged (the bytes of train/{arrow.name} changed" in again.stderr
    assert hashlib.sha256(arrow.read_bytes()).hexdigest() == digest  # rebuilt: the rows it had, not others
    assert not leftover.exists()
    (cache / "stats.json").unlink()
    again = run_cli("preprocess", str(config), "--json")
    assert again.returncode == 0 and "(stats.json is missing)" in again.stderr, again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name, f"{cache.name}.lock"]

    full, read_only = tmp_path / "full", tmp_path / "ro"
    full.mkdir(), read_only.mkdir()
    (tmp_path / "full.yml").write_text(config.read_text().replace(str(tmp_path / "prepared"), str(full)))
    (tmp_path / "ro.yml").write_text(config.read_text().replace(str(tmp_path / "prepared"), str(read_only)))
    trainer = f"{sys.executable} -m trainer preprocess"
    script = (f"mount -t tmpfs -o size=16k tmpfs {full} && mount -t tmpfs -o ro,size=16k tmpfs {read_only} && "
              f"{trainer} {tmp_path / 'full.yml'}; echo \"exit $?\"; ls -A {full}; echo ---; "
              f"{trainer} {tmp_path / 'ro.yml'}; echo \"exit $?\"")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    report, _, after = out.stdout.partition("---")
    assert "exit 1" in report and [line for line in report.split("exit 1")[1].split() if "tmp" in line] == []
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and "Traceback" not in out.stderr, out.stderr
    assert "no space left on the device of dataset_prepared_path" in lines[0] and "nothing was left behind" in lines[0]
    assert "exit 2" in after and f"dataset_prepared_path {read_only}: cannot write the dataset cache there" in lines[1]


@pytest.mark.slow
def test_local_data_files_without_a_path_are_prepared(make_config, alpaca_file):
    """Axolotl's `data_files:` with no `path`: local files, so no Hub probe, and the cache's manifest lists the
    cache's own files (two helpers once shared the name `_files`, and the dataset one was shadowed)."""
    config = make_config(datasets=[{"data_files": str(alpaca_file), "type": "alpaca"}])
    result = run_cli("preprocess", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prepared" in result.stdout and "training" in result.stdout
