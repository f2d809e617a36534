"""The chunked cross-entropy (trainer/objectives/chunked_loss.py) against the oracle: F.cross_entropy over the full
logits, loss and every parameter's gradient, on models built from transformers' own config classes (random sizes
drawn by hypothesis), with and without LoRA, tied or untied heads, under CPU bf16 autocast; and a model that changes
its logits after the head (Gemma 2's soft-capping) falls back to the full logits with one note."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.batch.labels import IGNORE
from trainer.objectives import chunked_loss
from trainer.objectives.loss import MODEL_INPUTS, token_loss_sum
from trainer.runtime import loss_chunks

SMALL = 4096  # bytes of fp32 logits per chunk in these tests: 16 tokens a chunk, so most batches run several chunks


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS_BYTES", SMALL)
    # the chunked path on every step (chunked_cross_entropy: true), whatever the cost choice would take: these tests
    # are its oracle (tests/trainer/objectives/test_loss_path.py tests the choice)
    monkeypatch.setitem(chunked_loss._chosen, "setting", True)


FP32 = {"rtol": 1e-4, "atol": 1e-5}  # fp32: only the order of the sums differs (seen: 3e-6 absolute)


def model_of(family: str, vocab: int, hidden: int, tied: bool, seed: int = 0):
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

    kinds = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma2": Gemma2Config}
    extra = {"head_dim": hidden // 4, "final_logit_softcapping": 30.0} if family == "gemma2" else {}
    config = kinds[family](vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=tied, **extra)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager" if family == "gemma2" else "sdpa")


def batch_of(vocab: int, rows: int, width: int, masked: float, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    labels = ids.clone()
    labels[torch.rand(rows, width, generator=g) < masked] = IGNORE
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def full_path(model, batch):
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    return chunked_loss.full_loss_sum(model, inputs, batch["labels"])


def loss_and_grads(model, fn, batch):
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model, batch, **tol):
    want, want_grads = loss_and_grads(model, full_path, batch)
    got, got_grads = loss_and_grads(model, token_loss_sum, batch)
    assert chunked_loss._decided.get(model) is not None, chunked_loss.notes()
    torch.testing.assert_close(got, want, **tol)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol, msg=lambda m: f"{name}: {m}")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llama", "qwen2"]), vocab=st.integers(50, 3000), hidden=st.sampled_from([16, 32, 64]),
       tied=st.booleans(), rows=st.integers(1, 3), width=st.integers(2, 40), masked=st.sampled_from([0.0, 0.5, 0.9]))
def test_chunked_loss_and_gradients_equal_the_full_logits(family, vocab, hidden, tied, rows, width, masked):
    model = model_of(family, vocab, hidden, tied)
    assert_same(model, batch_of(vocab, rows, width, masked), **FP32)


def test_many_chunks_and_no_target_at_all():
    """Many chunks of 16 tokens (the last one shorter); a batch without a target token gives 0
    with a graph (every rank runs the same backward)."""
    model = model_of("llama", 4000, 16, tied=False)
    batch = batch_of(4000, 2, 64, 0.2)
    assert loss_chunks.chunk_tokens(100, 4000, SMALL) == 16
    assert_same(model, batch, **FP32)
    empty = dict(batch, labels=torch.full_like(batch["labels"], IGNORE))
    loss = token_loss_sum(model, empty)
    assert float(loss) == 0.0 and loss.requires_grad


def test_lora_with_a_trained_head_under_bf16_autocast():
    """peft's LoRA on the attention and on lm_head (modules_to_save), the head run under the same autocast as inside
    the model's forward: equal within bf16's rounding."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model_of("llama", 500, 32, tied=False),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0))
    batch = batch_of(500, 2, 24, 0.3)
    assert_same(model, batch, **FP32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = loss_and_grads(model, full_path, batch)
        got, _ = loss_and_grads(model, token_loss_sum, batch)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)


def test_a_model_that_changes_its_logits_after_the_head_keeps_the_full_logits():
    chunked_loss.notes()  # (earlier tests' notes)
    model = model_of("gemma2", 300, 32, tied=True)
    batch = batch_of(300, 1, 12, 0.0)
    want = full_path(model, batch)
    got = token_loss_sum(model, batch)
    assert chunked_loss._decided[model] is None
    torch.testing.assert_close(got, want, **FP32)
    (note,) = chunked_loss.notes()
    assert note.startswith("loss: full logits") and "final_logit_softcapping: 30.0" in note


@pytest.mark.parametrize("train_mode", [True, False])
def test_the_probe_draws_no_random_numbers_and_keeps_the_mode(train_mode):
    model = model_of("llama", 200, 16, tied=False)
    model.train(train_mode)
    batch = batch_of(200, 1, 10, 0.0)
    state = torch.get_rng_state()
    token_loss_sum(model, batch)
    assert model.training is train_mode
    model.zero_grad()
    torch.set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_change_after_the_head_that_no_config_field_names_is_found_by_the_probe():
    """A model whose forward soft-caps its logits without a config field saying so (tanh, as Gemma 2 does): the probe
    compares the head's output with the model's own logits and keeps the full logits. (A scaling would not need
    it where the head has no bias: scaling its input scales its output the same.)"""
    model = model_of("llama", 300, 32, tied=False)
    plain = type(model).forward

    def capped(self, *args, **kwargs):
        out = plain(self, *args, **kwargs)
        out.logits = torch.tanh(out.logits / 3) * 3
        return out

    model.forward = capped.__get__(model)
    batch = batch_of(300, 1, 12, 0.0)
    torch.testing.assert_close(token_loss_sum(model, batch), full_path(model, batch), **FP32)
    assert chunked_loss._decided[model] is None
    assert any("the probe's logits differ" in n for n in chunked_loss.notes())


def test_preference_sequence_log_probs_equal_the_full_logits():
    """The preference objectives' per-sequence sums (objectives/base.py sequence_logps: completion tokens, and all
    tokens with with_all), packed two sequences to a row and a padded row, against the full logits; gradients too."""
    from trainer.objectives.base import sequence_logps

    model = model_of("llama", 700, 32, tied=False)
    batch = batch_of(700, 2, 30, 0.4, seed=3)
    seq = torch.full((2, 30), -1)
    seq[0, :12], seq[0, 12:30], seq[1, :20] = 0, 1, 2  # row 0 packs two sequences; row 1 is padded after 20
    batch.update(sequence_ids=seq, n_sequences=torch.tensor(3))

    for with_all in (False, True):
        model.zero_grad(set_to_none=True)
        with chunked_loss_off(model):
            want = sequence_logps(model, batch, with_all=with_all)
        (torch.stack(want).sum() if with_all else want.sum()).backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        got = sequence_logps(model, batch, with_all=with_all)
        (torch.stack(got).sum() if with_all else got.sum()).backward()
        assert chunked_loss._decided.get(model) is not None
        torch.testing.assert_close(got, want, **FP32)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[name], **FP32, msg=lambda m: f"{name}: {m}")


class chunked_loss_off:
    """The full-logits path for one model (what the chunked path is compared with)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.before = chunked_loss._decided.get(self.model, "unset")
        chunked_loss._decided[self.model] = None

    def __exit__(self, *exc):
        if self.before == "unset":
            del chunked_loss._decided[self.model]
        else:
            chunked_loss._decided[self.model] = self.before


def test_the_configs_chunked_cross_entropy_keys_are_read(monkeypatch):
    """chunked_cross_entropy: false gives the full logits (one note), chunked_cross_entropy_num_chunks that many
    chunks of target tokens; both keep the loss and gradients (issue 44 item 8: the keys table called them honoured
    while nothing read them)."""
    from types import SimpleNamespace

    calls = []
    real = loss_chunks.chunk_tokens
    monkeypatch.setattr(loss_chunks, "chunk_tokens", lambda *a: calls.append(a) or real(*a))
    model, batch = model_of("llama", 400, 16, tied=False), batch_of(400, 2, 40, 0.0)
    try:
        chunked_loss.configure(SimpleNamespace(chunked_cross_entropy=True, chunked_cross_entropy_num_chunks=3))
        assert_same(model, batch, **FP32)
        assert calls and calls[-1][-1] == 3 and real(78, 400, SMALL, 3) == 26  # 78 targets in 3 chunks
        chunked_loss.configure(SimpleNamespace(chunked_cross_entropy=False, chunked_cross_entropy_num_chunks=None))
        chunked_loss.notes()
        want, _ = loss_and_grads(model, full_path, batch)
        got, _ = loss_and_grads(model, token_loss_sum, batch)
        assert chunked_loss._decided[model] is None and float(got) == float(want)
        assert chunked_loss.notes() == ["loss: full logits (chunked_cross_entropy: false)"]
    finally:
        chunked_loss.configure(SimpleNamespace(chunked_cross_entropy=None, chunked_cross_entropy_num_chunks=None))
