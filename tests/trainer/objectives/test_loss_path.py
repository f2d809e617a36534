"""The loss path chosen by cost (trainer/runtime/loss_chunks.py choose_path, trainer/objectives/chunked_loss.py choose):
the full logits where every token is a target and they fit, the chunked loss where the prompts make it cheaper or the
full logits would take the memory, nothing recomputed when a step's target logits fit one chunk, the config's
chunked_cross_entropy as Axolotl reads it; and whichever path a step takes, the loss and every gradient are the full
logits' (the oracle)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.objectives import chunked_loss
from trainer.objectives.loss import token_loss_sum
from trainer.runtime import loss_chunks
from tests.trainer.objectives.test_chunked_loss import FP32, batch_of, full_path, loss_and_grads, model_of

GiB = 2**30
QWEN = (151936, 896)  # Qwen2.5-0.5B's head: vocabulary x hidden


def test_every_token_a_target_takes_the_full_logits_while_they_fit():
    """train_on_inputs at 2 x 2048 tokens: the chunked loss would run 16 chunks, each recomputed (4/3 of the head's
    FLOPs where it trains): the full logits (7 GiB), which fit in 80 GiB free."""
    p = loss_chunks.choose_path(2 * 2048, 2 * 2047, QWEN, head_trains=True, free_bytes=80 * GiB)
    assert (p.path, p.rule, p.recompute) == ("full", "cheaper", False)
    assert p.chunked_flops > p.full_flops and "4,094 of 4,096 tokens are targets" in p.reason


def test_the_full_logits_that_would_take_the_memory_are_chunked():
    p = loss_chunks.choose_path(2 * 2048, 2 * 2047, QWEN, head_trains=True, free_bytes=24 * GiB)
    assert (p.path, p.rule) == ("chunked", "memory") and p.full_logits_bytes > loss_chunks.MEMORY_SHARE * 24 * GiB
    assert "saves memory" in p.reason and "GiB free" in p.reason


def test_prompt_masking_takes_the_chunked_loss():
    """A chat SFT step whose completions are a third of its tokens: chunked, even with its recompute."""
    p = loss_chunks.choose_path(4 * 4096, 4 * 1365, QWEN, head_trains=True, free_bytes=80 * GiB)
    assert (p.path, p.rule, p.recompute) == ("chunked", "time", True)
    assert p.chunked_flops < 0.9 * p.full_flops


def test_target_logits_that_fit_one_chunk_are_not_recomputed():
    p = loss_chunks.choose_path(2048, 200, QWEN, head_trains=False, free_bytes=80 * GiB)
    assert (p.path, p.rule, p.chunks, p.recompute) == ("chunked", "one_chunk", 1, False)
    every = loss_chunks.choose_path(2048, 2047, QWEN, head_trains=False, free_bytes=80 * GiB)
    assert every.path == "full"  # one chunk of nearly every token saves nothing


@pytest.mark.parametrize("setting, path", [(True, "chunked"), (False, "full")])
def test_the_config_decides_where_it_says(setting, path):
    for targets in (16383, 100):
        p = loss_chunks.choose_path(16384, targets, QWEN, head_trains=True, setting=setting, free_bytes=1 * GiB)
        assert (p.path, p.rule) == (path, "setting")
    assert loss_chunks.choose_path(16384, 16383, QWEN, head_trains=True, setting=True, num_chunks=3).chunks == 3


@pytest.fixture
def config():
    def configure(**keys):
        chunked_loss.configure(SimpleNamespace(chunked_cross_entropy=None, chunked_cross_entropy_num_chunks=None,
                                               **keys))
        chunked_loss.notes()

    yield configure
    configure()


@pytest.mark.parametrize("masked, small, path", [
    (0.0, True, "full"),  # every token a target, several chunks: the full logits
    (0.0, False, "full"),  # every token a target, one chunk: nothing to save
    (0.7, True, "chunked"),  # prompts masked, several chunks, each recomputed
    (0.7, False, "chunked"),  # prompts masked, one chunk, nothing recomputed
])
def test_the_chosen_path_gives_the_full_logits_loss_and_gradients(config, monkeypatch, masked, small, path):
    if small:
        monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS_BYTES", 4096)  # 16 tokens a chunk at this vocabulary
    config()
    model, batch = model_of("llama", 256, 32, tied=False), batch_of(256, 3, 40, masked, seed=5)
    recomputed = []
    real = chunked_loss.checkpoint
    monkeypatch.setattr(chunked_loss, "checkpoint", lambda *a, **k: recomputed.append(1) or real(*a, **k))
    want, want_grads = loss_and_grads(model, full_path, batch)
    got, got_grads = loss_and_grads(model, token_loss_sum, batch)
    torch.testing.assert_close(got, want, **FP32)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **FP32, msg=lambda m: f"{name}: {m}")
    (note,) = chunked_loss.notes()
    assert note.startswith("loss: chunked cross-entropy: cheaper" if path == "chunked" else "loss: full logits: cheaper")
    assert bool(recomputed) == (path == "chunked" and small)  # one chunk: nothing recomputed


def test_a_path_is_noted_once_and_again_when_another_is_taken(config):
    config()
    model = model_of("llama", 256, 32, tied=False)
    for masked in (0.0, 0.0, 0.7, 0.7, 0.0):
        token_loss_sum(model, batch_of(256, 2, 30, masked)).backward()
    notes = chunked_loss.notes()
    assert [n.split(":")[1].strip() for n in notes] == ["full logits", "chunked cross-entropy"], notes


@pytest.mark.slow  # three `validate` runs in a subprocess
def test_validate_says_how_the_loss_is_chosen(make_config):
    """What `validate` (and the dry run) prints for the loss, from the config's keys."""
    from tests.trainer.helpers import run_cli

    lines = {}
    for name, keys in {"unset": {"train_on_inputs": True}, "false": {"chunked_cross_entropy": False},
                       "true": {"chunked_cross_entropy": True, "chunked_cross_entropy_num_chunks": 4}}.items():
        out = run_cli("validate", str(make_config(f"{name}.yml", **keys)))
        assert out.returncode == 0, out.stderr
        lines[name] = next(line.strip() for line in out.stdout.splitlines() if line.strip().startswith("loss:"))
    assert lines["unset"].startswith("loss:       chosen each step by cost: the full logits while they fit")
    assert lines["false"] == "loss:       full logits (chunked_cross_entropy: false)"
    assert lines["true"].startswith("loss:       chunked cross-entropy (chunked_cross_entropy: true, 4 chunks")
