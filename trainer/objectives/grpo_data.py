"""Prompt data for rl: grpo / gdpo, and the user's code it names (Axolotl's conventions).

- `datasets[i].type: module.function` (e.g. Axolotl's `rwd.gsm8k_transform`): `function(cfg, dataset_idx=i)`
  returns a row transform, or `(transform, map_kwargs)` (`remove_columns`, "__all__" for every column); a
  transform taking `tokenizer` gets it. Without a type the rows already have a `prompt` column.
- `trl.reward_funcs: [module.function]`: TRL's reward-function signature, `f(prompts, completions,
  completion_ids, **columns) -> list[float | None]`.
Modules import from the config's directory first, then the working directory (where Axolotl finds them).

Each row keeps its `prompt` (a string, or chat messages rendered with the chat template and a generation
prompt, as TRL does) as token ids, and its other columns as JSON for the reward functions. The rows are
prepared in memory by every process (prompts are small, and the transform is user code a cache key could not
see); prompts longer than sequence_len are dropped and counted.
"""

from __future__ import annotations

import inspect
import json

from trainer.data import user_code
from trainer.data.prepare import Prepared, load_raw, refuse_too_long
from trainer.errors import ConfigError, DataError
from trainer.runtime.templates import render as budgeted  # the chat template under a time budget


def reward_functions(cfg) -> list:
    funcs = [user_code.find(n, "trl.reward_funcs", cfg._config_dir)[0] for n in cfg.trl.reward_funcs]
    for name, func in zip(cfg.trl.reward_funcs, funcs):
        try:
            enough = len(inspect.signature(func).parameters) >= 2 or any(
                p.kind == p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())
        except (TypeError, ValueError):
            enough = True
        if not enough:
            raise ConfigError(f"trl.reward_funcs: {name} must accept (prompts, completions, **kwargs)")
    return funcs


def _transformed(cfg, i: int, ds, raw, tokenizer, builtin: dict | None = None):
    key = f"datasets.{i}.type"
    factory, _ = user_code.find(ds.type, key, cfg._config_dir, builtin)
    return user_code.transform(factory(cfg, dataset_idx=i), raw, tokenizer, key, desc=f"transforming {ds.path}")


def prompt_ids(prompt, tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """TRL's prompt tokens: chat messages through the chat template with a generation prompt (and
    trl.chat_template_kwargs, as TRL's GRPOTrainer passes them); text as is."""
    if isinstance(prompt, list):
        out = budgeted(tokenizer, prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                       **(template_kwargs or {}))
        return list(out["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def prepare(cfg, tokenizer, log=print, builtin: dict | None = None, columns: tuple[str, ...] = ("prompt",)):
    """Prepared(train rows {prompt_ids, length, row, index}, validation rows (val_set_size) or None, stats).
    builtin: transforms known by name (structured EBFT's strategies); columns: what each row must have after them."""
    # heavy: datasets loads only when this runs
    import datasets

    parts = []
    for i, ds in enumerate(cfg.datasets):
        raw = load_raw(ds, cfg.seed)
        data = _transformed(cfg, i, ds, raw, tokenizer, builtin) if ds.type else raw
        for column in columns:
            if column not in data.column_names:
                raise DataError(f"datasets.{i}: rows have no {column!r} column after {ds.type or 'loading'} "
                                f"(columns: {', '.join(data.column_names)})")
        parts.append(data)
    rows = [row for part in parts for row in part]
    kept, too_long = [], 0
    for row in rows:
        try:
            ids = prompt_ids(row["prompt"], tokenizer, cfg.trl.chat_template_kwargs if cfg.trl else None)
        except (ValueError, TypeError, KeyError) as err:  # no chat template, or messages it cannot render
            raise DataError(f"datasets: cannot tokenize the prompt {str(row['prompt'])[:80]!r}: "
                            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        if len(ids) > cfg.sequence_len:
            too_long += 1
            continue
        kept.append({"prompt_ids": ids, "length": len(ids), "row": json.dumps(row, default=str), "index": len(kept)})
    refuse_too_long(cfg, too_long, len(rows), "prompts")
    if too_long:
        log(f"{too_long} of {len(rows)} prompts are longer than sequence_len {cfg.sequence_len}: dropped")
    if not kept:
        raise DataError("no prompts left to train on")
    train = datasets.Dataset.from_list(kept)
    if cfg.shuffle_merged_datasets:
        train = train.shuffle(seed=cfg.seed)
    validation = None
    if cfg.val_set_size:  # as SFT data: a seeded split of val_set_size rows (>= 1) or that fraction
        size = cfg.val_set_size if cfg.val_set_size < 1 else int(cfg.val_set_size)
        if isinstance(size, int) and size >= len(train):
            raise ConfigError(f"val_set_size {size} leaves no training prompts (there are {len(train)})")
        split = train.train_test_split(test_size=size, seed=cfg.seed)
        train, validation = split["train"], split["test"]
    stats = {"rows": len(rows), "train_rows": len(train), "validation_rows": len(validation or []),
             "too_long": too_long, "dropped_too_long": too_long, "train_tokens": int(sum(train["length"]))}
    return Prepared(train, validation, stats, None)
