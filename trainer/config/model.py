"""The model and tokenizer keys, the adapter (LoRA, QLoRA, LoftQ) and quantized loading, with their rules.

What they become is trainer/model/ (load.py, quantization.py, quantization_config.py, config_class.py, loftq.py,
bitnet.py) and the tokenizer's trainer/data/prepare.py and trainer/data/formats/mistral_tokenizer.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer.errors import ConfigError


class LoftQOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loftq_bits: Literal[4] = 4  # Axolotl's LoftQConfig: 4-bit NF4 (peft's LoftQ also knows 8; Axolotl's examples use 4)


class PeftOptions(BaseModel):  # Axolotl's `peft:` block
    model_config = ConfigDict(extra="forbid")
    loftq_config: LoftQOptions | None = None


class ModelKeys(BaseModel):
    # model and tokenizer
    base_model: str
    # the model's config (and, without tokenizer_config, the tokenizer) read from here instead of base_model, as
    # Axolotl's load_model_config / load_tokenizer; the same value as base_model is dropped on reading
    base_model_config: str | None = None
    tokenizer_config: str | None = None
    trust_remote_code: bool = False
    # Axolotl's `model_config:` (overrides of the model's config); renamed on reading, pydantic owns the name
    model_config_overrides: dict[str, Any] | None = None
    # extra from_pretrained arguments (Axolotl's model_kwargs, field overrides_of_model_kwargs): the model loader's
    # own (dtype, attention, quantization, revision, ...) win over them, as Axolotl's ModelLoader sets its own after
    model_kwargs: dict[str, Any] | None = None
    revision_of_model: str | None = None  # the model repository's branch, tag or commit
    special_tokens: dict[str, str | list[str]] | None = None  # bos_token, ..., additional_special_tokens: [...]
    tokens: list[str] | None = None  # extra tokens added to the vocabulary
    resize_token_embeddings_to_32x: bool = False
    shrink_embeddings: bool = False  # also shrink the embeddings to the tokenizer's length (Axolotl's)
    # new embedding rows at the mean of the others (transformers' resize_token_embeddings(mean_resizing=); unset: its
    # default, true)
    mean_resizing_embeddings: bool | None = None
    # the embedding (and lm_head) rows of tokens the base never trained, set to the trained rows' mean before
    # training (trainer/model/untrained_tokens.py); a list adds those token ids to the ones found, as Axolotl
    fix_untrained_tokens: bool | int | list[int] | None = None
    # added tokens renamed {token id: new text} before any data is tokenized (trainer/data/prepare.py), as Axolotl's
    # modify_tokenizer_files: the id keeps its embedding row, the text now reads as that token
    added_tokens_overrides: dict[int, str] | None = None
    cls_model_config: str | None = None  # transformers config class to read the model's config with
    reinit_weights: bool = False  # train from the model's config with freshly initialised weights
    # Mistral's own tokenizer (trainer/data/formats/mistral_tokenizer.py); chat_template data encoded by it.
    # Unset: true for Magistral models, as in Axolotl
    tokenizer_use_mistral_common: bool | None = None
    # offload / offload_disk: Axolotl's deprecated spellings of true with activation_offloading (trainer/config/speed.py)
    gradient_checkpointing: bool | Literal["offload", "offload_disk"] = False
    gradient_checkpointing_kwargs: dict[str, Any] | None = None

    # adapter
    adapter: Literal["lora", "qlora"] | None = None
    lora_model_dir: str | None = None  # start from this trained adapter instead of a fresh one
    load_in_4bit: bool = False  # bitsandbytes NF4/FP4 base weights (QLoRA)
    load_in_8bit: bool = False  # bitsandbytes LLM.int8() base weights
    bnb_config_kwargs: dict[str, Any] | None = None  # extra BitsAndBytesConfig arguments, as in Axolotl
    # MoE experts (fused 3-D tensors, which bitsandbytes leaves unquantized) quantized as they load, in the format of
    # load_in_4bit / load_in_8bit (trainer/model/experts.py)
    quantize_moe_experts: bool = False
    # transformers' experts forward for MoE models (its ExpertsInterface): eager, batched_mm or grouped_mm run
    # everywhere; sonicmoe where the GPU takes it, scattermoe and deepgemm as grouped_mm with a note
    # (trainer/model/expert_kernels.py)
    experts_implementation: str | None = None
    lora_r: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | str | None = None
    lora_target_linear: bool = False
    peft_use_rslora: bool = False  # rank-stabilized LoRA scaling (alpha / sqrt(r)), peft's use_rslora
    peft_use_dora: bool = False  # weight-decomposed LoRA, peft's use_dora
    lora_target_parameters: list[str] | None = None  # LoRA on bare parameters (MoE experts), peft's target_parameters
    lora_modules_to_save: list[str] | None = None
    # peft's LoraConfig fields, passed as Axolotl passes them (loaders/adapter.py _build_lora_config_kwargs):
    lora_rank_pattern: dict[str, Annotated[int, Field(ge=1)]] | None = None  # rank_pattern: a rank per module regex
    lora_alpha_pattern: dict[str, Annotated[int, Field(ge=1)]] | None = None  # alpha_pattern
    peft_layers_to_transform: list[int] | None = None  # layers_to_transform: only these layer indices
    peft_layers_pattern: list[str] | None = None  # layers_pattern: the name of the layers' ModuleList
    peft_layer_replication: list[tuple[int, int]] | None = None  # layer_replication: a deeper model from ranges
    # init_lora_weights: true (peft's default), false, or a method name (gaussian, pissa, pissa_niter_N, olora, ...)
    peft_init_lora_weights: bool | str | None = None
    peft_trainable_token_indices: list[int] | dict[str, list[int]] | None = None  # trainable_token_indices
    peft_ensure_weight_tying: bool | None = None  # ensure_weight_tying (tied embeddings' adapters kept tied)
    # get_peft_model(autocast_adapter_dtype=...): true (peft's default) trains the adapter in fp32, false in the
    # base weights' dtype
    peft_autocast_adapter_dtype: bool | None = None
    unfrozen_parameters: list[str] | None = None  # full fine-tune: train only parameters matching these regexes
    peft: PeftOptions | None = None  # peft.loftq_config.loftq_bits: LoftQ initialisation of LoRA (trainer.model.loftq)

    # a transformers quantization config by class name, built with these kwargs (trainer/model/quantization_config.py);
    # only Mxfp4Config with dequantize: true (gpt-oss's MXFP4 experts loaded as bf16 weights to train)
    model_quantization_config: str | None = None
    model_quantization_config_kwargs: dict[str, Any] | None = None
    # --- BitNet training (trainer/model/bitnet.py) -----------------------------------------------------------------
    use_onebitllms: bool = False  # Falcon-E: every linear layer but lm_head becomes onebitllms' BitNetLinear

    def _check_model(self) -> None:
        if self.added_tokens_overrides and self.tokenizer_use_mistral_common:
            raise ValueError("added_tokens_overrides: not with tokenizer_use_mistral_common (Mistral's tokenizer file "
                             "has no added tokens to rename; Axolotl refuses it too)")
        if self.peft_init_lora_weights not in (None, True, "loftq") and self.peft and self.peft.loftq_config:
            raise ValueError(f"peft_init_lora_weights: {self.peft_init_lora_weights!r} conflicts with "
                             "peft.loftq_config (LoftQ is an initialisation of its own); set one of them")
        if self.reinit_weights and (self.adapter or self.load_in_4bit or self.load_in_8bit):
            raise ValueError("reinit_weights: not with an adapter or quantized loading (random base weights are "
                             "not saved, so an adapter over them could not be reloaded)")
        if self.peft and self.peft.loftq_config and (self.adapter != "lora" or self.load_in_8bit or self.lora_model_dir):
            raise ValueError("peft.loftq_config needs adapter: lora on an unquantized base and a fresh adapter (LoftQ "
                             "initialises LoRA against its own 4-bit quantization of the weights)")
        check_quantization_config(self.model_quantization_config, self.model_quantization_config_kwargs)
        if self.model_quantization_config and (self.load_in_4bit or self.load_in_8bit):
            raise ValueError("model_quantization_config and load_in_4bit/load_in_8bit are two quantizations; choose one")

    def _check_experts_implementation(self) -> None:
        if self.experts_implementation is not None and self.experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(f"experts_implementation: {self.experts_implementation!r} is not one of "
                             f"{', '.join(EXPERTS_IMPLEMENTATIONS)}")
        # Axolotl's kernels plugin's rules (src/axolotl/integrations/kernels/args.py at 067b021: check_mutually_exclusive,
        # _canonicalize_expert_backend); the keys are declared by the expert_kernels feature (trainer/config/features.py)
        if self.use_scattermoe and self.use_sonicmoe:
            raise ValueError("use_scattermoe and use_sonicmoe are both true: ScatterMoE and SonicMoE cannot run "
                             "together; set only one")
        for flag in ("use_scattermoe", "use_sonicmoe"):
            if getattr(self, flag) and self.expert_backend and self.expert_backend != flag.removeprefix("use_"):
                raise ValueError(f"expert_backend: {self.expert_backend} conflicts with {flag}: true; set only one")

    def _check_adapter(self) -> None:
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both true; choose one")
        if self.adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("adapter: qlora needs load_in_4bit: true (QLoRA trains LoRA on 4-bit base weights)")
        if (self.load_in_4bit or self.load_in_8bit) and not self.adapter:
            raise ValueError("load_in_4bit/load_in_8bit need an adapter (lora or qlora): quantized weights cannot "
                             "be trained directly")
        if self.quantize_moe_experts and not (self.adapter and (self.load_in_4bit or self.load_in_8bit)):
            raise ValueError("quantize_moe_experts needs adapter: lora or qlora with load_in_4bit or load_in_8bit "
                             "(the experts take the quantization the linear layers load with)")
        if self.lora_target_parameters and self.lora_dropout:
            raise ValueError(f"lora_dropout: {self.lora_dropout} with lora_target_parameters: dropout cannot apply to "
                             "a LoRA on a bare parameter (peft's ParamWrapper); set lora_dropout: 0")
        if self.quantize_moe_experts and self.lora_target_linear:
            raise ValueError("lora_target_linear with quantize_moe_experts: the experts are not linear layers; name "
                             "them in lora_target_parameters instead (as Axolotl requires)")
        if self.quantize_moe_experts and self.deepspeed:
            raise ValueError("quantize_moe_experts with deepspeed is not supported: DeepSpeed partitions the experts' "
                             "quantized storage apart from its quantization state (Axolotl has not tested it either); "
                             "use FSDP (fsdp_version: 2), one process, or drop quantize_moe_experts")
        if self.lora_model_dir and not self.adapter:
            raise ValueError("lora_model_dir needs adapter: lora or qlora")
        for pattern in self.unfrozen_parameters or []:
            if re.search(r"\$\[\d*:\d*\]$", pattern):
                raise ValueError(f"unfrozen_parameters: range patterns ({pattern}) are not supported; "
                                 "freeze or train whole parameters")


# experts_implementation values: transformers' own (integrations/moe.py ExpertsInterface, 5.23: eager plus batched_mm,
# grouped_mm, deepgemm, sonicmoe) and Axolotl's kernels plugin's scattermoe (integrations/kernels/README.md at 067b021)
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "scattermoe", "sonicmoe", "deepgemm")
RUN_HERE = ("eager", "batched_mm", "grouped_mm")  # plain torch: every device


def notes(cfg) -> list[str]:
    """Keys accepted that do less than they say here."""
    out = []
    if cfg.gradient_checkpointing in ("offload", "offload_disk"):
        became = "true" if cfg.gradient_checkpointing == "offload" else "disk"
        out.append(f"gradient_checkpointing: {cfg.gradient_checkpointing} is Axolotl's deprecated spelling of "
                   f"gradient_checkpointing: true with activation_offloading: {became} (read so)")
    if cfg.adapter and cfg.unfrozen_parameters:
        out.append("unfrozen_parameters: ignored with an adapter (the adapter's weights are what is trained; "
                   "quantized base weights cannot be)")
    if cfg.liger_use_token_scaling and not cfg.token_scaling:
        out.append("liger_use_token_scaling: not read: Axolotl reads the liger_* keys only with its Liger plugin "
                   "listed in plugins: (axolotl.integrations.liger.LigerPlugin); so here")
    if cfg.use_pose and not cfg.pose:
        out.append("use_pose: not read: Axolotl adds PoSE's position ids only while it prepares packed SFT data "
                   "(sample_packing: true, not streamed, not skip_prepare_dataset, no rl); so here")
    if cfg.hub_revision and not cfg.hub_model_id:
        out.append(f"hub_revision: {cfg.hub_revision} not read: nothing is pushed without hub_model_id (as in Axolotl)")
    fix = cfg.fix_untrained_tokens
    if isinstance(fix, int) and not isinstance(fix, bool) and fix != 1:
        out.append(f"fix_untrained_tokens: {fix} is read as true: the untrained tokens found are fixed, and token "
                   f"{fix} only if it is one of them (Axolotl passes ids on only as a list: write [{fix}] for that)")
    if fix and cfg.rl:
        out.append("fix_untrained_tokens: not read with rl (Axolotl's fix reads the rows' input_ids, which "
                   "preference rows do not have)")
    return out


# --- LoRA on a classification head (reward models; trainer/model/reward_model.py loads the head) -------------
def lora_task_type(cfg) -> str:
    return {"reward": "SEQ_CLS", "prm": "TOKEN_CLS"}.get(cfg.objective, "CAUSAL_LM")


HEAD_NAMES = ("score", "classifier")  # the heads transformers' classification models add (peft's names too)


def lora_exclusions(cfg) -> list[str] | None:
    """A classification head is trained whole (peft's modules_to_save), so LoRA must not wrap it too: peft
    leaves it out of all-linear for SEQ_CLS only, and refuses a head that is both (TOKEN_CLS)."""
    return list(HEAD_NAMES) if cfg.objective in ("reward", "prm") else None


# --- model_quantization_config ---------------------------------------------------------------------------------
# Only the case Axolotl's gpt-oss examples use is supported: `Mxfp4Config` with `dequantize: true`. gpt-oss
# checkpoints store their MoE experts in MXFP4 (4-bit values in blocks of 32 sharing an 8-bit exponent);
# transformers' Mxfp4HfQuantizer cannot train them (its `is_trainable` is False), so `dequantize: true` has it
# expand them to ordinary weights while loading, and training is then ordinary training. Any other class name, or
# MXFP4 kept quantized, is refused in one line.
SUPPORTED_QUANTIZATION_CONFIG = "Mxfp4Config"


def check_quantization_config(name: str | None, kwargs: dict[str, Any] | None) -> None:
    """Raise ValueError (one line) for anything but Mxfp4Config(dequantize=True, ...its other arguments)."""
    if name is None:
        if kwargs:
            raise ValueError("model_quantization_config_kwargs needs model_quantization_config")
        return
    if name != SUPPORTED_QUANTIZATION_CONFIG:
        raise ValueError(f"model_quantization_config: {name!r} is not supported; only {SUPPORTED_QUANTIZATION_CONFIG} "
                         "with dequantize: true (gpt-oss's MXFP4 experts loaded as trainable weights)")
    kwargs = kwargs or {}
    if kwargs.get("dequantize") is not True:
        raise ValueError("model_quantization_config: Mxfp4Config needs model_quantization_config_kwargs.dequantize: "
                         "true; transformers cannot train MXFP4 weights (Mxfp4HfQuantizer.is_trainable is False)")
    if importlib.util.find_spec("transformers") is None:  # judged where the resolver runs, without transformers:
        return  # the arguments are checked again when the trainer builds the config to load the model

    # heavy: transformers loads only when this runs
    from transformers import Mxfp4Config

    accepted = set(inspect.signature(Mxfp4Config.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"model_quantization_config_kwargs: {', '.join(unknown)} is not an argument of "
                         f"transformers' Mxfp4Config ({', '.join(sorted(accepted))})")


# --- cls_model_config ------------------------------------------------------------------------------------------
def config_class(name: str):
    """Axolotl's cls_model_config: the transformers config class of that name, or a ConfigError."""
    # heavy: transformers loads only when this runs
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        cls = None
    if not isinstance(cls, type) or not issubclass(cls, transformers.PretrainedConfig):
        raise ConfigError(f"cls_model_config: {name!r} is not a transformers config class (e.g. LlamaConfig, "
                          "Gemma3TextConfig)")
    return cls


def check_config_class(cfg) -> None:
    """A transformers class by name: judged where transformers is installed (the trainer's own start checks it
    again before loading; the resolver may read the config in an environment without it)."""
    if cfg.cls_model_config and importlib.util.find_spec("transformers") is not None:
        config_class(cfg.cls_model_config)


# --- tokenizer_use_mistral_common ------------------------------------------------------------------------------
def check_mistral_tokenizer(cfg) -> list[str]:
    """What a config with tokenizer_use_mistral_common may not ask for (as Axolotl's validation refuses, plus what
    this trainer cannot do with it). Raises ConfigError listing every problem; returns notes."""
    notes = []
    named = " ".join(str(getattr(cfg, key) or "") for key in ("base_model", "tokenizer_config")).lower()
    if cfg.tokenizer_use_mistral_common is None and "magistral" in named:
        cfg.tokenizer_use_mistral_common = True
        notes.append("tokenizer_use_mistral_common: unset, read as true for a Magistral model (as Axolotl infers it; "
                     "set it to false for the model's Hugging Face tokenizer)")
    if not cfg.tokenizer_use_mistral_common:
        return notes
    why = "mistral-common tokenizers cannot add tokens"
    problems = [f"{key} cannot be used with tokenizer_use_mistral_common ({why})"
                for key in ("special_tokens", "tokens") if getattr(cfg, key)]
    fixed_format = "the conversation format is the tokenizer's own"
    for key in ("chat_template", "chat_template_jinja"):
        if key in cfg.model_fields_set:
            problems.append(f"{key} cannot be set with tokenizer_use_mistral_common ({fixed_format})")
    if cfg.rl:
        problems.append("rl: preference training with tokenizer_use_mistral_common is not supported "
                        "(only chat_template SFT datasets)")
    for i, ds in enumerate(cfg.datasets):
        if ds.type != "chat_template" and not cfg.rl:
            problems.append(f"datasets.{i}.type: {ds.type} with tokenizer_use_mistral_common is not supported; "
                            "use chat_template (mistral-common encodes conversations, not text)")
        for key in ("chat_template", "chat_template_jinja"):
            if getattr(ds, key):
                problems.append(f"datasets.{i}.{key} cannot be set with tokenizer_use_mistral_common ({fixed_format})")
        for key in ("message_field_training", "message_field_training_detail", "split_thinking"):
            if getattr(ds, key):
                problems.append(f"datasets.{i}.{key} with tokenizer_use_mistral_common is not supported (its "
                                "conversations train the turns of roles_to_train)")
    if problems:
        raise ConfigError("; ".join(problems))
    if cfg.eot_tokens:
        notes.append("eot_tokens: ignored with tokenizer_use_mistral_common (an assistant turn ends with the "
                     "tokenizer's </s>, which train_on_eos governs, as in Axolotl's Mistral strategy)")
    return notes
