"""hub_model_id: push the final model or adapter (and tokenizer) to the Hugging Face Hub at the end of training.

The Hub is checked before any work starts (token present, Hub reachable, the token can write), so a run with
no network or no token stops at once with one line instead of failing after hours of training.
"""

from __future__ import annotations

import os

from trainer.errors import ConfigError


def check(cfg) -> None:
    if not cfg.hub_model_id:
        return
    # heavy: huggingface_hub loads only when this runs
    from huggingface_hub import HfApi
    from huggingface_hub.utils import get_token

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ConfigError(f"hub_model_id: {cfg.hub_model_id} is to be pushed at the end, but HF_HUB_OFFLINE is set; "
                          "unset it or remove hub_model_id (checked before training)")
    token = get_token()
    if not token:
        raise ConfigError(f"hub_model_id: pushing {cfg.hub_model_id} needs a Hugging Face token (HF_TOKEN or "
                          "`hf auth login`); none found (checked before training)")
    try:
        who = HfApi().whoami(token=token)
    except Exception as err:  # connection errors, HTTP errors: all mean the push would fail
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"hub_model_id: cannot reach the Hugging Face Hub to push {cfg.hub_model_id} at the end "
                          f"({first[:200]}); fix the network/token or remove hub_model_id (checked before training)") from None
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise ConfigError(f"hub_model_id: the Hugging Face token is read-only; pushing {cfg.hub_model_id} needs "
                          "a write token (checked before training)")


def push(cfg, model, tokenizer, log) -> None:
    if not cfg.hub_model_id:
        return
    # hub_revision: the branch pushed to, as Axolotl passes it to transformers (TrainingArguments.hub_revision);
    # push_to_hub creates the branch where it is missing
    model.push_to_hub(cfg.hub_model_id, private=True, revision=cfg.hub_revision)
    tokenizer.push_to_hub(cfg.hub_model_id, private=True, revision=cfg.hub_revision)
    branch = f" (branch {cfg.hub_revision})" if cfg.hub_revision else ""
    log(f"pushed the final {'adapter' if cfg.adapter else 'model'} to https://huggingface.co/{cfg.hub_model_id}{branch}")
