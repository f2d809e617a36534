"""rl: ebft datasets: each dataset's `type: module.function` is a transform, resolved as Axolotl does
(prompt_strategies/base.py load, utils/data/rl.py _load_split): a module of that name importable from the
config's directory or the working directory (e.g. the examples' ebft_pretrain.py next to the config) first,
else the built-in strategy of that name (Axolotl's prompt_strategies/ebft: here ebft_strided_structured; structured
mode's ebft_opencode, ebft_chat_multiturn.transform_last_turn, ebft_reasoning.transform / transform_answer_only,
whose rows are prompts for trainer/objectives/grpo_data.py).
`function(cfg)` returns a row function (given tokenizer= when it takes one) or (function, map kwargs), with
remove_columns "__all__" meaning every original column. Rows give input_ids, labels (default: input_ids) and
optionally prompt_length.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from trainer.batch.labels import IGNORE
from trainer.data import user_code
from trainer.data.prepare import filter_and_split, load_raw, merged
from trainer.errors import DataError


def strided_structured(cfg, **_):
    """Built-in ebft_strided_structured.transform (the behaviour of Axolotl's
    prompt_strategies/ebft/ebft_strided_structured.py transform): prompt (input|prompt|question) tokenized with
    special tokens, completion (output|completion|answer) without; the completion is cut first to fit
    sequence_len (a prompt alone too long keeps its first sequence_len - 1 tokens and one completion token);
    prompt labels -100; padded to sequence_len; prompt_length is the prompt's token count."""
    limit = cfg.sequence_len

    def row(example, tokenizer=None):
        prompt = example.get("input", example.get("prompt", example.get("question", "")))
        completion = example.get("output", example.get("completion", example.get("answer", "")))
        pad = tokenizer.pad_token_id or tokenizer.eos_token_id
        p = tokenizer(prompt, truncation=False, add_special_tokens=True)["input_ids"]
        c = tokenizer(completion, truncation=False, add_special_tokens=False)["input_ids"]
        if len(p) + len(c) > limit:
            if limit - len(p) < 1:
                p, c = p[:limit - 1], c[:1]
            else:
                c = c[:limit - len(p)]
        fill = limit - len(p) - len(c)
        return {"input_ids": p + c + [pad] * fill, "attention_mask": [1] * (len(p) + len(c)) + [0] * fill,
                "labels": [IGNORE] * len(p) + c + [IGNORE] * fill, "prompt_length": len(p)}

    return row, {"remove_columns": "__all__"}


BUILTIN = {"ebft_strided_structured.transform": strided_structured}


# --- structured mode: rows {prompt (chat messages), ground_truth (the reference completion's text)} ------------------
# Axolotl's prompt_strategies/ebft strategies of that mode, by behaviour (the multi-turn `transform`, whose
# remaining_turns ask for sequential rollouts on a vLLM server, is not here).

def opencode(cfg, **_):
    """ebft_opencode.transform: OpenCodeInstruct's input as one user message, its output the ground truth."""
    return (lambda example: {"prompt": [{"role": "user", "content": example["input"]}],
                             "ground_truth": example["output"]}), {"remove_columns": "__all__"}


def _messages(example) -> list[dict]:
    return example.get("messages", example.get("conversations", [])) or []


def _last_assistant(example, answer=lambda text: text) -> dict:
    """The conversation before its last assistant turn as the prompt, that turn (through `answer`) the ground truth
    (no assistant turn: every message but the last, and an empty ground truth)."""
    messages = _messages(example)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return {"prompt": list(messages[:-1]), "ground_truth": ""}
    return {"prompt": list(messages[:last]), "ground_truth": answer(messages[last]["content"])}


def last_turn(cfg, **_):
    """ebft_chat_multiturn.transform_last_turn and ebft_reasoning.transform (the same split; thinking kept)."""
    return _last_assistant, {"remove_columns": "__all__"}


def answer_only(cfg, **_):
    """ebft_reasoning.transform_answer_only: as last_turn, <think>...</think> blocks cut from the ground truth."""
    def strip(text: str) -> str:
        return re.sub(r"<think>.*?</think>\s*", "", text, flags=re.DOTALL).strip()

    return (lambda example: _last_assistant(example, strip)), {"remove_columns": "__all__"}


STRUCTURED = {"ebft_opencode.transform": opencode, "ebft_chat_multiturn.transform_last_turn": last_turn,
              "ebft_reasoning.transform": last_turn, "ebft_reasoning.transform_answer_only": answer_only}


def resolve(cfg, type_: str, key: str = "datasets.type"):
    """(the transform's factory, the file it came from or None for a built-in): trainer/data/user_code.py's order,
    then the built-in strategy of that name."""
    return user_code.find(type_, key, getattr(cfg, "_config_dir", None), BUILTIN)


def identity(cfg) -> list[str]:
    """The transforms' source files' hashes (part of the dataset cache key: editing a transform re-tokenizes)."""
    out = []
    for ds in cfg.datasets:
        _, path = resolve(cfg, ds.type)
        out.append(hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else f"builtin:{ds.type}")
    return out


def build_ebft(cfg, tokenizer):
    parts = []
    for i, ds in enumerate(cfg.datasets):
        factory, _ = resolve(cfg, ds.type, f"datasets.{i}.type")
        mapped = user_code.transform(factory(cfg), load_raw(ds, cfg.seed), tokenizer, f"datasets.{i}.type",
                                     desc=f"ebft transform {ds.type}")
        if "input_ids" not in mapped.column_names:
            raise DataError(f"datasets.{i}: the transform {ds.type} gave no input_ids (columns: "
                            f"{', '.join(mapped.column_names)}); it must tokenize (take tokenizer=)")
        parts.append(mapped.map(lambda row: _finish(row, cfg), remove_columns=mapped.column_names,
                                desc=f"checking {ds.path}"))
    return filter_and_split(cfg, merged(cfg, parts))


def _finish(row: dict, cfg) -> dict:
    ids = list(row["input_ids"])
    labels = list(row["labels"]) if row.get("labels") is not None else list(ids)
    if len(labels) != len(ids):
        raise DataError(f"an ebft transform gave {len(ids)} input_ids but {len(labels)} labels")
    too_long = len(ids) > cfg.sequence_len
    if too_long and cfg.excess_length_strategy == "truncate":
        ids, labels = ids[:cfg.sequence_len], labels[:cfg.sequence_len]
    out = {"input_ids": ids, "labels": labels, "too_long": too_long, "length": len(ids),
           "targets": sum(1 for t in labels[1:] if t != IGNORE)}
    if row.get("prompt_length") is not None:
        out["prompt_length"] = int(row["prompt_length"])
    return out

