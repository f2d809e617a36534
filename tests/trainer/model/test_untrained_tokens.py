"""fix_untrained_tokens (trainer/model/untrained_tokens.py): the embedding and lm_head rows of tokens the base never
trained (all zero), which the data uses, start training at the trained rows' mean scaled by frequency, as Axolotl's
fix; with an adapter (embeddings frozen) the run stops in one line instead of training them as NaNs."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from tests.trainer.helpers import alpaca_rows, run_cli, write_jsonl


def _base_with_untrained_rows(tiny_llama, tmp_path, n: int = 3):
    """The tiny llama with the rows of n tokens the alpaca data uses zeroed in embed_tokens and lm_head; their ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    used = torch.bincount(torch.tensor([t for r in alpaca_rows(8) for t in tok(r["output"])["input_ids"]]))
    special = set(tok.all_special_ids)
    ids = [int(t) for t in used.argsort(descending=True) if int(t) not in special][:n]
    with torch.no_grad():
        for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            matrix[ids] = 0
    model.save_pretrained(str(base))
    return base, ids, model


def _config(tmp_path, base, **keys):
    data = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(8))
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(base), "datasets": [{"path": str(data), "type": "alpaca"}],
        "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
        "sequence_len": 128, "micro_batch_size": 2, "max_steps": 1, "learning_rate": 1e-9, "seed": 1,
        "attn_implementation": "sdpa", **keys}))
    return config


@pytest.mark.slow
def test_untrained_rows_the_data_uses_start_at_the_mean_of_the_trained_rows(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    base, ids, before = _base_with_untrained_rows(tiny_llama, tmp_path)
    result = run_cli("train", str(_config(tmp_path, base, fix_untrained_tokens=True)), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"fix_untrained_tokens: set the embedding and lm_head rows of {len(ids)} untrained token(s)" in result.stderr
    after = load_file(tmp_path / "out" / "final" / "model.safetensors")
    for name, matrix in (("model.embed_tokens.weight", before.get_input_embeddings().weight),
                         ("lm_head.weight", before.get_output_embeddings().weight)):
        trained = [i for i in range(matrix.shape[0]) if i not in ids]
        mean = matrix[trained].mean(0)
        for i in ids:  # (a learning rate of 1e-9: one step moves nothing a user would see)
            row = after[name][i].float()
            assert row.abs().max() > 0, f"{name}[{i}] is still untrained"
            assert torch.nn.functional.cosine_similarity(row, mean, dim=0) > 0.999  # the mean, scaled
            assert row.norm() <= mean.norm() * 1.001  # by the token's count over the most frequent token's
        for i in trained[:20]:
            assert torch.allclose(after[name][i].float(), matrix[i], atol=1e-6)  # the others as loaded


@pytest.mark.slow
def test_with_an_adapter_the_run_stops_in_one_line_where_the_data_uses_them(tmp_path, tiny_llama):
    base, ids, _ = _base_with_untrained_rows(tiny_llama, tmp_path)
    config = _config(tmp_path, base, fix_untrained_tokens=True, adapter="lora", lora_r=4, lora_alpha=8,
                     lora_target_linear=True)
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "fix_untrained_tokens: the untrained tokens" in line[0]
    assert all(str(i) in line[0] for i in ids)
