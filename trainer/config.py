"""The training config: Axolotl-style YAML keys, validated up front.

Reading a config is two passes:
1. key check: every key is a supported key, an inert Axolotl key (accepted, with a note), or an Axolotl
   key we do not support (an error unless its value is empty). Anything else is an unknown key, and the
   error names the closest valid key.
2. value check: pydantic validates types and ranges of the supported keys.

A YAML null (``fp16:``) means "unset", as in Axolotl, so it takes the default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainer.errors import ConfigError

Attention = Literal["flash_attention_2", "flash_attention_3", "sdpa", "xformers", "eager"]
PromptFormat = Literal["alpaca", "chat_template", "completion", "input_output"]

# --- preference training (rl:) -------------------------------------------------------------------------
# Axolotl's preference dataset types (prompt_strategies/dpo, orpo, kto): "<family>.<function>".
# chat_template.* render with the tokenizer's chat template; chatml.* and llama3.* write the template's
# text themselves. KTO rows carry one completion and a boolean `label` instead of a chosen/rejected pair.
RL_METHODS = ("dpo", "ipo", "orpo", "kto", "simpo")
PAIR_TYPES = (
    "chat_template", "chat_template.default", "chat_template.argilla", "chat_template.argilla_chat",
    *[f"{family}{suffix}" for family in ("chatml", "llama3") for suffix in (
        "", ".default", ".argilla", ".argilla_chat", ".icr", ".intel", ".prompt_pairs", ".ultra")],
)
KTO_TYPES = tuple(f"{family}.{fn}" for family in ("chatml", "llama3")
                  for fn in ("argilla", "argilla_chat", "intel", "prompt_pairs", "ultra"))
# --------------------------------------------------------------------------------------------------------


class DatasetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    type: str  # a PromptFormat, or with rl: a PAIR_TYPES / KTO_TYPES entry (checked by Config)
    split: str = "train"
    name: str | None = None  # hub dataset configuration name
    data_files: str | list[str] | None = None
    ds_type: Literal["json", "parquet", "csv"] | None = None  # file format when the extension does not say
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
    message_property_mappings: dict[str, str] | None = None  # {"role": "from", "content": "value"}
    message_field_role: str | None = None  # legacy spelling of message_property_mappings.role
    message_field_content: str | None = None  # legacy spelling of message_property_mappings.content
    roles: dict[str, list[str]] | None = None  # canonical role -> names used in the data
    roles_to_train: list[str] = ["assistant"]
    # preference types (rl:) -- chat_template.default: the chosen/rejected message (or string) fields
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"

    @property
    def role_key(self) -> str:
        return (self.message_property_mappings or {}).get("role") or self.message_field_role or "role"

    @property
    def content_key(self) -> str:
        return (self.message_property_mappings or {}).get("content") or self.message_field_content or "content"


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # model and tokenizer
    base_model: str
    tokenizer_config: str | None = None
    trust_remote_code: bool = False
    special_tokens: dict[str, str] | None = None
    tokens: list[str] | None = None  # extra tokens added to the vocabulary

    # data
    datasets: list[DatasetConfig] = Field(min_length=1)
    val_set_size: float = Field(0.0, ge=0)  # < 1: fraction, >= 1: number of rows
    dataset_prepared_path: str = "last_run_prepared"
    dataset_processes: int | None = Field(None, ge=1)  # default min(cpu_count, 8)
    dataset_prepare_timeout: int = Field(1800, ge=1)  # seconds other ranks wait for rank 0's cache
    shuffle_merged_datasets: bool = True
    chat_template: Literal["tokenizer_default", "chatml", "jinja"] = "tokenizer_default"  # jinja: chat_template_jinja
    chat_template_jinja: str | None = None
    sequence_len: int = Field(2048, ge=8)
    excess_length_strategy: Literal["drop", "truncate"] = "drop"
    train_on_inputs: bool = False

    # batching
    sample_packing: bool = False
    eval_sample_packing: bool | None = None  # default: same as sample_packing
    pad_to_sequence_len: bool = False
    micro_batch_size: int = Field(1, ge=1)
    eval_batch_size: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    dataloader_num_workers: int = Field(0, ge=0)

    # adapter
    adapter: Literal["lora"] | None = None
    lora_r: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | str | None = None
    lora_target_linear: bool = False
    lora_modules_to_save: list[str] | None = None

    # optimisation
    num_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2e-5, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    warmup_steps: int | None = Field(None, ge=0)
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "adamw", "sgd"] = "adamw_torch"
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    seed: int = 42

    # hardware: resolved against the GPU by trainer.hardware
    bf16: bool | Literal["auto"] = "auto"
    fp16: bool | None = None
    tf32: bool | Literal["auto"] = "auto"
    attn_implementation: Attention | None = None
    flash_attention: bool | None = None  # legacy flags, same meaning as attn_implementation
    sdp_attention: bool | None = None
    xformers_attention: bool | None = None
    eager_attention: bool | None = None
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    deepspeed: str | None = None  # passed through to accelerate's DeepSpeed plugin
    ddp_timeout: int = Field(1800, ge=1)  # seconds a collective may wait before the run stops

    # outputs and cadence
    output_dir: str = "./outputs"
    logging_steps: int = Field(1, ge=1)
    eval_steps: int | None = Field(None, ge=1)
    evals_per_epoch: int | None = Field(None, ge=1)
    save_steps: int | None = Field(None, ge=1)
    saves_per_epoch: int | None = Field(None, ge=1)
    save_total_limit: int | None = Field(None, ge=1)
    resume_from_checkpoint: str | None = None
    auto_resume_from_checkpoints: bool = False

    # --- preference training (Axolotl's names; defaults as TRL's configs) --------------------------------
    rl: Literal["dpo", "ipo", "orpo", "kto", "simpo"] | None = None
    rl_beta: float | None = Field(None, gt=0)  # DPO/IPO/KTO/SimPO beta (TRL default 0.1)
    dpo_beta: float | None = Field(None, gt=0)  # deprecated spelling of rl_beta
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # conservative DPO (cDPO); SimPO's too
    dpo_loss_type: list[Literal["sigmoid", "ipo"]] | None = None  # rl: dpo with ["ipo"] is IPO
    orpo_alpha: float | None = Field(None, gt=0)  # ORPO's weight of the odds-ratio term (TRL's beta)
    kto_desirable_weight: float = Field(1.0, gt=0)
    kto_undesirable_weight: float = Field(1.0, gt=0)
    simpo_gamma: float = Field(0.5, ge=0)  # SimPO's target reward margin
    cpo_alpha: float = Field(1.0, ge=0)  # SimPO/CPO: weight of the NLL (behaviour cloning) term
    precompute_ref_log_probs: bool | None = None  # always precomputed here: only true (or unset) is accepted
    remove_unused_columns: bool | None = None  # TRL-ism Axolotl's KTO examples set; nothing to remove here
    # ------------------------------------------------------------------------------------------------------

    @property
    def objective(self) -> str:
        """sft, or the preference method (rl: dpo with dpo_loss_type: [ipo] is ipo)."""
        if self.rl == "dpo" and self.dpo_loss_type == ["ipo"]:
            return "ipo"
        return self.rl or "sft"

    @property
    def beta(self) -> float:
        """The method's beta, with Axolotl's precedence: rl_beta (or dpo_beta), then orpo_alpha, else TRL's 0.1."""
        return self.rl_beta or self.dpo_beta or self.orpo_alpha or 0.1

    def _check_preference(self) -> None:
        if self.rl is None:
            for i, ds in enumerate(self.datasets):
                if ds.type not in PromptFormat.__args__:
                    hint = " (a preference type: set rl: dpo, ipo, orpo, simpo or kto)" if ds.type in PAIR_TYPES + KTO_TYPES else ""
                    raise ValueError(f"datasets.{i}.type: got {ds.type!r}{hint}; use alpaca, chat_template, completion or input_output")
            return
        allowed = KTO_TYPES if self.rl == "kto" else PAIR_TYPES
        for i, ds in enumerate(self.datasets):
            if ds.type not in allowed:
                raise ValueError(f"datasets.{i}.type: {ds.type!r} is not a {'KTO' if self.rl == 'kto' else 'preference pair'} "
                                 f"dataset type; use one of {', '.join(allowed)}")
        if self.dpo_loss_type is not None and (self.rl != "dpo" or len(self.dpo_loss_type) != 1):
            raise ValueError("dpo_loss_type: only with rl: dpo, as a single loss ([sigmoid] or [ipo])")
        if self.precompute_ref_log_probs is False:
            raise ValueError("precompute_ref_log_probs: false is not supported: the reference log-probs are always "
                             "computed once before training (no reference model is kept in memory)")
        if self.dpo_label_smoothing and self.objective == "ipo":
            raise ValueError("dpo_label_smoothing does not apply to IPO")

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        self._check_preference()
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError("set warmup_ratio or warmup_steps, not both")
        if self.bf16 is True and self.fp16:
            raise ValueError("bf16 and fp16 are both true; choose one (or bf16: auto)")
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            raise ValueError("chat_template: jinja needs chat_template_jinja (the template text)")
        if self.eval_steps and self.evals_per_epoch:
            raise ValueError("set eval_steps or evals_per_epoch, not both")
        if self.save_steps and self.saves_per_epoch:
            raise ValueError("set save_steps or saves_per_epoch, not both")
        if (self.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            raise ValueError(
                "gradient_checkpointing_kwargs.use_reentrant: true is not supported: reentrant checkpointing "
                "breaks with DDP and frozen parameters; the trainer always uses use_reentrant=False"
            )
        flags = [f for f in ("flash_attention", "sdp_attention", "xformers_attention", "eager_attention") if getattr(self, f)]
        if len(flags) > 1 or (flags and self.attn_implementation):
            raise ValueError(f"choose one attention setting, got {', '.join(flags + (['attn_implementation'] if self.attn_implementation else []))}")
        return self

    @property
    def requested_attention(self) -> str | None:
        """attn_implementation, or the legacy flag that says the same."""
        legacy = {
            "flash_attention": "flash_attention_2",
            "sdp_attention": "sdpa",
            "xformers_attention": "xformers",
            "eager_attention": "eager",
        }
        for flag, name in legacy.items():
            if getattr(self, flag):
                return name
        return self.attn_implementation

    @property
    def packing_for_eval(self) -> bool:
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing


# Axolotl keys that do nothing here but are common in real configs: accepted, with a note.
INERT_KEYS: dict[str, str] = {
    "strict": "Axolotl's key-strictness switch; this trainer always rejects unknown keys",
    "local_rank": "the rank comes from torchrun's environment",
    "debug": "use --debug on the command line",
    "model_type": "AutoModelForCausalLM picks the class from the model's config",
    "tokenizer_type": "AutoTokenizer picks the class from the tokenizer's files",
    "tokenizer_use_fast": "the fast tokenizer is always used",
    "is_llama_derived_model": "model family is read from the model's config",
    "is_mistral_derived_model": "model family is read from the model's config",
    "is_qwen_derived_model": "model family is read from the model's config",
    "eval_max_new_tokens": "only used by eval_table_size, which is not supported",
}

# Axolotl keys this trainer does not implement. Empty values are accepted (with a note); anything else is an error.
UNSUPPORTED_KEYS: dict[str, str] = {
    **{k: "quantized loading (bitsandbytes/GPTQ) is not supported" for k in (
        "load_in_8bit", "load_in_4bit", "gptq", "bnb_config_kwargs", "lora_on_cpu")},
    **{k: "this adapter option is not supported" for k in (
        "lora_model_dir", "lora_fan_in_fan_out", "peft_layers_to_transform", "loraplus_lr_ratio",
        "loraplus_lr_embedding", "peft_use_dora", "peft_use_rslora", "lora_mlp_kernel", "lora_qkv_kernel",
        "lora_o_kernel", "unfrozen_parameters")},
    **{k: "only rl: dpo, ipo, orpo, kto and simpo are supported (no GRPO, reward models or TRL pass-through)" for k in (
        "trl", "reward_model", "process_reward_model", "dpo_use_weighting", "dpo_use_liger_kernel",
        "dpo_padding_free", "dpo_loss_weights", "rl_adapter_ref_model", "dpo_norm_loss")},
    **{k: "FSDP/tensor/context parallelism is not supported; use deepspeed or DDP" for k in (
        "fsdp", "fsdp_config", "fsdp_version", "tensor_parallel_size", "context_parallel_size",
        "sequence_parallel_degree")},
    **{k: "experiment trackers are not supported; metrics go to output_dir/metrics.jsonl" for k in (
        "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "wandb_mode",
        "wandb_run_id", "mlflow_tracking_uri", "mlflow_experiment_name", "use_tensorboard", "comet_api_key",
        "use_comet", "use_mlflow")},
    **{k: "pushing to the hub is not supported" for k in (
        "hub_model_id", "hub_strategy", "push_dataset_to_hub", "hf_use_auth_token")},
    **{k: "not supported" for k in (
        "plugins", "group_by_length", "curriculum_sampling", "early_stopping_patience",
        "loss_watchdog_threshold", "loss_watchdog_patience", "neftune_noise_alpha", "noisy_embedding_alpha",
        "s2_attention", "flex_attention", "sage_attention", "torch_compile", "torch_compile_backend",
        "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy",
        "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o", "relora_steps", "lisa_n_layers",
        "lr_quadratic_warmup", "lr_div_factor", "cosine_min_lr_ratio", "eval_table_size",
        "eval_causal_lm_metrics", "do_causal_lm_eval", "test_datasets", "pretraining_dataset",
        "sample_packing_eff_est", "sample_packing_group_size", "sample_packing_bin_size",
        "multipack_real_batches", "save_strategy", "eval_strategy", "save_only_model", "save_safetensors",
        "chat_template_kwargs", "default_system_message", "dataset_shard_num", "dataset_shard_idx",
        "skip_prepare_dataset", "dataset_keep_in_memory", "device_map", "max_memory", "gpu_memory_limit",
        "low_cpu_mem_usage", "base_model_config", "revision_of_model", "resize_token_embeddings_to_32x",
        "embeddings_skip_upcast", "float16", "bfloat16", "fp8", "xformers_attention_backend", "lr_groups",
        "optim_args", "optim_target_modules", "sequence_len_overflow_handling", "max_packed_sequence_len")},
}


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _check_keys(raw: dict, fields: set[str], where: str, notes: list[str], allow_axolotl: bool) -> tuple[dict, list[str]]:
    """Return the supported keys with non-null values, and the problems found."""
    kept, problems = {}, []
    known = sorted(fields | (set(INERT_KEYS) | set(UNSUPPORTED_KEYS) if allow_axolotl else set()))
    for key, value in raw.items():
        key = str(key)
        if key in fields:
            if value is not None:
                kept[key] = value
        elif allow_axolotl and key in INERT_KEYS:
            if not _is_empty(value):
                notes.append(f"{where}{key}: ignored ({INERT_KEYS[key]})")
        elif allow_axolotl and key in UNSUPPORTED_KEYS:
            if _is_empty(value):
                notes.append(f"{where}{key}: empty, ignored")
            else:
                problems.append(f"{where}{key} is an Axolotl key this trainer does not support ({UNSUPPORTED_KEYS[key]}); remove it")
        else:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(f"unknown key '{where}{key}'{hint}")
    return kept, problems


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "literal_error":
            msg = f"got {e['input']!r}; {msg[0].lower()}{msg[1:]}"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_config(raw: Any) -> tuple[Config, list[str]]:
    """Validate a config mapping. Returns the config and notes about keys that were accepted but do nothing."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a YAML mapping of keys to values")
    notes: list[str] = []
    kept, problems = _check_keys(raw, set(Config.model_fields), "", notes, allow_axolotl=True)
    datasets = kept.get("datasets")
    if isinstance(datasets, list):
        cleaned = []
        for i, entry in enumerate(datasets):
            if not isinstance(entry, dict):
                problems.append(f"datasets.{i}: each dataset must be a mapping with at least path and type")
                continue
            if isinstance(entry.get("type"), dict):
                problems.append(f"datasets.{i}.type: custom prompt formats are not supported; use alpaca, chat_template, completion or input_output")
                continue
            d, p = _check_keys(entry, set(DatasetConfig.model_fields), f"datasets.{i}.", notes, allow_axolotl=False)
            cleaned.append(d)
            problems += p
        kept["datasets"] = cleaned
    try:
        cfg = Config.model_validate(kept)
    except ValidationError as err:  # report key and value problems together, so one run shows them all
        problems.append(_format_validation_error(err))
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg, notes


def load_config(path: str | Path) -> tuple[Config, list[str]]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    cfg, notes = parse_config(raw)
    check_local_paths(cfg)
    return cfg, notes


def looks_local(path: str) -> bool:
    """A path that is meant to be on disk (not a hub id like 'org/name')."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix in {".json", ".jsonl", ".parquet", ".csv"} or Path(path).exists()


def check_local_paths(cfg: Config) -> None:
    """Missing local files are bad input: say so before any work starts."""
    missing = []
    for i, ds in enumerate(cfg.datasets):
        if looks_local(ds.path) and not Path(ds.path).expanduser().exists():
            missing.append(f"datasets.{i}.path: file not found: {ds.path}")
    for key in ("base_model", "tokenizer_config", "deepspeed"):
        value = getattr(cfg, key)
        if value and looks_local(value) and not Path(value).expanduser().exists():
            missing.append(f"{key}: not found: {value}")
    if missing:
        raise ConfigError("; ".join(missing))
