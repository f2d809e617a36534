"""Preference data: tokenise pairs (dpo, ipo, orpo, simpo) or KTO examples; filter, split, add KTO's KL pairs.

The preference objectives' data hook (PairObjective.prepare_data, KTO.prepare_data) hands build_preference to
trainer.data.prepare.prepare, so the result is cached, prepared by rank 0 only and waited for with a timeout
exactly like SFT data.

Rows (pairs):  chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels, length (both), targets
Rows (KTO):    input_ids, labels, label (desirable?), kl_input_ids, kl_labels, length, targets

KTO's KL term is estimated from mismatched (prompt, completion) pairs. They are fixed here, once: example i
gets the completion of example i-1 of its split (after the seeded shuffle), as TRL does within each batch.
Fixing them at preparation time is what lets their reference log-probs be computed once and cached.
"""

from __future__ import annotations

from trainer.batch.labels import IGNORE
from trainer.config import Config, DatasetConfig
from trainer.data.formats.preference_prompts import label_of, render, tokenize
from trainer.data.prepare import tokenize_and_split

PAIR_SIDES = ("chosen", "rejected")


def _targets(labels: list[int]) -> int:
    return sum(1 for t in labels[1:] if t != IGNORE)


def _tokenize(raw, ds: DatasetConfig, cfg: Config, tokenizer, workers: int):
    kto = cfg.rl == "kto"
    limit = cfg.sequence_len
    truncate = cfg.excess_length_strategy == "truncate"

    def convert(row):
        prompt, completions, add_special = render(row, ds, tokenizer, kto)
        seqs = [tokenize(prompt, c, tokenizer, add_special) for c in completions]
        too_long = max(len(s["input_ids"]) for s in seqs) > limit
        if too_long and truncate:
            seqs = [{**s, "input_ids": s["input_ids"][:limit], "labels": s["labels"][:limit],
                     "prompt_len": min(s["prompt_len"], limit)} for s in seqs]
        out = {"too_long": too_long, "length": sum(len(s["input_ids"]) for s in seqs),
               "targets": min(_targets(s["labels"]) for s in seqs)}
        if kto:
            (s,) = seqs
            return {**out, "input_ids": s["input_ids"], "labels": s["labels"], "prompt_len": s["prompt_len"],
                    "label": label_of(row, ds)}
        for side, s in zip(PAIR_SIDES, seqs):
            out[f"{side}_input_ids"], out[f"{side}_labels"] = s["input_ids"], s["labels"]
        return out

    return raw.map(convert, remove_columns=raw.column_names, num_proc=workers if workers > 1 else None,
                   desc=f"tokenizing {ds.path}")


def add_kl_pairs(data, limit: int):
    """KTO: each example's mismatched pair is its prompt with the previous example's completion."""
    ids, labels, prompt_lens = data["input_ids"], data["labels"], data["prompt_len"]

    def mismatched(row, i):
        j = i - 1  # -1 wraps to the last example
        completion = ids[j][prompt_lens[j]:]
        kl_ids = (row["input_ids"][: row["prompt_len"]] + completion)[:limit]
        kl_labels = ([IGNORE] * row["prompt_len"] + labels[j][prompt_lens[j]:])[:limit]
        return {"kl_input_ids": kl_ids, "kl_labels": kl_labels}

    return data.map(mismatched, with_indices=True, desc="KTO mismatched pairs")


def build_preference(cfg: Config, tokenizer) -> tuple[object, object | None, dict]:
    data, validation, stats = tokenize_and_split(cfg, tokenizer, _tokenize)
    if cfg.rl == "kto":
        data = add_kl_pairs(data, cfg.sequence_len)
        validation = add_kl_pairs(validation, cfg.sequence_len) if validation is not None else None
        stats["desirable"] = int(sum(data["label"]))
        stats["undesirable"] = len(data) - stats["desirable"]
    stats.update(train_rows=len(data), train_tokens=int(sum(data["length"])),
                 validation_rows=len(validation) if validation is not None else 0)
    return data, validation, stats
