"""What is trained besides SFT: the preference methods (rl:), reward models and EAFT's weighted token loss, with
their keys and rules. Their data, losses and evaluation are trainer/objectives/; GRPO's `trl:` block is
trainer/config/grpo.py, EBFT's `ebft:` block trainer/config/ebft.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from trainer.config.datasets import KTO_TYPES, PAIR_TYPES, UserDefinedPreference  # noqa: F401 (read here)
from trainer.errors import ConfigError

# --- preference training (rl:) -------------------------------------------------------------------------
RL_METHODS = ("dpo", "ipo", "orpo", "kto", "simpo")


class RlKeys(BaseModel):
    # --- preference training (Axolotl's names; defaults as TRL's configs) --------------------------------
    rl: Literal["dpo", "ipo", "orpo", "kto", "simpo", "ebft", "grpo", "gdpo"] | None = None
    rl_beta: float | None = Field(None, gt=0)  # DPO/IPO/KTO/SimPO beta (TRL default 0.1)
    dpo_beta: float | None = Field(None, gt=0)  # deprecated spelling of rl_beta
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # conservative DPO (cDPO); SimPO's too
    dpo_loss_type: list[Literal["sigmoid", "ipo"]] | None = Field(None, min_length=1)  # rl: dpo with ["ipo"] is IPO
    # one weight per dpo_loss_type: the step's loss is the weighted sum of each type's mean loss (TRL's loss_weights)
    dpo_loss_weights: list[float] | None = Field(None, min_length=1)
    dpo_use_weighting: bool | None = None  # WPO's weights on each pair's loss (TRL's DPOConfig.use_weighting)
    orpo_alpha: float | None = Field(None, ge=0)  # ORPO's weight of the odds-ratio term (TRL's beta; 0: NLL only)
    kto_desirable_weight: float = Field(1.0, gt=0)
    kto_undesirable_weight: float = Field(1.0, gt=0)
    simpo_gamma: float = Field(0.5, ge=0)  # SimPO's target reward margin
    cpo_alpha: float = Field(1.0, ge=0)  # SimPO/CPO: weight of the NLL (behaviour cloning) term
    precompute_ref_log_probs: bool | None = None  # always precomputed here: only true (or unset) is accepted
    remove_unused_columns: bool | None = None  # TRL-ism Axolotl's KTO examples set; nothing to remove here
    # --- reward models (Axolotl's names; TRL's RewardTrainer / PRMTrainer losses) -------------------------
    reward_model: bool = False  # Bradley-Terry outcome reward model (AutoModelForSequenceClassification)
    process_reward_model: bool = False  # per-step reward model (AutoModelForTokenClassification)
    center_rewards_coefficient: float | None = Field(None, ge=0)  # TRL's mean-zero reward term
    num_labels: int | None = Field(None, ge=1)  # head outputs: 1 for reward_model, 2 (default) for process_reward_model
    # --- EAFT (trainer/objectives/eaft.py) ------------------------------------------------------------------
    use_eaft: bool = False  # entropy-aware focal training: token losses weighted by top-k entropy ** eaft_alpha
    eaft_alpha: float = Field(1.0, ge=0)  # Axolotl's default 1.0
    eaft_k: int = Field(20, ge=2)  # Axolotl's default 20; top-1 entropy is 0 (every weight would be 0)

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
        if self.rl_beta or self.dpo_beta:
            return self.rl_beta or self.dpo_beta
        return self.orpo_alpha if self.orpo_alpha is not None else 0.1  # (Axolotl: `is not None`, so 0 is 0)

    def _check_preference(self) -> None:
        """The datasets' types follow what is trained; the preference keys only with their method."""
        if check_reward_config(self):  # reward_model / process_reward_model: their own dataset types
            return
        if self.rl in ("grpo", "gdpo"):  # prompt datasets with user transforms (trainer/config/grpo.py checks)
            return
        if self.rl is None:
            self._check_sft_types()  # (trainer/config/datasets.py)
            return
        if self.rl == "ebft":  # transforms named module.function (trainer/config/ebft.py check)
            return
        allowed = KTO_TYPES if self.rl == "kto" else PAIR_TYPES
        for group, entries in (("datasets", self.datasets), ("test_datasets", self.test_datasets or [])):
            for i, ds in enumerate(entries):
                if ds.user_defined and ds.user_defined.model_fields_set <= set(UserDefinedPreference.model_fields):
                    ds.type = UserDefinedPreference(**ds.user_defined.model_dump(include=ds.user_defined.model_fields_set))
                if ds.preference_format:
                    continue
                if ds.user_defined:
                    raise ValueError(f"{group}.{i}.type: a format of your own (a mapping) is for SFT here; with rl: "
                                     f"{self.rl} use one of {', '.join(allowed)}, or no type (rows with prompt, chosen "
                                     "and rejected texts)")
                if ds.type is None and self.rl != "kto":
                    continue  # Axolotl: no type means rows already in prompt / chosen / rejected form
                if ds.type not in allowed:
                    raise ValueError(f"{group}.{i}.type: {ds.type!r} is not a {'KTO' if self.rl == 'kto' else 'preference pair'} "
                                     f"dataset type; use one of {', '.join(allowed)}")
        if (self.dpo_loss_type is not None or self.dpo_loss_weights is not None) and self.rl != "dpo":
            raise ValueError(f"dpo_loss_type / dpo_loss_weights: only with rl: dpo, not rl: {self.rl} (Axolotl refuses "
                             "them too)")
        if self.dpo_loss_weights is not None and (self.dpo_loss_type is None or
                                                  len(self.dpo_loss_weights) != len(self.dpo_loss_type)):
            raise ValueError(f"dpo_loss_weights: {self.dpo_loss_weights} needs one weight per dpo_loss_type "
                             f"({self.dpo_loss_type or 'unset'}), as Axolotl and TRL require")
        if self.orpo_alpha == 0 and self.rl in ("dpo", "ipo", "kto", "simpo") and not (self.rl_beta or self.dpo_beta):
            raise ValueError(f"orpo_alpha: 0 is the beta of rl: {self.rl} (Axolotl passes orpo_alpha as the method's "
                             "beta): its loss is constant in the policy at beta 0 and trains nothing; set rl_beta")
        if self.precompute_ref_log_probs is False:
            raise ValueError("precompute_ref_log_probs: false is not supported: the reference log-probs are always "
                             "computed once before training (no reference model is kept in memory)")
        if self.dpo_label_smoothing and self.objective == "ipo":
            raise ValueError("dpo_label_smoothing does not apply to IPO")


def preference_notes(cfg) -> list[str]:
    """Keys of a preference method the config's objective does not read (as in Axolotl, which passes them to
    DPO's trainer only)."""
    if cfg.dpo_use_weighting and cfg.objective not in ("dpo", "ipo"):
        return [f"dpo_use_weighting: no effect with {cfg.objective} (it weights DPO's and IPO's pair losses, as in "
                "Axolotl)"]
    return []


def check_eaft(cfg) -> None:
    if cfg.use_eaft and cfg.objective != "sft":
        raise ConfigError("use_eaft: weights SFT's token losses; not with rl: preference training or reward models")


# --- reward models ----------------------------------------------------------------------------------------
REWARD_TYPES = ("bradley_terry.chat_template",)
PRM_TYPES = ("stepwise_supervised",)


def check_reward_config(cfg) -> bool:
    """Raise ValueError for inconsistent reward-model keys; True when the config trains a reward model."""
    for i, ds in enumerate(cfg.datasets):
        if ds.type not in PRM_TYPES:
            for key, default in (("step_separator", "\n"), ("max_completion_length", None),
                                 ("train_on_last_step_only", False)):
                if getattr(ds, key) != default:
                    raise ValueError(f"datasets.{i}.{key}: only with type: stepwise_supervised (got type {ds.type!r})")
    if not (cfg.reward_model or cfg.process_reward_model):
        for i, ds in enumerate(cfg.datasets):
            if ds.type in REWARD_TYPES + PRM_TYPES:
                key = "reward_model" if ds.type in REWARD_TYPES else "process_reward_model"
                raise ValueError(f"datasets.{i}.type: {ds.type!r} is a {key} dataset type; set {key}: true")
        for key in ("num_labels", "center_rewards_coefficient"):
            if getattr(cfg, key) is not None:
                raise ValueError(f"{key}: only with reward_model: true (or process_reward_model: true for num_labels)")
        return False
    name = "reward_model" if cfg.reward_model else "process_reward_model"
    if cfg.reward_model and cfg.process_reward_model:
        raise ValueError("reward_model and process_reward_model are both true; choose one")
    if cfg.rl:
        raise ValueError(f"{name} is not an rl method; remove rl: {cfg.rl} (or {name})")
    allowed = REWARD_TYPES if cfg.reward_model else PRM_TYPES
    for i, ds in enumerate(cfg.datasets):
        if ds.type not in allowed:
            raise ValueError(f"datasets.{i}.type: {ds.type!r} is not a {name} dataset type; use {', '.join(allowed)}")
    if cfg.reward_model:
        if cfg.num_labels not in (None, 1):
            raise ValueError(f"num_labels: {cfg.num_labels} with reward_model; the Bradley-Terry loss scores each "
                             "sequence with one number (num_labels: 1)")
        if cfg.sample_packing:
            raise ValueError("sample_packing: not supported with reward_model (the sequence-classification head "
                             "scores each row's last token, so every sequence needs its own row)")
    else:
        if cfg.center_rewards_coefficient is not None:
            raise ValueError("center_rewards_coefficient: only with reward_model (TRL's PRMTrainer has no such term)")
        if cfg.num_labels is not None and cfg.num_labels < 2:
            raise ValueError("num_labels: process_reward_model classifies each step, so it needs at least 2 labels")
    return True


def num_labels(cfg) -> int:
    """Axolotl's defaults: 1 for reward_model, 2 for process_reward_model."""
    return cfg.num_labels or (1 if cfg.reward_model else 2)
