"""Axolotl's `cls_model_config`: the transformers config class to read the model's config with (e.g.
Gemma3TextConfig) instead of AutoConfig (src/axolotl/loaders/utils.py load_model_config at 067b021c8b87:
getattr(transformers, name).from_pretrained(base_model)). The model is then built from that config, so
the class decides which architecture is loaded."""

from __future__ import annotations

from trainer.config.model import config_class  # the lookup, checked with the config
from trainer.errors import ConfigError


def load(cfg, source: str, overrides: dict, revision: str | None = None):
    """The model's config read with cls_model_config (else AutoConfig: base_model_config), with Axolotl's
    model_config overrides applied."""
    kwargs = {"revision": revision} if revision else {}
    try:
        if cfg.cls_model_config:
            reader = config_class(cfg.cls_model_config)
        else:  # base_model_config alone: the class its config.json names
            # heavy: transformers loads only when this runs
            from transformers import AutoConfig as reader
        config = reader.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except OSError as err:
        raise ConfigError(f"cannot load the model config from {source}: {str(err).splitlines()[0]}") from None
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
