"""Packed sequences must not see each other, on every attention backend."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.batch.collate import Collator, count_targets
from trainer.batch.labels import IGNORE
from trainer.objectives.loss import MODEL_INPUTS

LENGTHS = [[7, 12, 5], [9]]  # two rows: three packed sequences, and one shorter row that gets padding


def examples(vocab: int, seed: int = 0) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in LENGTHS:
        rows.append([{"input_ids": torch.randint(5, vocab, (n,), generator=g).tolist(),
                      "labels": torch.randint(5, vocab, (n,), generator=g).tolist()} for n in row])
    return rows


def load(model_dir, attention):
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_unpacked_logits(family, attention, request):
    model = load(request.getfixturevalue(family), attention)
    rows = examples(model.config.vocab_size)
    batch = Collator(pad_token_id=0, attention=attention)(rows)
    assert batch["attention_mask"].shape == (2, 1, 24, 24)
    with torch.no_grad():
        packed = model(**{k: batch[k] for k in MODEL_INPUTS}).logits
        for r, row in enumerate(rows):
            start = 0
            for example in row:
                alone = model(torch.tensor([example["input_ids"]])).logits[0]
                n = len(example["input_ids"])
                diff = (packed[r, start:start + n] - alone).abs().max().item()
                assert diff < 1e-4, f"row {r} segment at {start}: max |diff| {diff}"
                start += n


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_position_ids_alone_do_not_isolate_packed_sequences(tiny_llama, attention):
    """The measurement behind the block-diagonal mask: with transformers' defaults, position_ids that
    restart at 0 leave the second packed sequence attending to the first."""
    model = load(tiny_llama, attention)
    first, second = examples(model.config.vocab_size)[0][:2]
    ids = torch.tensor([first["input_ids"] + second["input_ids"]])
    positions = torch.tensor([list(range(7)) + list(range(12))])
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits[0, 7:]
        alone = model(torch.tensor([second["input_ids"]])).logits[0]
    assert (packed - alone).abs().max().item() > 1e-2


def test_collator_labels_and_padding():
    rows = examples(100)
    batch = Collator(pad_token_id=0, attention="sdpa", pad_to=32)(rows)
    labels = batch["labels"]
    assert labels.shape == (2, 32)
    # the first token of every packed sequence is no target (its predecessor is another example's token)
    assert labels[0, 0] == labels[0, 7] == labels[0, 19] == IGNORE
    assert (labels[1, 9:] == IGNORE).all() and (batch["input_ids"][1, 9:] == 0).all()
    assert batch["position_ids"][0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    assert int(batch["num_tokens"]) == 33
    assert count_targets(batch) == 33 - 4
    mask = batch["attention_mask"][0, 0]
    assert mask[8, 7] and mask[6, 0] and not mask[7, 8] and not mask[0, 6]  # causal inside a sequence
    assert not mask[7, 6] and not mask[19, 18]  # nothing across sequence boundaries
    assert batch["attention_mask"][1, 0, 20].sum() > 0  # padding rows are not fully masked (no NaN)


def test_eager_gets_an_additive_float_mask():
    mask = Collator(pad_token_id=0, attention="eager")(examples(100))["attention_mask"]
    assert mask.dtype == torch.float32 and mask[0, 0, 0, 0] == 0 and mask[0, 0, 0, 1] < -1e30


def test_flash_attention_gets_one_flat_row_with_restarting_positions():
    batch = Collator(pad_token_id=0, attention="flash_attention_2")(examples(100))
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape == (1, 33)
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == [0, 7, 19, 24]  # cu_seqlens [0, 7, 19, 24, 33] follow from these
