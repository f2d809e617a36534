"""Checkpoints: complete or absent.

Every rank writes its RNG state into output_dir/.tmp-checkpoint-N, rank 0 adds the model (HF format:
full weights, or the LoRA adapter), optimizer, scheduler, loss scaler and trainer state (step, epoch,
sampler position), then renames the directory to checkpoint-N. A crash leaves only a .tmp-* directory,
which resuming ignores.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from trainer.errors import TrainingError
from trainer.model.load import load_weights
from trainer.parallel.collective import barrier

STATE_FILE = "trainer_state.json"
DEEPSPEED_TAG = "deepspeed"  # the subdirectory DeepSpeed's own checkpoint (optimizer partitions) goes to


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(output_dir: Path, step: int, model, optimizer, scheduler, scaler, state: dict,
         rank: int, timeout_s: float, keep: int | None = None, engine=None, model_only: bool = False,
         tensors: dict | None = None, protect: str | None = None) -> Path:
    """engine: the accelerator-prepared model; under DeepSpeed its engine writes each rank's partition of the
    optimizer (and ZeRO-3 weights) with save_checkpoint; under FSDP2 the full states are gathered first.
    model_only (save_only_model): the weights and trainer state only -- no optimizer, scheduler, scaler or RNG
    state, as the HF Trainer's save_only_model; trainer_state.json says so, and load() restarts the optimizer.
    tensors: more safetensors files for the checkpoint, {file name: {name: tensor}} (ReLoRA's merged base).
    protect: a checkpoint name that save_total_limit does not delete (early stopping's best, as the HF Trainer)."""
    from trainer.parallel import distributed

    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier("checkpoint save (start)", rank, timeout_s)
    if not model_only:
        torch.save(rng_state(), tmp / f"rng_state_{rank}.pt")
    barrier("checkpoint save (RNG states)", rank, timeout_s)
    deepspeed = engine is not None and distributed.is_deepspeed(engine)
    model_state = distributed.gathered_model_state(engine, model)  # collectives: every rank
    optimizer_state = None if model_only else distributed.full_optimizer_state(model, optimizer)
    if deepspeed and not model_only:
        engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG)  # every rank writes its own partition
    if rank == 0:
        model.save_pretrained(tmp, state_dict=model_state)  # a PeftModel saves only its adapter
        if not model_only:
            if not deepspeed:
                torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(),
                           tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            if scaler is not None:
                torch.save(scaler.state_dict(), tmp / "scaler.pt")
        for name, content in (tensors or {}).items():
            from safetensors.torch import save_file

            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            save_file(content, str(tmp / name))
        (tmp / STATE_FILE).write_text(json.dumps({**state, "model_only": True} if model_only else state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep:
            for old in list_checkpoints(output_dir)[:-keep]:
                if old.name != protect:
                    shutil.rmtree(old, ignore_errors=True)
    barrier("checkpoint save (rename)", rank, timeout_s)
    return final


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
             and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _load_sharded_weights(model, path: Path) -> None:
    """The checkpoint's full weights into an FSDP-sharded model (or adapter)."""
    from safetensors.torch import load_file

    from trainer.parallel import distributed

    weights = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if hasattr(model, "peft_config"):  # adapter files drop the adapter's name from the parameter names
        adapter = f".{model.active_adapter}"
        names = {fqn.replace(adapter, ""): fqn for fqn in model.state_dict() if adapter in fqn}
        missing = [k for k in weights if k not in names]
        if missing:
            raise TrainingError(f"checkpoint {path} does not match the adapter (unexpected {missing[:3]})")
        weights = {names[k]: v for k, v in weights.items()}
    unexpected = [k for k in weights if k not in model.state_dict()]
    if unexpected:
        raise TrainingError(f"checkpoint {path} does not match the model (unexpected {unexpected[:3]})")
    distributed.load_full_model_state(model, weights)


def load(path: Path, model, optimizer, scheduler, scaler, rank: int, world_size: int, engine=None) -> dict:
    """Restore everything save() wrote; return the trainer state."""
    from trainer.parallel import distributed

    path = Path(path)
    if not (path / STATE_FILE).exists():
        raise TrainingError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    state = json.loads((path / STATE_FILE).read_text())
    if state["world_size"] != world_size:
        raise TrainingError(f"checkpoint {path} was written by {state['world_size']} processes; resume it with "
                            f"the same number (got {world_size}) so the data order continues exactly")
    if state.get("model_only"):
        return _load_model_only(path, state, model, scheduler, engine)
    if engine is not None and distributed.is_deepspeed(engine):
        if not (path / DEEPSPEED_TAG).is_dir():
            raise TrainingError(f"checkpoint {path} has no DeepSpeed state ({DEEPSPEED_TAG}/); it was not written "
                                "by a DeepSpeed run")
        engine.load_checkpoint(str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                               load_lr_scheduler_states=False, load_module_strict=False)
        # DeepSpeed's load may leave the optimizer it steps a different object from the one the LR scheduler was
        # built on: point the scheduler at the one DeepSpeed steps, or the learning rate stops following it
        inner = getattr(engine.optimizer, "optimizer", None)
        if inner is not None and inner is not scheduler.optimizer:
            scheduler.optimizer = inner
    elif distributed.is_sharded(model):
        _load_sharded_weights(model, path)
        distributed.load_full_optimizer_state(model, optimizer, torch.load(path / "optimizer.pt", weights_only=False))
    else:
        load_weights(model, path)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    if scaler is not None and (path / "scaler.pt").exists():
        scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=False))
    set_rng_state(torch.load(path / f"rng_state_{rank}.pt", weights_only=False))
    return state



def _load_model_only(path: Path, state: dict, model, scheduler, engine) -> dict:
    """A save_only_model checkpoint: its weights, step and data position. The optimizer starts afresh (its
    moments are not in the checkpoint), the RNG stays as seeded, and the learning-rate schedule is moved to the
    checkpoint's step (it is a function of the step). The HF Trainer resumes such checkpoints the same way,
    except that its schedule restarts from step 0."""
    import warnings

    from trainer.parallel import distributed

    if engine is not None and distributed.is_deepspeed(engine):
        raise TrainingError(f"checkpoint {path} was written with save_only_model (no DeepSpeed state); resuming it "
                            "under DeepSpeed is not supported: resume without deepspeed, or use a full checkpoint")
    if distributed.is_sharded(model):
        _load_sharded_weights(model, path)
    else:
        load_weights(model, path)
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended, nothing is trained
        warnings.simplefilter("ignore")
        for _ in range(state["step"]):
            scheduler.step()
    return state
