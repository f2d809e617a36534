"""NEFTune (neftune_noise_alpha): uniform noise on the input embeddings while training, transformers' own.

The noise is transformers.integrations.neftune's forward hook on the model's input embeddings (the one its Trainer
activates for TrainingArguments.neftune_noise_alpha, and Axolotl through it): in training mode each embedding output
gets U(-m, m) noise with m = alpha / sqrt(sequence length x hidden size); in eval mode nothing. The hook is on from
the first step to the end of training and removed before the final model is written.
"""

from __future__ import annotations

from trainer.hooks import Hook


class NEFTune(Hook):
    def __init__(self, model, alpha: float) -> None:
        self.model, self.alpha, self.handle = model, alpha, None

    def start(self, state, checkpoint) -> None:
        # heavy: transformers loads only when this runs
        from transformers.integrations.neftune import activate_neftune

        self.handle = activate_neftune(self.model, self.alpha)

    def end(self, step: int) -> None:
        # heavy: transformers loads only when this runs
        from transformers.integrations.neftune import deactivate_neftune

        if self.handle is not None:
            deactivate_neftune(self.model, self.handle)
            self.handle = None


def hook(cfg, model) -> NEFTune | None:
    return NEFTune(model, cfg.neftune_noise_alpha) if cfg.neftune_noise_alpha else None
