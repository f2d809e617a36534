"""`python -m trainer train config.yml`: one training loop, top to bottom.

1. processes, precision and timeouts (accelerate)   5. optimizer, LR schedule; reference log-probs (once)
2. tokenizer and data (rank 0 prepares the cache)   6. resume from a checkpoint
3. model (attention backend, LoRA, checkpointing)   7. the loop: accumulate, step, log, evaluate, save
4. objective, packing sampler and collator          8. save the final model or adapter

What is trained -- SFT or a preference method (DPO, IPO, ORPO, KTO, SimPO) -- is the objective
(trainer.objectives): it builds the batches and computes the loss. Everything else is this one loop.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch

from trainer import objectives
from trainer.batch.collate import Collator
from trainer.batch.sampler import MultipackBatchSampler
from trainer.config import Config
from trainer.data.prepare import load_tokenizer
from trainer.errors import ConfigError, DataError, TrainingError
from trainer.model.load import load_model, load_weights
from trainer.objectives.base import to_device
from trainer.objectives.loss import token_loss_sum
from trainer.outputs import checkpoint
from trainer.parallel.collective import barrier, phase, reduce_sum
from trainer.runtime.hardware import Runtime

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def make_accelerator(cfg: Config, runtime: Runtime):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"the plan is for {runtime.gpu.describe()} but torch sees no CUDA GPU here")
    deepspeed = None
    if cfg.deepspeed:  # passed through to accelerate; DeepSpeed then owns accumulation, clipping and stepping
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("deepspeed: the deepspeed package is not installed in this environment")
        from trainer.parallel.distributed import deepspeed_path

        deepspeed = DeepSpeedPlugin(hf_ds_config=str(deepspeed_path(cfg.deepspeed)), gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                    gradient_clipping=cfg.max_grad_norm or 0.0)
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        world = int(os.environ.get("WORLD_SIZE", "1"))  # "auto" in Axolotl's files; DeepSpeed checks the product
        deepspeed.deepspeed_config["train_batch_size"] = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world
    # gradient_accumulation_steps stays 1: the loop accumulates itself, normalising by the step's token count
    from trainer.parallel import distributed
    from trainer.parallel import mesh as parallelism

    mesh = parallelism.mesh_for(cfg, parallelism.world_size(), distributed.enabled(cfg))  # sizes vs processes
    mesh_config = parallelism.parallelism_config(mesh)
    # with tensor parallelism transformers shards the model as it loads (FSDP included): accelerate wraps nothing
    fsdp = fsdp_plugin(cfg, runtime) if mesh is None or mesh.tp == 1 else None
    if deepspeed is not None and runtime.device == "cpu":
        # DeepSpeed's CPU accelerator over gloo: accelerate skips DeepSpeed when told cpu=True, and with no GPU
        # and no backend named it would count one process; name gloo and the DeepSpeed launch path
        from accelerate.state import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(cpu=False, backend="gloo", timeout=timedelta(seconds=cfg.ddp_timeout))
    accelerator = Accelerator(
        mixed_precision=MIXED_PRECISION[runtime.precision],
        # accelerate ignores DeepSpeed when told cpu=True; without a GPU it still runs on the CPU (over gloo)
        cpu=runtime.device == "cpu" and deepspeed is None,
        deepspeed_plugin=deepspeed,
        fsdp_plugin=fsdp,
        parallelism_config=mesh_config if runtime.device == "cuda" else None,  # CPU: attached below
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout))] + ddp_kwargs(cfg),
    )
    if fsdp is not None and runtime.device == "cpu":
        from trainer.parallel.distributed import use_fsdp_on_cpu

        use_fsdp_on_cpu(accelerator, fsdp)
        if mesh_config is not None:
            parallelism.attach(accelerator, mesh_config)
    accelerator.mesh = mesh
    return accelerator


def ddp_kwargs(cfg: Config) -> list:
    """ddp_find_unused_parameters, as in Axolotl/HF (only where set: DDP's default is False)."""
    from accelerate.utils import DistributedDataParallelKwargs

    if cfg.ddp_find_unused_parameters is None:
        return []
    return [DistributedDataParallelKwargs(find_unused_parameters=cfg.ddp_find_unused_parameters)]


def fsdp_plugin(cfg: Config, runtime: Runtime):
    from trainer.parallel import distributed

    return distributed.fsdp_plugin(cfg, runtime) if distributed.enabled(cfg) else None


def make_optimizer(cfg: Config, model) -> torch.optim.Optimizer:
    from trainer.optim.optimizers import make_optimizer as build  # the optimizer named in the config, by its library

    return build(cfg, model)


def cadence(every: int | None, per_epoch: int | None, steps_per_epoch: int) -> int | None:
    """eval_steps / save_steps, or the step interval that gives evals/saves_per_epoch."""
    if every:
        return every
    if per_epoch:
        return max(1, steps_per_epoch // per_epoch)
    return None


class MetricsLog:
    """output_dir/metrics.jsonl, one JSON object per line, written by rank 0."""

    def __init__(self, path: Path, enabled: bool, fresh: bool):
        self.path, self.enabled = path, enabled
        if enabled and fresh:  # a new run replaces an old log; a resumed run appends to it
            path.write_text("")

    def write(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def train(cfg: Config, runtime: Runtime, log=print) -> Path:
    from tqdm.auto import tqdm
    from transformers import set_seed

    # 1. processes, precision, timeouts
    accelerator = make_accelerator(cfg, runtime)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    main = accelerator.is_main_process
    say = log if main else (lambda *_: None)
    timeout = cfg.ddp_timeout
    set_seed(cfg.seed)
    if runtime.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    say(f"training on {world} process(es), {runtime.gpu.describe()}, attention {runtime.attention}, "
        f"precision {runtime.precision}")
    if cfg.deepspeed or cfg.fsdp or cfg.fsdp_config or cfg.fsdp_version:
        say(f"sharding: {accelerator.distributed_type.value}")

    # 2. tokenizer and data
    from trainer.model import kernels
    from trainer.outputs import hub, loggers

    loggers.check(cfg)  # trackers installed, hub reachable: fail now, not after training
    if main:
        hub.check(cfg)
    tokenizer = load_tokenizer(cfg)
    if cfg.streamed:  # read while training (trainer/data/streaming.py); checked now, before the model loads
        from trainer.data.prepare import Prepared
        from trainer.data.streaming import check_stream

        check_stream(cfg, tokenizer, world)
        data = Prepared(None, None, {"train_rows": "streamed"}, None)
    else:
        data = objectives.prepare(cfg, tokenizer, rank, log=say)

    # 3. model (attention fitted to the model's class first: the collator's packing follows it)
    from trainer.model.attention import for_model

    for note in for_model(cfg, runtime, local_only=False):
        say(f"note: {note}")
    from trainer.parallel import mesh as parallelism

    mesh = accelerator.mesh
    model = load_model(cfg, runtime, tokenizer, parallel_kwargs=parallelism.load_kwargs(mesh))
    parallelism.after_load(model, mesh)
    tp = mesh.tp if mesh is not None else 1
    cp = mesh.cp if mesh is not None else 1
    # the ranks of a tensor-parallel group, and of a context-parallel group, share their batches
    data_rank, data_world = rank // (tp * cp), world // (tp * cp)
    context = None
    if cp > 1:  # each sequence split over the CP group (trainer/parallel/context_parallel.py); refuses Mamba-like models
        from trainer.parallel.context_parallel import ContextParallel

        context = ContextParallel(model, cp, tp, rank, world)
    kernels.apply(cfg, model, getattr(runtime, "kernels", False), say)  # liger, where the plan says triton runs
    if cfg.qat is not None:  # torchao fake quantization of the linear layers (before sharding, as Axolotl)
        from trainer.model import qat

        say(f"qat: {qat.prepare(model, cfg.qat)} layers fake-quantized ({cfg.qat.describe()})")

    # 4. the objective (how batches are built and the loss computed), sampler and collator
    pad_multiple = 8 if runtime.device == "cuda" else 1
    collator = Collator(tokenizer.pad_token_id, runtime.attention,
                        pad_to=cfg.sequence_len if cfg.pad_to_sequence_len else None, pad_multiple=pad_multiple,
                        positions_only=context is not None)  # CP builds its masks from positions, per slice
    objective = objectives.build(cfg, collator, token_loss_sum if context is None else context.loss_sum)
    if context is not None:
        objective.eval_loss_sum = context.loss_sum
    ga = cfg.gradient_accumulation_steps
    # rows per loader batch, loader batches per step (GRPO: one batch of prompts, generated into ga micro-batches)
    rows_per_batch, draws = objective.loader_batch(cfg.micro_batch_size, ga)
    if cfg.streamed:  # max_steps x accumulation micro-batches from the stream, every rank its own rows
        from trainer.data.streaming import StreamSampler

        sampler = StreamSampler(cfg, tokenizer, data_rank, data_world)
    else:
        sampler = MultipackBatchSampler(objective.lengths(data.train), rows_per_batch,
                                        objectives.capacity(cfg, cfg.sample_packing), seed=cfg.seed,
                                        rank=data_rank, world_size=data_world, drop_last=True, shuffle=not cfg.curriculum_sampling,
                                        group_by_length=cfg.group_by_length,
                                        group_size=cfg.micro_batch_size * cfg.gradient_accumulation_steps,
                                        sequential_packing=cfg.sample_packing_sequentially)
    steps_per_epoch = len(sampler) // draws
    if steps_per_epoch == 0:
        unit = "micro-batches" if draws == ga else f"batches of {rows_per_batch} prompts"
        raise DataError(f"{data.stats['train_rows']} training rows make {len(sampler)} {unit} per process, "
                        f"fewer than {f'gradient_accumulation_steps={ga}' if draws == ga else 'one per step'}: add "
                        "data or lower micro_batch_size/gradient_accumulation_steps")
    total_steps = cfg.max_steps or steps_per_epoch * cfg.num_epochs
    eval_every = cadence(cfg.eval_steps, cfg.evals_per_epoch, steps_per_epoch) if data.validation is not None else None
    save_every = cadence(cfg.save_steps, cfg.saves_per_epoch, steps_per_epoch)

    # 5. optimizer and schedule
    optimizer = make_optimizer(cfg, model)
    from trainer.optim.schedule import (  # Axolotl's choice of schedule (cosine floor, constant tail)
        make_scheduler,
        warmup_steps,
    )

    scheduler = make_scheduler(cfg, optimizer, warmup_steps(cfg, total_steps), total_steps)
    if tp > 1:  # already sharded by transformers; accelerate would wrap it in DDP on CPU
        optimizer = accelerator.prepare(optimizer)
        model = parallelism.autocast(model, accelerator)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)  # the scheduler is stepped by us, once per step
        from trainer.parallel.distributed import register_lora_weights

        register_lora_weights(model)  # ZeRO-3 + LoRA: the same parameter fetches in every micro-batch
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.mesh is not None:
        from trainer.parallel.mesh import placement

        say(f"parallelism: {accelerator.mesh.describe()}; {placement(unwrapped) or 'parameters not sharded'}")
    lisa = None
    if cfg.lisa_n_layers:  # after the optimizer is built over every layer: LISA then freezes all but a few
        from trainer.optim.lisa import Lisa

        if world > 1:
            raise ConfigError("lisa_n_layers: runs in one process here (DDP reduces a gradient for every parameter "
                              "it was built with, so frozen layers would still be decayed and moved)")
        lisa = Lisa(cfg, unwrapped, say)
    relora = None
    if cfg.relora:  # merges LoRA into the base every jagged_restart_steps (trainer.model.relora)
        from trainer.model.load import DTYPES
        from trainer.model.relora import BASE_FILE, ReLoRA

        if world > 1:
            raise ConfigError("relora: runs in one process here (each rank would re-draw its own LoRA at a restart)")
        relora = ReLoRA(cfg, unwrapped, DTYPES[runtime.precision], say)

    # 5b. reference log-probs (DPO, IPO, KTO): once, before any step and before a checkpoint's weights load,
    # from the cache when a previous run computed them. Never a second copy of the model.
    reference = {}
    if objective.needs_reference:
        from trainer.objectives.reference import reference_logps
        from trainer.parallel import distributed

        reference = reference_logps(objective, unwrapped, data, cfg, runtime, device, rank, world,
                                    autocast=accelerator.autocast, log=say,  # FSDP/ZeRO-3: lock-step forwards
                                    sharded=distributed.is_sharded(unwrapped) or bool(cfg.deepspeed))
    from trainer.model.load import DTYPES

    # EBFT's feature network, GRPO's reference and tokenizer: from the starting weights, before a checkpoint loads
    objective.before_training(unwrapped, tokenizer=tokenizer, dtype=DTYPES[runtime.precision], rank=rank,
                              timeout=timeout, output_dir=Path(cfg.output_dir), say=say)
    # The loader gets its own generator: starting an iterator must not draw from the global RNG, or a
    # resumed run (which starts one after restoring the RNG) would see different dropout masks.
    from trainer.data.streaming import StreamRows

    rows = StreamRows() if cfg.streamed else objective.rows(data.train, reference.get("train"))
    loader = torch.utils.data.DataLoader(rows, batch_sampler=sampler,
                                         collate_fn=objective.collate, num_workers=cfg.dataloader_num_workers,
                                         generator=torch.Generator().manual_seed(cfg.seed))

    # 6. resume
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    step, epoch = 0, 0
    trainer_state = {}
    resume = cfg.resume_from_checkpoint
    if resume is None and cfg.auto_resume_from_checkpoints and checkpoint.list_checkpoints(output_dir):
        resume = str(checkpoint.list_checkpoints(output_dir)[-1])
    if resume:
        if not Path(resume).is_dir():
            raise ConfigError(f"resume_from_checkpoint: not found: {resume}")
        state = checkpoint.load(Path(resume), unwrapped, optimizer, scheduler, accelerator.scaler, rank, world,
                                engine=model)
        step, epoch, trainer_state = state["step"], state["sampler"]["epoch"], state
        if relora is not None and "relora_restarts" in state:
            relora.load(Path(resume) / BASE_FILE, state["relora_restarts"])
        sampler.load_state_dict(state["sampler"])
        say(f"resumed from {resume} at step {step}")
        if state.get("model_only"):
            say(f"note: {resume} was saved with save_only_model: its weights, step and data position continue, the "
                "optimizer restarts with empty state (moments reset) and the RNG is not restored")

    pruning = None
    if cfg.llmcompressor is not None:  # after resume: the zero pattern of the weights training continues from
        from trainer.model.sparsity import Pruning

        pruning = Pruning(cfg, unwrapped, say)

    # 7. the loop. Each step's loss is normalised by the step's totals on all ranks (target tokens for SFT,
    # pairs or examples for preference objectives), counted before the first backward in ONE all-reduce of a
    # fixed-size vector. DDP averages gradients over ranks and DeepSpeed divides by ga: scale to undo both.
    # (CP ranks are data ranks to DDP/FSDP/ZeRO, and each backward holds only its own slice's share)
    loss_scale = data_world * cp * (ga if cfg.deepspeed else 1)
    # each batch counts once: the other ranks of a tensor- or context-parallel group add zeros to the step's sums
    vote = 1.0 if rank % (tp * cp) == 0 else 0.0
    from trainer.parallel.mesh import sync_each_batch

    sync_every = sync_each_batch(cfg)  # accelerator_config: reduce gradients after every micro-batch
    evaluation = Evaluation(cfg, objective, unwrapped, data.validation, reference.get("validation"), data_rank,
                            data_world, device, say, tp=tp * cp)
    if cfg.do_causal_lm_eval:  # Axolotl's perplexity of the reference answers, at every evaluation
        from trainer.objectives.causal_lm_eval import CausalLMMetrics

        evaluation.extra = CausalLMMetrics(cfg, tokenizer)
    generate_every = None  # diffusion's generate_samples: rank 0 alone, so not where every forward is a collective
    if cfg.diffusion is not None and cfg.diffusion.generate_samples:
        if evaluation.sharded or tp > 1:
            say("note: diffusion.generate_samples: no samples with sharded weights (each forward is a collective)")
        else:
            generate_every = cfg.diffusion.generation_interval
    stopper, stopped = None, False
    if cfg.early_stopping_patience:
        from trainer.outputs.early_stopping import EarlyStopping

        stopper = EarlyStopping(cfg.early_stopping_patience, say)
        if "early_stopping" in trainer_state:
            stopper.load_state_dict(trainer_state["early_stopping"])
    metrics = loggers.Trackers(MetricsLog(output_dir / "metrics.jsonl", main, fresh=step == 0), cfg, output_dir, main,
                               resumed=step > 0, log=say)
    progress = tqdm(total=total_steps, initial=step, disable=not main, desc="training", unit="step")
    model.train()
    try:  # close the progress bar on errors too, so the error is a line of its own
        while step < total_steps and not stopped:
            sampler.set_epoch(epoch)
            consumed = sampler.skip  # micro-batches of this epoch done before a resume
            batches = iter(loader)
            for _ in range(steps_per_epoch - consumed // draws):
                started = time.perf_counter()
                if cfg.qat is not None and cfg.qat.fake_quant_after_n_steps is not None:
                    from trainer.model import qat

                    qat.set_fake_quant(unwrapped, qat.fake_quant_on(cfg.qat, step))
                if lisa is not None:
                    lisa.before_step(step)
                if relora is not None:
                    relora.before_step(step, optimizer)
                micro_batches = [next(batches) for _ in range(draws)]  # moved to the device one at a time
                consumed += draws
                objective.step = step  # objectives that draw noise key it by the step (diffusion), so resume is exact
                if objective.generates:  # GRPO: generate and score the step's completions (no grad), then ga micro-batches
                    with accelerator.autocast():
                        micro_batches = objective.expand(unwrapped, micro_batches, ga, world > 1)
                stats = torch.zeros(len(objective.stat_names), dtype=torch.float64, device=device)
                for batch in micro_batches:  # counts; KTO's KL forwards (no grad) run on the unwrapped model,
                    # ga per rank on every rank, so also where each forward gathers shards (FSDP2, ZeRO-3)
                    batch = to_device(batch, device) if objective.stats_need_model else batch
                    stats += torch.tensor(objective.step_stats(unwrapped, batch), dtype=torch.float64, device=device)
                stats = reduce_sum(stats * vote, f"step {step + 1} (counting the step's totals)", rank, timeout)
                totals = dict(zip(objective.stat_names, stats.tolist()))
                sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
                for i, batch in enumerate(micro_batches):
                    batch = to_device(batch, device)
                    sync = nullcontext() if i == ga - 1 or sync_every else accelerator.no_sync(model)
                    if cfg.deepspeed:  # accelerate steps the DeepSpeed engine in every backward made with
                        accelerator.sync_gradients = i == ga - 1  # sync_gradients set: only in the step's last one
                    with sync, phase(f"step {step + 1} (backward)", rank, timeout):
                        loss, values = objective.loss(model, batch, totals)
                        accelerator.backward(loss * loss_scale)
                    sums += values.to(device)
                sums = reduce_sum(sums * vote, f"step {step + 1} (summing the loss)", rank, timeout)
                report = objective.report(dict(zip(objective.metric_names, sums.tolist())), totals)
                loss = report["loss"]
                if not math.isfinite(loss):
                    raise TrainingError(f"loss is {loss} at step {step + 1}; lower learning_rate, check the data, "
                                        "or use bf16 instead of fp16")
                grad_norm = None
                if cfg.max_grad_norm:
                    norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
                    grad_norm = None if norm is None else float(norm)  # None under DeepSpeed, which clips itself
                lr = float(scheduler.get_last_lr()[0])  # torchao optimizers keep lr as a tensor
                optimizer.step()
                if pruning is not None:  # ConstantPruningModifier: the targeted weights' zeros again
                    pruning.after_step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                progress.update(1)
                elapsed = time.perf_counter() - started
                if step % cfg.logging_steps == 0 or step == total_steps:
                    row = {"step": step, "epoch": round(epoch + consumed / (steps_per_epoch * draws), 4), **report,
                           "lr": lr, "grad_norm": grad_norm, "tokens_per_s": report["tokens"] / elapsed,
                           "step_time_s": elapsed}
                    metrics.write(row)
                    progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}",
                                         **{k: f"{report[k]:.3f}" for k in objective.progress_names if k in report})
                if generate_every and step % generate_every == 0 and main:  # diffusion's generate_samples
                    from trainer.objectives.diffusion_steps import write_samples

                    write_samples(unwrapped, tokenizer, data.validation if data.validation is not None else data.train,
                                  cfg.diffusion, runtime.attention, cfg.seed, step, output_dir, say)
                if eval_every and step % eval_every == 0 and step < total_steps:
                    result = evaluation.run(step)
                    metrics.write({"step": step, **result})
                    stopped = stopper is not None and stopper.evaluated(step, result["eval_loss"])
                if save_every and step % save_every == 0:
                    state = {"step": step, "world_size": world, "sampler": sampler.state_dict(consumed)}
                    if stopper is not None:
                        stopper.saved(step)
                        state["early_stopping"] = stopper.state_dict()
                    if relora is not None:
                        state["relora_restarts"] = relora.restarts
                    path = checkpoint.save(output_dir, step, unwrapped, optimizer, scheduler, accelerator.scaler,
                                           state, rank, timeout, keep=cfg.save_total_limit, engine=model,
                                           model_only=cfg.save_only_model,
                                           tensors={BASE_FILE: relora.base_weights()} if relora is not None else None,
                                           protect=stopper.best_name() if stopper is not None else None)
                    say(f"saved {path}")
                if step >= total_steps or stopped:
                    break
            else:
                epoch += 1
    except BaseException:
        metrics.close()  # finish the trackers' runs on errors too
        raise
    finally:
        progress.close()
    if data.validation is not None and not stopped:  # (an early stop has just evaluated)
        result = evaluation.run(step)
        metrics.write({"step": step, **result})
        if stopper is not None:
            stopper.evaluated(step, result["eval_loss"])
    metrics.close()
    best = stopper.best_checkpoint(output_dir, step) if stopper is not None else None
    if best is not None:  # early stopping ends with the best checkpoint's weights, as load_best_model_at_end
        load_weights(unwrapped, best)
        say(f"the final model is {best.name}, the lowest eval_loss ({stopper.evals[int(best.name.split('-')[1])]:.4f})")

    # 8. the final model (or adapter) and tokenizer, in HF format
    final = output_dir / "final"
    from trainer.parallel.distributed import gathered_model_state

    full_state = gathered_model_state(model, unwrapped)  # FSDP/ZeRO-3: every rank takes part
    if cfg.qat is not None:  # fake-quantized layers back to nn.Linear/nn.Embedding (same weights, same names)
        from trainer.model import qat

        qat.convert(unwrapped)
        say("qat: converted the fake-quantized layers back to plain ones; quantize the final model with the same "
            "qat dtypes (e.g. `axolotl quantize` with this config)")
    if main:
        tmp = output_dir / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        if relora is not None:  # a full model: the merged base with the last LoRA folded in
            relora.write_final(unwrapped, tmp, tokenizer)
        else:
            unwrapped.save_pretrained(tmp, state_dict=full_state)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        say(f"saved the final {'adapter' if cfg.adapter else 'model'} to {final}")
        hub.push(cfg, unwrapped, tokenizer, say)
    barrier("final save", rank, timeout)
    if hasattr(model, "destroy"):  # a DeepSpeed engine: stop its hooks and helper threads before the process group
        model.destroy()
    accelerator.end_training()
    return final


class Evaluation:
    """The validation split, scored by the objective (each rank its share; fixed-size all-reduces only)."""

    def __init__(self, cfg, objective, model, validation, reference, rank, world, device, say, tp=1):
        from trainer.parallel import distributed

        self.cfg, self.objective, self.model, self.validation, self.reference = cfg, objective, model, validation, reference
        self.rank, self.world, self.device, self.say, self.tp = rank, world, device, say, tp
        # FSDP and ZeRO-3 gather weights in every forward (other ZeRO stages pay one extra collective here)
        self.sharded = distributed.is_sharded(model) or bool(cfg.deepspeed)
        self.extra = None  # more metrics on the validation split (do_causal_lm_eval)

    def run(self, step: int) -> dict:
        cfg = self.cfg
        kwargs = {"reference": self.reference} if self.objective.needs_reference else {}
        result = self.objective.evaluate(self.model, self.validation, cfg.eval_batch_size or cfg.micro_batch_size,
                                         objectives.capacity(cfg, cfg.packing_for_eval), self.device, self.rank,
                                         self.world, cfg.ddp_timeout, sharded=self.sharded, **kwargs)
        if self.tp > 1:  # SFT only (rl: is refused with tensor parallelism): each batch was summed on tp ranks
            result["eval_tokens"] //= self.tp
        if self.extra is not None:
            result.update(self.extra(self.model, self.validation, self.device))
        self.say(f"step {step}: {self.objective.describe_eval(result)}")
        return result
