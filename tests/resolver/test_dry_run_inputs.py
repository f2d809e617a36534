"""The dry-run finds what the run would (issue 27, item 3): a hub model that is not here, rows whose fields do not
fit the dataset's `type`, a malformed JSON Lines row -- each one line, exit 2, from `envtool train --dry-run` and
`python -m trainer validate`, before anything is built; and what the run reads fine passes.

The Hub's answers are served on 127.0.0.1 with the status and X-Error-Code header the Hub sends (the header
huggingface_hub's hf_raise_for_status reads: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from .conftest import ENVTOOL

REPO = Path(__file__).resolve().parents[2]
TINY_ROWS = REPO / "examples" / "data" / "tiny-alpaca.jsonl"


def closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on: refused at once, as with no network
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def env(tmp_path):
    import os

    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU", "HF_TOKEN")}
    environment.update(ENVTOOL_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf"),
                       HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    environment.pop("HF_HUB_CACHE", None)
    return environment


def write_config(tmp_path: Path, name: str = "config.yml", **keys) -> Path:
    cfg = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    cfg.update(base_model=str(REPO / "outputs" / "tiny-model"), dataset_prepared_path=str(tmp_path / "prepared"),
               output_dir=str(tmp_path / "out"), datasets=[{"path": str(TINY_ROWS), "type": "alpaca"}])
    cfg.update(keys)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def dry_run(config: Path, env: dict, *more: str):
    return subprocess.run([str(ENVTOOL), "train", str(config), "--dry-run", *more], capture_output=True, text=True,
                          env=env, timeout=120)


def validate(config: Path, env: dict):
    return subprocess.run([sys.executable, "-m", "trainer", "validate", str(config)], capture_output=True, text=True,
                          env=env, timeout=120)


def error_lines(out) -> list[str]:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return [line for line in out.stderr.splitlines() if "error: " in line]


class Hub(BaseHTTPRequestHandler):
    """HEAD {repo}/resolve/{rev}/{file}: 307 (the Hub's redirect to its CDN) for `have`, else the Hub's error."""

    have: set[str] = set()
    errors: dict[str, tuple[int, str]] = {}

    def do_HEAD(self):
        repo = "/".join(self.path.strip("/").split("/")[:2])
        if repo in self.have:
            self.send_response(307)
            self.send_header("Location", "https://cdn-lfs.example/config.json")
        else:
            status, code = self.errors.get(repo, (401, "RepoNotFound"))
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", "Repository not found" if code == "RepoNotFound" else code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slow
def test_a_hub_model_not_here_is_one_line_from_the_dry_run_and_validate(tmp_path, env, hub):
    Hub.have = {"someone/here"}
    Hub.errors = {"someone/gated": (403, "GatedRepo")}
    config = write_config(tmp_path, base_model="someone/missing")
    # the Hub does not answer (a closed port) and the model is not cached
    for out in (dry_run(config, env), validate(config, env)):
        assert out.returncode == 2
        (line,) = error_lines(out)
        assert "base_model: someone/missing is not on this machine" in line and "does not answer (connection " \
            "refused)" in line, line
    # the Hub answers: no such repository / gated
    env["HF_ENDPOINT"] = hub
    out = dry_run(config, env)
    assert out.returncode == 2 and "base_model: someone/missing: no such model on the Hub" in error_lines(out)[0]
    out = dry_run(write_config(tmp_path, "gated.yml", base_model="someone/gated"), env)
    assert out.returncode == 2 and "someone/gated: gated on the Hub: it needs a token" in error_lines(out)[0]
    # the Hub has it: the dry-run goes on (and says nothing of it)
    out = dry_run(write_config(tmp_path, "here.yml", base_model="someone/here"), env, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    # HF_HUB_OFFLINE with nothing cached, then the same model in the cache: found, no Hub asked
    env.update(HF_HUB_OFFLINE="1", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    out = dry_run(config, env)
    assert out.returncode == 2 and "HF_HUB_OFFLINE is set" in error_lines(out)[0]
    snapshot = tmp_path / "hf" / "hub" / "models--someone--missing" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((REPO / "outputs" / "tiny-model" / "config.json").read_text())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    out = dry_run(config, env)
    assert "is not on this machine" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_rows_that_do_not_fit_the_type_and_malformed_rows_are_named_by_file_line_and_column(tmp_path, env):
    rows = [json.loads(line) for line in TINY_ROWS.read_text().splitlines()[:5]]
    wrong = tmp_path / "qa.jsonl"
    wrong.write_text("".join(json.dumps({"question": r["instruction"], "answer": r["output"]}) + "\n" for r in rows))
    broken = tmp_path / "broken.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[3] = lines[3][:-1]  # line 4 loses its closing brace
    broken.write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path, datasets=[{"path": str(wrong), "type": "alpaca"},
                                              {"path": str(broken), "type": "alpaca"}])
    for out in (dry_run(config, env), validate(config, env)):
        assert out.returncode == 2
        first, second = error_lines(out)  # one line each
        assert f"dataset {wrong}: a row has no 'instruction' field (type alpaca)" in first
        assert "columns are ['answer', 'question']" in first
        assert f"dataset {broken} line 4, column {len(lines[3]) + 1}: not valid JSON" in second
    # the same rows under the type they fit, with their fields mapped: accepted
    config = write_config(tmp_path, "fixed.yml", datasets=[{"path": str(wrong), "type": "alpaca_chat.load_qa"},
                                              {"path": str(wrong), "type": "alpaca", "field_instruction": "question",
                                               "field_output": "answer"}])
    for out in (dry_run(config, env), validate(config, env)):
        assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_preference_rows_are_checked_by_the_preference_formats(tmp_path, env):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    config = write_config(tmp_path, rl="dpo", datasets=[{"path": str(pairs), "type": "chatml.intel"}])
    out = dry_run(config, env)
    assert out.returncode == 2 and "a row has no 'question' field (type chatml.intel)" in error_lines(out)[0]
    config = write_config(tmp_path, "fixed.yml", rl="dpo", datasets=[{"path": str(pairs), "type": "chatml.prompt_pairs"}])
    assert dry_run(config, env).returncode == 0


@pytest.mark.slow
def test_a_cached_hub_dataset_is_read_from_the_cache(tmp_path, env):
    """A hub dataset the run would read from the Hugging Face cache: its cached data file's first rows checked."""
    snapshot = tmp_path / "hf" / "hub" / "datasets--someone--qa" / "snapshots" / "def456"
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "data" / "train-00000-of-00001.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("def456")
    out = dry_run(write_config(tmp_path, datasets=[{"path": "someone/qa", "type": "alpaca"}]), env)
    assert out.returncode == 2
    assert "dataset someone/qa: a row has no 'instruction' field" in error_lines(out)[0]
    assert "cached: data/train-00000-of-00001.jsonl" in error_lines(out)[0]
