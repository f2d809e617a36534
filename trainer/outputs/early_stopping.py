"""early_stopping_patience, as Axolotl sets it up (transformers' EarlyStoppingCallback with
load_best_model_at_end), and load_best_model_at_end alone (the same, never stopping): after each evaluation, an eval_loss lower than the best so far resets the count;
any other adds one; when the count reaches the patience, training stops after that step. At the end the
final model is the checkpoint with the lowest eval_loss among the evaluations made where a checkpoint was
saved (Axolotl requires eval_steps to divide save_steps for this), unless the last weights are that one.

The state (best loss, count, evaluations at checkpoints) is part of every checkpoint, so a resumed run
stops at the same evaluation as an uninterrupted one. save_total_limit never deletes the best checkpoint
(as the HF Trainer keeps it).
"""

from __future__ import annotations

from pathlib import Path

from trainer.hooks import Hook, Saved


class EarlyStopping(Hook):
    def __init__(self, patience: int | None, log=print, model=None, output_dir: Path | None = None):
        self.patience, self.log = patience, log
        self.model, self.output_dir = model, output_dir  # the run's model ends with the best checkpoint's weights
        self.best: float | None = None
        self.bad = 0
        self.evals: dict[int, float] = {}  # step -> eval_loss, for the steps that have a checkpoint
        self.last_eval: tuple[int, float] | None = None

    def evaluated(self, step: int, eval_loss: float) -> bool:
        """Record an evaluation; True when training should stop."""
        self.last_eval = (step, eval_loss)
        if self.best is None or eval_loss < self.best:
            self.best, self.bad = eval_loss, 0
        else:
            self.bad += 1
        if self.patience is not None and self.bad >= self.patience:  # None: load_best_model_at_end alone
            self.log(f"early stopping at step {step}: eval_loss has not improved on {self.best:.4f} for "
                     f"{self.bad} evaluation(s) (early_stopping_patience {self.patience})")
            return True
        return False

    def saved(self, step: int) -> None:
        """A checkpoint was written at `step`; remember its evaluation if this step had one."""
        if self.last_eval is not None and self.last_eval[0] == step:
            self.evals[step] = self.last_eval[1]

    def best_name(self) -> str | None:
        """The checkpoint save_total_limit must keep (the lowest eval_loss so far)."""
        return f"checkpoint-{min(self.evals, key=lambda s: (self.evals[s], s))}" if self.evals else None

    def best_checkpoint(self, output_dir: Path, final_step: int) -> Path | None:
        """The checkpoint to end with, or None when the last weights are already the best."""
        found = {s: loss for s, loss in self.evals.items() if (Path(output_dir) / f"checkpoint-{s}").is_dir()}
        if not found:
            return None
        step = min(found, key=lambda s: (found[s], s))
        if step == final_step:
            return None
        if self.last_eval is not None and self.last_eval[0] == final_step and self.last_eval[1] <= found[step]:
            return None
        return Path(output_dir) / f"checkpoint-{step}"

    # -- the loop's hook --------------------------------------------------------------------------------------
    def start(self, state: dict, checkpoint) -> None:
        if "early_stopping" in state:
            self.load_state_dict(state["early_stopping"])

    def after_evaluation(self, step: int, result: dict) -> bool:
        return self.evaluated(step, result["eval_loss"])

    def on_save(self, step: int) -> Saved:
        self.saved(step)
        return Saved(state={"early_stopping": self.state_dict()}, keep=self.best_name())

    def end(self, step: int) -> None:
        """Early stopping ends with the best checkpoint's weights, as load_best_model_at_end."""
        best = self.best_checkpoint(self.output_dir, step)
        if best is not None:
            # heavy: torch loads only when this runs
            from trainer.model.load import load_weights

            load_weights(self.model, best)
            self.log(f"the final model is {best.name}, the lowest eval_loss ({self.evals[int(best.name.split('-')[1])]:.4f})")

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "evals": {str(k): v for k, v in self.evals.items()},
                "last_eval": self.last_eval}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad = state["best"], state["bad"]
        self.evals = {int(k): v for k, v in state["evals"].items()}
        self.last_eval = tuple(state["last_eval"]) if state["last_eval"] else None


def hook(cfg, model, output_dir: Path, say=print) -> Hook | None:
    if not (cfg.early_stopping_patience or cfg.load_best_model_at_end):
        return None
    return EarlyStopping(cfg.early_stopping_patience, say, model, output_dir)
