"""`optimizer: muon`, as Axolotl's MuonOptimizerFactory builds it (axolotl-contribs-mit 0.0.6,
axolotl/contribs/mit/muon/muon.py, Moonlight's Muon), out of torch's own optimizers:

- 2-D hidden matrices: torch.optim.Muon with adjust_lr_fn="match_rms_adamw" (lr x 0.2 x sqrt(max(A, B))),
  Nesterov momentum 0.95, 5 Newton-Schulz steps with the same coefficients, decoupled weight decay
  lr x weight_decay. torch keeps its momentum as an average (its buffer is (1 - momentum) x Axolotl's sum);
  Newton-Schulz first divides the update by its norm, so the step is the same.
- embed_tokens / lm_head (and LoRA's modules_to_save): torch.optim.AdamW with the same lr and weight decay,
  betas (adam_beta1, adam_beta2) when both are set, else Axolotl's (0.95, 0.95).
- parameters with fewer than 2 dimensions (norms, biases) are left out, as Axolotl's factory leaves them out:
  they keep their initial values.

One optimizer object with both kinds of parameter group, so the LR schedule, checkpoints (optimizer.pt) and
FSDP's optimizer-state gathering see an ordinary torch optimizer.
"""

from __future__ import annotations

import torch

from trainer.errors import ConfigError

ADAMW_NAMES = ("embed_tokens", "lm_head")
AXOLOTL_ADAMW_BETAS = (0.95, 0.95)


def split(model) -> tuple[list, list, list]:
    """(Muon parameters, AdamW parameters, names of the trainable parameters left out), by Axolotl's rule."""
    muon, adamw, left_out = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2:
            left_out.append(name)
            continue
        if name.endswith("modules_to_save.default.weight") or any(k in name for k in ADAMW_NAMES):
            adamw.append(p)
        elif p.ndim > 2:
            raise ConfigError(f"optimizer: muon orthogonalises 2-D matrices; {name} has {p.ndim} dimensions")
        else:
            muon.append(p)
    return muon, adamw, left_out


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the hidden matrices and torch.optim.AdamW over the rest, as one optimizer."""

    def __init__(self, muon_params, adamw_params, lr: float, weight_decay: float, betas, eps: float,
                 model=None, left_out=()):
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        adamw_params = list(adamw_params)
        self.adamw = torch.optim.AdamW(adamw_params or [torch.zeros(0)], lr=lr, weight_decay=weight_decay,
                                       betas=betas, eps=eps)  # a placeholder when every matrix is Muon's
        groups = self.muon.param_groups + (self.adamw.param_groups if adamw_params else [])
        self.counts = (len(self.muon.param_groups), len(groups) - len(self.muon.param_groups))
        super().__init__([{**g} for g in groups], {"lr": lr})
        self._link()
        # Parameters left out still get gradients (they count in gradient clipping, as under the HF Trainer,
        # which zeroes every gradient of the model each step); zero_grad clears theirs too. They are looked up
        # by name each time: FSDP2 replaces the model's parameter objects after the optimizer is built.
        self.model, self.left_out = model, list(left_out)

    def _link(self) -> None:
        """The two optimizers step this object's groups and state (after load_state_dict replaced them too)."""
        m, a = self.counts
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:m], self.param_groups[m:m + a]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self.left_out:
            params = dict(self.model.named_parameters())
            for name in self.left_out:
                params[name].grad = None

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


def build(cfg, model) -> MuonWithAdamW:
    muon, adamw, left_out = split(model)
    if not muon:
        raise ConfigError("optimizer: muon found no 2-D hidden matrices to train")
    given = cfg.model_fields_set
    betas = (cfg.adam_beta1, cfg.adam_beta2) if {"adam_beta1", "adam_beta2"} <= given else AXOLOTL_ADAMW_BETAS
    return MuonWithAdamW(muon, adamw, cfg.learning_rate, cfg.weight_decay, betas, cfg.adam_epsilon, model, left_out)
