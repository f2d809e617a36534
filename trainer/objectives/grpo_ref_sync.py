"""trl.sync_ref_model (TR-DPO's reference sync) for rl: grpo / gdpo, as TRL 1.16's SyncRefModelCallback does it.

Axolotl passes sync_ref_model, ref_model_mixup_alpha (its default 0.9) and ref_model_sync_steps (its default 64) to
TRL's GRPOConfig (core/trainers/grpo/__init__.py); TRL's GRPOTrainer then adds SyncRefModelCallback, whose
on_step_end, after every ref_model_sync_steps-th optimizer step (global_step % steps == 0), mixes the policy into
the reference, parameter by parameter in the order of `parameters()`:

    reference = (1 - alpha) x reference + alpha x policy      (target.mul_(1 - alpha).add_(policy, alpha=alpha))

Here the same mix runs in the loop's after_step hook on the GRPO objective's reference: the frozen copy of the
starting model a full fine-tune with beta > 0 keeps (trainer/objectives/grpo.py). With an adapter the reference is
the base with the adapter disabled, no model of its own, and with beta 0 there is no reference: TRL refuses both,
and so does the config here (trainer/config/grpo.py check). Every process mixes its own copy from its own (equal)
policy weights, so the copies stay equal without a collective.

The mixed reference is no longer the starting model, so a checkpoint keeps it (`grpo_reference/model.safetensors`, a
subfolder: the checkpoint's own *.safetensors are the policy) and a resumed run loads it back before its first
step: the resumed run's KL is against the same reference as the uninterrupted one's. (TRL's checkpoints do not
keep it: there a resumed run's reference restarts from the starting model.)
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import TrainingError
from trainer.hooks import Hook, Saved

REFERENCE_FILE = "grpo_reference/model.safetensors"


def mix_into(reference, policy, alpha: float) -> None:
    """TRL's SyncRefModelCallback._sync_target_model: reference = (1 - alpha) reference + alpha policy, in place."""
    # heavy: torch loads only when this runs
    import torch

    with torch.no_grad():
        for target, source in zip(reference.parameters(), policy.parameters(), strict=True):
            target.data.mul_(1.0 - alpha).add_(source.data, alpha=alpha)


class SyncReference(Hook):
    def __init__(self, objective, model, alpha: float, every: int, say):
        self.objective, self.model, self.alpha, self.every, self.say = objective, model, alpha, every, say
        self.synced: list[int] = []  # the steps after which the reference was mixed (this process's run)

    @property
    def reference(self):
        ref = self.objective.ref_model  # made by the objective's before_training, after this hook
        if ref is None:
            raise TrainingError("trl.sync_ref_model: the GRPO objective kept no reference model to sync")
        return ref

    def start(self, state: dict, checkpoint: Path | None) -> None:
        """A resumed run's reference: the checkpoint's mixed one (a checkpoint without it was not written with
        sync_ref_model, which a resume cannot turn on: trainer/config/resume.py)."""
        if checkpoint is None:
            return
        path = Path(checkpoint) / REFERENCE_FILE
        if not path.is_file():
            raise TrainingError(f"checkpoint {checkpoint} does not hold the synced GRPO reference ({REFERENCE_FILE}), "
                                "which trl.sync_ref_model needs to resume; start a new run (a new output_dir)")
        # heavy: safetensors and torch load only when this runs
        import torch
        from safetensors.torch import load_file

        saved, params = load_file(str(path)), dict(self.reference.named_parameters())
        if set(saved) != set(params):
            raise TrainingError(f"checkpoint {checkpoint}: {REFERENCE_FILE} does not hold this model's parameters")
        with torch.no_grad():
            for name, param in params.items():
                param.data.copy_(saved[name].to(device=param.device, dtype=param.dtype))

    def after_step(self, step: int) -> None:
        if step % self.every == 0:
            mix_into(self.reference, self.model, self.alpha)
            self.synced.append(step)

    def on_save(self, step: int) -> Saved:
        tensors = {name: p.detach().cpu().contiguous() for name, p in self.reference.named_parameters()}
        return Saved(tensors={REFERENCE_FILE: tensors})


def hook(training) -> Hook | None:
    """The sync for rl: grpo / gdpo with trl.sync_ref_model (the config has refused it with an adapter or beta 0)."""
    cfg = training.cfg
    trl = getattr(cfg, "trl", None)
    if trl is None or not trl.sync_ref_model or cfg.rl not in ("grpo", "gdpo"):
        return None
    training.say(f"{cfg.rl}: trl.sync_ref_model: the reference becomes {trl.mixup_alpha:g} x policy + "
                 f"{1 - trl.mixup_alpha:g} x reference every {trl.sync_steps} steps (TR-DPO, TRL's "
                 "SyncRefModelCallback); checkpoints keep it")
    return SyncReference(training.objective, training.unwrapped, trl.mixup_alpha, trl.sync_steps, training.say)
