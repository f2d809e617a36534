"""No wrong model written with exit 0 (issue 33, item 2), through `python -m trainer merge-lora / export /
chat-check` (their entry point, in this process): a merged/ older than the adapter is refused by export and
chat-check; an adapter_config.json whose rank is not its tensors' is refused by merge-lora; a config.json whose
vocab_size is not the embedding's rows is refused by export; linear rope scaling (Axolotl's `rope_scaling:`) is kept
in merged/config.json (transformers' reading as the oracle) and in the GGUF (gguf's reader); other scalings refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import alpaca_rows, write_jsonl
from trainer.cli import main

pytestmark = pytest.mark.slow


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    from trainer.model.tiny import build_model, build_tokenizer

    work = tmp_path_factory.mktemp("wrong")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, "llama", hidden_size=64, layers=2)
    model.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    return {"dir": work, "base": work / "base", "data": write_jsonl(work / "a.jsonl", alpaca_rows(8))}


def _run(work: dict, name: str, adapter_seed: int | None = 0, **keys) -> tuple[Path, Path]:
    """output_dir with final/ holding a LoRA adapter (r 4) on the base, and its config."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work["dir"] / name
    if adapter_seed is not None:
        torch.manual_seed(adapter_seed)
        model = AutoModelForCausalLM.from_pretrained(work["base"])
        adapter = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False))
        adapter.save_pretrained(out / "final")
        AutoTokenizer.from_pretrained(work["base"]).save_pretrained(out / "final")
    config = work["dir"] / f"{name}.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(work["base"]), "datasets": [{"path": str(work["data"]), "type": "alpaca"}],
        "output_dir": str(out), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules":
        ["q_proj", "v_proj"], "sequence_len": 128, "micro_batch_size": 1, "max_steps": 1, "learning_rate": 1e-3,
        **keys}))
    return out, config


def test_a_merged_model_older_than_the_adapter_is_refused_by_export_and_chat_check(work, capsys):
    out, config = _run(work, "stale")
    assert main(["merge-lora", str(config), "--dtype", "fp32"]) == 0
    made_from = json.loads((out / "merged" / "envtool-merge.json").read_text())
    assert set(made_from["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    _run(work, "stale", adapter_seed=1)  # training continued: final/ holds another adapter
    capsys.readouterr()
    assert main(["export", str(config), "--outtype", "f32"]) == 2
    line = _error(capsys)
    assert f"{out / 'merged'} was merged from an earlier {out / 'final'}" in line and "merge-lora" in line
    assert not list(out.glob("*.gguf*"))
    assert main(["chat-check", str(config)]) == 2
    assert "was merged from an earlier" in _error(capsys)
    shutil.rmtree(out / "merged")  # merged again: export goes on
    assert main(["merge-lora", str(config), "--dtype", "fp32"]) == 0
    assert main(["export", str(config), "--outtype", "f32"]) == 0


def test_an_adapter_config_whose_rank_is_not_the_tensors_is_refused(work, capsys):
    out, config = _run(work, "rank")
    adapter_config = out / "final" / "adapter_config.json"
    data = json.loads(adapter_config.read_text())
    data["r"] = 2  # on rank-4 tensors: the update would be scaled twice
    adapter_config.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["merge-lora", str(config)]) == 2
    line = _error(capsys)
    assert f"{adapter_config} says r 2 for " in line and "but its tensors have rank 4" in line
    assert sorted(p.name for p in out.iterdir()) == ["final"]  # nothing written


def _full_model(work: dict, name: str, **config_changes) -> tuple[Path, Path]:
    out, config = _run(work, name, adapter_seed=None)
    shutil.copytree(work["base"], out / "final")
    model_config = json.loads((out / "final" / "config.json").read_text())
    model_config.update(config_changes)
    (out / "final" / "config.json").write_text(json.dumps(model_config))
    return out, config


def test_a_vocab_size_that_is_not_the_embeddings_rows_is_refused_by_export(work, capsys):
    out, config = _full_model(work, "vocab", vocab_size=10)
    capsys.readouterr()
    assert main(["export", str(config), "--outtype", "f32"]) == 2
    line = _error(capsys)
    assert "config.json says vocab_size 10, but " in line and ".weight has 384 rows" in line  # the embedding or head
    assert "does not match the weights" in line
    assert not list(out.glob("*.gguf*"))


def test_linear_rope_scaling_is_kept_in_merged_and_gguf_and_other_scalings_refused(work, capsys):
    import gguf
    from transformers import AutoConfig

    linear = {"rope_type": "linear", "factor": 2.0}
    out, config = _run(work, "rope", rope_scaling=linear)  # Axolotl's top-level key
    assert main(["merge-lora", str(config), "--dtype", "fp32"]) == 0
    read = AutoConfig.from_pretrained(out / "merged")  # what transformers runs the merged model with
    assert read.rope_parameters["rope_type"] == "linear" and read.rope_parameters["factor"] == 2.0
    assert main(["export", str(config), "--outtype", "f32"]) == 0
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("llama.rope")}
    assert fields["llama.rope.scaling.type"] == "linear" and fields["llama.rope.scaling.factor"] == 2.0

    out, config = _full_model(work, "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 1024})
    capsys.readouterr()
    assert main(["export", str(config), "--outtype", "f32"]) == 2
    assert "rope scaling 'yarn' is not written by this exporter" in _error(capsys)
    assert not list(out.glob("*.gguf*"))


@pytest.mark.parametrize("vocab, said", [(2e9, "vocab_size is 2000000000.0: a model's sizes are whole numbers"),
                                         (2 * 10**9, "vocab_size is 2,000,000,000: no model has that")])
def test_an_impossible_vocab_size_is_refused_by_export_before_anything_is_written(work, capsys, vocab, said):
    """The sizes `envtool fit` checks (trainer/fit/memory_model.py check_sizes): 2e9 hung export."""
    out, config = _full_model(work, f"vocab-{type(vocab).__name__}", vocab_size=vocab)
    capsys.readouterr()
    assert main(["export", str(config), "--outtype", "f32"]) == 2
    line = _error(capsys)
    assert line.startswith(f"error: export: {out / 'final' / 'config.json'}: {said}"), line
    assert not list(out.glob("*.gguf*"))
