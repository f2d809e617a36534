"""Training keys (batching, optimisation, schedule, cadence, checkpoints, evaluation, and the long tail: LISA,
ReLoRA, early stopping, training order) and their rules. The optimizer's name is checked against
matrices/optimizers.toml here (trainer/optim/optimizers.py builds it).
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer import facts
from trainer.config.parallel import fsdp_enabled, fsdp_settings
from trainer.errors import ConfigError

# Axolotl's SUPPORTED_METRICS (axolotl/utils/schemas/validation.py)
CAUSAL_LM_METRICS = ("sacrebleu", "comet", "ter", "chrf", "perplexity")
# do_causal_lm_eval without eval_causal_lm_metrics: Axolotl's default list (sacrebleu, comet, ter, chrf) without comet
CAUSAL_LM_DEFAULT = ("sacrebleu", "ter", "chrf")
SACREBLEU_METRICS = ("sacrebleu", "ter", "chrf")  # scored on generations by the sacrebleu package
COMET_WHY = ("it needs the unbabel-comet package and the Unbabel/wmt22-comet-da model from the Hugging Face Hub, "
             "which this trainer does not fetch")


class LrGroup(BaseModel):
    """One of Axolotl's lr_groups: the parameters whose names contain one of `modules` train at `lr`."""

    model_config = ConfigDict(extra="forbid")
    name: str
    modules: list[str] = Field(min_length=1)
    lr: float = Field(gt=0)


class TrainingKeys(BaseModel):
    # batching
    sample_packing: bool = False
    eval_sample_packing: bool | None = None  # default: same as sample_packing
    pad_to_sequence_len: bool = False
    micro_batch_size: int = Field(1, ge=1)  # `auto` in YAML: auto_find_batch_size over micro 1 x accumulation (load.py)
    auto_find_batch_size: bool = False  # the largest micro-batch that fits, the step's batch kept; an OOM backs off
    eval_batch_size: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    dataloader_num_workers: int = Field(0, ge=0)

    # optimisation
    # a float as in Axolotl (1.5 epochs: the steps of one and a half); 0 or -1 only beside max_steps, which then
    # decides the length alone (check_epochs)
    num_epochs: float = 1.0
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2e-5, gt=0)
    # transformers' SchedulerType names (get_scheduler builds them) and Axolotl's own one_cycle and rex
    # (tests/trainer/optim/test_schedules.py compares the list with transformers'); check_schedule refuses the two
    # that step on evaluation metrics
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial",
                          "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
                          "reduce_lr_on_plateau", "greedy", "one_cycle", "rex"] = "cosine"
    lr_scheduler_kwargs: dict[str, Any] | None = None  # passed to the schedule as Axolotl passes them (schedule.py)
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1)  # cosine decays to this fraction of learning_rate
    cosine_constant_lr_ratio: float | None = Field(None, ge=0, le=1)  # cosine to cosine_min_lr_ratio by this fraction of the steps, then flat
    warmup_ratio: float | None = Field(None, ge=0, le=1)  # 1: the whole run warms up (Axolotl takes it)
    warmup_steps: int | float | None = Field(None, ge=0)  # a float < 1 is a fraction of the steps (transformers v5)
    optimizer: str = "adamw_torch"  # a name in matrices/optimizers.toml (check_optimizer)
    optim_args: dict[str, Any] | str | None = None  # extra optimizer arguments, as transformers' optim_args
    weight_decay: float = Field(0.0, ge=0)
    # learning rates per parameter group, as Axolotl's OptimizerMixin sets them (core/trainers/mixins/optimizer.py):
    # LoRA+ through peft's create_loraplus_optimizer (lora_B at learning_rate x ratio, LoRA embeddings at
    # loraplus_lr_embedding, default 1e-6); else the embeddings (embed_tokens, lm_head) at learning_rate x
    # embedding_lr_scale or at embedding_lr (0: unset, as Axolotl reads them), and lr_groups' modules at their lr
    loraplus_lr_ratio: float | None = Field(None, gt=0)
    loraplus_lr_embedding: float | None = Field(None, ge=0)
    embedding_lr: float | None = Field(None, ge=0)
    embedding_lr_scale: float | None = Field(None, ge=0)
    lr_groups: list[LrGroup] | None = None
    max_grad_norm: float | None = Field(1.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    seed: int = 42

    # outputs and cadence
    output_dir: str = "./outputs"
    # logging_steps, eval_steps, save_steps: a step count, or a fraction (< 1) of the total steps, rounded up, as
    # transformers' TrainingArguments reads them (resolved by steps_from_fractions once the total is known)
    logging_steps: int | float = Field(1, gt=0)
    eval_steps: int | float | None = Field(None, gt=0)
    evals_per_epoch: int | None = Field(None, ge=0)  # 0: none, as in Axolotl
    save_steps: int | float | None = Field(None, gt=0)
    saves_per_epoch: int | None = Field(None, ge=0)  # 0: none (only the final model), as evals_per_epoch
    save_total_limit: int | None = Field(None, ge=1)
    save_only_model: bool = False  # checkpoints without optimizer/scheduler/RNG state (resume restarts the optimizer)
    # checkpoints and the final model are safetensors; false is refused, as Axolotl 0.19 refuses it
    # (utils/schemas/model.py: transformers 5 saves only safetensors)
    save_safetensors: bool = True
    resume_from_checkpoint: str | None = None
    auto_resume_from_checkpoints: bool = False

    # --- long tail: training order, LISA, early stopping, quadratic warmup, ReLoRA (Axolotl's names) ---------
    group_by_length: bool = False  # the HF Trainer's length-grouped order (no effect with sample_packing, as in Axolotl)
    curriculum_sampling: bool = False  # the data's own order every epoch, no shuffle (trainer.batch.ordering)
    sample_packing_sequentially: bool = False  # next-fit packing in order instead of best-fit (trainer.batch.ordering)
    lisa_n_layers: int | None = Field(None, ge=1)  # LISA: train this many randomly chosen layers ... (trainer.optim.lisa)
    lisa_step_interval: int | None = Field(None, ge=1)  # ... re-drawn every this many steps
    lisa_layers_attribute: str = "model.layers"  # where the layers are, under the model
    early_stopping_patience: int | None = Field(None, ge=1)  # stop after this many evals without a better eval_loss
    lr_quadratic_warmup: bool = False  # cosine schedule with a quadratic warmup (trainer.optim.schedule)
    do_causal_lm_eval: bool = False  # eval_causal_lm_metrics at every evaluation (trainer.objectives.causal_lm_eval)
    # sacrebleu, ter, chrf, perplexity (comet refused); unset: sacrebleu, ter, chrf (Axolotl's default less comet)
    eval_causal_lm_metrics: list[str] | None = None
    eval_max_new_tokens: int = Field(128, ge=1)  # Axolotl's default; the generations' length, perplexity's window
    # NEFTune: uniform noise of alpha / sqrt(sequence length x hidden size) on the input embeddings while training,
    # transformers' own neftune_noise_alpha (trainer/model/neftune.py)
    # 0 is off: Axolotl passes it to transformers, whose noise alpha / sqrt(L * d) is then 0 (and its deprecated
    # noisy_embedding_alpha: 0 is never moved to this key)
    neftune_noise_alpha: float | None = Field(None, ge=0)
    # the accelerator's cache emptied every N steps, transformers' own key (trainer/runtime/empty_cache.py)
    torch_empty_cache_steps: int | None = Field(None, ge=1)
    eval_table_size: int | None = Field(None, ge=0)  # Axolotl logs prediction tables only to wandb/mlflow/comet
    relora: bool = False  # ReLoRA: merge LoRA into the base every jagged_restart_steps (trainer.model.relora)
    relora_prune_ratio: float | None = Field(None, ge=0, le=1)  # share of LoRA's optimizer state zeroed at a restart
    relora_prune_method: Literal["magnitude", "random", "reset"] = "magnitude"
    relora_cpu_offload: bool = False  # compute the merges on the CPU
    jagged_restart_steps: int | None = Field(None, ge=1)  # LR restarts (and ReLoRA merges) every this many steps
    jagged_restart_warmup_steps: int | None = Field(None, ge=0)  # warmup after each restart (0/unset: 10)
    jagged_restart_anneal_steps: int | None = Field(None, ge=0)  # anneal before each restart (0/unset: 1)

    def _check_lr_groups(self) -> None:
        """LoRA+ builds its own groups (Axolotl then drops embedding_lr, embedding_lr_scale and lr_groups without a
        word); Muon splits the parameters its own way (Axolotl's optimizer factory ignores all four)."""
        grouped = [k for k in ("embedding_lr", "embedding_lr_scale", "lr_groups") if getattr(self, k)]
        if self.loraplus_lr_ratio is not None and grouped:
            raise ValueError(f"loraplus_lr_ratio conflicts with {grouped[0]}: LoRA+ sets the groups' learning rates "
                             "itself (Axolotl ignores the other); set one of them")
        if self.optimizer == "muon" and (grouped or self.loraplus_lr_ratio is not None):
            raise ValueError(f"{(grouped or ['loraplus_lr_ratio'])[0]}: not with optimizer: muon (it splits the "
                             "parameters its own way; Axolotl ignores the key there)")

    @field_validator("save_safetensors")
    @classmethod
    def _safetensors_only(cls, value: bool) -> bool:
        if value is False:
            raise ValueError("false is not supported: transformers 5 saves models only as safetensors (Axolotl "
                             "refuses it too); remove it")
        return value

    @field_validator("logging_steps", "eval_steps", "save_steps", mode="after")
    @classmethod
    def _steps_or_fraction(cls, value, info):
        if isinstance(value, float) and value >= 1:
            if not value.is_integer():
                raise ValueError(f"{value} is neither a step count nor a fraction (< 1) of the total steps")
            return int(value)
        return value

    @property
    def packing_for_eval(self) -> bool:
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing

    def _check_training(self) -> None:
        """LISA, early stopping, ReLoRA and the evaluation keys: what goes together."""
        if (self.lisa_n_layers is None) != (self.lisa_step_interval is None):
            raise ValueError("lisa_n_layers and lisa_step_interval go together: set both (or neither)")
        if self.lisa_n_layers is not None:
            if self.adapter or self.unfrozen_parameters:
                raise ValueError("lisa_n_layers: LISA trains whole layers of a full fine-tune; remove adapter / "
                                 "unfrozen_parameters")
            if self.deepspeed or self.fsdp or self.fsdp_config or self.fsdp_version:
                raise ValueError("lisa_n_layers: not with DeepSpeed or FSDP (their sharded optimizers fix the trained "
                                 "parameters up front; LISA changes them every lisa_step_interval steps)")
        # load_best_model_at_end is declared by the early_stopping entry of trainer/config/features.py
        best = "early_stopping_patience" if self.early_stopping_patience else (
            "load_best_model_at_end" if getattr(self, "load_best_model_at_end", False) else None)
        if best:
            if not (self.save_steps and self.eval_steps) or (
                    isinstance(self.save_steps, int) and isinstance(self.eval_steps, int) and self.save_steps % self.eval_steps):
                raise ValueError(f"{best} needs save_steps and eval_steps, with eval_steps dividing save_steps (as "
                                 "Axolotl and transformers require: the best checkpoint becomes the final model)")
            if not (self.val_set_size or self.test_datasets):
                raise ValueError(f"{best} needs a validation split (val_set_size or test_datasets)")
            if self.deepspeed or self.fsdp or self.fsdp_config or self.fsdp_version:
                raise ValueError(f"{best}: not with DeepSpeed or FSDP here (ending with the best checkpoint's weights "
                                 "is not implemented for sharded weights)")
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
        named = set(self.eval_causal_lm_metrics or []) - set(CAUSAL_LM_METRICS)
        if named:  # Axolotl refuses them whether do_causal_lm_eval is on or not (check_causal_lm_evals)
            raise ValueError(f"eval_causal_lm_metrics: {', '.join(sorted(named))} is not one of Axolotl's metrics "
                             f"({', '.join(CAUSAL_LM_METRICS)})")
        if self.do_causal_lm_eval:
            if "comet" in (self.eval_causal_lm_metrics or []):
                raise ValueError(f"eval_causal_lm_metrics: comet not supported ({COMET_WHY}); list the others you want "
                                 "(sacrebleu, ter, chrf, perplexity)")
            if self.rl:
                raise ValueError("do_causal_lm_eval: for SFT only (no preference training)")

    def _check_schedule(self) -> None:
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError(f"warmup_steps: {self.warmup_steps} beside warmup_ratio: {self.warmup_ratio}: set one "
                             "(Axolotl reads warmup_steps and drops the ratio; both non-zero, it refuses them)")
        if self.warmup_ratio == 1 and self.lr_scheduler == "one_cycle":
            raise ValueError("warmup_ratio: 1 with lr_scheduler: one_cycle leaves its annealing phase 0 steps: torch's "
                             "OneCycleLR divides by zero at the first step (in Axolotl too); set warmup_ratio below 1")
        if self.min_sample_len is not None and (self.rl or self.min_sample_len > self.sequence_len):
            raise ValueError(f"min_sample_len: {self.min_sample_len} must be at most sequence_len ({self.sequence_len})"
                             if not self.rl else "min_sample_len: applies to SFT data, not to rl: preference pairs")
        if isinstance(self.warmup_steps, float) and self.warmup_steps >= 1 and not self.warmup_steps.is_integer():
            raise ValueError(f"warmup_steps: {self.warmup_steps} is neither a step count nor a fraction (< 1) of the steps")

    def _check_cadence(self) -> None:
        if self.eval_steps and self.evals_per_epoch:
            raise ValueError("set eval_steps or evals_per_epoch, not both")
        if self.save_steps and self.saves_per_epoch:
            raise ValueError("set save_steps or saves_per_epoch, not both")


# --- the optimizer by name (matrices/optimizers.toml: which names exist and which library implements each) -------
def optimizer_table() -> dict[str, dict]:
    return {row["name"]: row for row in facts.rows("optimizers", "optimizer")}


def check_optimizer(name: str) -> dict:
    """The optimizers.toml row of a config's optimizer, or a ConfigError naming the choices."""
    rows = optimizer_table()
    row = rows.get(name)
    if row is None:
        close = difflib.get_close_matches(name, list(rows), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        supported = ", ".join(n for n, r in rows.items() if "unsupported" not in r)
        raise ConfigError(f"optimizer: unknown optimizer '{name}'{hint} (supported: {supported})")
    if "unsupported" in row:
        raise ConfigError(f"optimizer: {name} is not supported ({row['unsupported']})")
    return row


def check_muon(cfg) -> None:
    """Muon needs each 2-D matrix whole, or as FSDP2's DTensor shard (torch's Muon runs on those)."""
    if cfg.optimizer != "muon":
        return

    if cfg.deepspeed:
        raise ConfigError("optimizer: muon with deepspeed: ZeRO flattens parameters into 1-D partitions and Muon "
                          "orthogonalises 2-D matrices; use FSDP2 (fsdp_version: 2) or DDP")
    if fsdp_enabled(cfg) and fsdp_settings(cfg)["fsdp_version"] == 1:
        raise ConfigError("optimizer: muon with FSDP1: its flat parameters are 1-D and Muon orthogonalises 2-D "
                          "matrices; use fsdp_version: 2")


def check_relora_optimizer(cfg) -> None:
    """Axolotl prunes Adam moments only (and refuses other optimizers); 8-bit state comes from bitsandbytes."""
    if not cfg.relora:
        return
    name = cfg.optimizer
    row = check_optimizer(name)
    if "adam" not in name or row["library"] not in ("torch", "bitsandbytes") or "ademamix" in name:
        raise ConfigError(f"relora: optimizer {name} is not supported with ReLoRA (its Adam moments are pruned at "
                          "each restart: use an AdamW from torch or bitsandbytes)")

def ordering_notes(cfg) -> list[str]:
    """group_by_length, curriculum_sampling, sample_packing_sequentially (trainer/batch/ordering.py): where Axolotl
    would behave in a way a user may not expect."""
    out = []
    if cfg.group_by_length and cfg.sample_packing:
        out.append("group_by_length: no effect with sample_packing (the packer decides the batches, as in Axolotl)")
    if cfg.curriculum_sampling and len(cfg.datasets) > 1 and cfg.shuffle_merged_datasets:
        out.append("curriculum_sampling: the merged datasets are shuffled once (shuffle_merged_datasets, as Axolotl "
                   "does), then trained in that order every epoch; set shuffle_merged_datasets: false to keep the "
                   "datasets' own order")
    if cfg.sample_packing_sequentially and not cfg.sample_packing:
        out.append("sample_packing_sequentially: no effect without sample_packing")
    elif cfg.sample_packing_sequentially and not cfg.curriculum_sampling:
        out.append("sample_packing_sequentially: packs in the shuffled order (set curriculum_sampling: true for the "
                   "data's own order, as Axolotl's warning says)")
    return out


METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")  # stepped by transformers' Trainer on evaluation metrics
NEED_KWARGS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")  # get_scheduler fails without
OWN_SCHEDULES = ("one_cycle", "rex")  # Axolotl's own (SchedulerMixin), with lr_scheduler_type cosine behind them


def check_epochs(cfg) -> None:
    """num_epochs <= 0 trains nothing unless max_steps says how long to train (Axolotl passes both to transformers,
    where max_steps wins)."""
    if cfg.num_epochs <= 0 and not cfg.max_steps:
        raise ConfigError(f"num_epochs: {cfg.num_epochs:g} trains nothing without max_steps (set max_steps for a "
                          "run measured in steps, or num_epochs above 0)")


def epoch_steps(cfg, steps_per_epoch: int) -> int:
    """The optimizer steps of num_epochs epochs, as Axolotl's calculate_total_num_steps counts a fraction: rounded
    down with sample packing, up without (src/axolotl/utils/trainer.py); at least one."""
    steps = steps_per_epoch * cfg.num_epochs
    return max(1, math.floor(steps) if cfg.sample_packing else math.ceil(steps))


def one_cycle_args(cfg, warmup: int, total_steps: int) -> dict:
    """torch's OneCycleLR's arguments for lr_scheduler: one_cycle, as Axolotl's SchedulerMixin gives them: peaking
    at learning_rate, pct_start the warmup's share and a cosine anneal unless lr_scheduler_kwargs say otherwise."""
    kwargs = dict(cfg.lr_scheduler_kwargs or {})
    if warmup == 1 and "pct_start" not in kwargs:  # torch's rising phase lasts pct_start * total - 1 = 0 steps
        raise ConfigError("lr_scheduler: one_cycle with exactly 1 warmup step divides by zero in torch's OneCycleLR "
                          "(as it would in Axolotl): use 0 or 2+ warmup steps")
    return {"max_lr": cfg.learning_rate, "total_steps": total_steps, "pct_start": warmup / total_steps,
            "anneal_strategy": "cos", **kwargs}


def check_schedule(cfg) -> None:
    """A schedule this loop steps once per optimizer step, with arguments it takes: refused in one line before the
    model loads otherwise (the arguments are tried on a one-parameter optimizer when torch is importable)."""
    if cfg.lr_scheduler in METRIC_SCHEDULES:
        raise ConfigError(f"lr_scheduler: {cfg.lr_scheduler} steps on evaluation metrics (transformers' Trainer "
                          "feeds it eval_loss); this trainer's loop steps the schedule once per optimizer step and "
                          "does not implement metric-driven schedules: use cosine, linear, warmup_stable_decay, ...")
    if cfg.jagged_restart_steps and cfg.lr_scheduler == "one_cycle":
        raise ConfigError("jagged_restart_steps with lr_scheduler: one_cycle is not supported here (the restarts "
                          "scale a per-step factor, which OneCycleLR does not have; Axolotl's ReLoRA refuses it too)")
    cycle = None
    if cfg.lr_scheduler == "one_cycle":  # the warmup as given (a fraction: 2 of 10 steps, as a stand-in)
        cycle = one_cycle_args(cfg, int(cfg.warmup_steps) if cfg.warmup_steps and cfg.warmup_steps >= 1 else 2, 10)
    if cfg.lr_scheduler == "rex" or (not cfg.lr_scheduler_kwargs and cfg.lr_scheduler not in NEED_KWARGS):
        return
    try:  # the library's own constructor, given what trainer/optim/schedule.py gives it
        # heavy: torch and transformers load only when this runs
        import torch
        from transformers import get_scheduler
    except ImportError:  # envtool's own environment without the trainer's stack: the trainer checks it where it runs
        return
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    try:
        if cycle is not None:
            torch.optim.lr_scheduler.OneCycleLR(optimizer, **cycle)
        else:
            get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=2, num_training_steps=10,
                          scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs or {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"lr_scheduler_kwargs: {str(err).splitlines()[0]} (lr_scheduler: {cfg.lr_scheduler})") from None


def schedule_notes(cfg) -> list[str]:
    """Schedule keys that have no effect (as in Axolotl; trainer/optim/schedule.py builds the schedule)."""
    if cfg.lr_scheduler_kwargs and (cfg.lr_scheduler == "rex" or (cfg.lr_scheduler == "cosine" and (
            cfg.lr_quadratic_warmup or cfg.cosine_min_lr_ratio))):
        return [f"lr_scheduler_kwargs: not read by this schedule (lr_scheduler: {cfg.lr_scheduler} with "
                "lr_quadratic_warmup / cosine_min_lr_ratio / rex is built by Axolotl's own code, which takes none)"]
    if cfg.lr_quadratic_warmup and cfg.lr_scheduler != "cosine":
        return [f"lr_quadratic_warmup: no effect with lr_scheduler: {cfg.lr_scheduler} (Axolotl applies it to cosine only)"]
    if cfg.lr_quadratic_warmup and cfg.cosine_min_lr_ratio is not None:
        return ["cosine_min_lr_ratio: not applied with lr_quadratic_warmup (as in Axolotl: the quadratic-warmup "
                "cosine decays to zero)"]
    if cfg.cosine_constant_lr_ratio and cfg.lr_scheduler != "cosine":
        return [f"cosine_constant_lr_ratio: no effect with lr_scheduler: {cfg.lr_scheduler} (cosine only, as in Axolotl)"]
    if cfg.cosine_constant_lr_ratio and not cfg.cosine_min_lr_ratio:
        return ["cosine_constant_lr_ratio: no effect without a non-zero cosine_min_lr_ratio (as in Axolotl)"]
    return []


def causal_lm_notes(cfg) -> list[str]:
    """do_causal_lm_eval without eval_causal_lm_metrics: Axolotl's default list, comet left out."""
    if cfg.do_causal_lm_eval and not cfg.eval_causal_lm_metrics:
        return [f"eval_causal_lm_metrics: unset, so sacrebleu, ter and chrf (Axolotl's default list without comet: "
                f"{COMET_WHY}; Axolotl too skips it where unbabel-comet is not installed); list the metrics to choose"]
    return []


def eval_table_notes(cfg) -> list[str]:
    """eval_table_size: prediction tables are a tracker's output, not part of training."""
    if cfg.eval_table_size and (cfg.wandb_project or cfg.use_wandb or cfg.use_mlflow):
        return ["eval_table_size: ignored (no prediction tables are logged to wandb/mlflow here; what is trained is "
                "the same; Axolotl has deprecated the key for generate_samples)"]
    if cfg.eval_table_size:
        return ["eval_table_size: ignored (Axolotl logs prediction tables only to wandb, mlflow or comet, and none "
                "is configured)"]
    return []


def steps_from_fractions(cfg, total_steps: int) -> None:
    """logging_steps, eval_steps and save_steps given as a fraction (< 1) of the total steps, as step counts:
    ceil(total x fraction), as transformers' TrainingArguments does. Called once the total is known."""
    for key in ("logging_steps", "eval_steps", "save_steps"):
        value = getattr(cfg, key)
        if isinstance(value, float) and value < 1:
            setattr(cfg, key, max(1, math.ceil(total_steps * value)))


def one_process_only(cfg, processes: int) -> None:
    """Features that run in one process here: refused when more are launched, before anything loads."""
    if processes <= 1:
        return
    if cfg.lisa_n_layers:
        raise ConfigError("lisa_n_layers: runs in one process here (DDP reduces a gradient for every parameter it "
                          "was built with, so frozen layers would still be decayed and moved)")
    if cfg.relora:
        raise ConfigError("relora: runs in one process here (each rank would re-draw its own LoRA at a restart)")
