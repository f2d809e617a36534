"""rl: ebft with ebft.mode: structured (Axolotl's default): its rules, and the trl: block as Axolotl's EBFT builder
passes it on (core/trainers/ebft/__init__.py EBFTStrategy.set_training_args_kwargs, core/builders/rl.py for beta;
read 2026-12-08 at 067b021c8b87).

Structured EBFT is GRPO with one reward function, feature matching (trainer/objectives/ebft_structured.py): the trl:
keys Axolotl passes to its EBFT trainer are honoured as rl: grpo honours them; the keys it does not pass are not read
there (its GRPOConfig keeps TRL's defaults), and so here: they are named in a note and reset to TRL's defaults.
"""

from __future__ import annotations

from trainer.config.grpo import TrlConfig, generating_rules
from trainer.errors import ConfigError

# trl.* keys Axolotl's EBFT builder does not pass to AxolotlEBFTConfig / AxolotlAsyncEBFTConfig (reward_funcs and
# reward_weights: its trainer passes its own feature-matching reward, weight 1)
UNREAD_TRL = ("reward_funcs", "reward_weights", "generation_batch_size", "importance_sampling_level",
              "use_bias_correction_kl", "multi_objective_aggregation", "vllm_guided_decoding_regex",
              "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
              "ref_model_mixup_alpha", "ref_model_sync_steps", "off_policy_mask_threshold", "prefetch_depth",
              "replay_buffer_size", "replay_recompute_logps", "reroll_start_fraction", "reroll_max_groups",
              "skip_zero_advantage_batches")
# ebft.* keys only the strided trainer reads (EBFTStrategy passes them in strided mode only)
STRIDED_ONLY = ("stride", "context_length", "generate_max_len", "n_samples_per_prompt", "temperature", "top_p",
                "rl_coef", "advantage_estimator", "min_completion_prefix")


def effective_trl(trl: TrlConfig | None) -> TrlConfig:
    """The trl: block as Axolotl's EBFT trainer sees it: the keys it is not passed at TRL's defaults."""
    trl = trl or TrlConfig()
    return trl.model_copy(update={k: TrlConfig.model_fields[k].default for k in unread(trl)})


def unread(trl: TrlConfig) -> tuple[str, ...]:
    """UNREAD_TRL, and vllm_sync_interval without async_prefetch (Axolotl passes it only with async_prefetch)."""
    return UNREAD_TRL + (() if trl.async_prefetch else ("vllm_sync_interval",))


def asynchronous(trl: TrlConfig) -> bool:
    """Axolotl picks its asynchronous EBFT trainer (AxolotlAsyncEBFTTrainer) for async_prefetch or use_data_producer."""
    return bool(trl.async_prefetch or trl.use_data_producer)


def adaptive(cfg) -> bool:
    """ebft.adaptive_max_tokens takes effect where Axolotl's override of _generate_only runs: in its asynchronous
    trainer, with vLLM generation (EBFTMixin._generate_only checks hasattr(self, 'vllm_generation'))."""
    trl = cfg.trl or TrlConfig()
    return cfg.ebft.adaptive_max_tokens and bool(trl.use_vllm) and asynchronous(trl)


def check(cfg) -> list[str]:
    """Config rules of structured EBFT (raises ConfigError; returns notes)."""
    e, trl = cfg.ebft, cfg.trl or TrlConfig()
    if any(not 0.0 <= f <= 1.0 for f in e.feature_layers) or not e.feature_layers:
        raise ConfigError("ebft.feature_layers: fractions of the model's depth in [0, 1], at least one")
    if trl.sync_ref_model:
        raise ConfigError("trl.sync_ref_model: not implemented with rl: ebft here (the reference sync runs for rl: "
                          "grpo / gdpo); remove it")
    if asynchronous(trl) and not trl.use_vllm:
        raise ConfigError("trl.async_prefetch / use_data_producer: Axolotl's asynchronous EBFT trainer generates with "
                          "vLLM; set use_vllm: true, or remove them")
    if cfg.val_set_size:
        raise ConfigError("val_set_size: no evaluation for rl: ebft here (Axolotl's examples set 0); set 0")
    for i, ds in enumerate(cfg.datasets):
        if ds.type is not None and (not isinstance(ds.type, str) or "." not in ds.type):
            raise ConfigError(f"datasets.{i}.type: {ds.type!r}; with rl: ebft use a transform 'module.function' (as "
                              "Axolotl's ebft_opencode.transform) or no type (rows with prompt and ground_truth)")
    try:
        notes = generating_rules(cfg, trl)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    ignored = [f"trl.{k}" for k in unread(trl) if getattr(trl, k) is not None]
    if ignored:
        notes.append(f"{', '.join(ignored)}: not read with rl: ebft (Axolotl's EBFT builder does not pass them to its "
                     "trainer, which scores with its own feature-matching reward); so here")
    strided = [f"ebft.{k}" for k in STRIDED_ONLY if k in e.model_fields_set]
    if e.ce_coef:
        strided.append("ebft.ce_coef")
    if strided:
        notes.append(f"{', '.join(strided)}: not read in ebft.mode: structured (Axolotl's structured trainer does not "
                     "read them; sampling is trl.temperature, trl.num_generations, trl.max_completion_length)")
    if asynchronous(trl) and not trl.vllm_lora_sync:
        notes.append("trl.async_prefetch / use_data_producer: completions come from model.generate here (use_vllm "
                     "without vllm_lora_sync), sampled at each step by the current policy: on-policy, where Axolotl's "
                     "asynchronous trainer samples one step ahead on its vLLM server")
    if adaptive(cfg):
        notes.append(f"ebft.adaptive_max_tokens: each step's completions are capped at max(64, the largest "
                     f"min(int(ground-truth tokens x {e.gt_length_multiplier:g}), max_completion_length)) of its "
                     "prompts, as Axolotl's asynchronous EBFT trainer caps its vLLM requests")
    return notes
