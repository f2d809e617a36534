"""Which model head an objective trains, as Axolotl loads it (loaders/utils.py, schemas/validation.py):

- SFT and preference objectives: AutoModelForCausalLM;
- reward_model: AutoModelForSequenceClassification with num_labels 1 (the reward is the score of the last
  non-pad token, so config.pad_token_id is the tokenizer's, as TRL's RewardTrainer sets it);
- process_reward_model: AutoModelForTokenClassification with num_labels (default 2).

With LoRA the peft task type is SEQ_CLS / TOKEN_CLS: peft then trains the new head (`score` or
`classifier`) in full as a module to save, beside the adapter, and saves it with the adapter.
"""

from __future__ import annotations


import contextlib
from trainer.config import Config
from trainer.config.rl import num_labels


def auto_class(cfg: Config):
    # heavy: transformers loads only when this runs
    import transformers

    name = {"reward": "AutoModelForSequenceClassification", "prm": "AutoModelForTokenClassification"}.get(
        cfg.objective, "AutoModelForImageTextToText" if cfg.processor_type else "AutoModelForCausalLM")
    return getattr(transformers, name)


def load_kwargs(cfg: Config, tokenizer) -> dict:
    """Extra from_pretrained arguments for the head: its size and the pad token it pools by."""
    if cfg.objective not in ("reward", "prm"):
        return {}

    return {"num_labels": num_labels(cfg), "pad_token_id": tokenizer.pad_token_id}


def head_init(cfg: Config):
    """The new head's random init, seeded by `seed` alone: whether this process tokenised the data (rank 0, or
    a run without a cache) must not change it, or two processes would not train what one process trains."""
    # heavy: torch loads only when this runs
    import torch

    if cfg.objective not in ("reward", "prm"):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))  # the global RNG continues as it was afterwards
    torch.manual_seed(cfg.seed)
    return stack


def disable_dropout(cfg: Config, model) -> None:
    """TRL's RewardConfig and PRMConfig default disable_dropout=True (Axolotl keeps it): every dropout of the
    model is switched off after the adapter is added, lora_dropout and the token-classification head's
    included. (It also makes a step independent of how its micro-batches are spread over processes.)"""
    # heavy: torch loads only when this runs
    import torch

    if cfg.objective in ("reward", "prm"):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
