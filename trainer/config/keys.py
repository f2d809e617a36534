"""Axolotl keys a config may carry that are not this trainer's own fields: inert ones (accepted, with a note),
performance switches (accepted, off here, with a note), unsupported ones (an error unless empty), and the legacy
spellings of the precision. trainer/config/load.py's key check reads these tables; the supported keys are the
fields of the sections (trainer/config/schema.py).
"""

from __future__ import annotations

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
