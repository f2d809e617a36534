"""What a user meets around a run, through `python -m trainer train` (issue 16's last items, issue 23's final save):
a re-run into an output_dir with checkpoints is refused in one line or continues when the config says so; the
final save carries a generation config that stops at the chat template's end of turn; a malformed JSON Lines
row names its file and line; a hub model with no hub is one line at once, not a minute of retries."""

from __future__ import annotations

import json
import socket

import pytest

from tests.trainer.helpers import read_metrics, run_cli, write_jsonl


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_rerun_is_refused_or_resumed_and_the_final_model_stops_at_the_end_of_a_turn(make_config, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    config = make_config(max_steps=2, save_steps=1)
    first = run_cli("train", str(config))
    assert first.returncode == 0, first.stderr[-3000:]
    # final/generation_config.json stops on the eos and on ChatML's <|im_end|>, which the base's config lacks
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    eos = json.loads((out / "final" / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "generation_config.json: generation stops on </s>, <|im_end|>" in first.stderr
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    # the same command again: refused in one line naming the checkpoint and both ways forward, nothing touched
    again = run_cli("train", str(config))
    assert again.returncode == 2
    line = one_error_line(again)
    assert f"output_dir {out} holds checkpoint-2 from an earlier run" in line
    assert "auto_resume_from_checkpoints: true" in line and "set a new output_dir" in line
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == steps
    # ... and with auto_resume_from_checkpoints it continues from checkpoint-2 (two more steps)
    resumed = run_cli("train", str(make_config("resume.yml", max_steps=4, save_steps=1,
                                               auto_resume_from_checkpoints=True)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_malformed_jsonl_row_names_the_file_and_line(make_config, tmp_path):
    rows = [{"instruction": "Say hi.", "input": "", "output": "hi"}] * 4
    broken = write_jsonl(tmp_path / "broken.jsonl", rows)
    text = broken.read_text().splitlines()
    text[2] = text[2][:-1]  # line 3 loses its closing brace
    broken.write_text("\n".join(text) + "\n")
    result = run_cli("train", str(make_config(datasets=[{"path": str(broken), "type": "alpaca"}])))
    assert result.returncode == 2
    line = one_error_line(result)
    assert line.startswith(f"error: dataset {broken} line 3, column ") and "not valid JSON" in line
    # a row that is JSON but not an object
    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps(rows[0]) + "\n" + json.dumps(["a", "list"]) + "\n")
    result = run_cli("train", str(make_config(datasets=[{"path": str(array), "type": "alpaca"}])))
    assert result.returncode == 2
    assert one_error_line(result) == f"error: dataset {array} line 2: an array, not a JSON object (one object per row)"


@pytest.mark.slow
def test_a_hub_model_with_no_hub_is_one_line_naming_it(make_config, tmp_path):
    # a port nothing listens on: the connection is refused, as with no network. The socket stays bound (not
    # listening) for the whole run, so no server another test starts meanwhile can take the port (seen in CI: the
    # probe found a stand-in server there, then the tokenizer's download found none)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        endpoint = f"http://127.0.0.1:{port}"
        env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
        result = run_cli("train", str(make_config(base_model="someone/some-model")), env=env)
    assert result.returncode == 2
    line = one_error_line(result)
    assert line.startswith("error: base_model: someone/some-model is not on this machine")
    assert f"the Hugging Face Hub at {endpoint} does not answer (connection refused)" in line
    assert "Retrying" not in result.stderr and "retry" not in result.stderr.lower()
