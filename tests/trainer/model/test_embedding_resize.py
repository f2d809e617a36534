"""shrink_embeddings and mean_resizing_embeddings, as Axolotl's ModelLoader._resize_token_embeddings
(loaders/model.py): grow to the tokenizer's length (a multiple of 32 with resize_token_embeddings_to_32x), shrink to it
only with shrink_embeddings, new rows by transformers' resize_token_embeddings(mean_resizing=...)."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from tests.trainer.helpers import run_cli, write_jsonl
from trainer.config import parse_config
from trainer.model.load import resize_embeddings


def _cfg(**keys):
    cfg, _ = parse_config({"base_model": "m", "learning_rate": 1e-4, "datasets": [{"path": "d", "type": "alpaca"}],
                           **keys})
    return cfg


def test_resizing_is_axolotls(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    rows = model.get_input_embeddings().num_embeddings
    tok.add_tokens(["<new1>", "<new2>"])
    for mean in (None, True, False):  # transformers' own resize of the same model is the reference
        ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
        torch.manual_seed(0)
        resize_embeddings(_cfg(**({} if mean is None else {"mean_resizing_embeddings": mean})), ours, tok)
        torch.manual_seed(0)
        theirs.resize_token_embeddings(len(tok), **({} if mean is None else {"mean_resizing": mean}))
        assert torch.equal(ours.get_input_embeddings().weight, theirs.get_input_embeddings().weight)
    kept = copy.deepcopy(model)
    resize_embeddings(_cfg(resize_token_embeddings_to_32x=True), kept, tok)
    assert kept.get_input_embeddings().num_embeddings == -(-len(tok) // 32) * 32 > len(tok) > rows
    resize_embeddings(_cfg(), kept, tok)  # more rows than tokens: kept, as Axolotl keeps them
    assert kept.get_input_embeddings().num_embeddings == -(-len(tok) // 32) * 32
    resize_embeddings(_cfg(shrink_embeddings=True), kept, tok)  # shrink_embeddings: down to the tokenizer
    assert kept.get_input_embeddings().num_embeddings == len(tok)

@pytest.mark.slow
def test_shrink_and_mean_resizing_train_through_the_cli(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} of the data"} for i in range(8)])
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(tiny_llama), "datasets": [{"path": str(data), "type": "completion"}],
        "tokens": ["<new1>"], "shrink_embeddings": True, "mean_resizing_embeddings": False,
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 64, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "seed": 1}))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
