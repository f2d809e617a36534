"""added_tokens_overrides: added tokens renamed before the data is tokenized, as Axolotl's modify_tokenizer_files
(loaders/tokenizer.py): the id keeps its row, the new text reads as that token, the saved tokenizer carries it."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import run_cli, write_jsonl


@pytest.fixture
def reserved(tiny_llama, tmp_path):
    """The tiny llama with a reserved added token (as Llama 3's <|reserved_special_token_N|>); (folder, its id)."""
    import shutil

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_tokens([AddedToken("<|reserved_0|>", special=True, normalized=False)])
    tok.save_pretrained(str(base))
    return base, tok.convert_tokens_to_ids("<|reserved_0|>")


def test_an_added_token_is_renamed_and_its_id_kept(reserved):
    from transformers import AutoTokenizer

    from trainer.data.prepare import override_added_tokens
    from trainer.errors import ConfigError

    base, turn = reserved
    tok = AutoTokenizer.from_pretrained(str(base))
    renamed = override_added_tokens(tok, {turn: "<|turn|>"})
    assert renamed.convert_tokens_to_ids("<|turn|>") == turn
    assert turn in renamed("a <|turn|> b")["input_ids"]
    assert turn not in tok("a <|turn|> b")["input_ids"]  # as loaded, the text is plain characters
    assert len(renamed) == len(tok)
    with pytest.raises(ConfigError, match=r"added_tokens_overrides: token id\(s\) \[7\] are not added tokens"):
        override_added_tokens(tok, {7: "<|x|>"})


@pytest.mark.slow
def test_a_run_trains_with_the_renamed_token_and_saves_it(tmp_path, reserved):
    from transformers import AutoTokenizer

    base, turn = reserved
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"<|turn|> row {i} of the data"} for i in range(8)])
    config = tmp_path / "c.yml"
    body = {"base_model": str(base), "datasets": [{"path": str(data), "type": "completion"}],
            "added_tokens_overrides": {turn: "<|turn|>"},
            "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
            "sequence_len": 64, "micro_batch_size": 2, "max_steps": 1, "learning_rate": 1e-3, "seed": 1}
    config.write_text(yaml.safe_dump(body))
    result = run_cli("train", str(config), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "final"))
    assert saved.convert_tokens_to_ids("<|turn|>") == turn
    config.write_text(yaml.safe_dump({**body, "added_tokens_overrides": {40: "<|x|>"}}))
    bad = run_cli("train", str(config), timeout=400)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    lines = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "added_tokens_overrides: token id(s) [40] are not added tokens" in lines[0], bad.stderr
