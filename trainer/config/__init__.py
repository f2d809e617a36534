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
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from trainer import facts
from trainer.config.diffusion import DiffusionConfig
from trainer.config.ebft import EbftConfig
from trainer.config.grpo import TrlConfig
from trainer.data.formats import alpaca_styles
from trainer.errors import ConfigError
from trainer.model.qat import QatConfig
from trainer.model.sparsity import SparsityConfig

# The attention backends a config may name: matrices/attention.toml's rows (one copy of the fact; the resolver
# and trainer/runtime/hardware.py read the same table), e.g. flash_attention_2, sdpa, flex_attention, Hub kernel ids.
Attention = Literal[tuple(row["name"] for row in facts.rows("attention", "backend"))]
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
    # a PromptFormat, or with rl: a PAIR_TYPES / KTO_TYPES entry (checked by Config); None: pre-tokenized rows
    type: str | None = None
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
    drop_system_message: bool = False
    train_on_eos: Literal["turn", "last", "all", "none"] | None = None  # None: the whole turn tail, as rendered
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


class LoftQOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loftq_bits: Literal[4] = 4  # Axolotl's LoftQConfig: 4-bit NF4 (peft's LoftQ also knows 8; Axolotl's examples use 4)


class PeftOptions(BaseModel):  # Axolotl's `peft:` block
    model_config = ConfigDict(extra="forbid")
    loftq_config: LoftQOptions | None = None


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # model and tokenizer
    base_model: str
    tokenizer_config: str | None = None
    trust_remote_code: bool = False
    # Axolotl's `model_config:` (overrides of the model's config); renamed on reading, pydantic owns the name
    model_config_overrides: dict[str, Any] | None = None
    revision_of_model: str | None = None  # the model repository's branch, tag or commit
    special_tokens: dict[str, str] | None = None
    tokens: list[str] | None = None  # extra tokens added to the vocabulary

    # data
    datasets: list[DatasetConfig] = []  # required unless pretraining_dataset is set (checked below)
    val_set_size: float = Field(0.0, ge=0)  # < 1: fraction, >= 1: number of rows
    dataset_prepared_path: str = "last_run_prepared"
    dataset_exact_deduplication: bool = False  # drop rows identical after tokenising (train and validation)
    dataset_processes: int | None = Field(None, ge=1)  # default min(cpu_count, 8)
    dataset_prepare_timeout: int = Field(1800, ge=1)  # seconds other ranks wait for rank 0's cache
    shuffle_merged_datasets: bool = True
    # tokenizer_default | jinja (chat_template_jinja: text or file) | a name in trainer/templates/ |
    # tokenizer_default_fallback_<name>; checked against the templates by trainer.data.formats.chat_templates
    chat_template: str = "tokenizer_default"
    chat_template_jinja: str | None = None
    eot_tokens: list[str] | None = None  # the tokens that end a turn (train_on_eos decides which are trained)
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
    adapter: Literal["lora", "qlora"] | None = None
    lora_model_dir: str | None = None  # start from this trained adapter instead of a fresh one
    load_in_4bit: bool = False  # bitsandbytes NF4/FP4 base weights (QLoRA)
    load_in_8bit: bool = False  # bitsandbytes LLM.int8() base weights
    bnb_config_kwargs: dict[str, Any] | None = None  # extra BitsAndBytesConfig arguments, as in Axolotl
    lora_r: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | str | None = None
    lora_target_linear: bool = False
    peft_use_rslora: bool = False  # rank-stabilized LoRA scaling (alpha / sqrt(r)), peft's use_rslora
    peft_use_dora: bool = False  # weight-decomposed LoRA, peft's use_dora
    lora_target_parameters: list[str] | None = None  # LoRA on bare parameters (MoE experts), peft's target_parameters
    lora_modules_to_save: list[str] | None = None
    unfrozen_parameters: list[str] | None = None  # full fine-tune: train only parameters matching these regexes

    # optimisation
    num_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2e-5, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1)  # cosine decays to this fraction of learning_rate
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    warmup_steps: int | float | None = Field(None, ge=0)  # a float < 1 is a fraction of the steps (transformers v5)
    optimizer: str = "adamw_torch"  # a name in trainer.optim.optimizers (checked against matrices/optimizers.toml)
    optim_args: dict[str, Any] | str | None = None  # extra optimizer arguments, as transformers' optim_args
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    seed: int = 42

    # hardware: resolved against the GPU by trainer.runtime.hardware
    bf16: bool | Literal["auto"] = "auto"
    fp16: bool | None = None
    tf32: bool | Literal["auto"] = "auto"
    attn_implementation: Attention | None = None
    flash_attention: bool | None = None  # legacy flags, same meaning as attn_implementation
    sdp_attention: bool | None = None
    xformers_attention: bool | None = None
    eager_attention: bool | None = None
    gradient_checkpointing: bool | Literal["offload"] = False  # offload: accepted, trains as true (see notes)
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    deepspeed: str | None = None  # passed through to accelerate's DeepSpeed plugin
    fsdp: list[str] | str | None = None  # legacy Axolotl/HF list: full_shard, auto_wrap, offload, ...
    fsdp_config: dict[str, Any] | None = None  # Axolotl's keys, with or without the fsdp_ prefix
    fsdp_version: Literal[1, 2] | None = None
    ddp_find_unused_parameters: bool | None = None
    resize_token_embeddings_to_32x: bool = False

    # kernels and plugins (applied where the plan says triton kernels run, else switched off with a note)
    plugins: list[str] | None = None
    liger_rope: bool = False
    liger_rms_norm: bool = False
    liger_layer_norm: bool = False
    liger_glu_activation: bool = False
    liger_swiglu: bool = False
    liger_cross_entropy: bool = False
    liger_fused_linear_cross_entropy: bool = False
    liger_rms_norm_gated: bool = False
    cut_cross_entropy: bool = False
    lora_mlp_kernel: bool = False
    lora_qkv_kernel: bool = False
    lora_o_kernel: bool = False

    # loggers (besides output_dir/metrics.jsonl)
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = None
    wandb_run_id: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_watch: str | None = None
    wandb_log_model: str | None = None
    use_wandb: bool | None = None
    use_tensorboard: bool = False
    use_mlflow: bool = False
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None
    loss_watchdog_threshold: float | None = Field(None, gt=0)  # stop when the loss stays above this ...
    loss_watchdog_patience: int = Field(3, ge=1)  # ... for this many steps in a row
    hub_model_id: str | None = None  # push the final model or adapter to the hub at the end
    hub_strategy: str | None = None
    ddp_timeout: int = Field(1800, ge=1)  # seconds a collective may wait before the run stops

    # outputs and cadence
    output_dir: str = "./outputs"
    logging_steps: int = Field(1, ge=1)
    eval_steps: int | None = Field(None, ge=1)
    evals_per_epoch: int | None = Field(None, ge=0)  # 0: none, as in Axolotl
    save_steps: int | None = Field(None, ge=1)
    saves_per_epoch: int | None = Field(None, ge=1)
    save_total_limit: int | None = Field(None, ge=1)
    resume_from_checkpoint: str | None = None
    auto_resume_from_checkpoints: bool = False

    # --- pretraining and streaming (trainer/data/streaming.py) -------------------------------------------------
    pretraining_dataset: list[PretrainingDatasetConfig] | None = None  # raw text, streamed, windowed, packed
    streaming: bool = False  # stream `datasets` (tokenized while training) instead of preparing them up front
    streaming_multipack_buffer_size: int | None = Field(None, ge=1)  # rows per shuffle/packing buffer (10000)
    pretrain_multipack_buffer_size: int | None = Field(None, ge=1)  # Axolotl's deprecated spelling of the above
    pretrain_multipack_attn: bool = True  # packed documents do not attend to each other
    reinit_weights: bool = False  # train from the model's config with freshly initialised weights
    # --- mistral-common tokenizer (trainer/data/formats/mistral_tokenizer.py) ------------------------------------------
    # Mistral's own tokenizer; chat_template data encoded by it. Unset: true for Magistral models, as in Axolotl
    tokenizer_use_mistral_common: bool | None = None

    # --- quantization-aware training, fp8, schedule and checkpoint keys that come with them (trainer/model/qat.py) ---
    qat: QatConfig | None = None  # torchao fake quantization while training (Axolotl's QATConfig)
    fp8: bool = False  # torchao float8 training: refused with its hardware floor (trainer.model.qat.hardware_notes)
    fp8_enable_fsdp_float8_all_gather: bool = False
    cosine_constant_lr_ratio: float | None = Field(None, ge=0, le=1)  # cosine to cosine_min_lr_ratio by this fraction of the steps, then flat
    save_only_model: bool = False  # checkpoints without optimizer/scheduler/RNG state (resume restarts the optimizer)
    # --- N-D parallelism (trainer/parallel/mesh.py; context_parallel_size: trainer/parallel/context_parallel.py) -------
    dp_shard_size: int | None = Field(None, ge=1)  # FSDP shards over this many ranks (unset/1: all left)
    dp_replicate_size: int | None = Field(None, ge=1)  # replicas of the sharded model (HSDP with dp_shard_size)
    tensor_parallel_size: int | None = Field(None, ge=1)
    context_parallel_size: int | None = Field(None, ge=1)
    # accelerate's AcceleratorConfig, as Axolotl passes it: only gradient_accumulation_kwargs.sync_each_batch
    accelerator_config: dict[str, Any] | None = None
    min_sample_len: int | None = Field(None, ge=1)  # SFT rows with fewer tokens are dropped (Axolotl's filter)

    # --- long tail: training order, LISA, LoftQ, early stopping, quadratic warmup (Axolotl's names) -------
    group_by_length: bool = False  # the HF Trainer's length-grouped order (no effect with sample_packing, as in Axolotl)
    curriculum_sampling: bool = False  # the data's own order every epoch, no shuffle (trainer.batch.ordering)
    sample_packing_sequentially: bool = False  # next-fit packing in order instead of best-fit (trainer.batch.ordering)
    lisa_n_layers: int | None = Field(None, ge=1)  # LISA: train this many randomly chosen layers ... (trainer.optim.lisa)
    lisa_step_interval: int | None = Field(None, ge=1)  # ... re-drawn every this many steps
    lisa_layers_attribute: str = "model.layers"  # where the layers are, under the model
    peft: PeftOptions | None = None  # peft.loftq_config.loftq_bits: LoftQ initialisation of LoRA (trainer.model.loftq)
    early_stopping_patience: int | None = Field(None, ge=1)  # stop after this many evals without a better eval_loss
    lr_quadratic_warmup: bool = False  # cosine schedule with a quadratic warmup (trainer.optim.schedule)
    do_causal_lm_eval: bool = False  # eval_causal_lm_metrics at every evaluation (trainer.objectives.causal_lm_eval)
    eval_causal_lm_metrics: list[str] | None = None  # Axolotl's default: sacrebleu, comet, ter, chrf
    eval_max_new_tokens: int = Field(128, ge=1)  # Axolotl's default; perplexity's window length
    eval_table_size: int | None = Field(None, ge=0)  # Axolotl logs prediction tables only to wandb/mlflow/comet
    relora: bool = False  # ReLoRA: merge LoRA into the base every jagged_restart_steps (trainer.model.relora)
    relora_prune_ratio: float | None = Field(None, ge=0, le=1)  # share of LoRA's optimizer state zeroed at a restart
    relora_prune_method: Literal["magnitude", "random", "reset"] = "magnitude"
    relora_cpu_offload: bool = False  # compute the merges on the CPU
    jagged_restart_steps: int | None = Field(None, ge=1)  # LR restarts (and ReLoRA merges) every this many steps
    jagged_restart_warmup_steps: int | None = Field(None, ge=0)  # warmup after each restart (0/unset: 10)
    jagged_restart_anneal_steps: int | None = Field(None, ge=0)  # anneal before each restart (0/unset: 1)

    def _check_longtail(self) -> None:
        if (self.lisa_n_layers is None) != (self.lisa_step_interval is None):
            raise ValueError("lisa_n_layers and lisa_step_interval go together: set both (or neither)")
        if self.lisa_n_layers is not None:
            if self.adapter or self.unfrozen_parameters:
                raise ValueError("lisa_n_layers: LISA trains whole layers of a full fine-tune; remove adapter / "
                                 "unfrozen_parameters")
            if self.deepspeed or self.fsdp or self.fsdp_config or self.fsdp_version:
                raise ValueError("lisa_n_layers: not with DeepSpeed or FSDP (their sharded optimizers fix the trained "
                                 "parameters up front; LISA changes them every lisa_step_interval steps)")
        if self.peft and self.peft.loftq_config and (self.adapter != "lora" or self.load_in_8bit or self.lora_model_dir):
            raise ValueError("peft.loftq_config needs adapter: lora on an unquantized base and a fresh adapter (LoftQ "
                             "initialises LoRA against its own 4-bit quantization of the weights)")
        if self.early_stopping_patience:
            if not (self.save_steps and self.eval_steps) or self.save_steps % self.eval_steps:
                raise ValueError("early_stopping_patience needs save_steps and eval_steps, with eval_steps dividing "
                                 "save_steps (as Axolotl requires: the best checkpoint becomes the final model)")
            if not self.val_set_size:
                raise ValueError("early_stopping_patience needs a validation split (val_set_size)")
            if self.deepspeed or self.fsdp or self.fsdp_config or self.fsdp_version:
                raise ValueError("early_stopping_patience: not with DeepSpeed or FSDP here (ending with the best "
                                 "checkpoint's weights is not implemented for sharded weights)")
        if self.relora:
            if not self.jagged_restart_steps:
                raise ValueError("relora needs jagged_restart_steps (how often LoRA is merged and restarted)")
            if self.adapter not in ("lora", "qlora") or self.load_in_8bit:
                raise ValueError("relora needs adapter: lora (or qlora on a 4-bit base; not load_in_8bit, whose "
                                 "LLM.int8() weights are not re-quantized here)")
            if self.peft_use_dora or self.lora_modules_to_save or self.lora_target_parameters:
                raise ValueError("relora: not with peft_use_dora, lora_modules_to_save or lora_target_parameters "
                                 "(only LoRA's low-rank update is merged at a restart)")
            if self.deepspeed or self.fsdp or self.fsdp_config or self.fsdp_version:
                raise ValueError("relora: not with DeepSpeed or FSDP (Axolotl refuses FSDP too: the merge needs the "
                                 "whole weights)")
            if self.early_stopping_patience or self.hub_model_id:
                raise ValueError("relora: not with early_stopping_patience or hub_model_id here (a checkpoint's adapter "
                                 "alone is not the model after merges; push or pick output_dir/final, the full model)")
        if self.do_causal_lm_eval:
            metrics = self.eval_causal_lm_metrics or ["sacrebleu", "comet", "ter", "chrf"]
            other = [m for m in metrics if m != "perplexity"]
            if other:
                raise ValueError(f"eval_causal_lm_metrics: {', '.join(other)} not supported (Axolotl scores "
                                 "generations with the evaluate package's metric scripts, fetched from the Hugging "
                                 "Face Hub); only perplexity is computed here")
            if self.rl:
                raise ValueError("do_causal_lm_eval: for SFT only (no preference training)")
        if self.eval_table_size and (self.wandb_project or self.use_wandb or self.use_mlflow):
            raise ValueError("eval_table_size: prediction tables are not logged to wandb/mlflow here (Axolotl logs "
                             "them only there, and has deprecated the key for generate_samples)")
    # ------------------------------------------------------------------------------------------------------

    # --- attention, gpt-oss (attn) -----------------------------------------------------------------------
    # a transformers quantization config by class name, built with these kwargs (trainer/model/quantization_config.py);
    # only Mxfp4Config with dequantize: true (gpt-oss's MXFP4 experts loaded as bf16 weights to train)
    model_quantization_config: str | None = None
    model_quantization_config_kwargs: dict[str, Any] | None = None
    flex_attention: bool | None = None  # Axolotl's deprecated flag for attn_implementation: flex_attention
    # --- reward models (Axolotl's names; TRL's RewardTrainer / PRMTrainer losses) -------------------------
    reward_model: bool = False  # Bradley-Terry outcome reward model (AutoModelForSequenceClassification)
    process_reward_model: bool = False  # per-step reward model (AutoModelForTokenClassification)
    center_rewards_coefficient: float | None = Field(None, ge=0)  # TRL's mean-zero reward term
    num_labels: int | None = Field(None, ge=1)  # head outputs: 1 for reward_model, 2 (default) for process_reward_model
    # --- EAFT, diffusion LM training, cls_model_config (trainer/objectives/eaft.py, trainer/config/diffusion.py, trainer/model/config_class.py)
    use_eaft: bool = False  # entropy-aware focal training: token losses weighted by top-k entropy ** eaft_alpha
    eaft_alpha: float = Field(1.0, ge=0)  # Axolotl's default 1.0
    eaft_k: int = Field(20, ge=2)  # Axolotl's default 20; top-1 entropy is 0 (every weight would be 0)
    cls_model_config: str | None = None  # transformers config class to read the model's config with
    diffusion: DiffusionConfig | None = None  # with plugins: [axolotl.integrations.diffusion.DiffusionPlugin]
    # ------------------------------------------------------------------------------------------------------
    # --- BitNet training (trainer/model/bitnet.py) -----------------------------------------------------------------
    use_onebitllms: bool = False  # Falcon-E: every linear layer but lm_head becomes onebitllms' BitNetLinear

    # --- sparse fine-tuning (trainer/model/sparsity.py) -----------------------------------------------------------
    llmcompressor: SparsityConfig | None = None  # with plugins: [axolotl.integrations.llm_compressor.LLMCompressorPlugin]

    # --- EBFT (rl: ebft, strided mode; trainer/config/ebft.py, trainer/objectives/ebft_strided.py) ---
    ebft: EbftConfig | None = None  # Axolotl's ebft: block (checked by trainer.config.ebft.check)

    # --- online RL with generation: rl: grpo / gdpo (trainer/config/grpo.py, trainer/objectives/grpo.py) ---
    trl: TrlConfig | None = None  # Axolotl's trl: block (reward_funcs, num_generations, beta, ...)
    # set by load_config: user modules (ebft and trl.reward_funcs transforms, `module.function` dataset types)
    # import from the config's directory
    _config_dir: str | None = PrivateAttr(None)

    # --- Ray Train launching (trainer/ray_launch.py; Axolotl's names and defaults) ----------------------------
    use_ray: bool = False  # `train` starts a local Ray cluster and runs the loop on ray_num_workers workers
    ray_num_workers: int = Field(1, ge=1)  # Ray Train workers (processes), each one rank
    resources_per_worker: dict[str, float] | None = None  # Ray resources per worker; unset: Axolotl's {GPU: 1}
    ray_run_name: str | None = None  # the Ray run's directory under output_dir (unset: "ray")

    def _check_ray(self) -> None:
        for name, amount in (self.resources_per_worker or {}).items():
            if amount < 0:
                raise ValueError(f"resources_per_worker.{name}: {amount:g} is negative (give 0 or more)")
        if self.ray_run_name is not None and (not self.ray_run_name.strip() or "/" in self.ray_run_name
                                              or self.ray_run_name in (".", "..")):
            raise ValueError(f"ray_run_name: {self.ray_run_name!r} must be a plain directory name")

    # --- preference training (Axolotl's names; defaults as TRL's configs) --------------------------------
    rl: Literal["dpo", "ipo", "orpo", "kto", "simpo", "ebft", "grpo", "gdpo"] | None = None
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
        """sft, reward or prm, or the preference method (rl: dpo with dpo_loss_type: [ipo] is ipo)."""
        if self.reward_model or self.process_reward_model:
            return "reward" if self.reward_model else "prm"
        if self.rl == "dpo" and self.dpo_loss_type == ["ipo"]:
            return "ipo"
        return self.rl or "sft"

    @property
    def beta(self) -> float:
        """The method's beta, with Axolotl's precedence: rl_beta (or dpo_beta), then orpo_alpha, else TRL's 0.1."""
        return self.rl_beta or self.dpo_beta or self.orpo_alpha or 0.1

    @property
    def streamed(self) -> bool:
        """The training data is read as a stream (pretraining_dataset or streaming: true)."""
        return bool(self.pretraining_dataset) or self.streaming

    @property
    def stream_buffer_size(self) -> int:
        return self.streaming_multipack_buffer_size or self.pretrain_multipack_buffer_size or 10_000

    def _check_pretraining(self) -> None:
        if not self.datasets and not self.pretraining_dataset:
            raise ValueError("datasets: Field required (or pretraining_dataset for streamed pretraining)")
        if self.datasets and self.pretraining_dataset:
            raise ValueError("set datasets or pretraining_dataset, not both")
        if self.streaming_multipack_buffer_size and self.pretrain_multipack_buffer_size:
            raise ValueError("pretrain_multipack_buffer_size is the deprecated spelling of "
                             "streaming_multipack_buffer_size; set only one")
        if self.reinit_weights and (self.adapter or self.load_in_4bit or self.load_in_8bit):
            raise ValueError("reinit_weights: not with an adapter or quantized loading (random base weights are "
                             "not saved, so an adapter over them could not be reloaded)")
        if not self.streamed:
            return
        what = "pretraining_dataset" if self.pretraining_dataset else "streaming: true"
        if self.max_steps is None:
            raise ValueError(f"{what} needs max_steps (a stream has no length to count epochs by)")
        if self.val_set_size:
            raise ValueError(f"{what}: val_set_size must be 0 (a stream has no held-out split here)")
        if self.rl:
            raise ValueError(f"{what}: not with rl: (preference data is prepared up front)")
        if self.dataset_exact_deduplication:
            raise ValueError(f"{what}: not with dataset_exact_deduplication (it needs every row up front)")
        if self.group_by_length or self.curriculum_sampling or self.sample_packing_sequentially:
            raise ValueError(f"{what}: not with group_by_length, curriculum_sampling or sample_packing_sequentially "
                             "(they order prepared data; shuffle_merged_datasets: false keeps the stream's order)")

    def _check_preference(self) -> None:
        from trainer.config.rl import check_reward_config

        if check_reward_config(self):  # reward_model / process_reward_model: their own dataset types
            return
        if self.rl in ("grpo", "gdpo"):  # prompt datasets with user transforms (trainer/config/grpo.py checks)
            return
        if self.rl is None:
            for i, ds in enumerate(self.datasets):
                if ds.type is not None and ds.type not in PromptFormat.__args__ and ds.type not in alpaca_styles.TYPES:
                    hint = " (a preference type: set rl: dpo, ipo, orpo, simpo or kto)" if ds.type in PAIR_TYPES + KTO_TYPES else ""
                    raise ValueError(f"datasets.{i}.type: got {ds.type!r}{hint}; use alpaca (or alpaca:instruct|chat|chatml|phi), chat_template, completion or input_output")
            return
        if self.rl == "ebft":  # transforms named module.function (trainer/config/ebft.py check)
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
        self._check_pretraining()
        self._check_preference()
        self._check_longtail()
        self._check_ray()
        from trainer.model.quantization_config import check as check_quantization_config

        check_quantization_config(self.model_quantization_config, self.model_quantization_config_kwargs)
        if self.model_quantization_config and (self.load_in_4bit or self.load_in_8bit):
            raise ValueError("model_quantization_config and load_in_4bit/load_in_8bit are two quantizations; choose one")
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError("set warmup_ratio or warmup_steps, not both")
        if self.min_sample_len is not None and (self.rl or self.min_sample_len > self.sequence_len):
            raise ValueError(f"min_sample_len: {self.min_sample_len} must be at most sequence_len ({self.sequence_len})"
                             if not self.rl else "min_sample_len: applies to SFT data, not to rl: preference pairs")
        if isinstance(self.warmup_steps, float) and self.warmup_steps >= 1 and not self.warmup_steps.is_integer():
            raise ValueError(f"warmup_steps: {self.warmup_steps} is neither a step count nor a fraction (< 1) of the steps")
        if self.bf16 is True and self.fp16:
            raise ValueError("bf16 and fp16 are both true; choose one (or bf16: auto)")
        if self.eval_steps and self.evals_per_epoch:
            raise ValueError("set eval_steps or evals_per_epoch, not both")
        if self.save_steps and self.saves_per_epoch:
            raise ValueError("set save_steps or saves_per_epoch, not both")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both true; choose one")
        if self.adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("adapter: qlora needs load_in_4bit: true (QLoRA trains LoRA on 4-bit base weights)")
        if (self.load_in_4bit or self.load_in_8bit) and not self.adapter:
            raise ValueError("load_in_4bit/load_in_8bit need an adapter (lora or qlora): quantized weights cannot "
                             "be trained directly")
        if self.lora_model_dir and not self.adapter:
            raise ValueError("lora_model_dir needs adapter: lora or qlora")
        for pattern in self.unfrozen_parameters or []:
            if re.search(r"\$\[\d*:\d*\]$", pattern):
                raise ValueError(f"unfrozen_parameters: range patterns ({pattern}) are not supported; "
                                 "freeze or train whole parameters")
        flags = [f for f in ("flash_attention", "sdp_attention", "xformers_attention", "eager_attention",
                             "flex_attention") if getattr(self, f)]
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
            "flex_attention": "flex_attention",
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
    "model_type": "the head follows the objective (causal LM; sequence classification with reward_model, token "
                  "classification with process_reward_model) and the class within it the model's config",
    "tokenizer_type": "AutoTokenizer picks the class from the tokenizer's files",
    "tokenizer_use_fast": "the fast tokenizer is always used",
    "tokenizer_legacy": "the tokenizer's own files decide",
    "is_llama_derived_model": "model family is read from the model's config",
    "is_mistral_derived_model": "model family is read from the model's config",
    "is_qwen_derived_model": "model family is read from the model's config",
    "is_falcon_derived_model": "model family is read from the model's config",
    "test_value": "not an Axolotl option: Axolotl's config schema drops keys it does not define, and one of its "
                  "examples carries this one",
    "adam_eps": "not an Axolotl option (Axolotl's schema drops it, so its optimizer keeps the default epsilon); "
                "the epsilon is adam_epsilon",
    "save_safetensors": "checkpoints and the final model are always safetensors",
    "save_strategy": "checkpoints follow save_steps / saves_per_epoch",
    "eval_strategy": "evaluation follows eval_steps / evals_per_epoch",
    "evaluation_strategy": "evaluation follows eval_steps / evals_per_epoch",
    "low_cpu_mem_usage": "transformers always loads with low CPU memory use",
    "experimental_skip_move_to_device": "the trainer places the model itself",
    "hf_use_auth_token": "the hub token comes from HF_TOKEN or `hf auth login`",
    "flash_attn_cross_entropy": "a flash-attn kernel option; the loss is computed by torch",
    "flash_attn_rms_norm": "a flash-attn kernel option; the model's own RMSNorm is used",
    "flash_attn_fuse_qkv": "a flash-attn kernel option",
    "flash_attn_fuse_mlp": "a flash-attn kernel option",
    "eta_min": "not a key of Axolotl's config schema: Axolotl drops it and trains its usual cosine schedule, and "
               "so does this trainer; for a floor set cosine_min_lr_ratio (floor / learning_rate)",
}

# Speed/memory switches with no effect on what is trained: accepted with a note saying they are off here.
PERFORMANCE_KEYS: dict[str, str] = {
    **{k: "a speed option this trainer does not implement (same training, slower)" for k in (
        "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_kernels", "use_scattermoe",
        "use_sonicmoe", "fused_attn_kernel", "experts_implementation", "flash_optimum",
        "llama4_linearized_experts", "gemma4_hybrid_attn_impl", "use_dsv4_kernels", "use_glm_dsa_kernels", "dsv4_fp4_grouped_mode")},
    "quantize_moe_experts": "MoE expert weights (3-D parameters, which bitsandbytes' linear-layer quantization "
                            "skips) stay in the training precision: more memory, no quantization error on them",
    **{k: "a memory option this trainer does not implement (same training, more memory)" for k in (
        "activation_offloading", "embeddings_skip_upcast", "lora_on_cpu", "gpu_memory_limit", "max_memory",
        "device_map")},
    **{k: "an experiment tracker this trainer does not log to; metrics go to output_dir/metrics.jsonl "
          "(wandb_*, use_tensorboard, use_mlflow are supported)" for k in (
        "swanlab_project", "swanlab_run_name", "swanlab_workspace", "swanlab_mode", "swanlab_log_model",
        "swanlab_description", "swanlab_tags", "use_swanlab", "swanlab_experiment_name", "swanlab_log_completions",
        "swanlab_completion_log_interval", "swanlab_completion_max_buffer", "trackio_project_name", "trackio_run_name",
        "trackio_space_id", "use_trackio", "comet_api_key", "comet_project_name", "comet_workspace",
        "use_comet", "use_otel_metrics", "otel_metrics_host", "otel_metrics_port")},
}

# Axolotl keys this trainer does not implement. Empty values are accepted (with a note); anything else is an error.
UNSUPPORTED_KEYS: dict[str, str] = {
    **{k: "GPTQ/AWQ/torchao quantized loading is not supported (use load_in_4bit or load_in_8bit)" for k in (
        "model_quantization_config", "model_quantization_config_kwargs")},
    **{k: "GPTQ checkpoints load through gptqmodel and optimum, which this trainer does not carry: gptqmodel 7.7 "
          "requires torch>=2.14.1 and 7.0-7.6 pin numpy==2.2.6, against the tested torch 2.13 stack. Train QLoRA "
          "on the unquantized model instead (adapter: qlora, load_in_4bit: true)"
       for k in ("gptq", "gptq_disable_exllama")},
    **{k: "this adapter option is not supported" for k in (
        "lora_fan_in_fan_out", "peft_layers_to_transform", "loraplus_lr_ratio", "loraplus_lr_embedding")},
    **{k: "this preference-training option is not supported (rl: dpo, ipo, orpo, kto, simpo, grpo and gdpo train with the options listed in the README)" for k in (
        "dpo_use_weighting", "dpo_use_liger_kernel",
        "dpo_padding_free", "dpo_loss_weights", "rl_adapter_ref_model", "dpo_norm_loss")},
    "sequence_parallel_degree": "Axolotl's deprecated name for context_parallel_size: write context_parallel_size",
    **{k: "expert parallelism is not supported (use FSDP, DeepSpeed or DDP)" for k in (
        "expert_parallel_size",)},
    **{k: "not supported" for k in (
        "neftune_noise_alpha", "noisy_embedding_alpha", "s2_attention", "sage_attention",
        "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o",
        "lr_div_factor",
        "test_datasets",
        "sample_packing_eff_est", "sample_packing_group_size", "sample_packing_bin_size",
        "multipack_real_batches", "hub_strategy_every_save",
        "chat_template_kwargs", "default_system_message", "dataset_shard_num", "dataset_shard_idx",
        "skip_prepare_dataset", "dataset_keep_in_memory", "push_dataset_to_hub",
        "base_model_config", "xformers_attention_backend", "lr_groups",
        "optim_target_modules", "sequence_len_overflow_handling", "max_packed_sequence_len",
        "torchdistx_path")},
}

PERFORMANCE_KEYS.update({k: "ALST's tiled MLP (the MLP computed in sequence chunks) is a memory option this trainer "
                            "does not implement (same training, more memory)"
                         for k in ("tiled_mlp", "tiled_mlp_num_shards", "tiled_mlp_use_original_mlp")})
UNSUPPORTED_KEYS["relora_steps"] = ("the old name of jagged_restart_steps, which Axolotl no longer reads: set relora: true "
                                    "and jagged_restart_steps")
UNSUPPORTED_KEYS.update({k: "merge-aware LoRA on an NVFP4 (modelopt) checkpoint runs in Axolotl's SonicMoE NVFP4 "
                            "kernels (integrations/kernels/libs/sonicmoe), which this trainer does not implement"
                         for k in ("nvfp4_merge_aware", "nvfp4_merge_aware_start_step")})

# --- context parallelism (trainer/parallel/context_parallel.py) ---
PERFORMANCE_KEYS.update({
    "heads_k_stride": "ring-flash-attn's number of key/value heads communicated at a time (memory and speed); "
                      "context parallelism here all-gathers every key/value head of a layer at once, and the "
                      "attention computed is the same",
    "ring_attn_func": "ring-flash-attn's communication pattern (varlen_llama3, batch_ring, batch_zigzag, "
                      "batch_stripe: speed and load balance); context parallelism here always all-gathers keys "
                      "and values (the varlen_llama3 scheme), and every pattern computes the same attention",
})

PERFORMANCE_KEYS["flex_attn_compile_kwargs"] = (
    "torch.compile options for flex_attention's kernel (speed only); transformers compiles it with its own "
    "defaults, as Axolotl does today (its patch applying them is switched off in loaders/patch_manager.py)")

INERT_KEYS["ddp"] = ("Axolotl sets it from WORLD_SIZE when absent and reads it only to pass ddp_find_unused_parameters "
                     "and to place the model on the rank's device; processes launched together still train with DDP "
                     "here, as there")

# Legacy dtype switches: the same as bf16/fp16 (float32: neither).
LEGACY_DTYPE_KEYS = {"bfloat16": ("bf16", True), "float16": ("fp16", True), "float32": ("bf16", False)}
TORCH_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _check_keys(raw: dict, fields: set[str], where: str, notes: list[str], allow_axolotl: bool) -> tuple[dict, list[str]]:
    """Return the supported keys with non-null values, and the problems found."""
    kept, problems = {}, []
    known = sorted(fields | (set(INERT_KEYS) | set(PERFORMANCE_KEYS) | set(UNSUPPORTED_KEYS) if allow_axolotl else set()))
    for key, value in raw.items():
        key = str(key)
        if key in fields:
            if value is not None:
                kept[key] = value
        elif allow_axolotl and key in INERT_KEYS:
            if not _is_empty(value):
                notes.append(f"{where}{key}: ignored ({INERT_KEYS[key]})")
        elif allow_axolotl and key in PERFORMANCE_KEYS:
            if not _is_empty(value):
                notes.append(f"{where}{key}: off ({PERFORMANCE_KEYS[key]})")
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


def _legacy_keys(raw: dict, notes: list[str]) -> dict:
    """Axolotl's older spellings of the precision: bfloat16/float16/float32: true and torch_dtype."""
    if "model_config" in raw:
        raw["model_config_overrides"] = raw.pop("model_config")
    for key, (target, value) in LEGACY_DTYPE_KEYS.items():
        if key in raw:
            given = raw.pop(key)
            if given and raw.get(target) is None:
                raw[target] = value
                notes.append(f"{key}: true is the legacy spelling of {target}: {str(value).lower()}")
    if "torch_dtype" in raw:
        given = raw.pop("torch_dtype")
        precision = TORCH_DTYPES.get(str(given).removeprefix("torch."))
        if given is not None and precision is None:
            raise ConfigError(f"torch_dtype: unknown dtype {given!r}; use bfloat16, float16 or float32")
        if precision and raw.get("bf16") is None and raw.get("fp16") is None:
            raw["bf16" if precision != "fp16" else "fp16"] = precision == "bf16" or (True if precision == "fp16" else False)
            notes.append(f"torch_dtype: {given} is read as {precision}")
    return raw


def parse_config(raw: Any) -> tuple[Config, list[str]]:
    """Validate a config mapping. Returns the config and notes about keys that were accepted but do nothing."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a YAML mapping of keys to values")
    notes: list[str] = []
    assert not any("; " in r for r in UNSUPPORTED_KEYS.values())  # refusals are '; '-joined
    raw = _legacy_keys(dict(raw), notes)
    kept, problems = _check_keys(raw, set(Config.model_fields), "", notes, allow_axolotl=True)
    datasets = kept.get("datasets")
    if isinstance(datasets, list):
        cleaned = []
        for i, entry in enumerate(datasets):
            if not isinstance(entry, dict):
                problems.append(f"datasets.{i}: each dataset must be a mapping with at least path and type")
                continue
            if entry.get("type") == "chat_template.default":  # Axolotl's full name of the same strategy
                entry = {**entry, "type": "chat_template"}
            if isinstance(entry.get("type"), dict):
                problems.append(f"datasets.{i}.type: custom prompt formats are not supported; use alpaca, chat_template, completion or input_output")
                continue
            d, p = _check_keys(entry, set(DatasetConfig.model_fields), f"datasets.{i}.", notes, allow_axolotl=False)
            cleaned.append(d)
            problems += p
        kept["datasets"] = cleaned
    if isinstance(kept.get("pretraining_dataset"), list):  # a YAML null in an entry means unset, as above
        kept["pretraining_dataset"] = [{k: v for k, v in e.items() if v is not None} if isinstance(e, dict) else e
                                       for e in kept["pretraining_dataset"]]
    try:
        cfg = Config.model_validate(kept)
    except ValidationError as err:  # report key and value problems together, so one run shows them all
        problems.append(_format_validation_error(err))
    else:
        problems += _named_choices(cfg, notes)
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg, notes


def _named_choices(cfg: Config, notes: list[str]) -> list[str]:
    """Choices checked against data tables: optimizer, chat templates, plugins, FSDP settings."""
    from trainer.batch import ordering
    from trainer.config import ebft, training
    from trainer.data.formats import chat_templates, mistral_tokenizer
    from trainer.model import kernels, qat, relora, sparsity
    from trainer.optim import optimizers, schedule
    from trainer.parallel import distributed, mesh

    problems = []
    if cfg.gradient_checkpointing == "offload":
        notes.append("gradient_checkpointing: offload trains as true (activations are recomputed, not offloaded "
                     "to CPU memory)")
    if cfg.adapter and cfg.unfrozen_parameters:
        notes.append("unfrozen_parameters: ignored with an adapter (the adapter's weights are what is trained; "
                     "quantized base weights cannot be)")
    checks = [lambda: optimizers.check(cfg.optimizer), lambda: chat_templates.check(cfg.chat_template, cfg.chat_template_jinja),
              lambda: optimizers.check_muon(cfg)]
    checks += [lambda ds=ds: chat_templates.check(ds.chat_template, ds.chat_template_jinja)
               for ds in cfg.datasets if ds.chat_template]
    checks += [lambda: notes.extend(kernels.check_plugins(cfg)), lambda: notes.extend(distributed.check(cfg))]
    checks += [lambda: notes.extend(mistral_tokenizer.check(cfg))]
    checks += [lambda: qat.check_config(cfg)]
    checks += [lambda: notes.extend(sparsity.check(cfg))]
    checks += [lambda: notes.extend(objective_notes(cfg))]
    checks += [lambda: notes.extend(ebft.check(cfg))]  # rl: ebft (strided mode only)
    checks += [lambda: notes.extend(mesh.check(cfg, distributed.enabled(cfg)))]
    checks += [lambda: notes.extend(ordering.notes(cfg) + training.eval_table_notes(cfg) + schedule.notes(cfg))]
    if cfg.relora:
        checks += [lambda: relora.check_optimizer(cfg.optimizer)]
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    return problems


def objective_notes(cfg: Config) -> list[str]:
    """use_eaft, the diffusion plugin and cls_model_config (trainer/objectives/eaft.py, trainer/config/diffusion.py)."""
    from trainer.config import diffusion

    if cfg.use_eaft and cfg.objective != "sft":
        raise ConfigError("use_eaft: weights SFT's token losses; not with rl: preference training or reward models")
    from trainer.config import grpo

    try:
        notes = grpo.check(cfg)  # rl: grpo / gdpo and the trl: block
    except ValueError as err:
        raise ConfigError(str(err)) from None
    import importlib.util

    # a transformers class by name: judged where transformers is installed (the trainer's own start checks it
    # again before loading; the resolver may read the config in an environment without it)
    if cfg.cls_model_config and importlib.util.find_spec("transformers") is not None:
        from trainer.model import config_class

        config_class.config_class(cfg.cls_model_config)
    return notes + diffusion.check(cfg)


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
    cfg._config_dir = str(path.resolve().parent)
    check_local_paths(cfg)
    return cfg, notes


def looks_local(path: str) -> bool:
    """A path that is meant to be on disk (not a hub id like 'org/name')."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix in {".json", ".jsonl", ".parquet", ".csv"} or Path(path).exists()


def check_local_paths(cfg: Config) -> None:
    """Missing local files are bad input: say so before any work starts."""
    missing = []
    entries = [("datasets", cfg.datasets), ("pretraining_dataset", cfg.pretraining_dataset or [])]
    for key, i, ds in [(key, i, ds) for key, group in entries for i, ds in enumerate(group)]:
        if looks_local(ds.path) and not Path(ds.path).expanduser().exists():
            missing.append(f"{key}.{i}.path: file not found: {ds.path}")
    from trainer.parallel.distributed import deepspeed_path

    for key in ("base_model", "tokenizer_config", "deepspeed"):
        value = getattr(cfg, key)
        if key == "deepspeed" and value:
            value = str(deepspeed_path(value))
        if value and looks_local(value) and not Path(value).expanduser().exists():
            missing.append(f"{key}: not found: {value}")
    if missing:
        raise ConfigError("; ".join(missing))
