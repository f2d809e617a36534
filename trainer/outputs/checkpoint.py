"""Checkpoints: complete or absent, verified before they are trusted, loaded without running code.

Every rank writes its RNG state into output_dir/.tmp-checkpoint-N, rank 0 adds the model (HF format:
full weights, or the LoRA adapter), optimizer, scheduler, loss scaler and trainer state (step, epoch,
sampler position, processes, global batch), and last `manifest.json`: every file's size and sha256. Then it
renames the directory to checkpoint-N. A kill leaves only a .tmp-* directory, which resuming ignores and
the next save in that place removes; a full disk removes it and says so in one line.

Resuming (`choose`) takes the newest checkpoint whose manifest verifies (sizes, then hashes) and names each
newer one it skipped and why (a truncated or overwritten file, a missing one, no manifest: a damaged copy),
so a run continues from the previous good checkpoint instead of failing on every rerun or training on
altered weights. Checkpoints written before manifests existed (no manifest.json, a trainer_state.json) are
still taken, unverified, with a note.

Everything is loaded with `torch.load(weights_only=True)`: tensors and plain containers, never a pickled
object, so a downloaded checkpoint cannot run code (the RNG states are saved as plain lists for that).
DeepSpeed's own partition files are read by DeepSpeed's loader, which unpickles them.

A checkpoint written by N processes resumes on M (trainer/train.py keeps the global batch; here: ranks
without an RNG file of their own take rank `rank % N`'s). DeepSpeed's per-rank ZeRO partitions are the
exception: they resume on N only.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from trainer.errors import TrainingError
from trainer.hooks import Run, Saved
from trainer.model.experts import as_loaded
from trainer.model.load import load_weights
from trainer.parallel.collective import barrier
from trainer.runtime import digest

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"  # written last: {"files": {relative path: {"size": bytes, "sha256": hex}}}
DEEPSPEED_TAG = "deepspeed"  # the subdirectory DeepSpeed's own checkpoint (optimizer partitions) goes to


def rng_state() -> dict:
    """Plain data only (loadable with weights_only=True): numpy's state as a list, its key array as a tensor."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run: Run, model, optimizer, scheduler, scaler, state: dict, engine=None, saved: Saved | None = None) -> Path:
    """Checkpoint `state["step"]` into run.output_dir, keeping the newest cfg.save_total_limit.
    engine: the accelerator-prepared model; under DeepSpeed its engine writes each rank's partition of the
    optimizer (and ZeRO-3 weights) with save_checkpoint; under FSDP2 the full states are gathered first.
    model_only (save_only_model): the weights and trainer state only -- no optimizer, scheduler, scaler or RNG
    state, as the HF Trainer's save_only_model; trainer_state.json says so, and load() restarts the optimizer.
    saved: what the hooks add (trainer.hooks.Saved, its state already in `state`): `tensors`, more safetensors files,
    {file name: {name: tensor}} (ReLoRA's merged base); `keep`, a checkpoint name that save_total_limit does not
    delete (early stopping's best, as the HF Trainer)."""
    # heavy: safetensors loads only when this runs
    from trainer.parallel import distributed

    output_dir, step, rank, timeout_s = run.output_dir, state["step"], run.rank, run.timeout_s
    keep, model_only = run.cfg.save_total_limit, run.cfg.save_only_model
    tensors, protect = (saved.tensors or None, saved.keep) if saved is not None else (None, None)

    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    try:
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
        barrier("checkpoint save (every rank's files)", rank, timeout_s)
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
            write_manifest(tmp)  # last: a checkpoint without one was never finished
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if keep:
                for old in list_checkpoints(output_dir)[:-keep]:
                    if old.name != protect:
                        shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays (and keeps the disk full)
        why = disk_full(err)
        if why is None:
            raise
        raise TrainingError(f"cannot write checkpoint-{step} to {output_dir}: {why}; free space (or lower "
                            f"save_total_limit), then {how_to_continue(output_dir)}") from None
    barrier("checkpoint save (rename)", rank, timeout_s)
    return final




def write_manifest(folder: Path) -> None:
    digest.write(folder, MANIFEST, key="files")  # every file (trainer/runtime/digest.py: the one manifest module)


def damage(path: Path, hashes: bool = True) -> str | None:
    """None when the checkpoint at `path` is whole; else what is wrong with it, in a few words. A checkpoint
    without a manifest (written before manifests existed) passes when its trainer_state.json reads."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.exists():
        if not (path / STATE_FILE).exists():
            return f"no {MANIFEST} or {STATE_FILE} (never finished)"
        try:
            json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError):
            return f"{STATE_FILE} does not read"
        return None
    try:
        files = digest.load(path, MANIFEST, key="files")
    except (OSError, ValueError):
        return f"{MANIFEST} does not read"
    return digest.damage(path, files, MANIFEST, hash_limit=None if hashes else -1)


def choose(output_dir: Path, say=print) -> Path | None:
    """The newest checkpoint in output_dir that verifies; each newer one is named with why it was skipped."""
    for candidate in reversed(list_checkpoints(output_dir)):
        wrong = damage(candidate)
        if wrong is None:
            if not (candidate / MANIFEST).exists():
                say(f"note: {candidate} has no {MANIFEST} (written by an older envtool): resuming it unverified")
            return candidate
        say(f"note: skipping {candidate}: {wrong}; trying the previous checkpoint")
    return None


def read_state(path: Path) -> dict:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise TrainingError(f"checkpoint {path}: {STATE_FILE} does not read ({err})") from None


def _load(path: Path):
    """A checkpoint file as tensors and plain containers: a pickled object (code) is refused, not run."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise TrainingError(f"{path} holds more than tensors and plain values ({str(err).splitlines()[0][:160]}); "
                            "envtool does not load it (it could run code): resume from a checkpoint envtool wrote, "
                            "or start without resume_from_checkpoint") from None
    except FileNotFoundError:
        raise TrainingError(f"checkpoint {path.parent} has no {path.name}: it is damaged; delete it to resume "
                            "from the previous checkpoint") from None


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
             and ((p / STATE_FILE).exists() or (p / MANIFEST).exists())]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _load_sharded_weights(model, path: Path) -> None:
    """The checkpoint's full weights into an FSDP-sharded model (or adapter)."""
    # heavy: safetensors loads only when this runs
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
    else:  # MoE experts saved unfused (the checkpoint's original layout), fused as from_pretrained fuses them
        weights = as_loaded(model, weights)
    unexpected = [k for k in weights if k not in model.state_dict()]
    if unexpected:
        raise TrainingError(f"checkpoint {path} does not match the model (unexpected {unexpected[:3]})")
    distributed.load_full_model_state(model, weights)


def load(path: Path, model, optimizer, scheduler, scaler, rank: int, world_size: int, engine=None) -> dict:
    """Restore everything save() wrote; return the trainer state."""
    # start-up: trainer.parallel.distributed imported only when this runs
    from trainer.parallel import distributed

    path = Path(path)
    state = read_state(path)
    written_by = state["world_size"]
    deepspeed = engine is not None and distributed.is_deepspeed(engine)
    if written_by != world_size and deepspeed and not state.get("model_only"):
        raise TrainingError(f"checkpoint {path} holds DeepSpeed ZeRO partitions of {written_by} processes; resume "
                            f"it on {written_by} (got {world_size}), or convert it with DeepSpeed's "
                            "ds_to_universal.py first")
    if state.get("model_only"):
        return _load_model_only(path, state, model, scheduler, engine)
    if deepspeed:
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
    elif distributed.is_sharded(model):  # the full optimizer state, re-sharded over this run's processes
        _load_sharded_weights(model, path)
        distributed.load_full_optimizer_state(model, optimizer, _load(path / "optimizer.pt"))
    else:
        load_weights(model, path)
        optimizer.load_state_dict(_load(path / "optimizer.pt"))
    scheduler.load_state_dict(_load(path / "scheduler.pt"))
    if scaler is not None and (path / "scaler.pt").exists():
        scaler.load_state_dict(_load(path / "scaler.pt"))
    set_rng_state(_load(path / f"rng_state_{rank % written_by}.pt"))  # more processes now: a previous rank's
    return state


def _load_model_only(path: Path, state: dict, model, scheduler, engine) -> dict:
    """A save_only_model checkpoint: its weights, step and data position. The optimizer starts afresh (its
    moments are not in the checkpoint), the RNG stays as seeded, and the learning-rate schedule is moved to the
    checkpoint's step (it is a function of the step). The HF Trainer resumes such checkpoints the same way,
    except that its schedule restarts from step 0."""
    # start-up: trainer.parallel.distributed imported only when this runs
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


def disk_full(err: BaseException) -> str | None:
    """Why a write failed for want of room, in a few words (no space, over quota, a read-only file system), or None
    for any other failure. torch.save says it as a RuntimeError ("[enforce fail at inline_container.cc] ...
    unexpected pos")."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return os.strerror(err.errno)
    if isinstance(err, RuntimeError) and ("inline_container" in str(err) or "No space left" in str(err)):
        return f"no space left on the device ({str(err).splitlines()[0][:120]})"
    return None


def how_to_continue(output_dir: Path) -> str:
    """What to run after a failure, as words: continue from the newest whole checkpoint (the config keys that
    resume it: a plain rerun into an output_dir with checkpoints is refused, trainer/setup.py), or run again."""
    found = list_checkpoints(Path(output_dir))
    if not found:
        return "run again (no checkpoint was saved yet)"
    return (f"continue from {found[-1]}: run again with auto_resume_from_checkpoints: true (or resume_from_checkpoint: "
            f"{found[-1]})")
