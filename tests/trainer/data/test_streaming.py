"""Streamed data (pretraining_dataset, streaming: true), pre-tokenized rows and reinit_weights: on CPU, with
local files as the stream."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import (
    WORDS,
    alpaca_rows,
    read_metrics,
    run_cli,
    train_losses,
    train_then_resume,
    write_jsonl,
)
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError, DataError


def texts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90)))} for i in range(n)]


@pytest.fixture
def text_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "text.jsonl", texts(24))


@pytest.fixture
def pretrain_config(make_config, text_file):
    def make(name="pretrain.yml", **overrides):
        base = dict(datasets=None, pretraining_dataset=[{"path": str(text_file), "type": "pretrain",
                                                         "text_column": "text", "split": "train"}],
                    streaming_multipack_buffer_size=6, sample_packing=True, sequence_len=48, micro_batch_size=2,
                    gradient_accumulation_steps=2, max_steps=6, save_steps=2)
        return make_config(name, **{**base, **overrides})

    return make


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def stream_of(config_path, rank=0, world=1):
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer
    from trainer.data.streaming import Stream

    cfg, _ = load_config(config_path)
    return Stream(cfg, load_tokenizer(cfg), rank, world), cfg


# --- config --------------------------------------------------------------------------------------------

def test_stream_keys_are_checked(tiny_llama):
    base = {"base_model": str(tiny_llama), "pretraining_dataset": [{"path": "allenai/c4", "name": "en"}]}
    with pytest.raises(ConfigError, match="needs max_steps"):
        parse_config(base)
    _, notes = parse_config({**base, "max_steps": 3, "val_set_size": 0.1})  # Axolotl ignores it there too
    assert any(n.startswith("val_set_size: 0.1 ignored with pretraining_dataset") for n in notes)
    with pytest.raises(ConfigError, match="val_set_size must be 0"):
        parse_config({"base_model": "m", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "streaming": True,
                      "max_steps": 3, "val_set_size": 0.1})
    with pytest.raises(ConfigError, match="datasets or pretraining_dataset, not both"):
        parse_config({**base, "max_steps": 3, "datasets": [{"path": "x.jsonl", "type": "alpaca"}]})
    with pytest.raises(ConfigError, match="datasets: Field required"):
        parse_config({"base_model": "m"})
    with pytest.raises(ConfigError, match="reinit_weights: not with an adapter"):
        parse_config({**base, "max_steps": 3, "reinit_weights": True, "adapter": "lora"})
    with pytest.raises(ConfigError, match="not with group_by_length"):
        parse_config({**base, "max_steps": 3, "group_by_length": True})
    cfg, _ = parse_config({**base, "max_steps": 3, "pretrain_multipack_buffer_size": 7})
    assert cfg.stream_buffer_size == 7 and cfg.pretraining_dataset[0].text_column == "text"


def test_only_the_first_pretraining_dataset_entry_is_streamed_as_in_axolotl(tiny_llama, pretrain_config, text_file,
                                                                            capsys):
    """Axolotl streams pretraining_dataset[0] only (utils/data/sft.py _extract_pretraining_config); a second entry,
    such as users' `type: eval`, is not read there, nor here, and a note says so where before it was refused."""
    from trainer.cli import main

    entries = [{"path": "allenai/c4", "name": "en"}, {"path": "my/held-out", "type": "eval"}]
    cfg, notes = parse_config({"base_model": str(tiny_llama), "max_steps": 3, "pretraining_dataset": entries})
    assert [e.path for e in cfg.pretraining_dataset] == ["allenai/c4"]
    assert "pretraining_dataset.1 (path: my/held-out, type: eval): not read; as in Axolotl, only the first " \
           "pretraining_dataset entry is streamed" in "\n".join(notes)
    config = pretrain_config(pretraining_dataset=[{"path": str(text_file)}, {"path": "elsewhere.jsonl", "type": "eval"}])
    assert main(["validate", str(config)]) == 0
    said = capsys.readouterr()
    assert "pretraining_dataset.1 (path: elsewhere.jsonl, type: eval): not read" in said.out + said.err


# --- what the stream holds -----------------------------------------------------------------------------

def test_pretrain_windows_cover_the_text_as_axolotls_pretrain_type(tiny_llama):
    """Windows of sequence_len - 1 tokens overlapping by the stride, each + EOS; together they are the text."""
    from trainer.data.streaming import pretrain_windows

    tok = tokenizer_of(tiny_llama)
    text = " ".join(WORDS * 6)
    whole = tok(text, add_special_tokens=True)["input_ids"]
    windows = pretrain_windows(text, tok, 32)
    stride = min(256, 31 // 2)
    assert len(windows) > 2 and all(len(w["input_ids"]) <= 32 for w in windows)
    assert all(w["input_ids"][-1] == tok.eos_token_id and w["labels"] == w["input_ids"] for w in windows)
    prefix = tok("")["input_ids"]  # special tokens the tokenizer puts before every window (BOS)
    assert all(w["input_ids"][:len(prefix)] == prefix for w in windows)
    rebuilt = windows[0]["input_ids"][:-1]
    for w in windows[1:]:
        body = w["input_ids"][len(prefix):-1]
        assert body[:stride] == rebuilt[-stride:]  # the overlap repeats the previous window's tail
        rebuilt += body[stride:]
    assert rebuilt == whole


def test_each_rank_reads_its_own_rows_and_the_stream_repeats(pretrain_config):
    """Two ranks: in every pass, disjoint documents whose union is the file; a pass that ends starts again,
    reshuffled, so every rank always has a next micro-batch (no rank runs dry before max_steps)."""
    def doc_ids(stream, pass_index):  # the documents whose first window this rank has, in order
        text = [stream.tokenizer.decode(e["input_ids"], skip_special_tokens=True) for e in stream.examples(pass_index)]
        return [t.split(":")[0] for t in text if t.startswith("doc ")]

    config = pretrain_config(shuffle_merged_datasets=True)
    streams = [stream_of(config, rank, 2)[0] for rank in (0, 1)]
    for pass_index in (0, 1):
        mine = [doc_ids(s, pass_index) for s in streams]
        assert set(mine[0]).isdisjoint(mine[1]) and set(mine[0]) | set(mine[1]) == {f"doc {i}" for i in range(24)}
    assert doc_ids(streams[0], 0) != doc_ids(streams[0], 1)
    skipping = stream_of(pretrain_config(shuffle_merged_datasets=False, pretraining_dataset=[
        {**streams[0].cfg.pretraining_dataset[0].model_dump(), "skip": 20}]))[0]
    assert doc_ids(skipping, 0) == ["doc 20", "doc 21", "doc 22", "doc 23"]  # skip: the stream's first rows
    cfg = streams[0].cfg
    for stream in streams:
        batches = list(itertools.islice(iter(stream), 40))  # many more micro-batches than one pass holds
        assert len(batches) == 40 and all(len(b) == cfg.micro_batch_size for b in batches)
        assert all(sum(len(e["input_ids"]) for e in row) <= cfg.sequence_len for b in batches for row in b)


def test_unpacked_pretraining_keeps_each_texts_start_as_axolotl(pretrain_config, text_file):
    """Without sample_packing Axolotl's encode_streaming truncates each text to sequence_len - 2 tokens."""
    stream, cfg = stream_of(pretrain_config(sample_packing=False, shuffle_merged_datasets=False))
    tok = stream.tokenizer
    docs = [json.loads(line)["text"] for line in text_file.read_text().splitlines()]
    assert [e["input_ids"] for e in stream.examples(0)] == [tok(d)["input_ids"][:46] for d in docs]
    assert all(len(row) == 1 for batch in itertools.islice(iter(stream), 5) for row in batch)


def test_streamed_sft_rows_are_the_prepared_rows(make_config, tmp_path):
    """streaming: true tokenizes each row exactly as the prepared path does (same prompt format, same filter)."""
    from trainer.config import load_config
    from trainer.data.prepare import build, load_tokenizer

    data = write_jsonl(tmp_path / "a.jsonl", alpaca_rows(20, long_every=5))
    common = dict(datasets=[{"path": str(data), "type": "alpaca"}], sequence_len=120, shuffle_merged_datasets=False)
    stream, _ = stream_of(make_config("s.yml", streaming=True, **common))
    cfg, _ = load_config(make_config("p.yml", **common))
    prepared, _, stats = build(cfg, load_tokenizer(cfg))
    assert stats["dropped_too_long"] > 0
    assert [e["input_ids"] for e in stream.examples(0)] == prepared["input_ids"]
    assert [e["labels"] for e in stream.examples(0)] == prepared["labels"]


# --- training ------------------------------------------------------------------------------------------

def test_pretraining_trains_and_resumes_with_the_next_unseen_rows(pretrain_config, tmp_path):
    """6 steps of 2x2 packed micro-batches pass over the 24-document file more than once; a run resumed from
    checkpoint-2 takes exactly the uninterrupted run's steps 3..6 (same losses: same rows, same order)."""
    full, _ = train_then_resume(main, pretrain_config, tmp_path, checkpoint=2, reinit_weights=True,
                                learning_rate=3e-3)
    rows = [r for r in read_metrics(full) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["tokens"] > 2 * 2 * 48 * 0.6 for r in rows)  # packed: bins mostly full
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert json.loads((full / "checkpoint-2" / "trainer_state.json").read_text())["sampler"]["consumed"] == 4


@pytest.mark.slow  # trains 4 steps and evaluates twice in process: 4-6 s
def test_a_streamed_run_evaluates_on_its_test_datasets(pretrain_config, text_file, tmp_path):
    """Axolotl's advice for evaluating a pretraining run ("use test_datasets", its validation of val_set_size with
    pretraining_dataset): the test rows are prepared up front and evaluated every eval_steps while the training rows
    stream, where before such a config was refused."""
    out = tmp_path / "out"
    config = pretrain_config(output_dir=str(out), max_steps=4, eval_steps=2, save_steps=None,
                             test_datasets=[{"path": str(text_file), "type": "completion", "split": "train"}])
    assert main(["train", str(config)]) == 0
    evals = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_loss"] > 0 for r in evals)


def test_pretrain_multipack_attn_false_lets_packed_documents_attend(pretrain_config, tmp_path):
    losses = {}
    for attn in (True, False):
        out = tmp_path / f"attn-{attn}"
        assert main(["train", str(pretrain_config(f"{attn}.yml", output_dir=str(out), pretrain_multipack_attn=attn,
                                                  sequence_len=256, max_steps=1, save_steps=None))]) == 0
        losses[attn] = train_losses(out)[1]
    assert losses[True] != pytest.approx(losses[False], rel=1e-6)  # same tokens, different attention


def test_streamed_sft_trains_and_resumes(make_config, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_rows(30, seed=2))
    train_then_resume(main, make_config, tmp_path, checkpoint=2, streaming=True, streaming_multipack_buffer_size=8,
                      sample_packing=True, datasets=[{"path": str(data), "type": "alpaca"}], max_steps=5,
                      save_steps=2, gradient_accumulation_steps=2)


def test_reinit_weights_starts_from_the_seeded_config_not_the_weights(make_config, tiny_llama, tmp_path):
    """With a learning rate too small to move the weights, the final model is AutoModelForCausalLM.from_config
    under the seed, and not the pretrained weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "reinit"
    assert main(["train", str(make_config(output_dir=str(out), reinit_weights=True, learning_rate=1e-12,
                                          max_steps=1, seed=5))]) == 0
    trained = load_file(str(out / "final" / "model.safetensors"))
    torch.manual_seed(5)
    oracle = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_llama))).state_dict()
    base = load_file(str(Path(tiny_llama) / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(trained[name], oracle[name], atol=1e-6)
    assert not torch.allclose(trained[name], base[name], atol=1e-3)


@pytest.mark.slow
def test_axolotls_streaming_pretrain_example_trains_with_only_model_and_data_swapped(tiny_llama, text_file, tmp_path):
    """examples/streaming/pretrain.yaml as Axolotl ships it (copy in data/axolotl_examples/), with a local
    model and file, and 3 of its 1000 steps: 8 accumulated micro-batches of one packed 1024-token row each."""
    import yaml

    raw = yaml.safe_load((Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "streaming__pretrain.yaml").read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"), max_steps=3)
    raw["pretraining_dataset"][0].update(path=str(text_file))
    config = tmp_path / "pretrain.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [3]  # the example logs every 10 steps, and the last
    assert rows[0]["tokens"] > 8 * 1024 * 0.5  # 8 micro-batches of packed windows per step


def test_a_typed_pretraining_dataset_streams_rows_tokenized_as_that_type(pretrain_config, tmp_path):
    """Axolotl's diffusion pretrain example streams `type: completion` rows: each is the completion type's
    tokens (the whole text plus EOS, every token trained), not pretrain windows."""
    from trainer.config import DatasetConfig
    from trainer.data.prepare import tokenize_example

    config = pretrain_config(pretraining_dataset=[{"path": str(tmp_path / "text.jsonl"), "type": "completion",
                                                   "field": "text"}], sample_packing=False, sequence_len=128)
    stream, cfg = stream_of(config)
    got = list(itertools.islice(stream.examples(0), 6))
    want = [tokenize_example(row, DatasetConfig(path="x", type="completion"), cfg, stream.tokenizer)
            for row in texts(24)]
    by_ids = {tuple(w["input_ids"]): w for w in want}
    for example in got:
        match = by_ids[tuple(example["input_ids"])]
        assert example["labels"] == match["labels"]
        assert example["input_ids"][-1] == stream.tokenizer.eos_token_id
    with pytest.raises(ConfigError, match="type: got 'alpaca_chat'; use pretrain or an SFT type"):
        parse_config({"base_model": "x", "max_steps": 1, "pretraining_dataset": [{"path": "x", "type": "alpaca_chat"}]})


def test_axolotls_diffusion_pretrain_example_trains_with_only_model_and_data_swapped(tiny_llama, text_file, tmp_path):
    """examples/llama-3/diffusion/pretrain-1b.yaml (copy in data/axolotl_examples/): the diffusion objective on
    streamed `type: completion` rows, 2 of its steps."""
    import yaml

    raw = yaml.safe_load((Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "llama-3__diffusion__pretrain-1b.yaml").read_text())
    raw.update(base_model=str(tiny_llama), output_dir=str(tmp_path / "out"), max_steps=2, sequence_len=128)
    raw["pretraining_dataset"][0].update(path=str(text_file), name=None)
    raw["diffusion"]["generate_samples"] = False  # sampling is covered in test_diffusion.py
    config = tmp_path / "pretrain-diffusion.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_masked_tokens"] > 0 for r in rows)


def test_diffusion_on_a_stream_resumes_exactly(pretrain_config, tmp_path):
    """The diffusion masks are keyed by each streamed example's index (pass, row, window), which the replayed
    stream gives again: a resumed run takes the uninterrupted run's later steps, loss for loss."""
    from trainer.config.diffusion import PLUGIN

    train_then_resume(main, pretrain_config, tmp_path, checkpoint=2, plugins=[PLUGIN],
                      diffusion={"mask_token_id": 5, "eps": 1e-3}, attn_implementation="sdpa", max_steps=4)


# --- pre-tokenized rows (a dataset entry without type) --------------------------------------------------

def test_pretokenized_rows_train_as_given(make_config, tiny_llama, tmp_path):
    """input_ids and labels are used as they are (-100 labels not trained), attention_mask 0 positions dropped."""
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer, prepare

    tok = tokenizer_of(tiny_llama)
    rows = []
    for r in alpaca_rows(16):
        prompt, answer = tok(r["instruction"])["input_ids"], tok(r["output"], add_special_tokens=False)["input_ids"]
        ids = prompt + answer + [tok.eos_token_id]
        rows.append({"input_ids": ids + [0, 0], "attention_mask": [1] * len(ids) + [0, 0],
                     "labels": [-100] * len(prompt) + answer + [tok.eos_token_id] + [-100, -100]})
    data = write_jsonl(tmp_path / "tok.jsonl", rows)
    config = make_config(datasets=[{"path": str(data), "type": None}], shuffle_merged_datasets=False)
    cfg, _ = load_config(config)
    prepared = prepare(cfg, load_tokenizer(cfg))
    assert prepared.train["input_ids"] == [r["input_ids"][:-2] for r in rows]
    assert prepared.train["labels"] == [r["labels"][:-2] for r in rows]
    assert main(["train", str(config)]) == 0
    assert len(train_losses(tmp_path / "out")) == 4


@pytest.mark.slow
def test_pretokenized_rows_without_input_ids_are_bad_input(make_config, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_rows(8))
    result = run_cli("train", str(make_config(datasets=[{"path": str(data)}])))
    assert result.returncode == 2, result.stderr
    assert "pre-tokenized rows, which need an `input_ids` list" in result.stderr.strip().splitlines()[-1]


# --- several processes ---------------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_fsdp2_muon_pretraining_finish_and_resume(pretrain_config, tmp_path):
    """Axolotl's qwen2/muon-pretrain-fsdp2 shape (pretraining_dataset, reinit_weights, optimizer: muon, FSDP2)
    on 2 processes over gloo: 23 documents split unevenly between the ranks, each rank's stream wraps around at
    its own pace, and both take max_steps steps (a hang fails the test: hard timeout); resumed from checkpoint-2
    by torchrun, the run continues with the same losses."""
    import shutil

    from tests.trainer.helpers import torchrun_train as torchrun
    from tests.trainer.parallel.test_fsdp_deepspeed import FSDP2

    data = write_jsonl(tmp_path / "docs.jsonl", texts(23, seed=4))
    common = dict(pretraining_dataset=[{"path": str(data), "type": "pretrain"}], reinit_weights=True,
                  optimizer="muon", learning_rate=0.02, weight_decay=0.01, max_steps=4, save_steps=2,
                  gradient_accumulation_steps=1, **FSDP2)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = torchrun(pretrain_config("full.yml", output_dir=str(full), **common))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = train_losses(full)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    result = torchrun(pretrain_config("resumed.yml", output_dir=str(resumed), auto_resume_from_checkpoints=True,
                                      **common))
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_losses(resumed) == {s: losses[s] for s in (3, 4)}


@pytest.mark.slow
def test_preprocess_and_evaluate_say_a_stream_has_nothing_to_prepare(pretrain_config):
    for command in ("preprocess", "evaluate"):
        result = run_cli(command, str(pretrain_config()))
        assert result.returncode == 2 and "streamed data" in result.stderr.strip().splitlines()[-1], result.stderr


def test_too_few_rows_for_the_processes_is_said_before_training(pretrain_config, tmp_path):
    from trainer.data.streaming import check_stream

    data = write_jsonl(tmp_path / "two.jsonl", texts(2))
    stream, cfg = stream_of(pretrain_config(pretraining_dataset=[{"path": str(data)}]))
    check_stream(cfg, stream.tokenizer, world_size=2)
    with pytest.raises(DataError, match="2 row\\(s\\) for 3 processes"):
        check_stream(cfg, stream.tokenizer, world_size=3)


def test_a_pretraining_entrys_shards_are_named_as_ignored_as_axolotl_streams_it_whole():
    """Axolotl's pretraining stream reads only path, name, skip, split, data_files and type of its entry
    (utils/data/sft.py _extract_pretraining_config): shards / shards_idx there are not read, here neither."""
    from trainer.config import parse_config

    cfg, notes = parse_config({"base_model": "m", "learning_rate": 1e-4, "max_steps": 2,
                               "pretraining_dataset": [{"path": "org/corpus", "shards": 4, "shards_idx": 1}]})
    assert cfg.pretraining_dataset[0].path == "org/corpus"
    assert any("ignored: pretraining_dataset.0.shards, pretraining_dataset.0.shards_idx" in n and
               "_extract_pretraining_config" in n for n in notes), notes
