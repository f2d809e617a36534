"""Axolotl's keys and what this trainer does with each: matrices/axolotl_keys.toml, read here (tomllib only).

Every key any Axolotl release since v0.4.0 declared has a row there with a decision (scripts/axolotl_keys.py
regenerates the history; tests/trainer/config/test_axolotl_keys.py fails on a key without one):

    honoured   a field of a config section (trainer/config/schema.py): the trainer acts on it
    inert      accepted and named in the run's one "ignored: ..." note (the row's reason says why the run is the same)
    migrated   rewritten to the row's `to` before the config is read, with a note (trainer/config/migrate.py)
    refused    exit 2 with the row's reason (why ignoring it would change what was asked, and what to write instead),
               unless its value is empty or Axolotl's own default: then it asks for nothing and is ignored

A key no release declared is not an Axolotl key: Axolotl's schema drops it, and so does this trainer (it is named in
the same note), with a "did you mean" warning where it is one edit from a key the trainer reads.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from trainer import facts

TABLE = "axolotl_keys"
DECISIONS = ("honoured", "inert", "migrated", "refused")


@lru_cache(maxsize=1)
def rows() -> dict[str, dict]:
    """name -> the table's row (matrices/axolotl_keys.toml)."""
    return {row["name"]: row for row in facts.rows(TABLE, "key")}


def effective(table: dict[str, dict], name: str) -> dict:
    """A key's row by the table's rules (its header): its own decision, else its datasets[] twin's (test_datasets[],
    pretraining_dataset[]), else its block's where the block is ignored or refused whole; {} when none.
    (scripts/axolotl_keys.py and the tests use this one copy of the rules.)"""
    row = table.get(name, {})
    if row.get("decision"):
        return row
    for prefix in ("test_datasets[].", "pretraining_dataset[]."):
        if name.startswith(prefix):
            return effective(table, "datasets[]." + name.removeprefix(prefix))
    parts = name.replace("[]", "").split(".")
    for i in range(len(parts) - 1, 0, -1):
        for block in (".".join(parts[:i]), ".".join(parts[:i]) + "[]"):
            if table.get(block, {}).get("decision") in ("inert", "refused"):
                return table[block]
    return {}


def decision(name: str) -> dict:
    """The row deciding `name` (a key as written in the table: `lora_r`, `datasets[].conversation`, `trl.beta`),
    {} for a key no Axolotl release declared and no row names."""
    return effective(rows(), name)


def is_empty(value: Any) -> bool:
    """A value that asks for nothing: unset, false, empty."""
    return value is None or value is False or value == "" or value == [] or value == {}


def asks_nothing(name: str, value: Any) -> bool:
    """The value is empty or Axolotl's default for the key (a refused key given it changes nothing)."""
    row = decision(name)
    return is_empty(value) or ("default" in row and value == row["default"] and type(value) is type(row["default"]))


def one_edit(a: str, b: str) -> bool:
    """a and b differ by one insertion, deletion, substitution or swap of neighbours."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i, (x, y) in enumerate(zip(short, long)) if x != y), len(short))
    return short[i:] == long[i + 1:]


# Legacy dtype switches: the same as bf16/fp16 (float32: neither).
# Short forms users write for a key, beyond one edit of it (a near miss of a key the config does not set is an error
# with "did you mean": ignoring `lr: 2e-4` would train at the default learning rate)
SHORT_FORMS = {"lr": "learning_rate", "epochs": "num_epochs", "seq_len": "sequence_len", "max_seq_len": "sequence_len",
               "batch": "micro_batch_size", "grad_accum": "gradient_accumulation_steps"}

# transformers' TrainingArguments (and TRL's config) names that Axolotl fills, one to one, from a key of its own under
# another name (axolotl/core/builders/base.py and causal.py: training_args_kwargs["lr_scheduler_type"] =
# cfg.lr_scheduler, ["optim"] = cfg.optimizer, ...; tests/trainer/config/test_training_arguments_names.py checks each
# against Axolotl's source). Axolotl's schema drops the transformers name, so a config that writes it trains with the
# default of Axolotl's key; here it is a near miss of that key, with "did you mean".
TRAINING_ARGUMENTS_NAMES = {
    "lr_scheduler_type": "lr_scheduler", "optim": "optimizer", "per_device_train_batch_size": "micro_batch_size",
    "per_device_eval_batch_size": "eval_batch_size", "num_train_epochs": "num_epochs", "max_seq_length": "sequence_len",
    "max_length": "sequence_len", "desirable_weight": "kto_desirable_weight",
    "undesirable_weight": "kto_undesirable_weight",
}

# Keys resume.py classes "may change" (a resumed run may set them anew) that still decide what is trained: how long it
# trains. A near miss of one (num_train_epochs, max_step) is an error, as for a key that trains: ignored, the run would
# train for the default length instead of the one written.
LENGTH = ("num_epochs", "max_steps")

# The keys Axolotl's schema requires (AxolotlInputConfig fields with no default, axolotl 0.19.0, read by
# scripts/axolotl_oracle.py schema): a config without one is refused there, so here too
REQUIRED = ("base_model", "learning_rate")

LEGACY_DTYPE_KEYS = {"bfloat16": ("bf16", True), "float16": ("fp16", True), "float32": ("bf16", False)}
TORCH_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                "float32": "fp32", "fp32": "fp32", "float": "fp32"}
