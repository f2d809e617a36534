"""Retired and renamed Axolotl forms, rewritten to what this trainer reads before the config is checked, each with a
note saying what was read as what.

Keys: every row of matrices/axolotl_keys.toml whose decision is `migrated` is rewritten to its `to`: a plain rename
where `to` is a key of the same section (sequence_parallel_degree -> context_parallel_size, load_4bit ->
load_in_4bit, ...), else by its own function in MIGRATIONS below (batch_size, relora_steps, rope_scaling, the
precision switches, sharegpt's conversation / field_human / field_model). tests/trainer/config/test_migrations.py checks
that every migrated row has its rewrite.

Values (retired forms of a key that is still read):
- `type: sharegpt` (and sharegpt.load_role / load_guanaco / load_ultrachat), Axolotl's conversation format until it
  was refused in 0.5: `type: chat_template` with the messages field and the role/content names sharegpt read, the
  chat template named by `conversation`, the role names field_human / field_model added to `roles`.
- `deepspeed: deepspeed/zero3.json`: Axolotl's 2023 folder of DeepSpeed configs, renamed deepspeed_configs/; read
  as the bundled deepspeed_configs/ file of that name where the given path does not exist.
- a preference method (rl: dpo, ipo, orpo, simpo) over a dataset whose type names no preference format
  (alpaca, completion, an unknown chatml.<function>, ...): Axolotl 0.4's DPO loader found no transform for it and used the rows unchanged, as
  prompt / chosen / rejected; so does this trainer (no type), with a note.
- `base_model_config` equal to base_model (Axolotl's own default): nothing to read.
- `pretraining_dataset` with more than one entry: Axolotl streams the first entry only (utils/data/sft.py
  _extract_pretraining_config reads `cfg.pretraining_dataset[0]`) and reads nothing of the others, whatever their
  type (users' configs carry a second entry with `type: eval`); so does this trainer, with a note naming each entry
  left out and where more data goes (the first entry's data_files, or datasets: with streaming: true).
- a falsy value (0, an empty string) of a key Axolotl's normalize_config reads as `cfg.KEY or DEFAULT`
  (FALSY_AS_DEFAULT below): the default, as Axolotl reads it, with a note (`eval_max_new_tokens: 0` is 128 there).
- a 0 of a key Axolotl's trainer builders read as unset (`if cfg.KEY:`, `cfg.KEY or DEFAULT`; ZERO_AS_AXOLOTL
  below): unset here too, or the value Axolotl then trains with where this trainer's unset means another (a 0
  save_total_limit keeps 4 checkpoints there), with a note saying so.

A rewrite never overrides a key the config also sets to another value: that is a problem (set one of them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from trainer.config import keys
from trainer.config.datasets import template_names
from trainer.config.parallel import BUNDLED_DS
from trainer.config.rl import KTO_TYPES, PAIR_TYPES, PRM_TYPES, REWARD_TYPES

# the key a table row names, by the list the entry sits in
LISTS = ("datasets", "test_datasets", "pretraining_dataset")

# Axolotl 0.4's sharegpt loaders: type -> (messages field, role property, content property, extra role names)
SHAREGPT = {
    "sharegpt": ("conversations", "from", "value", {}),
    "sharegpt.load_role": ("conversations", "role", "value", {}),
    "sharegpt.load_guanaco": ("conversations", "role", "text", {"user": ["prompter"]}),
    "sharegpt.load_ultrachat": ("messages", "role", "content", {}),
}
# FastChat conversation names whose chat template here has another name
CONVERSATIONS = {"llama-3": "llama3"}
# Axolotl's role names when a conversation dataset sets none (trainer/data/formats/roles.py's DEFAULT_ROLES)
DEFAULT_ROLES = {"user": ["human", "user"], "assistant": ["gpt", "assistant"], "system": ["system"], "tool": ["tool"]}
PREFERENCE_METHODS = ("dpo", "ipo", "orpo", "simpo")
# Every key Axolotl's normalize_config rewrites as `cfg.KEY = cfg.KEY or DEFAULT` (axolotl 0.19.0,
# src/axolotl/utils/config/__init__.py): a 0 or "" there is the default, never the value as written
FALSY_AS_DEFAULT = {"eval_max_new_tokens": 128, "eval_table_size": 0, "device_map": "auto"}
# Every key whose 0 Axolotl 0.19's trainer builders read as unset: key -> (what this trainer reads instead, None for
# unset (the key's own default here, the same as Axolotl's unset), where Axolotl reads it so). The pairs of LISA go
# together: a 0 of either turns LISA off (both keys unset).
_UNSET = None
ZERO_AS_AXOLOTL: dict[str, tuple[Any, str]] = {
    "save_total_limit": (4, "core/builders/base.py: `save_total_limit if save_total_limit else 4`"),
    "ddp_timeout": (_UNSET, "core/builders/causal.py passes it only `if cfg.ddp_timeout` (transformers' 1800 s)"),
    "kto_desirable_weight": (_UNSET, "core/builders/rl.py: `kto_desirable_weight or 1.0`"),
    "kto_undesirable_weight": (_UNSET, "core/builders/rl.py: `kto_undesirable_weight or 1.0`"),
    "loss_watchdog_patience": (_UNSET, "utils/callbacks: `loss_watchdog_patience or 3`"),
    "eval_steps": (_UNSET, "core/builders/base.py: `elif cfg.eval_steps:` (no step cadence)"),
    "save_steps": (_UNSET, "core/builders/base.py: `if cfg.save_steps:` (no step cadence)"),
    "max_steps": (_UNSET, "core/builders/base.py: `max_steps or total_num_steps` (the epochs' steps)"),
    "dp_shard_size": (_UNSET, "utils/distributed.py uses a size only when it is > 1"),
    "dp_replicate_size": (_UNSET, "utils/distributed.py uses a size only when it is > 1"),
    "tensor_parallel_size": (_UNSET, "utils/distributed.py uses a size only when it is > 1"),
    "context_parallel_size": (_UNSET, "utils/distributed.py uses a size only when it is > 1"),
    "eval_batch_size": (8, "core/builders/base.py passes it only `if cfg.eval_batch_size`: transformers' "
                           "per_device_eval_batch_size, 8"),
    "early_stopping_patience": (_UNSET, "core/builders/causal.py: `if cfg.early_stopping_patience:` (no early stop)"),
    "lisa_n_layers": (_UNSET, "core/builders/causal.py: `if lisa_step_interval and lisa_n_layers:` (LISA off)"),
    "lisa_step_interval": (_UNSET, "core/builders/causal.py: `if lisa_step_interval and lisa_n_layers:` (LISA off)"),
    "jagged_restart_steps": (_UNSET, "core/builders/causal.py: `if cfg.jagged_restart_steps:` (no restarts)"),
    "scaling_softmax_factor": (_UNSET, "loaders/patch_manager.py: `scaling_softmax_factor or 0.43`"),
    "ray_num_workers": (1, "cli/train.py: Ray Train's ScalingConfig(num_workers=0) runs the loop in the driver "
                           "process, one rank; here one Ray worker, one rank: the same training"),
}


class Rewrite:
    """One config's rewrites: notes say what was read as what, problems what cannot be."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.problems: list[str] = []

    def set(self, raw: dict, key: str, value: Any, where: str, why: str) -> None:
        """raw[key] = value, unless the config already sets key to something else."""
        if raw.get(key) is not None and raw[key] != value:
            self.problems.append(f"{why} conflicts with {where}{key}: {raw[key]!r} also given; set only {where}{key}")
            return
        raw[key] = value


Migration = Callable[[dict, str, Any, str, Rewrite], None]  # (mapping, old key, its value, where, rewrite)


def _rename(target: str) -> Migration:
    def rename(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
        rw.set(raw, target, value, where, f"{where}{key}")
        rw.notes.append(f"{where}{key}: {value!r} read as {where}{target}: {value!r} (Axolotl's older name)")
    return rename


def _precision(target: str, flag: bool) -> Migration:
    def precision(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
        if value and raw.get(target) is None:
            raw[target] = flag
            rw.notes.append(f"{key}: true is the legacy spelling of {target}: {str(flag).lower()}")
    return precision


def _torch_dtype(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    precision = keys.TORCH_DTYPES.get(str(value).removeprefix("torch."))
    if precision is None:
        rw.problems.append(f"torch_dtype: unknown dtype {value!r}; use bfloat16, float16 or float32")
    elif raw.get("bf16") is None and raw.get("fp16") is None:
        raw["bf16" if precision != "fp16" else "fp16"] = precision in ("bf16", "fp16")
        rw.notes.append(f"torch_dtype: {value} is read as {precision}")


def _batch_size(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    micro = raw.get("micro_batch_size") or 1
    if not isinstance(value, int) or isinstance(micro, bool) or not isinstance(micro, int) or value < micro:
        rw.problems.append(f"batch_size: {value!r} must be a whole number of micro-batches (micro_batch_size "
                           f"{micro!r}); write gradient_accumulation_steps instead")
        return
    rw.set(raw, "gradient_accumulation_steps", value // micro, "", "batch_size")
    rw.notes.append(f"batch_size: {value} is read as gradient_accumulation_steps: {value // micro} (batch_size // "
                    "micro_batch_size, as Axolotl derives it; per process)")


def _max_packed(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    rw.set(raw, "sample_packing", True, "", "max_packed_sequence_len")
    rw.set(raw, "sequence_len", value, "", "max_packed_sequence_len")
    rw.notes.append(f"max_packed_sequence_len: {value} is read as sample_packing: true with sequence_len: {value} "
                    "(Axolotl's packing before sample_packing)")


def _relora_steps(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    rw.set(raw, "relora", True, "", "relora_steps")
    rw.set(raw, "jagged_restart_steps", value, "", "relora_steps")
    rw.notes.append(f"relora_steps: {value} is read as relora: true with jagged_restart_steps: {value} (ReLoRA's "
                    "older keys)")


def _rope_scaling(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    overrides = raw.get("model_config")
    overrides = dict(overrides) if isinstance(overrides, dict) else {}
    rw.set(overrides, "rope_scaling", value, "model_config.", "rope_scaling")
    raw["model_config"] = overrides
    rw.notes.append("rope_scaling: read as model_config.rope_scaling (an override of the model's config)")


def _model_config(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    """Axolotl's model_config alias and its field name overrides_of_model_config: the trainer's model_config_overrides."""
    rw.set(raw, "model_config", value, "", key)
    if key != "model_config":
        rw.notes.append(f"{key}: read as model_config (its field name in Axolotl's schema)")


def _conversation(entry: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    """Read with type: sharegpt (sharegpt()); with any other type Axolotl 0.4 did not read it."""
    rw.notes.append(f"{where}conversation: ignored (type {entry.get('type')!r} does not read it; only sharegpt did)")


def _extra_role(role: str) -> Migration:
    def extra_role(entry: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
        if not isinstance(value, str) or not value:
            return
        roles = {r: list(v) for r, v in (entry.get("roles") or DEFAULT_ROLES).items()}
        if value not in roles.setdefault(role, []):
            roles[role].append(value)
        entry["roles"] = roles
        rw.notes.append(f"{where}{key}: {value!r} turns are read as {role} turns (roles.{role})")
    return extra_role


def _gc_steps(raw: dict, key: str, value: Any, where: str, rw: Rewrite) -> None:
    """Axolotl's retired gc_steps: torch_empty_cache_steps (where > 0) and gc_collect_steps, when neither is set
    (its schema's migrate_gc_steps); else gc_collect_steps only, where unset (its trainer builder reads
    `gc_collect_steps or gc_steps`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:  # named as written, not as read
        rw.problems.append(f"{where}{key}: {value!r}: a whole number of steps, at least -1 (it is read as "
                           "gc_collect_steps and torch_empty_cache_steps)")
        return
    if raw.get("torch_empty_cache_steps") is None and raw.get("gc_collect_steps") is None:
        if isinstance(value, int) and value > 0:
            raw["torch_empty_cache_steps"] = value
        raw["gc_collect_steps"] = value
        rw.notes.append(f"{where}{key}: {value} (retired) is read as torch_empty_cache_steps and gc_collect_steps, as "
                        "in Axolotl")
    elif raw.get("gc_collect_steps") is None:
        raw["gc_collect_steps"] = value
        rw.notes.append(f"{where}{key}: {value} (retired) is read as gc_collect_steps, as in Axolotl (the "
                        "torch_empty_cache_steps given stays)")
    else:
        rw.notes.append(f"{where}{key}: ignored, as in Axolotl: gc_collect_steps is given")


# the rewrites that are not a plain rename, by the table's name of the key
MIGRATIONS: dict[str, Migration] = {
    "bfloat16": _precision("bf16", True), "float16": _precision("fp16", True), "float32": _precision("bf16", False),
    "torch_dtype": _torch_dtype,
    "batch_size": _batch_size,
    "max_packed_sequence_len": _max_packed,
    "relora_steps": _relora_steps,
    "gc_steps": _gc_steps,
    "rope_scaling": _rope_scaling,
    "overrides_of_model_config": _model_config,
    "datasets[].conversation": _conversation,
    "datasets[].field_human": _extra_role("user"),
    "datasets[].field_model": _extra_role("assistant"),
}


def migration(name: str, fields: set[str]) -> Migration | None:
    """The rewrite of a migrated key (its table name), or None where the table's `to` is not a key of `fields`."""
    if name in MIGRATIONS:
        return MIGRATIONS[name]
    target = str(keys.decision(name).get("to", "")).removeprefix("datasets[].")
    return _rename(target) if target in fields else None


def _keys_of(mapping: dict, prefix: str, where: str, fields: set[str], rw: Rewrite) -> dict:
    """The mapping with its migrated keys rewritten (in the order written)."""
    out = dict(mapping)
    for key in list(mapping):
        name = f"{prefix}{key}"
        if key not in out or keys.decision(name).get("decision") != "migrated" or key in fields:
            continue
        value = out.pop(key)
        if value is None:
            continue
        rewrite = migration(_table_name(name), fields)
        if rewrite is None:  # a table row without its rewrite (tests/trainer/config/test_migrations.py catches this)
            rw.problems.append(f"{where}{key}: no rewrite to {keys.decision(name).get('to')} here; write that instead")
            continue
        rewrite(out, key, value, where, rw)
    return out


def _table_name(name: str) -> str:
    for prefix in ("test_datasets[].", "pretraining_dataset[]."):
        if name.startswith(prefix):
            return "datasets[]." + name.removeprefix(prefix)
    return name


def sharegpt(entry: dict, where: str, rw: Rewrite) -> dict:
    """type: sharegpt[...] -> type: chat_template, read the way Axolotl 0.4's sharegpt loader read the rows."""
    kind = entry.get("type")
    base = kind.split(":")[0]
    if base not in SHAREGPT:
        rw.problems.append(f"{where}type: {kind!r} is one of Axolotl's retired sharegpt loaders this trainer does not "
                           f"translate ({', '.join(SHAREGPT)} are); write type: chat_template with field_messages and "
                           "message_property_mappings")
        return entry
    messages, role, content, extra = SHAREGPT[base]
    out = {k: v for k, v in entry.items() if k not in ("conversation", "strict")}
    out["type"] = "chat_template"
    rw.set(out, "field_messages", messages, where, f"{where}type: {kind}")
    out["message_property_mappings"] = {"role": role, "content": content}
    roles = {r: list(v) for r, v in (out.get("roles") or DEFAULT_ROLES).items()}
    for r, names in extra.items():
        roles[r] = roles.get(r, []) + [n for n in names if n not in roles.get(r, [])]
    if extra or "roles" in out:
        out["roles"] = roles
    conversation = entry.get("conversation")
    template = ""
    if conversation:
        name = CONVERSATIONS.get(conversation, conversation)
        if name not in template_names():
            rw.problems.append(f"{where}conversation: FastChat's {conversation!r} conversation template has no chat "
                               f"template here; write type: chat_template with chat_template: one of "
                               f"{', '.join(template_names())} (or jinja with chat_template_jinja)")
            return out
        rw.set(out, "chat_template", name, where, f"{where}conversation")
        template = f", chat template {name}"
    else:
        template = (", the config's chat_template (Axolotl 0.4 rendered it with FastChat's vicuna_v1.1 when "
                    "conversation was unset)")
    rw.notes.append(f"{where}type: {kind} (Axolotl's conversation format until 0.5) is read as type: chat_template "
                    f"with field_messages: {messages}, message_property_mappings {{role: {role}, content: {content}}}"
                    f"{template}")
    return out


def _old_deepspeed(raw: dict, rw: Rewrite) -> None:
    value = raw.get("deepspeed")
    if not isinstance(value, str) or Path(value).expanduser().exists():
        return
    given = Path(value)
    if given.parent.name == "deepspeed" and (BUNDLED_DS / given.name).exists():
        raw["deepspeed"] = f"deepspeed_configs/{given.name}"
        rw.notes.append(f"deepspeed: {value} (Axolotl's folder before it was renamed deepspeed_configs/) is read as "
                        f"the bundled deepspeed_configs/{given.name}")


def _preference_types(raw: dict, rw: Rewrite) -> None:
    if raw.get("rl") not in PREFERENCE_METHODS:
        return
    for group in ("datasets", "test_datasets"):
        for i, entry in enumerate(raw.get(group) or []):
            kind = entry.get("type") if isinstance(entry, dict) else None
            # Axolotl's strategy loader returns no transform for any name it cannot import (prompt_strategies/base.py
            # load), and the rows are used as they are. Not so here for a pair type (or one edit from one: a typo)
            # or another method's type (KTO, reward models): those are mistakes to name.
            if not isinstance(kind, str) or kind in PAIR_TYPES + KTO_TYPES + REWARD_TYPES + PRM_TYPES or any(
                    keys.one_edit(kind, t) for t in PAIR_TYPES):
                continue
            entry.pop("type")
            rw.notes.append(f"{group}.{i}.type: {kind!r} names no preference format; as in Axolotl 0.4 (whose DPO "
                            "loader found no transform for it), the rows are read unchanged: prompt, chosen and "
                            "rejected texts (field_prompt / field_chosen / field_rejected name other columns)")


def _base_model_config(raw: dict, rw: Rewrite) -> None:
    """The same value as base_model is Axolotl's own default (nothing to read); another one is where the model's
    config is read from, and the tokenizer too unless tokenizer_config says otherwise, as Axolotl's load_tokenizer."""
    other = raw.get("base_model_config")
    if other is None or other == raw.get("base_model"):
        raw.pop("base_model_config", None)
        return
    if raw.get("tokenizer_config") is None:
        raw["tokenizer_config"] = other
        rw.notes.append(f"base_model_config: the model's config and the tokenizer are read from {other} (Axolotl's "
                        "tokenizer_config default)")


def _pretraining_first(raw: dict, rw: Rewrite) -> None:
    """Only the first pretraining_dataset entry is streamed, as in Axolotl (see the module doc)."""
    entries = raw.get("pretraining_dataset")
    if not isinstance(entries, list) or len(entries) < 2:
        return
    raw["pretraining_dataset"] = entries[:1]
    for i, entry in enumerate(entries[1:], start=1):
        what = ", ".join(f"{k}: {entry[k]}" for k in ("path", "type") if isinstance(entry, dict) and k in entry)
        rw.notes.append(f"pretraining_dataset.{i}{f' ({what})' if what else ''}: not read; as in Axolotl, only the "
                        "first pretraining_dataset entry is streamed (more files: the first entry's data_files; "
                        "several datasets: datasets: with streaming: true)")


def _zero_as_axolotl(raw: dict, rw: Rewrite) -> None:
    """A 0 of a ZERO_AS_AXOLOTL key is read as Axolotl reads it: unset, or the value Axolotl then trains with."""
    def zero(value: Any) -> bool:  # (false too: Axolotl's int and float fields take it as 0)
        return isinstance(value, (int, float)) and value == 0

    lisa = ("lisa_n_layers", "lisa_step_interval")
    if any(zero(raw.get(k)) for k in lisa):
        for key in lisa:
            if key in raw:
                rw.notes.append(f"{key}: {raw.pop(key)!r} not read: LISA is off, as in Axolotl (a 0 of "
                                f"lisa_n_layers or lisa_step_interval; {ZERO_AS_AXOLOTL[key][1]})")
    for key, (value, where) in ZERO_AS_AXOLOTL.items():
        if key in lisa or not zero(raw.get(key)):
            continue
        written = raw.pop(key)
        if value is _UNSET:
            rw.notes.append(f"{key}: {written!r} read as unset, as Axolotl reads it ({where})")
        else:
            raw[key] = value
            rw.notes.append(f"{key}: {written!r} read as {value!r}, as Axolotl reads it ({where})")
    # warmup: Axolotl reads warmup_steps first (core/builders/base.py `if cfg.warmup_steps is not None`), so a 0
    # warmup_ratio beside warmup_steps is not read there
    if zero(raw.get("warmup_ratio")) and raw.get("warmup_steps") is not None:
        rw.notes.append(f"warmup_ratio: {raw.pop('warmup_ratio')!r} not read beside warmup_steps, as in Axolotl "
                        "(core/builders/base.py reads warmup_steps first)")


def _falsy_as_default(raw: dict, rw: Rewrite) -> None:
    """A falsy value of a FALSY_AS_DEFAULT key is read as its default, as Axolotl's normalize_config reads it."""
    for key, default in FALSY_AS_DEFAULT.items():
        value = raw.get(key)
        if value is not None and not isinstance(value, bool) and value in (0, "") and value != default:
            raw[key] = default
            rw.notes.append(f"{key}: {value!r} read as {default!r}, as Axolotl reads it (its normalize_config: "
                            f"`{key} or {default!r}`)")


def migrate(raw: dict, config_fields: set[str], entry_fields: set[str]) -> tuple[dict, Rewrite]:
    """The config with every retired form rewritten (a new mapping), and the notes and problems of doing so."""
    rw = Rewrite()
    out = _keys_of(dict(raw), "", "", config_fields, rw)
    for group in LISTS:
        entries = out.get(group)
        if not isinstance(entries, list):
            continue
        rewritten = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                rewritten.append(entry)
                continue
            where = f"{group}.{i}."
            if group != "pretraining_dataset" and isinstance(entry.get("type"), str) and \
                    entry["type"].split(":")[0].startswith("sharegpt"):
                entry = sharegpt(entry, where, rw)
            rewritten.append(_keys_of(entry, f"{group}[].", where, entry_fields, rw))
        out[group] = rewritten
    _old_deepspeed(out, rw)
    _preference_types(out, rw)
    _base_model_config(out, rw)
    _pretraining_first(out, rw)
    _falsy_as_default(out, rw)
    _zero_as_axolotl(out, rw)
    return out, rw
