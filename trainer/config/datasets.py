"""Datasets: the `datasets:` entries, `pretraining_dataset:` (streamed), and the data keys with their rules.

A dataset's `type` is a prompt format (PromptFormat, alpaca's styles), a preference/KTO/reward type with rl: or
reward models (trainer/config/rl.py checks those), a user transform `module.function` (rl: ebft, grpo), or
nothing (pre-tokenized rows). Streaming (pretraining_dataset, streaming: true) reads rows while training
(trainer/data/streaming.py), so it has no length: its rules are here.
"""

from __future__ import annotations

import difflib
import string
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from trainer.errors import ConfigError

PromptFormat = Literal["alpaca", "chat_template", "completion", "input_output"]
# Axolotl's alpaca styles (`type: alpaca:<style>`; the texts are trainer/data/formats/alpaca_styles.py's)
ALPACA_TYPES = ("alpaca", "alpaca:instruct", "alpaca:chat", "alpaca:chatml", "alpaca:phi")
# Axolotl's older instruction types, each an alpaca prompter over its own columns (trainer/data/formats/instruction.py
# NAMED; tests/trainer/data/test_user_formats.py checks the two lists agree)
INSTRUCTION_TYPES = ("alpaca_chat", "alpaca_chat.load_qa", "alpaca_chat.load_concise", "alpaca_chat.load_camel_ai",
                     "context_qa", "context_qa.load_v2", "context_qa.load_404",
                     "oasst", "oasst:chat", "oasst:chatml", "oasst:phi", "oasst:instruct",
                     "alpaca_w_system", "alpaca_w_system.load_chat", "alpaca_w_system.load_instruct",
                     "alpaca_w_system.load_open_orca", "alpaca_w_system.load_open_orca_chatml")


# Axolotl's preference dataset types (prompt_strategies/dpo, orpo, kto): "<family>.<function>".
# chat_template.* render with the tokenizer's chat template; chatml.* and llama3.* write the template's
# text themselves. KTO rows carry one completion and a boolean `label` instead of a chosen/rejected pair.
PAIR_TYPES = (
    "chat_template", "chat_template.default", "chat_template.argilla", "chat_template.argilla_chat",
    *[f"{family}{suffix}" for family in ("chatml", "llama3") for suffix in (
        "", ".default", ".argilla", ".argilla_chat", ".icr", ".intel", ".prompt_pairs", ".ultra")],
)
KTO_TYPES = tuple(f"{family}.{fn}" for family in ("chatml", "llama3")
                  for fn in ("argilla", "argilla_chat", "intel", "prompt_pairs", "ultra"))


class UserDefinedFormat(BaseModel):
    """A dataset `type:` given as a mapping: Axolotl's user-defined prompt format (prompt_strategies/user_defined.py,
    its defaults); rendered by trainer/data/formats/user_defined.py."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str = ""  # the system text when a row has no field_system column
    field_system: str = "system"
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    format: str = "{instruction} {input} "  # the prompt of a row with an input ({instruction}, {input})
    no_input_format: str = "{instruction} "  # ... and of a row without one ({instruction})
    system_format: str = "{system}"  # written before the prompt where there is a system text

    @model_validator(mode="after")
    def _placeholders(self) -> UserDefinedFormat:
        for key, allowed in (("format", {"instruction", "input"}), ("no_input_format", {"instruction"}),
                             ("system_format", {"system"})):
            names = {n for _, n, _, _ in string.Formatter().parse(getattr(self, key)) if n is not None}
            if names - allowed:
                raise ValueError(f"{key}: unknown placeholder(s) {', '.join(sorted(names - allowed))} (this format "
                                 f"fills {', '.join('{' + a + '}' for a in sorted(allowed))})")
        return self


class UserDefinedPreference(BaseModel):
    """A preference dataset's `type:` given as a mapping (rl: dpo, ipo, orpo, simpo: prompt, chosen, rejected; rl: kto:
    prompt, completion, label): Axolotl's user_defined.default of prompt_strategies/dpo and /kto, its defaults;
    rendered by trainer/data/formats/preference_prompts.py."""

    model_config = ConfigDict(extra="forbid")

    field_system: str = "system"
    field_prompt: str = "prompt"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    field_completion: str = "completion"  # kto
    field_label: str = "label"  # kto
    prompt_format: str | None = None  # "{prompt}" when empty; may hold {system}
    chosen_format: str | None = None  # "{chosen}"
    rejected_format: str | None = None  # "{rejected}"
    completion_format: str | None = None  # "{completion}" (kto)

    @model_validator(mode="after")
    def _placeholders(self) -> UserDefinedPreference:
        for key, allowed in (("prompt_format", {"prompt", "system"}), ("chosen_format", {"chosen"}),
                             ("rejected_format", {"rejected"}), ("completion_format", {"completion"})):
            names = {n for _, n, _, _ in string.Formatter().parse(getattr(self, key) or "") if n is not None}
            if names - allowed:
                raise ValueError(f"{key}: unknown placeholder(s) {', '.join(sorted(names - allowed))} (this format "
                                 f"fills {', '.join('{' + a + '}' for a in sorted(allowed))})")
        return self


def _type_kind(value: Any) -> str:
    """Which of a dataset type's forms a value is, so that a wrong one is reported once, as that form: a name, a
    preference format of one's own (a mapping naming a preference field), else a prompt format of one's own."""
    if not isinstance(value, (dict, BaseModel)):
        return "name"
    names = set(value) if isinstance(value, dict) else set(type(value).model_fields)
    return "preference format" if names & (set(UserDefinedPreference.model_fields) - set(UserDefinedFormat.model_fields)) \
        else "format"


DatasetType = Annotated[Union[Annotated[str, Tag("name")], Annotated[UserDefinedFormat, Tag("format")],
                              Annotated[UserDefinedPreference, Tag("preference format")]], Discriminator(_type_kind)]


class DatasetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # a hub id, a file or a directory; None: files given by data_files (with ds_type)
    # a PromptFormat, an alpaca style, an INSTRUCTION_TYPES name, a user-defined format (a mapping), or with rl: a
    # PAIR_TYPES / KTO_TYPES entry (checked by Config); None: pre-tokenized rows (rl: prompt/chosen/rejected rows)
    # (a mapping is an SFT format of your own, or with rl: a preference format of your own: UserDefinedPreference)
    type: DatasetType | None = None
    split: str = "train"
    name: str | None = None  # hub dataset configuration name
    revision: str | None = None  # the hub dataset's branch, tag or commit
    data_files: str | list[str] | None = None
    # file format when the extension does not say (arrow: a datasets Arrow file; text: one row per line, `text`)
    ds_type: Literal["json", "parquet", "csv", "arrow", "text"] | None = None
    # one shard of the rows: Axolotl's load_dataset_with_config, `rows.shuffle(seed=cfg.seed).shard(shards, shards_idx)`
    shards: int | None = Field(None, ge=1)
    shards_idx: int | None = Field(None, ge=0)  # which shard (Axolotl's default: the first, 0)
    # alpaca
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    # completion
    field: str = "text"
    # input_output: a list of {"text": ..., "label": bool}
    field_segments: str = "segments"
    # chat_template
    field_messages: str = "messages"
    # the row's tool definitions (a list of {"type": "function", "function": {...}}, or its JSON text), rendered by the
    # chat template as transformers' apply_chat_template(tools=...) renders them (Axolotl's _get_tools; its default
    # column is "tools" too)
    field_tools: str = "tools"
    message_property_mappings: dict[str, str] | None = None  # {"role": "from", "content": "value"}
    message_field_role: str | None = None  # legacy spelling of message_property_mappings.role
    message_field_content: str | None = None  # legacy spelling of message_property_mappings.content
    roles: dict[str, list[str]] | None = None  # canonical role -> names used in the data
    roles_to_train: list[str] = ["assistant"]
    # preference types (rl:) -- chat_template.default: the chosen/rejected message (or string) fields; rows
    # without a type: the prompt / chosen / rejected columns
    field_prompt: str = "prompt"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    drop_system_message: bool = False
    # a message's own boolean (this key of it) says whether its turn is trained, over roles_to_train (Axolotl's)
    message_field_training: str | None = None
    # a message's own list of {begin_offset, end_offset, train} (this key of it): which characters of its content
    # train, offsets inclusive, moved to token boundaries as Axolotl's get_offsets_for_train_detail moves them
    message_field_training_detail: str | None = None
    # assistant turns: the reasoning in <think>...</think> (or <reasoning>, <|begin_of_thought|>) of the content is
    # moved to template_thinking_key, the rest (or its <|begin_of_solution|> block) stays the content (Axolotl's)
    split_thinking: bool = False
    train_on_eos: Literal["turn", "last", "all", "none"] | None = None  # None: the whole turn tail, as rendered
    # which end-of-turn tokens (eot_tokens) are trained, where it differs from train_on_eos (Axolotl's: unset, it is
    # train_on_eos; an EOS that is one of them follows both, so the two must agree: check_train_on_eot)
    train_on_eot: Literal["turn", "last", "all", "none"] | None = None
    chat_template: str | None = None  # per-dataset override of the top-level chat_template
    chat_template_jinja: str | None = None
    # --- attention, gpt-oss (attn) ---
    # Axolotl's chat_template strategy: the message field holding the reasoning text, and the template
    # variable it is rendered from (gpt-oss: thinking; qwen3: reasoning_content); trained with the turn
    field_thinking: str = "reasoning_content"
    template_thinking_key: str = "reasoning_content"
    # --- reward models: stepwise_supervised (process_reward_model), Axolotl's names and defaults ---
    step_separator: str = "\n"  # appended to every step; the step's label sits on its last token
    max_completion_length: int | None = Field(None, ge=1)  # steps' tokens kept (prompt not counted)
    train_on_last_step_only: bool = False  # only the last step's label is trained
    # --- type: _synthetic (Axolotl's benchmark data, prompt_strategies/_synthetic.py): `length` rows of
    # `sequence_length` (default sequence_len) token ids drawn uniformly from [min_input_id, max_input_id) (default
    # 100, the tokenizer's vocab_size) by numpy's default_rng(seed), every token trained
    length: int | None = Field(None, ge=1)  # (Axolotl's default: 1000)
    sequence_length: int | None = Field(None, ge=1)
    min_input_id: int | None = Field(None, ge=0)
    max_input_id: int | None = Field(None, ge=1)
    seed: int | None = None

    @model_validator(mode="after")
    def _source(self) -> DatasetConfig:
        synthetic = [k for k in SYNTHETIC_KEYS if getattr(self, k) is not None]
        if synthetic and self.type != SYNTHETIC:
            raise ValueError(f"{synthetic[0]}: only with type: {SYNTHETIC} (a synthetic dataset's setting)")
        if not self.path and not self.data_files:
            raise ValueError("path: Field required (or data_files with ds_type)")
        if self.shards_idx and self.shards_idx >= (self.shards or 1):
            raise ValueError(f"shards_idx: {self.shards_idx} names no shard of {self.shards or 'no'} shards "
                             "(shards_idx counts from 0, and needs shards)")
        return self

    @property
    def source(self) -> str:
        """What the rows are read from, as a user reads it (the path, else the data files)."""
        files = [self.data_files] if isinstance(self.data_files, str) else list(self.data_files or [])
        return self.path or ", ".join(files)

    @property
    def user_defined(self) -> UserDefinedFormat | None:
        return self.type if isinstance(self.type, UserDefinedFormat) else None

    @property
    def preference_format(self) -> UserDefinedPreference | None:
        return self.type if isinstance(self.type, UserDefinedPreference) else None

    @property
    def role_key(self) -> str:
        return (self.message_property_mappings or {}).get("role") or self.message_field_role or "role"

    @property
    def content_key(self) -> str:
        return (self.message_property_mappings or {}).get("content") or self.message_field_content or "content"


class PretrainingDatasetConfig(BaseModel):
    """An entry of Axolotl's pretraining_dataset: raw text, cut into sequence_len windows (type: pretrain), or rows
    tokenized as an SFT type (type: completion, ...)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    name: str | None = None
    split: str = "train"
    # pretrain: windows of raw text; or an SFT prompt format (completion, alpaca, ...): each streamed row is
    # tokenized as that dataset type, as Axolotl's get_dataset_wrapper does for a typed pretraining_dataset
    type: str = "pretrain"
    text_column: str = "text"
    field: str | None = None  # completion's text field (default text_column; Axolotl reads `text` here)
    data_files: str | list[str] | None = None
    ds_type: Literal["json", "parquet", "csv"] | None = None
    skip: int | None = Field(None, ge=0)  # rows of the stream to skip before training
    trust_remote_code: bool = False  # inert: datasets >= 4 runs no dataset loading scripts

    @model_validator(mode="after")
    def _known_type(self) -> PretrainingDatasetConfig:
        if self.type != "pretrain" and self.type not in PromptFormat.__args__:
            raise ValueError(f"type: got {self.type!r}; use pretrain or an SFT type ({', '.join(PromptFormat.__args__)})")
        return self

    def as_dataset(self) -> DatasetConfig:
        """A typed entry as the dataset entry its rows are tokenized with."""
        return DatasetConfig(path=self.path, type=self.type, split=self.split, field=self.field or self.text_column)



class DataKeys(BaseModel):
    """What is read, how it is cut, where the tokenized rows are cached."""

    datasets: list[DatasetConfig] = []  # required unless pretraining_dataset is set (checked below)
    val_set_size: float = Field(0.0, ge=0)  # < 1: fraction, >= 1: number of rows
    # the validation rows: these datasets, prepared like `datasets`, instead of a val_set_size split
    test_datasets: list[DatasetConfig] | None = None
    skip_prepare_dataset: bool = False  # tokenize for this run only: no prepared cache is written or read
    dataset_prepared_path: str = "last_run_prepared"
    dataset_exact_deduplication: bool = False  # drop rows identical after tokenising (train and validation)
    dataset_processes: int | None = Field(None, ge=1)  # default min(cpu_count, 8)
    dataset_prepare_timeout: int = Field(1800, ge=1)  # seconds other ranks wait for rank 0's cache
    shuffle_merged_datasets: bool = True
    shuffle_before_merging_datasets: bool = False  # each of several datasets shuffled by the seed before merging
    # one shard of the prepared training rows (SFT), as Axolotl's _apply_dataset_sharding: rows.shard(num, idx) before
    # the validation split; 0 shards is unset (Axolotl's `if cfg.dataset_shard_num`)
    dataset_shard_num: int | None = Field(None, ge=0)
    dataset_shard_idx: int | None = Field(None, ge=0)
    # tokenizer_default | jinja (chat_template_jinja: text or file) | a name in trainer/templates/ |
    # tokenizer_default_fallback_<name>; checked against the templates by check_chat_template
    chat_template: str = "tokenizer_default"
    chat_template_jinja: str | None = None
    eot_tokens: list[str] | None = None  # the tokens that end a turn (train_on_eos decides which are trained)
    # extra variables for the chat template (enable_thinking: false, ...): apply_chat_template(**chat_template_kwargs),
    # as Axolotl's ChatTemplatePrompter passes them
    chat_template_kwargs: dict[str, Any] | None = None
    sequence_len: int = Field(2048, ge=8)
    # a row longer than sequence_len: dropped, cut to it, or (raise) the data refused in one line naming the first
    excess_length_strategy: Literal["drop", "truncate", "raise"] = "drop"
    train_on_inputs: bool = False
    min_sample_len: int | None = Field(None, ge=1)  # SFT rows with fewer tokens are dropped (Axolotl's filter)
    # --- pretraining and streaming (trainer/data/streaming.py) -------------------------------------------------
    pretraining_dataset: list[PretrainingDatasetConfig] | None = None  # raw text, streamed, windowed, packed
    streaming: bool = False  # stream `datasets` (tokenized while training) instead of preparing them up front
    streaming_multipack_buffer_size: int | None = Field(None, ge=1)  # rows per shuffle/packing buffer (10000)
    pretrain_multipack_buffer_size: int | None = Field(None, ge=1)  # Axolotl's deprecated spelling of the above
    pretrain_multipack_attn: bool = True  # packed documents do not attend to each other
    # --- PoSE (trainer/data/pose.py): random position skips up to pose_max_context_len, on packed SFT rows ---------
    use_pose: bool = False
    pose_split_on_token_ids: list[int] | None = None  # cut before these tokens (else pose_num_chunks equal chunks)
    pose_max_context_len: int | None = Field(None, ge=1)  # the positions reach up to this length
    pose_num_chunks: int | None = Field(None, ge=1)  # Axolotl's default 2

    @property
    def pose(self) -> bool:
        """PoSE's position ids are added: as in Axolotl, only while packed SFT data is prepared (its
        process_datasets_for_packing, called for sample_packing alone, not for a stream or skip_prepare_dataset)."""
        return bool(self.use_pose and self.sample_packing and not self.streamed and not self.skip_prepare_dataset
                    and not self.rl)

    def _check_pose(self) -> None:
        if not self.pose:
            return
        if self.pose_max_context_len is None:
            raise ValueError("use_pose: needs pose_max_context_len (how far the positions reach; Axolotl's "
                             "add_pose_position_ids fails without it while preprocessing)")
        if self.pose_max_context_len < self.sequence_len:
            raise ValueError(f"pose_max_context_len: {self.pose_max_context_len} is below sequence_len "
                             f"({self.sequence_len}): a row longer than it has a negative number of skips to draw "
                             "(Axolotl's random.randint fails while preprocessing)")

    @property
    def streamed(self) -> bool:
        """The training data is read as a stream (pretraining_dataset or streaming: true)."""
        return bool(self.pretraining_dataset) or self.streaming

    @property
    def stream_buffer_size(self) -> int:
        return self.streaming_multipack_buffer_size or self.pretrain_multipack_buffer_size or 10_000

    def _check_streaming(self) -> None:
        """datasets or pretraining_dataset, and what a stream (no length, no held-out split) cannot do."""
        if not self.datasets and not self.pretraining_dataset:
            raise ValueError("datasets: Field required (or pretraining_dataset for streamed pretraining)")
        if self.datasets and self.pretraining_dataset:
            raise ValueError("set datasets or pretraining_dataset, not both")
        if self.test_datasets and self.val_set_size:
            raise ValueError("set test_datasets or val_set_size, not both (each makes the validation rows)")
        if self.test_datasets and self.rl in ("grpo", "gdpo", "ebft"):
            raise ValueError("test_datasets: validation rows from their own datasets are read for SFT, preference and "
                             "reward training (streamed too); not with rl: grpo, gdpo or ebft (use val_set_size where "
                             "it applies)")
        if self.streaming_multipack_buffer_size and self.pretrain_multipack_buffer_size:
            raise ValueError("pretrain_multipack_buffer_size is the deprecated spelling of "
                             "streaming_multipack_buffer_size; set only one")
        if not self.streamed:
            return
        what = "pretraining_dataset" if self.pretraining_dataset else "streaming: true"
        sharded = [i for i, d in enumerate(self.datasets or []) if d.shards]
        if sharded:
            raise ValueError(f"datasets.{sharded[0]}.shards: one shard of a streamed dataset (streaming: true) is not "
                             "implemented here: ignoring it would train on all of it; remove it, or streaming")
        if self.max_steps is None:
            raise ValueError(f"{what} needs max_steps (a stream has no length to count epochs by)")
        if self.val_set_size and not self.pretraining_dataset:  # (pretraining_dataset: ignored, see stream_notes)
            raise ValueError(f"{what}: val_set_size must be 0 (a stream has no held-out split here)")
        if self.rl:
            raise ValueError(f"{what}: not with rl: (preference data is prepared up front)")
        if self.dataset_exact_deduplication:
            raise ValueError(f"{what}: not with dataset_exact_deduplication (it needs every row up front)")
        if self.group_by_length or self.curriculum_sampling or self.sample_packing_sequentially:
            raise ValueError(f"{what}: not with group_by_length, curriculum_sampling or sample_packing_sequentially "
                             "(they order prepared data; shuffle_merged_datasets: false keeps the stream's order)")

    def _check_dataset_shard(self) -> None:
        """dataset_shard_num and dataset_shard_idx go together (Axolotl shards only with both and drops a lone one
        without a word), the index one of the shards; not with rl: (Axolotl's preference loader never reads them)
        or a stream."""
        num, idx = self.dataset_shard_num or None, self.dataset_shard_idx
        if (num is None) != (idx is None):
            raise ValueError("dataset_shard_num and dataset_shard_idx go together: set both (or neither); Axolotl "
                             "trains on all the rows with one alone")
        if num is None:
            return
        if idx >= num:
            raise ValueError(f"dataset_shard_idx: {idx} names no shard of {num} (it counts from 0)")
        if self.rl or self.streaming or self.pretraining_dataset:
            raise ValueError("dataset_shard_num: shards prepared SFT rows; Axolotl does not shard rl: or streamed "
                             "data (it would train on all of it); remove it")

    def _check_train_on_eot(self) -> None:
        """Without eot_tokens the end-of-turn token is the EOS, which train_on_eos decides: a train_on_eot that differs
        is refused, as Axolotl's ChatTemplateStrategy refuses it (with eot_tokens it is checked against the tokenizer's
        EOS when the data is rendered)."""
        for group, entries in (("datasets", self.datasets), ("test_datasets", self.test_datasets or [])):
            for i, ds in enumerate(entries):
                if not self.eot_tokens and ds.train_on_eot and ds.train_on_eot != (ds.train_on_eos or "turn"):
                    raise ValueError(eot_conflict(f"{group}.{i}", ds))

    def _check_sft_types(self) -> None:
        """Without rl: or reward models, each dataset's type is a prompt format (or none: pre-tokenized rows)."""
        for group, entries in (("datasets", self.datasets), ("test_datasets", self.test_datasets or [])):
            for i, ds in enumerate(entries):
                if ds.type is None or ds.user_defined or ds.type in SFT_TYPES:
                    continue
                if ds.preference_format:
                    raise ValueError(f"{group}.{i}.type: a preference format of your own ("
                                     f"{', '.join(sorted(ds.preference_format.model_fields_set))}) needs rl: dpo, ipo, "
                                     "orpo, simpo or kto")
                hint = " (a preference type: set rl: dpo, ipo, orpo, simpo or kto)" if ds.type in PAIR_TYPES + KTO_TYPES else ""
                close = difflib.get_close_matches(ds.type, SFT_TYPES, n=1)
                hint += f"; did you mean '{close[0]}'?" if close and not hint else ""
                raise ValueError(f"{group}.{i}.type: got {ds.type!r}{hint}; use alpaca (or alpaca:instruct|chat|chatml"
                                 f"|phi), chat_template, completion, input_output, a format of your own (a mapping: "
                                 f"format, no_input_format, ...) or one of Axolotl's older types "
                                 f"({', '.join(INSTRUCTION_TYPES)})")


def eot_conflict(where: str, ds: DatasetConfig) -> str:
    return (f"{where}.train_on_eot: {ds.train_on_eot!r} differs from train_on_eos ({ds.train_on_eos or 'turn'!r}) while "
            "the EOS token is an end-of-turn token (eot_tokens unset, or naming it): one token cannot follow both; "
            "set them alike, or eot_tokens without the EOS")


def stream_notes(cfg) -> list[str]:
    if cfg.pretraining_dataset and cfg.val_set_size:
        return [f"val_set_size: {cfg.val_set_size:g} ignored with pretraining_dataset (a stream has no held-out split; "
                "Axolotl ignores it there too)"]
    return []


SYNTHETIC = "_synthetic"
SYNTHETIC_KEYS = ("length", "sequence_length", "min_input_id", "max_input_id", "seed")
SFT_TYPES = (*PromptFormat.__args__, *ALPACA_TYPES[1:], *INSTRUCTION_TYPES, SYNTHETIC)


# --- chat templates by name: trainer/templates/<name>.jinja, each listed with its source in SOURCES.toml ----------
# (the catalog is data, read here without a tokenizer; trainer/data/formats/chat_templates.py renders them)
TEMPLATE_DIR = Path(__file__).parents[1] / "templates"
FALLBACK = "tokenizer_default_fallback_"


@lru_cache(maxsize=1)
def template_sources() -> dict[str, dict]:
    with open(TEMPLATE_DIR / "SOURCES.toml", "rb") as f:
        return {row["name"]: row for row in tomllib.load(f)["template"]}


def template_names() -> list[str]:
    return sorted(template_sources())


def check_chat_template(choice: str, jinja: str | None) -> None:
    """Validate a chat_template choice without a tokenizer (validate runs offline)."""
    if choice in ("tokenizer_default",):
        return
    if choice == "jinja":
        if not jinja:
            raise ConfigError("chat_template: jinja needs chat_template_jinja (the template text or a .jinja file)")
        return
    name = choice.removeprefix(FALLBACK)
    if name not in template_sources():
        close = difflib.get_close_matches(name, template_names(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"chat_template: unknown template '{choice}'{hint} (known: tokenizer_default, jinja, "
                          f"{', '.join(template_names())})")


def check_chat_templates(cfg) -> None:
    """The top-level chat_template and each dataset's own (a later check: a name is data, not a type)."""
    check_chat_template(cfg.chat_template, cfg.chat_template_jinja)
    for ds in cfg.datasets:
        if ds.chat_template:
            check_chat_template(ds.chat_template, ds.chat_template_jinja)
