"""Helpers for the preference tests: pair/KTO rows, TRL's trainers as minimal objects (the test oracle)."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import torch

from tests.trainer.helpers import WORDS
from trainer.batch.labels import IGNORE


def random_sequences(n: int, seed: int = 0, vocab: int = 300, prompt=(2, 8), completion=(1, 9)):
    """n (input_ids, labels) with a random prompt (labels -100) and completion."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(*prompt), rng.randint(*completion)
        ids = [rng.randrange(5, vocab) for _ in range(p + c)]
        out.append((ids, [IGNORE] * p + ids[p:]))
    return out


def random_pairs(n: int, seed: int = 0, with_ref: bool = False) -> list[dict]:
    """Pairs that share their prompt, as the preference data has them."""
    rng = random.Random(seed + 1000)
    pairs = []
    for i, ((c_ids, c_lab), (r_ids, r_lab)) in enumerate(zip(random_sequences(n, seed), random_sequences(n, seed + 1))):
        p = sum(1 for t in c_lab if t == IGNORE)
        r_ids = c_ids[:p] + r_ids[sum(1 for t in r_lab if t == IGNORE):]
        r_lab = [IGNORE] * p + r_ids[p:]
        pair = {"chosen_input_ids": c_ids, "chosen_labels": c_lab, "rejected_input_ids": r_ids, "rejected_labels": r_lab}
        if with_ref:
            pair["ref"] = [-rng.uniform(5, 40), -rng.uniform(5, 40)]
        pairs.append(pair)
    return pairs


def trl_padded(sequences: list[tuple[list[int], list[int]]], pad: int = 0) -> dict[str, torch.Tensor]:
    """TRL's layout: right-padded input_ids, attention_mask, completion_mask."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), width), pad)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    completion = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (s, labels) in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        attention[i, :len(s)] = 1
        completion[i, :len(s)] = torch.tensor([int(t != IGNORE) for t in labels])
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def trl_object(cls, model=None, **attrs):
    """A TRL trainer object without its __init__ (which needs datasets and a Trainer): only what the loss reads."""
    from accelerate import Accelerator

    obj = cls.__new__(cls)
    defaults = {"accelerator": Accelerator(cpu=True), "model": model, "_metrics": defaultdict(lambda: defaultdict(list)),
                "_total_train_tokens": 0, "_tp_size": 1, "aux_loss_enabled": False, "is_encoder_decoder": False,
                "precompute_ref_logps": True}
    for key, value in {**defaults, **attrs}.items():
        object.__setattr__(obj, key, value)
    return obj


class LogProbsModel(torch.nn.Module):
    """Stands in for a model patched with TRL's fused LM head: returns given per-token log-probs."""

    def __init__(self, *per_token: torch.Tensor):
        super().__init__()
        self.outputs = list(per_token)

    def forward(self, input_ids, labels=None, **_):
        log_probs = self.outputs.pop(0)
        zeros = torch.zeros_like(log_probs)
        from types import SimpleNamespace

        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                               aux_loss=None)


def pair_rows(n: int, seed: int = 0, long_every: int = 0) -> list[dict]:
    """chat_template.default rows: messages + chosen/rejected assistant messages (skewed lengths with long_every)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
        long = long_every and i % long_every == 0
        rows.append({"messages": [{"role": "user", "content": f"Say {words(2)} {i % 5}."}],
                     "chosen": {"role": "assistant", "content": words(40 if long else rng.randint(1, 6))},
                     "rejected": {"role": "assistant", "content": words(rng.randint(1, 6))}})
    return rows


def kto_rows(n: int, seed: int = 0, long_every: int = 0) -> list[dict]:
    """chatml.prompt_pairs KTO rows with a label."""
    rng = random.Random(seed)
    return [{"prompt": f"Say {rng.choice(WORDS)} {i % 5}.",
             "completion": " ".join(rng.choice(WORDS) for _ in range(40 if long_every and i % long_every == 0 else rng.randint(1, 6))),
             "label": i % 3 != 0} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
