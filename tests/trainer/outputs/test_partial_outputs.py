"""merge-lora and export leave no partial output behind (issue 33, item 7), through `python -m trainer ...`.

A stop signal (SIGTERM, SIGUSR1) during the write removes the temporary output and exits 128 + the signal with one
line; a kill that runs no handler (SIGKILL) leaves it, and the next run of the same command removes it with a note
and completes. ENVTOOL_PAUSE_AT (trainer/runtime/signals.py) holds the real command at a point of its real path
(after merge-lora's first shard; after the GGUF header) until the test's signal arrives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import REPO, alpaca_rows, write_jsonl
from trainer.runtime.signals import remove_leftovers

def _env(**extra: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_PAUSE_AT")}
    environment.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", **extra)
    return environment


def _paused(args: list[str], point: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env(ENVTOOL_PAUSE_AT=point))
    seen = ""
    for line in proc.stdout:
        seen += line
        if f"paused at {point}" in line:
            return proc, seen
    proc.wait()
    raise AssertionError(f"never reached {point}:\n{seen[-3000:]}")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, cwd=REPO,
                          env=_env(), timeout=300)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """An adapter in output_dir/final on a base written in several shards (no training needed to merge it)."""
    from peft import LoraConfig, get_peft_model

    from trainer.model.tiny import build_model, build_tokenizer

    work = tmp_path_factory.mktemp("partial")
    base, out = work / "base", work / "out"
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, "llama", hidden_size=64, layers=4)
    model.save_pretrained(base, max_shard_size="100KB")
    tokenizer.save_pretrained(base)
    adapter = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               init_lora_weights=False))
    adapter.save_pretrained(out / "final")
    tokenizer.save_pretrained(out / "final")
    config = work / "config.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(base), "datasets": [{"path": str(write_jsonl(work / "a.jsonl", alpaca_rows(8))),
                                               "type": "alpaca"}],
        "output_dir": str(out), "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True,
        "sequence_len": 128, "micro_batch_size": 1, "max_steps": 1, "learning_rate": 1e-3}))
    return config, out


def _temps(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if ".tmp-" in p.name)


@pytest.mark.slow
def test_a_stopped_or_killed_merge_and_export_leave_no_partial_output(run):
    config, out = run
    merge = ["merge-lora", str(config), "--dtype", "fp32"]

    # SIGTERM after the first shard: the temporary directory is removed, one line, exit 143
    proc, _ = _paused(merge, "merge-shard")
    assert _temps(out) == [f".merged.tmp-{proc.pid}"]  # the partial merge exists while it runs
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "merge-lora: stopped by SIGTERM; its partial output was removed" in rest and "Traceback" not in rest
    assert _temps(out) == [] and not (out / "merged").exists()

    # SIGKILL (no handler runs): the partial merge stays until the same command runs again, which removes and merges
    proc, _ = _paused(merge, "merge-shard")
    proc.kill()
    proc.communicate(timeout=60)
    assert _temps(out) == [f".merged.tmp-{proc.pid}"]
    again = _run(merge)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"removed {out / f'.merged.tmp-{proc.pid}'}, the partial output of an interrupted run" in again.stderr
    assert _temps(out) == [] and (out / "merged" / "config.json").is_file()

    # export: SIGUSR1 after the GGUF header; then SIGKILL and the same command again
    export = ["export", str(config), "--outtype", "f32"]
    gguf = f"{out.resolve().name}-f32.gguf"
    proc, _ = _paused(export, "export-tensors")
    assert _temps(out) == [f".{gguf}.tmp-{proc.pid}"]
    proc.send_signal(signal.SIGUSR1)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGUSR1, rest
    assert "export: stopped by SIGUSR1; its partial output was removed" in rest and "Traceback" not in rest
    assert _temps(out) == [] and not (out / gguf).exists()
    proc, _ = _paused(export, "export-tensors")
    proc.kill()
    proc.communicate(timeout=60)
    assert _temps(out) == [f".{gguf}.tmp-{proc.pid}"]
    again = _run(export)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"removed {out / f'.{gguf}.tmp-{proc.pid}'}" in again.stderr
    assert _temps(out) == [] and (out / gguf).stat().st_size > 0


def test_only_leftovers_of_ended_processes_are_removed(tmp_path):
    """A concurrent command's temporary output (its process alive) is left alone; other names are never touched."""
    dead, live = _dead_pid(), os.getppid()
    for name in (f".merged.tmp-{dead}", f".merged.tmp-{live}", f".other.tmp-{dead}", f".merged.tmp-{dead}x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    (tmp_path / f".m.gguf.tmp-{dead}").write_bytes(b"partial")
    said = []
    assert remove_leftovers(tmp_path, "merged", said.append) == [tmp_path / f".merged.tmp-{dead}"]
    assert remove_leftovers(tmp_path, "m.gguf", said.append) == [tmp_path / f".m.gguf.tmp-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".merged.tmp-{live}", f".other.tmp-{dead}", f".merged.tmp-{dead}x"])
    assert len(said) == 2 and all(line.startswith("note: removed ") for line in said)
