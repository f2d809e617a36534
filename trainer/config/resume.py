"""What a resumed run may change: every config key's class, in one table, and the comparison with a checkpoint's.

A checkpoint records the config it was trained with (trainer_state.json's "config": the run's config as loaded,
before anything the run derives). A run that resumes it compares its own config with that one, key by key,
before the tokenizer, the data or the model load (trainer/train.py):

    trains     the key changes what the checkpoint's weights, optimizer state, schedule or data position mean
               (the base model, the adapter's shape, the data, the batch, the optimizer and its learning rate, ...):
               refused, exit 2, in one line naming the checkpoint and each changed key with both values
    may change the key may legitimately change on a resume (more steps or epochs, the logging, evaluation and save
               cadence, trackers, kernels and sharding that compute the same thing): allowed, with one note each
    resume     the keys that ask for the resume itself (resume_from_checkpoint, auto_resume_from_checkpoints): not
               compared

The learning rate (and the schedule's keys) is refused, not honoured: the checkpoint's optimizer and scheduler
state carry the old rate, and loading them overrode a new value without a word. Honouring a new rate would
mean rewriting each scheduler's base rates mid-schedule (the HF Trainer does not either); a user who wants a new
rate starts a new run (a new output_dir, or lora_model_dir from the checkpoint for an adapter).

A key a feature declares on the feature list (trainer/config/features.py `config`) carries its class there: the
table below takes it from the list. Every key of Config is in exactly one class (tests/trainer/config/test_resume_changes.py fails on an unclassified key);
a key missing from the table at run time is treated as `trains`. A checkpoint without a recorded config (written
by an older envtool) is not compared: one note says so.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from trainer.config.features import keys as feature_keys
from trainer.config.schema import Config
from trainer.errors import ConfigError

TRAINS, MAY_CHANGE, RESUME = "trains", "may change", "resume"

_TRAINS = """
base_model base_model_config tokenizer_config model_config_overrides revision_of_model special_tokens
tokens resize_token_embeddings_to_32x shrink_embeddings mean_resizing_embeddings fix_untrained_tokens added_tokens_overrides scaling_softmax scaling_softmax_factor scaling_softmax_bias liger_use_token_scaling cls_model_config reinit_weights tokenizer_use_mistral_common adapter
lora_model_dir load_in_4bit load_in_8bit bnb_config_kwargs quantize_moe_experts lora_r lora_alpha lora_dropout lora_target_modules
lora_target_linear peft_use_rslora peft_use_dora lora_target_parameters lora_modules_to_save unfrozen_parameters peft
lora_rank_pattern lora_alpha_pattern peft_layers_to_transform peft_layers_pattern peft_layer_replication
peft_init_lora_weights peft_trainable_token_indices peft_ensure_weight_tying peft_autocast_adapter_dtype
model_quantization_config model_quantization_config_kwargs use_onebitllms model_kwargs
datasets val_set_size skip_prepare_dataset dataset_exact_deduplication shuffle_merged_datasets
shuffle_before_merging_datasets dataset_shard_num dataset_shard_idx chat_template
chat_template_jinja chat_template_kwargs eot_tokens sequence_len excess_length_strategy train_on_inputs min_sample_len
pretraining_dataset
streaming streaming_multipack_buffer_size pretrain_multipack_buffer_size pretrain_multipack_attn use_pose pose_split_on_token_ids pose_max_context_len pose_num_chunks sample_packing
pad_to_sequence_len group_by_length curriculum_sampling sample_packing_sequentially
micro_batch_size gradient_accumulation_steps
learning_rate lr_scheduler lr_scheduler_kwargs cosine_min_lr_ratio cosine_constant_lr_ratio warmup_ratio warmup_steps
lr_quadratic_warmup
optimizer optim_args weight_decay max_grad_norm adam_beta1 adam_beta2 adam_epsilon seed neftune_noise_alpha
loraplus_lr_ratio loraplus_lr_embedding embedding_lr embedding_lr_scale lr_groups
lisa_n_layers lisa_step_interval lisa_layers_attribute relora relora_prune_ratio relora_prune_method
jagged_restart_steps jagged_restart_warmup_steps jagged_restart_anneal_steps
bf16 fp16 fp32_master_weights plugins
rl rl_beta dpo_beta dpo_label_smoothing dpo_loss_type dpo_loss_weights dpo_use_weighting orpo_alpha kto_desirable_weight kto_undesirable_weight simpo_gamma
cpo_alpha remove_unused_columns reward_model process_reward_model center_rewards_coefficient num_labels
use_eaft eaft_alpha eaft_k diffusion trl ebft qat fp8 llmcompressor
processor_type processor_kwargs freeze_mm_modules image_size image_resize_algorithm role_boundaries
"""

_MAY_CHANGE = """
gradient_checkpointing gradient_checkpointing_kwargs trust_remote_code
test_datasets dataset_prepared_path dataset_processes dataset_prepare_timeout eval_sample_packing
auto_find_batch_size eval_batch_size dataloader_num_workers num_epochs max_steps
output_dir logging_steps eval_steps evals_per_epoch save_steps saves_per_epoch save_total_limit save_only_model
save_safetensors
early_stopping_patience do_causal_lm_eval eval_causal_lm_metrics eval_max_new_tokens eval_table_size
relora_cpu_offload precompute_ref_log_probs torch_empty_cache_steps
activation_offloading selective_checkpointing tiled_mlp tiled_mlp_num_shards torch_compile
torch_compile_backend torch_compile_mode torch_compile_options
tf32 attn_implementation experts_implementation flash_attention sdp_attention xformers_attention eager_attention flex_attention
liger_rope liger_rms_norm liger_layer_norm liger_glu_activation liger_swiglu liger_cross_entropy
liger_fused_linear_cross_entropy liger_rms_norm_gated cut_cross_entropy chunked_cross_entropy
chunked_cross_entropy_num_chunks lora_mlp_kernel lora_qkv_kernel lora_o_kernel
deepspeed fsdp fsdp_config fsdp_version ddp_find_unused_parameters ddp_timeout preflight_timeout dp_shard_size
dp_replicate_size tensor_parallel_size context_parallel_size expert_parallel_size accelerator_config
fp8_enable_fsdp_float8_all_gather
use_ray ray_num_workers resources_per_worker ray_run_name
wandb_project wandb_entity wandb_name wandb_run_id wandb_mode wandb_watch wandb_log_model use_wandb use_tensorboard
use_mlflow mlflow_tracking_uri mlflow_experiment_name mlflow_run_name loss_watchdog_threshold loss_watchdog_patience
hub_model_id hub_strategy hub_revision
"""

_RESUME = "resume_from_checkpoint auto_resume_from_checkpoints"

# the one table: key -> its class (the features' own keys: as their entries on the feature list declare)
CLASSES: dict[str, str] = {**{k: TRAINS for k in _TRAINS.split()}, **{k: MAY_CHANGE for k in _MAY_CHANGE.split()},
                           **{k: RESUME for k in _RESUME.split()},
                           **{name: key.resume for name, key in feature_keys().items()}}


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    return recorded(Config.model_construct())


def recorded(cfg) -> dict[str, Any]:
    """What a checkpoint records: the config's values as JSON."""
    return cfg.model_dump(mode="json")


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value) if isinstance(value, str) else ("unset" if value is None else str(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


# keys of a block (a mapping key) that may change on a resume although the block trains: where a server is and how long
# to wait for it (a GRPO run's vLLM server restarted on another port resumes)
BLOCK_MAY_CHANGE = {"trl": {"vllm_server_host", "vllm_server_port", "vllm_server_timeout"}}


def changes(before: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(key, class, the checkpoint's value, this config's value) for every key whose value differs. A key the
    checkpoint does not record (added to envtool since) is compared with its default. A block (trl: {...}) is
    compared key by key (`trl.vllm_server_port`), each named with its own two values."""
    out = []
    for key, value in now.items():
        old = before.get(key, defaults.get(key))
        if old == value:
            continue
        kind = CLASSES.get(key, TRAINS)
        if isinstance(old, dict) and isinstance(value, dict):
            out += [(f"{key}.{sub}", MAY_CHANGE if sub in BLOCK_MAY_CHANGE.get(key, ()) else kind, old.get(sub),
                     value.get(sub)) for sub in sorted({*old, *value}) if old.get(sub) != value.get(sub)]
        else:
            out.append((key, kind, old, value))
    return out


def compare(checkpoint: str, before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """The notes for the allowed changes; raises ConfigError (exit 2) naming the checkpoint and every refused key
    with both values. `before`: the checkpoint's recorded config (None: an older checkpoint, one note); `now`:
    this run's, recorded(cfg) as loaded (before auto_find_batch_size or another number of processes sets the
    batch split)."""
    if not isinstance(before, dict):
        return [f"note: {checkpoint} does not record the config it was trained with (written by an older envtool): "
                "this config is not compared with it"]
    found = changes(before, now, _defaults())
    refused = [(k, old, new) for k, kind, old, new in found if kind == TRAINS]
    if refused:
        what = "; ".join(f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in refused)
        raise ConfigError(f"the config changed since {checkpoint} was saved, in what it trains ({what}): a resume "
                          "would continue those weights, optimizer and schedule under other settings. Put the "
                          "checkpoint's value(s) back to resume it, or start a new run with a new output_dir (and "
                          "without resume_from_checkpoint)")
    return [f"note: {k} changed since {checkpoint} was saved: {_show(old)} -> {_show(new)} (allowed on a resume)"
            for k, kind, old, new in found if kind == MAY_CHANGE]
