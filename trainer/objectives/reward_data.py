"""Reward-model data (reward_model / process_reward_model): Axolotl's dataset types, tokenised; config checks.

The reward objectives' data hook (Reward.prepare_data, PRM.prepare_data) hands build_reward to
trainer.data.prepare.prepare, so the result is cached, prepared by rank 0 only and waited for with a timeout
exactly like SFT data, and filtered/split by the same rules.

- bradley_terry.chat_template (reward_model; Axolotl's prompt_strategies/bradley_terry/chat_template.py):
  rows {system (optional), input, chosen, rejected} of strings. Each of chosen and rejected is rendered with
  the chat template as the conversation [system], user: input, assistant: answer.
  Rows: chosen_input_ids, rejected_input_ids, length (both), targets (1: a pair to score).
- stepwise_supervised (process_reward_model; Axolotl's prompt_strategies/stepwise_supervised.py, after TRL's
  PRMTrainer.tokenize_row): rows {prompt, completions: [step, ...], labels: [label per step]}. Every step gets
  `step_separator` appended and its label on its last token (-100 elsewhere); `train_on_last_step_only`
  keeps only the last step's label; `max_completion_length` cuts the steps' tokens; BOS (if the tokenizer has
  one) starts the prompt. Rows: input_ids, labels, length, targets (labelled tokens).

Rows longer than sequence_len are dropped or truncated by excess_length_strategy, like all data here.
"""

from __future__ import annotations

from itertools import chain

from trainer.batch.labels import IGNORE
from trainer.config import Config, DatasetConfig
from trainer.config.rl import num_labels
from trainer.data.prepare import tokenize_and_split
from trainer.errors import ConfigError, DataError
from trainer.runtime.templates import render as budgeted  # the chat template under a time budget


def _field(row: dict, key: str, ds: DatasetConfig, required: bool = True):
    value = row.get(key)
    if value is None and required:
        raise DataError(f"dataset {ds.path}: a row has no '{key}' field (type {ds.type}); columns are {sorted(row)}")
    return value


def bradley_terry(row: dict, ds: DatasetConfig, tokenizer) -> tuple[list[int], list[int]]:
    """(chosen ids, rejected ids): each answer as the last turn of [system], user, assistant."""
    template = tokenizer.chat_template
    if ds.chat_template:
        # start-up: trainer.data.formats.chat_templates imported only when this runs
        from trainer.data.formats.chat_templates import resolve

        template = resolve(ds.chat_template, ds.chat_template_jinja, tokenizer)
    if not template:
        raise DataError("the tokenizer has no chat template; set chat_template: chatml (or another name), or jinja "
                        "with chat_template_jinja")
    system = _field(row, "system", ds, required=False)
    prompt = ([{"role": "system", "content": system}] if system and not ds.drop_system_message else [])
    prompt.append({"role": "user", "content": str(_field(row, "input", ds))})
    out = []
    for side in ("chosen", "rejected"):
        answer = _field(row, side, ds)
        if not isinstance(answer, str):
            raise DataError(f"dataset {ds.path}: '{side}' must be a string for type {ds.type}, got {str(answer)[:80]}")
        try:
            text = budgeted(tokenizer, prompt + [{"role": "assistant", "content": answer}], tokenize=False,
                            chat_template=template)
        except ConfigError:  # the template's time budget: its own line
            raise
        except Exception as err:  # jinja's raise_exception (e.g. "System role not supported") and template bugs
            hint = "; set drop_system_message: true on the dataset" if prompt[0]["role"] == "system" else ""
            raise DataError(f"dataset {ds.path}: the chat template cannot render a row: "
                            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}{hint}") from None
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out[0], out[1]


def stepwise(row: dict, ds: DatasetConfig, tokenizer, labels_count: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a stepwise_supervised row, as Axolotl's strategy builds them."""
    steps, step_labels = _field(row, "completions", ds), _field(row, "labels", ds)
    if not isinstance(steps, list) or not isinstance(step_labels, list) or len(steps) != len(step_labels) or not steps:
        raise DataError(f"dataset {ds.path}: 'completions' and 'labels' must be lists of the same, non-zero length")
    values = []
    for label in step_labels:
        value = int(label)
        if not 0 <= value < labels_count:
            raise DataError(f"dataset {ds.path}: step label {label!r} is outside 0..{labels_count - 1} (num_labels)")
        values.append(value)
    if ds.train_on_last_step_only:
        values = [IGNORE] * (len(values) - 1) + values[-1:]
    prompt_ids = tokenizer(str(_field(row, "prompt", ds)), add_special_tokens=False)["input_ids"]
    separator = tokenizer.encode(ds.step_separator, add_special_tokens=False)
    step_ids = [list(tokenizer(str(s), add_special_tokens=False)["input_ids"]) + separator for s in steps]
    completion = list(chain(*step_ids))
    labels = list(chain(*([IGNORE] * (len(ids) - 1) + [v] for ids, v in zip(step_ids, values) if ids)))
    if ds.max_completion_length:
        completion, labels = completion[: ds.max_completion_length], labels[: ds.max_completion_length]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + list(prompt_ids)
    return list(prompt_ids) + completion, [IGNORE] * len(prompt_ids) + labels


def _tokenize(raw, ds: DatasetConfig, cfg: Config, tokenizer, workers: int):
    limit, truncate = cfg.sequence_len, cfg.excess_length_strategy == "truncate"
    labels_count = num_labels(cfg)

    def convert(row):
        if cfg.reward_model:
            chosen, rejected = bradley_terry(row, ds, tokenizer)
            too_long = max(len(chosen), len(rejected)) > limit
            if too_long and truncate:
                chosen, rejected = chosen[:limit], rejected[:limit]
            return {"chosen_input_ids": chosen, "rejected_input_ids": rejected, "too_long": too_long,
                    "length": len(chosen) + len(rejected), "targets": 1}
        ids, labels = stepwise(row, ds, tokenizer, labels_count)
        too_long = len(ids) > limit
        if too_long and truncate:
            ids, labels = ids[:limit], labels[:limit]
        return {"input_ids": ids, "labels": labels, "too_long": too_long, "length": len(ids),
                "targets": sum(1 for t in labels if t != IGNORE)}

    # heavy: datasets loads only when this runs
    from datasets import Features, Sequence, Value

    ids = Sequence(Value("int64"))
    columns = ({"chosen_input_ids": ids, "rejected_input_ids": ids} if cfg.reward_model
               else {"input_ids": ids, "labels": ids})  # stated: else map keeps a boolean `labels` column boolean
    features = Features({**columns, "too_long": Value("bool"), "length": Value("int64"), "targets": Value("int64")})
    return raw.map(convert, remove_columns=raw.column_names, num_proc=workers if workers > 1 else None,
                   features=features, desc=f"tokenizing {ds.path}")


def reward_kind(cfg: Config) -> dict:
    """What names reward-model rows in the dataset cache: the objective, and num_labels (labels are checked
    against it)."""
    return {"kind": cfg.objective, **({"num_labels": cfg.num_labels} if cfg.num_labels else {})}


def build_reward(cfg: Config, tokenizer) -> tuple[object, object | None, dict]:
    data, validation, stats = tokenize_and_split(cfg, tokenizer, _tokenize)
    stats.update(train_rows=len(data), train_tokens=int(sum(data["length"])),
                 validation_rows=len(validation) if validation is not None else 0)
    return data, validation, stats
