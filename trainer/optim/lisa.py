"""LISA (layerwise importance sampling, arXiv 2403.17919), as Axolotl's callback does it: every
`lisa_step_interval` steps, freeze all the model's layers (`lisa_layers_attribute`, default model.layers)
and unfreeze `lisa_n_layers` of them chosen at random; everything outside the layers (embeddings, final
norm, LM head) keeps training. Axolotl draws at step 0, at step 1, then every interval; so does this.

The draw is a function of (seed, the step it happens at), not of a running RNG, so a resumed run trains the
same layers as an uninterrupted one without storing anything. Frozen layers get no gradient (None), so the
optimizer skips them: no update, no weight decay, their moments kept for when they are drawn again.
"""

from __future__ import annotations

from functools import reduce

import numpy as np

from trainer.errors import ConfigError
from trainer.hooks import Hook


class Lisa(Hook):
    def __init__(self, cfg, model, log=print):
        self.n, self.interval, self.seed = cfg.lisa_n_layers, cfg.lisa_step_interval, cfg.seed
        try:
            self.layers = reduce(getattr, cfg.lisa_layers_attribute.split("."), model)
            total = len(self.layers)
        except (AttributeError, TypeError):
            raise ConfigError(f"lisa_layers_attribute: {type(model).__name__} has no layer list at "
                              f"'{cfg.lisa_layers_attribute}'") from None
        if self.n > total:
            raise ConfigError(f"lisa_n_layers: {self.n} is more than the model's {total} layers")
        self.total, self.current, self.log = total, None, log
        log(f"LISA: training {self.n} of {total} layers, drawn again every {self.interval} steps")

    def draw_step(self, step: int) -> int:
        """The step (completed steps before it) whose draw is in force for this step."""
        if step == 0:
            return 0
        return max(1, step - step % self.interval)

    def active(self, step: int) -> list[int]:
        rng = np.random.default_rng([self.seed, self.draw_step(step)])
        return sorted(int(i) for i in rng.choice(self.total, self.n, replace=False))

    def before_step(self, step: int) -> list[int]:
        """Set requires_grad for the step about to run (`step` steps done); return the trained layers."""
        active = self.active(step)
        if active != self.current:
            for i, layer in enumerate(self.layers):
                for param in layer.parameters():
                    param.requires_grad = i in active
            self.current = active
            self.log(f"LISA: step {step + 1} trains layers {active}")
        return active


def hook(cfg, model, say=print) -> Hook | None:
    """LISA's layer draws (made after the optimizer is built over every layer: LISA then freezes all but a few)."""
    return Lisa(cfg, model, say) if cfg.lisa_n_layers else None
