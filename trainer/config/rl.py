"""Reward models (reward_model / process_reward_model): their dataset types and rules (the data and losses are
trainer/objectives/reward_data.py, reward.py and prm.py)."""

from __future__ import annotations

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
