"""The `trl:` block of `rl: grpo` / `rl: gdpo` (Axolotl's TRLConfig names, TRL 1.16 GRPOConfig's defaults).

Validated without importing torch. What each key does is trainer/objectives/grpo.py; where the user's reward
functions and dataset transforms come from is trainer/objectives/grpo_data.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.config.parallel import deepspeed_path

GENERATING_METHODS = ("grpo", "gdpo")

# trl.* keys of the vLLM path: honoured with use_vllm + vllm_lora_sync (trainer/objectives/grpo_server.py), else unused.
VLLM_KEYS = ("vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_guided_decoding_regex",
             "vllm_enable_sleep_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_cap", "vllm_sync_interval", "vllm_lora_sync")


# TrlConfig's keys only Axolotl's fast asynchronous GRPO trainer reads
ASYNC_ONLY = ("replay_buffer_size", "replay_recompute_logps", "reroll_start_fraction", "reroll_max_groups",
              "skip_zero_advantage_batches")


class TrlConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    beta: float | None = Field(None, ge=0)  # KL coefficient; TRL's default 0.0 (no reference model at all)
    max_completion_length: int | None = Field(None, ge=1)  # TRL's default 512
    use_vllm: bool = False  # with vllm_lora_sync: completions from a vLLM server; without: model.generate (a note)
    reward_funcs: list[str] | None = None  # "module.function", imported from the config's directory or the cwd
    # extra variables for the chat template the prompts are rendered with (TRL's GRPOConfig.chat_template_kwargs:
    # apply_chat_template(prompt, add_generation_prompt=True, **chat_template_kwargs))
    chat_template_kwargs: dict[str, Any] | None = None
    # extra generation settings over the sampling keys (TRL's GRPOConfig.generation_kwargs: its generation_kwargs
    # dict updated with them for model.generate; with the vLLM server, merged into the request body as TRL's
    # VLLMClient.generate does)
    generation_kwargs: dict[str, Any] | None = None
    reward_weights: list[float] | None = None  # default 1.0 each
    num_generations: int | None = Field(None, ge=2)  # completions per prompt (a group); TRL's default 8
    generation_batch_size: int | None = Field(None, ge=1)  # only TRL's default (one generation batch per step)
    log_completions: bool | None = None
    num_completions_to_print: int | None = Field(None, ge=0)
    importance_sampling_level: Literal["token", "sequence"] | None = None  # TRL's default token
    scale_rewards: bool | Literal["group", "batch", "none"] = True  # Axolotl's default true = TRL's "group"
    temperature: float | None = Field(None, gt=0)  # TRL's default 1.0
    top_p: float | None = Field(None, gt=0, le=1)  # 1.0
    top_k: int | None = Field(None, ge=0)  # 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)  # 1.0
    num_iterations: int | None = Field(None, ge=1)  # only 1 (one policy update per generation batch)
    epsilon: float | None = Field(None, gt=0)  # lower clip of the importance ratio, TRL's 0.2
    epsilon_high: float | None = Field(None, gt=0)  # upper clip, default epsilon
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] | None = None  # TRL's default dapo
    use_bias_correction_kl: bool | None = None  # TRL's default true: the KL term times the importance ratio
    mask_truncated_completions: bool = False  # completions cut at max_completion_length get no loss
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] | None = None
    # Axolotl's keys for vLLM and its async GRPO trainer (utils/schemas/trl.py; checked below)
    vllm_mode: Literal["server", "colocate"] | None = None  # only server (TRL's default)
    vllm_server_host: str | None = None  # Axolotl's default 0.0.0.0
    vllm_server_port: int | None = Field(None, ge=1, le=65535)  # 8000
    vllm_server_timeout: int | None = Field(None, ge=0)  # seconds to wait for /health; TRL's default 240
    vllm_guided_decoding_regex: str | None = None  # passed to the server (structured_outputs regex)
    vllm_enable_sleep_mode: bool | None = None  # colocate only
    vllm_importance_sampling_correction: bool | None = None  # Axolotl's async default true
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] | None = None  # token_truncate
    vllm_importance_sampling_cap: float | None = Field(None, gt=0)  # 3.0
    vllm_sync_interval: int | None = Field(None, ge=1)  # adapter synced every N steps; 1
    vllm_lora_sync: bool | None = None  # the LoRA adapter to the server through the filesystem
    # TR-DPO's reference sync (TRL's SyncRefModelCallback: every ref_model_sync_steps optimizer steps the reference
    # becomes alpha x policy + (1 - alpha) x reference); Axolotl passes alpha and steps on only with sync_ref_model
    sync_ref_model: bool | None = None
    ref_model_mixup_alpha: float | None = None  # Axolotl's default 0.9
    ref_model_sync_steps: int | None = None  # Axolotl's default 64
    # DeepSeek-V3.2's off-policy sequence mask (TRL's GRPOTrainer.get_off_policy_mask): a completion with a negative
    # advantage whose mean per-token KL(sampling || policy) is above it gets no policy loss
    off_policy_mask_threshold: float | None = None
    use_data_producer: bool = False  # Axolotl's data-producer trainer; synchronous here (async_prefetch false)
    async_prefetch: bool = False  # the next step's completions generated while this one trains (one step stale)
    prefetch_depth: int | None = None  # only 1 (Axolotl's default: one step ahead)
    # options of Axolotl's fast asynchronous GRPO trainer (FastAsyncGRPOConfig): it passes them on only with
    # async_prefetch / use_data_producer (its builder blocks them otherwise), so without those they are not read
    replay_buffer_size: int | None = None
    replay_recompute_logps: bool | None = None
    reroll_start_fraction: float | None = None
    reroll_max_groups: int | None = None
    skip_zero_advantage_batches: bool | None = None

    @field_validator("reward_funcs")
    @classmethod
    def _names(cls, names):
        for name in names or []:
            module, _, func = name.rpartition(".")
            if not module or not func:
                raise ValueError(f"{name!r} is not 'module.function' (a reward model path is not supported here)")
        return names

    @model_validator(mode="after")
    def _supported(self) -> TrlConfig:
        lora_sync = self.use_vllm and self.vllm_lora_sync
        given = [k for k in ASYNC_ONLY if getattr(self, k) is not None]
        if given and (self.use_data_producer or self.async_prefetch):
            raise ValueError(f"{given[0]}: with async_prefetch / use_data_producer Axolotl's fast asynchronous GRPO "
                             "trainer reads it; not implemented here yet (remove it, or the asynchronous mode)")
        if self.prefetch_depth not in (None, 1):
            raise ValueError(f"prefetch_depth: {self.prefetch_depth}; only 1 (the next step generated while this one "
                             "trains, Axolotl's default): prefetching deeper is not implemented")
        if lora_sync and self.vllm_mode == "colocate":
            raise ValueError("vllm_mode: colocate runs vLLM inside the training process (CUDA and the vllm package); "
                             "not supported: use vllm_mode: server with a running vLLM server")
        if self.num_iterations not in (None, 1):
            raise ValueError("num_iterations: only 1 (one policy update per generation batch) is supported")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} "
                             "reward_funcs")
        return self

    @property
    def mixup_alpha(self) -> float:
        """Axolotl's default 0.9 when not given; TRL's 0.6 when given as null (Axolotl then passes nothing)."""
        if self.ref_model_mixup_alpha is not None:
            return self.ref_model_mixup_alpha
        return 0.6 if "ref_model_mixup_alpha" in self.model_fields_set else 0.9

    @property
    def sync_steps(self) -> int:
        """Axolotl's default 64 when not given; TRL's 512 when given as null."""
        if self.ref_model_sync_steps is not None:
            return self.ref_model_sync_steps
        return 512 if "ref_model_sync_steps" in self.model_fields_set else 64

    # TRL 1.16 GRPOConfig defaults where Axolotl passes nothing
    @property
    def kl_beta(self) -> float:
        return self.beta if self.beta is not None else 0.0

    @property
    def completion_length(self) -> int:
        return self.max_completion_length or 512

    @property
    def generations(self) -> int:
        return self.num_generations or 8

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)

    @property
    def scaling(self) -> str:
        return {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)

    @property
    def eps_low(self) -> float:
        return self.epsilon if self.epsilon is not None else 0.2

    @property
    def eps_high(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.eps_low


def check(cfg) -> list[str]:
    """Config-level rules for rl: grpo / gdpo (raises ValueError; returns notes)."""
    trl = cfg.trl
    if cfg.rl == "ebft":  # structured mode reads trl: as Axolotl's EBFT builder passes it (config/ebft_structured.py)
        return []
    if cfg.rl not in GENERATING_METHODS:
        if trl is not None and trl.model_dump(exclude_defaults=True):
            raise ValueError(f"trl: configures rl: grpo, gdpo or ebft, not rl: {cfg.rl or '(SFT)'}")
        return []
    if trl is None or not trl.reward_funcs:
        raise ValueError(f"rl: {cfg.rl} needs trl.reward_funcs (at least one 'module.function')")
    if (trl.use_data_producer or trl.async_prefetch) and not (trl.use_vllm and trl.vllm_lora_sync):
        raise ValueError("trl: use_data_producer/async_prefetch: Axolotl's asynchronous GRPO generates on a vLLM "
                         "server; here it needs use_vllm: true with vllm_lora_sync: true (and adapter: lora)")
    if cfg.rl == "gdpo" and trl.multi_objective_aggregation == "sum_then_normalize":
        raise ValueError("trl.multi_objective_aggregation: sum_then_normalize is GRPO, but rl: gdpo was selected")
    if trl.generation_batch_size is not None and trl.generation_batch_size != cfg.micro_batch_size * cfg.gradient_accumulation_steps:
        raise ValueError("trl.generation_batch_size: only micro_batch_size x gradient_accumulation_steps (one "
                         "generation batch per optimizer step, TRL's default) is supported")
    notes = generating_rules(cfg, trl)
    for i, ds in enumerate(cfg.datasets):
        if ds.type is not None and (not isinstance(ds.type, str) or "." not in ds.type):
            raise ValueError(f"datasets.{i}.type: {ds.type!r}; with rl: {cfg.rl} use a transform 'module.function' "
                             "(as Axolotl's rwd.gsm8k_transform) or no type (rows with a prompt column)")
    if trl.sync_ref_model and trl.kl_beta == 0.0:
        raise ValueError("trl.sync_ref_model: with trl.beta 0 (TRL's default) there is no reference model to sync "
                         "(TRL's GRPOTrainer raises ValueError); set trl.beta above 0, or remove sync_ref_model")
    if trl.sync_ref_model:
        _check_sync(trl)
    if trl.sync_ref_model and cfg.adapter:
        raise ValueError(f"trl.sync_ref_model: with adapter: {cfg.adapter} the reference is the base with the adapter "
                         "disabled, not a model of its own to sync (TRL's GRPOTrainer raises NotImplementedError with "
                         "a PEFT model); train without an adapter, or remove sync_ref_model")
    sync = [f"trl.{k}" for k in ("ref_model_mixup_alpha", "ref_model_sync_steps") if getattr(trl, k) is not None]
    if sync and not trl.sync_ref_model:
        notes.append(f"{', '.join(sync)}: not read without trl.sync_ref_model (Axolotl passes them on only with it); "
                     "so here")
    given = [f"trl.{k}" for k in ASYNC_ONLY if getattr(trl, k) is not None]
    if given:
        notes.append(f"{', '.join(given)}: not read without async_prefetch / use_data_producer (options of Axolotl's "
                     "fast asynchronous GRPO trainer, which its builder passes on only in that mode); so here")
    return notes


def generating_rules(cfg, trl) -> list[str]:
    """What every generating method (rl: grpo, gdpo, ebft structured) asks of the config: whole groups per process
    and step, no sharded weights, no packing, and where completions come from (model.generate or the vLLM server)."""
    if (cfg.micro_batch_size * cfg.gradient_accumulation_steps) % trl.generations:
        raise ValueError(f"micro_batch_size x gradient_accumulation_steps ({cfg.micro_batch_size} x "
                         f"{cfg.gradient_accumulation_steps}) completions per process and step must be a multiple of "
                         f"trl.num_generations ({trl.generations}): each process generates whole groups")
    if cfg.fsdp or cfg.fsdp_config or cfg.fsdp_version or _zero3(cfg):
        raise ValueError(f"rl: {cfg.rl} with FSDP or DeepSpeed ZeRO-3 is not supported (generation would gather the "
                         "sharded weights for every new token); use DDP or ZeRO-2")
    if cfg.sample_packing:
        raise ValueError(f"sample_packing: not with rl: {cfg.rl} (completions are generated, one per row)")
    notes = []
    if trl.use_vllm and trl.vllm_lora_sync:
        if cfg.adapter not in ("lora", "qlora"):
            raise ValueError("trl.vllm_lora_sync: needs adapter: lora or qlora (it sends the LoRA adapter to the vLLM "
                             "server; this config trains no adapter); without LoRA set vllm_lora_sync: false")
        if trl.vllm_enable_sleep_mode:
            notes.append("trl.vllm_enable_sleep_mode: unused (a colocated vLLM's option; the server owns its memory)")
    elif trl.use_vllm:
        notes.append("trl.use_vllm: off without vllm_lora_sync (TRL's full-weight sync to a vLLM server needs CUDA and "
                     "vLLM's NCCL weight-transfer engine in the trainer: completions are sampled with model.generate, "
                     "with the same sampling settings; with adapter: lora, vllm_lora_sync: true uses the server)")
    elif any(getattr(trl, k) is not None for k in VLLM_KEYS):
        notes.append("trl.vllm_*: ignored, use_vllm is false (completions come from model.generate)")
    return notes


def _check_sync(trl) -> None:
    """sync_ref_model's alpha and steps as Axolotl passes them: only when truthy (`if trl.ref_model_mixup_alpha:`),
    so a 0 would train with TRL's own 0.6 / 512 instead: refused, as is a step count below 1."""
    if trl.ref_model_mixup_alpha == 0:
        raise ValueError("trl.ref_model_mixup_alpha: 0 would keep the reference fixed, but Axolotl passes only a "
                         "non-zero alpha to TRL, which then mixes with its own 0.6; to keep the reference fixed "
                         "remove sync_ref_model")
    if trl.ref_model_sync_steps is not None and trl.ref_model_sync_steps < 1:
        raise ValueError(f"trl.ref_model_sync_steps: {trl.ref_model_sync_steps}; the reference is mixed after every "
                         "that many optimizer steps: at least 1 (Axolotl's default 64)")


def _zero3(cfg) -> bool:
    if not cfg.deepspeed:
        return False

    try:  # (deepspeed_path gives the path as written when it exists)
        return json.loads(Path(deepspeed_path(cfg.deepspeed)).read_text()).get("zero_optimization", {}).get("stage") == 3
    except (OSError, ValueError):
        return "zero3" in str(cfg.deepspeed)


class TrlKeys(BaseModel):
    trl: TrlConfig | None = None  # Axolotl's trl: block (reward_funcs, num_generations, beta, ...)
