"""Load the model for training: attention backend, dtype, quantization, LoRA, gradient checkpointing.

Full fine-tuning under bf16 holds the weights in bf16, as Axolotl does (trainer/runtime/hardware.py `full_weights`);
with `fp32_master_weights: true`, and under fp16, it keeps fp32 master weights and trains under autocast.
LoRA loads the frozen base in the training precision and keeps the adapter weights in fp32.
QLoRA / 8-bit LoRA load the base through bitsandbytes (trainer.model.quantization), then peft's
prepare_model_for_kbit_training (norms in fp32, input gradients for checkpointing) before the adapter.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from trainer.config import Config
from trainer.config.model import RUN_HERE, lora_exclusions, lora_task_type
from trainer.errors import ConfigError, TrainingError
from trainer.model import attention_varlen, expert_lora, experts
from trainer.model.attention import packed_masks
from trainer.runtime.hardware import Runtime
from trainer.runtime.hardware import full_weights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_model(cfg: Config, runtime: Runtime, tokenizer, source: str | None = None,
               parallel_kwargs: dict | None = None):
    # start-up: trainer.model.quantization, trainer.model.reward_model imported only when this runs
    from trainer.model.quantization import bnb_config
    from trainer.model.reward_model import auto_class, disable_dropout, head_init
    from trainer.model.reward_model import load_kwargs as head_kwargs

    source = source or cfg.base_model
    attention_varlen.install(runtime)  # torch's varlen_attn as a transformers backend; cuDNN off masked SDPA calls

    dtype = DTYPES[runtime.precision] if cfg.adapter else DTYPES[full_weights(cfg, runtime.precision)]
    quantization = bnb_config(cfg, DTYPES[runtime.precision], sharded=bool(cfg.deepspeed or cfg.fsdp or cfg.fsdp_config))
    # model_kwargs (not read by a from_config build, as Axolotl's), then model_config: overrides of the model's config
    heads = head_kwargs(cfg, tokenizer)
    extra = {**{k: v for k, v in user_kwargs(cfg).items() if k not in heads and not cfg.reinit_weights},
             **(cfg.model_config_overrides or {})}
    if quantization is not None:
        extra["quantization_config"] = quantization
    elif cfg.model_quantization_config:  # Mxfp4Config(dequantize=True): gpt-oss's MXFP4 experts as weights
        from trainer.model.quantization_config import build

        extra["quantization_config"] = build(cfg.model_quantization_config, cfg.model_quantization_config_kwargs)
    if cfg.revision_of_model:
        extra["revision"] = cfg.revision_of_model
    extra.update(parallel_kwargs or {})  # tensor parallelism: transformers' DistributedConfig (trainer/parallel/mesh.py)
    other_config = cfg.base_model_config if source == cfg.base_model else None  # Axolotl's base_model_config
    if cfg.cls_model_config or other_config:  # read the config with that class / from there (trainer/model/config_class.py)
        from trainer.model import config_class

        overrides = dict(cfg.model_config_overrides or {})
        extra = {k: v for k, v in extra.items() if k not in overrides}
        extra["config"] = config_class.load(cfg, other_config or source, overrides,
                                            None if other_config else cfg.revision_of_model)
    how = experts.scheme(quantization) if cfg.quantize_moe_experts and quantization is not None else None
    ep = getattr((parallel_kwargs or {}).get("distributed_config"), "ep_size", 1) or 1
    if ep > 1:  # before the load: a dense model, or one transformers has no expert plan for, stops in one line
        experts.check_expert_parallel(source, ep, cfg.trust_remote_code, extra)
    try:
        if cfg.reinit_weights:  # Axolotl's from_config: the architecture only, weights drawn from the seed
            model = fresh_model(cfg, source, dtype, runtime.attention, extra)
        else:  # quantize_moe_experts: each 3-D expert tensor quantized as it loads (trainer/model/experts.py)
            with head_init(cfg), experts.quantized_on_load(how):  # the head follows the objective (reward_model)
                model = auto_class(cfg).from_pretrained(
                    source, dtype=dtype, attn_implementation=runtime.attention,
                    trust_remote_code=cfg.trust_remote_code, **heads, **extra)
        if how:
            experts.quantize_remaining(model, how)
    except OSError as err:
        raise ConfigError(f"cannot load the model from {source}: {str(err).splitlines()[0]}") from None
    except ValueError as err:  # e.g. a model with no tp_plan asked for tensor_parallel_size
        if not parallel_kwargs:
            raise
        ep = getattr(parallel_kwargs.get("distributed_config"), "ep_size", 1) or 1
        key = f"expert_parallel_size: {ep}" if ep > 1 else "tensor_parallel_size"
        raise ConfigError(f"{key}: cannot shard {source}: {str(err).splitlines()[0]}") from None
    resize_embeddings(cfg, model, tokenizer)
    if cfg.experts_implementation in RUN_HERE:  # transformers' experts forward (the default: grouped_mm)
        model.set_experts_implementation(cfg.experts_implementation)
    if cfg.use_onebitllms:  # Falcon-E's BitNet layers, swapped in right after loading (as Axolotl)
        from trainer.model import bitnet

        bitnet.apply(model)
    model.config.use_cache = False  # no KV cache in training; the collator's mask keeps packed rows apart
    packed_masks(model)  # hybrid sliding/full models: per-layer masks from position_ids (trainer/model/attention.py)
    model = checkpointed(cfg, model, quantized=quantization is not None)
    if cfg.adapter:
        model = add_lora(cfg, model)
    elif cfg.unfrozen_parameters:
        freeze_except(model, cfg.unfrozen_parameters)
    if cfg.freeze_mm_modules:  # the vision/audio towers and projectors (trainer/model/vision.py), as Axolotl
        from trainer.model.vision import freeze

        freeze(model)
    disable_dropout(cfg, model)  # reward models: as TRL's disable_dropout (default true)
    return model


def checkpointed(cfg: Config, model, quantized: bool):
    """The memory options before LoRA wraps the layers: ALST's tiled MLP, then gradient checkpointing (with selective
    checkpointing's context_fn, torch's checkpoint's own argument), or peft's k-bit preparation of a quantized model
    (which turns checkpointing on itself)."""
    # heavy: peft loads only when this runs
    from trainer.model import memory_options

    memory_options.tile_mlps(cfg, model)  # ALST's tiled MLP (before LoRA wraps the MLP's linear layers)
    # selective checkpointing's context_fn (torch's checkpoint's own argument), handed to transformers with the rest
    checkpointing = {"use_reentrant": reentrant(cfg), **memory_options.checkpoint_kwargs(cfg, model)}
    if quantized:
        from peft import prepare_model_for_kbit_training

        from trainer.model.quantization import keep_trainable_layout

        keep_trainable_layout(model)  # evaluation mid-training must not break the 4-bit layers' backward

        with experts.kept_from_upcast(model):  # frozen MoE experts keep their dtype, never fp32 (experts.py)
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(cfg.gradient_checkpointing),
                                                    gradient_checkpointing_kwargs=checkpointing)
    elif cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        if checkpointing["use_reentrant"] and cfg.adapter:
            model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    return model


def fresh_model(cfg: Config, source: str, dtype, attention: str, extra: dict):
    """reinit_weights: the model built from its config (with model_config overrides) and initialised from
    the seed, as Axolotl's AutoModelForCausalLM.from_config; the pretrained weights are never read."""
    # heavy: transformers loads only when this runs
    from transformers import AutoConfig, AutoModelForCausalLM

    revision = {"revision": extra.pop("revision")} if "revision" in extra else {}
    config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **revision, **extra)
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention,
                                            trust_remote_code=cfg.trust_remote_code)


def freeze_except(model, patterns: list[str]) -> None:
    """Axolotl's unfrozen_parameters: train only the parameters whose names match one of the regexes."""
    compiled = [re.compile(p) for p in patterns]
    trained = 0
    for name, param in model.named_parameters():
        param.requires_grad = any(p.search(name) for p in compiled)
        trained += param.requires_grad
    if not trained:
        raise ConfigError(f"unfrozen_parameters: no parameter name matches {patterns}; names look like "
                          f"{next(iter(dict(model.named_parameters())))}")


def reentrant(cfg: Config) -> bool:
    """gradient_checkpointing_kwargs.use_reentrant, honoured as given (default False: non-reentrant works
    with DDP and frozen weights without extra hooks)."""
    return bool((cfg.gradient_checkpointing_kwargs or {}).get("use_reentrant", False))


def resize_embeddings(cfg: Config, model, tokenizer) -> None:
    """Axolotl's _resize_token_embeddings (loaders/model.py): the embeddings grow to the tokenizer's length (rounded up
    to a multiple of 32 with resize_token_embeddings_to_32x), or shrink to it with shrink_embeddings, through
    transformers' resize_token_embeddings (mean_resizing: mean_resizing_embeddings where given, not for llava)."""
    rows = model.get_input_embeddings().weight.shape[0]
    target = -(-len(tokenizer) // 32) * 32 if cfg.resize_token_embeddings_to_32x else len(tokenizer)
    if rows < target or (rows > target and cfg.shrink_embeddings):
        mean = cfg.mean_resizing_embeddings
        kwargs = {} if mean is None or model.config.model_type == "llava" else {"mean_resizing": mean}
        model.resize_token_embeddings(target, **kwargs)


def add_lora(cfg: Config, model):
    # heavy: peft loads only when this runs
    from peft import LoraConfig, PeftModel, get_peft_model

    if cfg.lora_model_dir:  # continue from a trained adapter (its own r, alpha and targets)
        try:
            with expert_lora.for_peft(model):  # quantized experts as peft sees them unquantized (expert_lora.py)
                model = PeftModel.from_pretrained(model, cfg.lora_model_dir, is_trainable=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"lora_model_dir: cannot load an adapter from {cfg.lora_model_dir}: "
                              f"{str(err).splitlines()[0]}") from None
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        return model
    targets = cfg.lora_target_modules
    if cfg.lora_target_linear or targets is None:
        targets = "all-linear"
    if cfg.lora_target_parameters and cfg.lora_target_modules is None and not cfg.lora_target_linear:
        targets = []  # only the named parameters
    from trainer.model import loftq

    on_cuda = torch.cuda.is_available()  # peft's LoftQ computes on CUDA whatever device the weights are on
    autocast = cfg.peft_autocast_adapter_dtype is not False
    try:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=targets, target_parameters=cfg.lora_target_parameters,
                          use_rslora=cfg.peft_use_rslora, use_dora=cfg.peft_use_dora,
                          modules_to_save=cfg.lora_modules_to_save, task_type=lora_task_type(cfg),
                          exclude_modules=lora_exclusions(cfg),
                          **{**loftq.lora_kwargs(cfg, on_cuda), **lora_options(cfg)})
        with expert_lora.for_peft(model):  # LoRA on quantized experts (lora_target_parameters; expert_lora.py)
            model = get_peft_model(model, lora, autocast_adapter_dtype=autocast)
    except ValueError as err:  # peft's own words, under the key they are about
        first = str(err).splitlines()[0]
        key = next((k for word, k in (("initialization", "peft_init_lora_weights"), ("layers_", "peft_layers_pattern"),
                                      ("replication", "peft_layer_replication"), ("token", "peft_trainable_token_indices"))
                    if word in first.lower()), "lora_target_modules")
        raise ConfigError(f"{key}: {first}") from None
    if loftq.loftq_bits(cfg) and not on_cuda:
        loftq.apply_on_cpu(cfg, model)
    for p in model.parameters() if autocast else ():  # adapter weights train in fp32 whatever the base dtype
        if p.requires_grad:
            p.data = p.data.float()
    return model


# from_pretrained arguments this loader passes itself (model_kwargs' value for one of them is replaced, as Axolotl's
# ModelLoader replaces it with its own)
OWN_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code", "quantization_config", "revision",
              "config", "device_map")


def user_kwargs(cfg: Config) -> dict:
    """model_kwargs (Axolotl's overrides_of_model_kwargs) without the arguments the loader sets itself."""
    return {k: v for k, v in (cfg.model_kwargs or {}).items() if k not in OWN_KWARGS}


def lora_options(cfg: Config) -> dict:
    """peft LoraConfig arguments from Axolotl's lora_*/peft_* keys, as its _build_lora_config_kwargs and
    _build_peft_lora_config pass them (only the keys given: peft's defaults otherwise)."""
    given = {"rank_pattern": cfg.lora_rank_pattern, "alpha_pattern": cfg.lora_alpha_pattern,
             "layers_to_transform": cfg.peft_layers_to_transform, "layers_pattern": cfg.peft_layers_pattern,
             "layer_replication": cfg.peft_layer_replication,
             # true is peft's default: not passed, so it never replaces LoftQ's own initialisation
             "init_lora_weights": None if cfg.peft_init_lora_weights is True else cfg.peft_init_lora_weights,
             "trainable_token_indices": cfg.peft_trainable_token_indices,
             "ensure_weight_tying": cfg.peft_ensure_weight_tying}
    return {k: v for k, v in given.items() if v is not None and v != {} and v != []}


def load_trained(cfg: Config, runtime: Runtime, tokenizer, model_dir=None):
    """For `evaluate`: the trained model or adapter in model_dir, else the base model."""
    if model_dir is None:
        return load_model(cfg, runtime, tokenizer)
    # heavy: peft loads only when this runs
    from trainer.model import loftq

    if (Path(model_dir) / "adapter_config.json").exists() and loftq.loftq_bits(cfg):
        # the LoftQ base is rebuilt, then the trained adapter loaded
        model = load_model(cfg, runtime, tokenizer)
        load_weights(model, Path(model_dir))
        return model
    if (Path(model_dir) / "adapter_config.json").exists():
        from peft import PeftModel

        attention_varlen.install(runtime)

        from trainer.model.quantization import bnb_config
        from trainer.model.reward_model import auto_class, load_kwargs

        quantization = bnb_config(cfg, DTYPES[runtime.precision])  # evaluate on the base the adapter trained on
        extra = {"quantization_config": quantization} if quantization is not None else {}
        if cfg.cls_model_config:  # the architecture the adapter trained on (trainer/model/config_class.py)
            from trainer.model import config_class

            extra["config"] = config_class.load(cfg, cfg.base_model, dict(cfg.model_config_overrides or {}),
                                                cfg.revision_of_model)
        how = experts.scheme(quantization) if cfg.quantize_moe_experts and quantization is not None else None
        with experts.quantized_on_load(how):  # the experts as they trained (trainer/model/experts.py)
            base = auto_class(cfg).from_pretrained(cfg.base_model, dtype=DTYPES[runtime.precision],
                                                   attn_implementation=runtime.attention,
                                                   trust_remote_code=cfg.trust_remote_code,
                                                   **{**user_kwargs(cfg), **load_kwargs(cfg, tokenizer), **extra})
        resize_embeddings(cfg, base, tokenizer)
        packed_masks(base)
        with expert_lora.for_peft(base):
            return PeftModel.from_pretrained(base, str(model_dir))
    return load_model(cfg, runtime, tokenizer, source=str(model_dir)).to(DTYPES[runtime.precision])


def load_weights(model, path: Path) -> None:
    """The model's (or adapter's) weights from a checkpoint directory, nothing else (trainer/outputs/checkpoint.py
    writes them; a LoftQ base rebuilt here takes its trained adapter this way)."""
    # heavy: safetensors and peft load only when this runs
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TrainingError(f"checkpoint {path} has no *.safetensors weights")
    weights = {k: v for f in files for k, v in load_file(str(f)).items()}
    try:
        if hasattr(model, "peft_config"):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, weights)
            return
        # MoE experts saved unfused (the checkpoint's original layout), fused as from_pretrained fuses them
        missing, unexpected = model.load_state_dict(experts.as_loaded(model, weights), strict=False)
    except RuntimeError as err:  # "size mismatch for ...": a checkpoint without a recorded config to compare first
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err)[:200])
        raise ConfigError(f"checkpoint {path} does not match this config's model or adapter ({first[:300]}): it was "
                          "trained with another base_model or lora_r; resume it with the config it was trained "
                          "with, or start a new run with a new output_dir") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]:
        raise TrainingError(f"checkpoint {path} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
