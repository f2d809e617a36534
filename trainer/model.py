"""Load the model for training: attention backend, dtype, LoRA, gradient checkpointing.

Full fine-tuning keeps fp32 master weights and trains under autocast (accelerate's mixed precision).
LoRA loads the frozen base in the training precision and keeps the adapter weights in fp32.
"""

from __future__ import annotations

import torch

from trainer.config import Config
from trainer.errors import ConfigError
from trainer.hardware import Runtime

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_model(cfg: Config, runtime: Runtime, tokenizer, source: str | None = None):
    from transformers import AutoModelForCausalLM

    source = source or cfg.base_model
    dtype = DTYPES[runtime.precision] if cfg.adapter else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=runtime.attention, trust_remote_code=cfg.trust_remote_code)
    except OSError as err:
        raise ConfigError(f"cannot load the model from {source}: {str(err).splitlines()[0]}") from None
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    model.config.use_cache = False  # no KV cache in training; the collator's mask keeps packed rows apart
    if cfg.gradient_checkpointing:
        no_reentrant = {"use_reentrant": False}  # reentrant checkpointing breaks with DDP and frozen weights
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=no_reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=no_reentrant)
    if cfg.adapter == "lora":
        model = add_lora(cfg, model)
    return model


def add_lora(cfg: Config, model):
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    if cfg.lora_target_linear or targets is None:
        targets = "all-linear"
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, modules_to_save=cfg.lora_modules_to_save, task_type="CAUSAL_LM")
    try:
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    except ValueError as err:
        raise ConfigError(f"lora_target_modules: {str(err).splitlines()[0]}") from None
    for p in model.parameters():  # adapter weights train in fp32 whatever the base dtype
        if p.requires_grad:
            p.data = p.data.float()
    return model


def load_trained(cfg: Config, runtime: Runtime, tokenizer, model_dir=None):
    """For `evaluate`: the trained model or adapter in model_dir, else the base model."""
    from pathlib import Path

    if model_dir is None:
        return load_model(cfg, runtime, tokenizer)
    if (Path(model_dir) / "adapter_config.json").exists():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=DTYPES[runtime.precision],
                                                    attn_implementation=runtime.attention,
                                                    trust_remote_code=cfg.trust_remote_code)
        if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
            base.resize_token_embeddings(len(tokenizer))
        return PeftModel.from_pretrained(base, str(model_dir))
    return load_model(cfg, runtime, tokenizer, source=str(model_dir)).to(DTYPES[runtime.precision])
