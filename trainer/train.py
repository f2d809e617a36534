"""`python -m trainer train config.yml`: one training loop, top to bottom, in three parts (torchtune's recipe shape).

set-up   1. processes, precision and timeouts (trainer/parallel/accelerator.py)
         2. tokenizer and data (the objective's data hook; rank 0 prepares the cache)
         3. model (attention backend, LoRA, checkpointing; kernels and QAT's fake quantization)
         4. the objective, packing sampler and collator
         5. optimizer and LR schedule; the features' hooks; reference log-probs (once)
         6. resume from a checkpoint (chosen at the start: the newest that verifies; on another number of
            processes the accumulation is rescaled to keep the global batch, trainer/config/global_batch.py)
loop     per optimizer step: hooks.before_step, `optimizer_step` (count, accumulate, clip, step: one screen),
         hooks.after_step, log, evaluate, save; a stop request (SIGTERM, SIGUSR1, Ctrl-C: trainer/runtime/stop.py)
         rides in the step's one all-reduce, so every rank stops after the same step and saves it
finish   the last evaluation, hooks.end, the final model or adapter and tokenizer in HF format

What is trained -- SFT, a preference method, a reward model, EBFT, GRPO, diffusion -- is the objective
(trainer.objectives): it builds the batches and computes the loss. What a feature adds to the loop -- QAT's
fake-quant schedule, LISA, ReLoRA, sparsity's masks, diffusion's samples, early stopping -- is its hook
(trainer/hooks.py), made by the feature's own module. The loop has no branch of its own for any of them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from trainer import objectives
from trainer.batch.collate import Collator
from trainer.batch.sampler import MultipackBatchSampler, Order
from trainer.config import Config
from trainer.config import resume as resume_keys
from trainer.config.parallel import sync_each_batch
from trainer.config.training import epoch_steps, steps_from_fractions
from trainer.data.prepare import Prepared, build_held_out, load_tokenizer, prepare
from trainer.errors import ConfigError, DataError, ServerFailed, StepAbandoned, Stopped, TrainingError
from trainer.hooks import Hooks, Run
from trainer.model.attention import for_model
from trainer.model.experts import sharded_experts
from trainer.model.load import DTYPES, load_model
from trainer.objectives import chunked_loss
from trainer.objectives.base import to_device
from trainer.objectives.loss import token_loss_sum
from trainer.outputs import checkpoint, loggers
from trainer.parallel import distributed
from trainer.parallel import mesh as parallelism
from trainer.parallel.accelerator import make_accelerator
from trainer.parallel.collective import barrier, phase, reduce_sum
from trainer.runtime import hub_access
from trainer.runtime.hardware import Runtime
from trainer.runtime.stop import REQUEUE_EXIT
from trainer.runtime.stop import StopRequest

STOPPED = "stopped.json"  # output_dir: written when a stop request ended a run; the next run resumes from it


def train(cfg: Config, runtime: Runtime, log=print) -> Path:
    claims: list = []  # output_dir's lock, released however the run ends (in-process runs follow one another)
    try:
        return Training(cfg, runtime, log, claims).run()
    finally:
        for held in claims:
            held.release()


class Lookahead:
    """The loader's iterator, with the next step's batches visible before they are taken (`peek`): an objective that
    prepares a step ahead (GRPO's async_prefetch) reads them through `Objective.upcoming`. Taking is unchanged."""

    def __init__(self, batches):
        self.batches, self.buffer = batches, []

    def take(self, n: int) -> list:
        return [self.buffer.pop(0) if self.buffer else next(self.batches) for _ in range(n)]

    def peek(self, n: int) -> list | None:
        """The next n batches without taking them; None when fewer are left (the epoch's end)."""
        try:
            while len(self.buffer) < n:
                self.buffer.append(next(self.batches))
        except StopIteration:
            return None
        return self.buffer[:n]


def cadence(every: int | None, per_epoch: int | None, steps_per_epoch: int) -> int | None:
    """eval_steps / save_steps, or the step interval that gives evals/saves_per_epoch."""
    if every:
        return every
    if per_epoch:
        return max(1, steps_per_epoch // per_epoch)
    return None


class Training:
    # --- set-up ---------------------------------------------------------------------------------------------
    def __init__(self, cfg: Config, runtime: Runtime, log=print, claims: list | None = None):
        self.cfg, self.runtime = cfg, runtime
        self.recorded_config = resume_keys.recorded(cfg)  # as given: what checkpoints record, and resumes compare
        self.stage_processes(log, claims)  # 0-1
        self.stage_data()  # 2
        model, context = self.stage_model()  # 3
        self.stage_objective(context)  # 4
        self.stage_optimizer(model)  # 5
        self.stage_reference()  # 5b
        self.stage_start()  # 6

    def stage_processes(self, log, claims: list | None) -> None:
        """0-1: the batch split, processes, precision and timeouts; output_dir claimed; the config a resume keeps."""
        # accelerate's set_seed (random, numpy, torch on every device), as transformers' does; transformers' own
        # imports peft and bitsandbytes (about 1.5 s of start-up) through transformers.trainer_utils
        from accelerate.utils import set_seed

        cfg, runtime = self.cfg, self.runtime
        # 0. micro_batch_size: auto: the split of the step's batch the GPU holds (before DeepSpeed's config reads it)
        from trainer.fit import auto_batch

        resuming = bool(cfg.resume_from_checkpoint) or (cfg.auto_resume_from_checkpoints and
                                                        bool(checkpoint.list_checkpoints(Path(cfg.output_dir))))
        self.batch_choice = auto_batch.choose(cfg, runtime, int(os.environ.get("WORLD_SIZE", "1")), resuming)
        # 1. processes, precision, timeouts
        self.accelerator = accelerator = make_accelerator(cfg, runtime)
        self.rank, self.world, self.device = accelerator.process_index, accelerator.num_processes, accelerator.device
        self.main = accelerator.is_main_process
        self.say = say = log if self.main else (lambda *_: None)
        self.timeout = cfg.ddp_timeout
        set_seed(cfg.seed)
        if runtime.tf32:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        say(f"training on {self.world} process(es), {runtime.gpu.describe()}, attention {runtime.attention}, "
            f"precision {runtime.precision}")
        if self.batch_choice is not None:
            say(auto_batch.describe(self.batch_choice))
        if cfg.deepspeed or cfg.fsdp or cfg.fsdp_config or cfg.fsdp_version:
            say(f"sharding: {accelerator.distributed_type.value}")
        # one run per output_dir, and one that takes writes: found now, not at the first checkpoint
        self.output_dir = Path(cfg.output_dir)
        self.claim = None
        if self.main:
            from trainer.outputs.output_dir import claim

            self.claim = claim(self.output_dir)
            if claims is not None:
                claims.append(self.claim)
        barrier("claiming output_dir", self.rank, self.timeout)  # the others wait for rank 0's refusal or claim
        # the checkpoint to resume, before anything is sized by gradient_accumulation_steps
        mesh = accelerator.mesh
        group = (mesh.tp * mesh.cp) if mesh is not None else 1
        self.resume_from = self.resume_path()
        if self.resume_from is not None:  # a changed config: refused or noted key by key, before anything loads
            before = checkpoint.read_state(self.resume_from).get("config")
            for note in resume_keys.compare(str(self.resume_from), before, self.recorded_config):
                say(note)
        self.cfg = cfg = self.keep_global_batch(cfg, self.world // group)

    def stage_data(self) -> None:
        cfg, runtime, say = self.cfg, self.runtime, self.say
        # 2. tokenizer and data
        # heavy: torch loads only when this runs
        from trainer.outputs import hub

        loggers.check(cfg)  # trackers installed, hub reachable: fail now, not after training
        if self.main:
            hub.check(cfg)
        hub_access.ensure(cfg, say)  # a hub model with no hub: one line now (or offline from the cache), no retries
        objectives.check_services(cfg)  # GRPO's vLLM server answers (bounded wait), or one line now
        self.tokenizer = tokenizer = load_tokenizer(cfg)
        if cfg.streamed:  # read while training (trainer/data/streaming.py); checked now, before the model loads
            from trainer.data.streaming import check_stream

            check_stream(cfg, tokenizer, self.world)
            validation = None
            if cfg.test_datasets:  # the validation rows are prepared up front, as Axolotl prepares them
                validation = prepare(cfg, tokenizer, self.rank, say, build_held_out, {"kind": "validation"}).validation
            self.data = Prepared(None, validation, {"train_rows": "streamed"}, None)
        else:
            self.data = objectives.prepare(cfg, tokenizer, self.rank, log=say)
            if cfg.pose:  # PoSE's position ids (trainer/data/pose.py), drawn per row from the seed
                from trainer.data import pose

                self.data = pose.apply(cfg, self.data)
                say(f"PoSE: position ids skip up to pose_max_context_len {cfg.pose_max_context_len}")

    def stage_model(self):
        """3: the model, fitted and patched; returns it (unprepared) and the context-parallel splitter (None)."""
        # heavy: torch loads only when this runs
        from trainer.model import expert_kernels, kernels, memory_options, qat

        cfg, runtime, say, tokenizer = self.cfg, self.runtime, self.say, self.tokenizer
        mesh = self.accelerator.mesh
        # 3. model (attention fitted to the model's class first: the collator's packing follows it)
        for note in for_model(cfg, runtime, local_only=False):
            say(f"note: {note}")
        model = load_model(cfg, runtime, tokenizer, parallel_kwargs=parallelism.load_kwargs(mesh))
        parallelism.after_load(model, mesh)
        if not cfg.rl:  # before the optimizer sees the weights, and before any wrapping or sharding (as Axolotl)
            from trainer.model import untrained_tokens

            untrained_tokens.fix(cfg, model, tokenizer, self.data.train, say)
        self.tp, self.cp = (mesh.tp, mesh.cp) if mesh is not None else (1, 1)
        self.by_transformers = parallelism.by_transformers(mesh)  # TP/EP: sharded as it loaded, FSDP2 included
        if mesh is not None and mesh.ep > 1:
            split, layers = sharded_experts(model)
            if split == 0 or split != layers:
                raise ConfigError(f"expert_parallel_size: {mesh.ep}: transformers split the experts of {split} of "
                                  f"{layers} MoE layers; this model's expert layout is not one its plan covers")
            say(f"expert parallel: the experts of {layers} MoE layers split over {mesh.ep} ranks "
                f"({self.world} processes)")
        # the ranks of a tensor-parallel group, and of a context-parallel group, share their batches
        group = self.tp * self.cp
        self.data_rank, self.data_world = self.rank // group, self.world // group
        context = None
        if self.cp > 1:  # each sequence split over the CP group (trainer/parallel/context_parallel.py)
            from trainer.parallel.context_parallel import ContextParallel

            context = ContextParallel(model, self.cp, self.tp, self.rank, self.world)
        from trainer.model import ssmax

        ssmax.install(cfg, runtime.attention, say)  # scaling_softmax: SSMax in place of the attention that runs
        kernels.apply(cfg, model, getattr(runtime, "kernels", False), say)  # liger, where the plan says triton runs
        expert_kernels.apply(cfg, model, runtime.gpu, say)  # SonicMoE where it loads, else grouped_mm (a note)
        qat.apply(cfg, model, say)  # torchao fake quantization of the linear layers (before sharding, as Axolotl)
        memory_options.compile_model(cfg, model, getattr(runtime, "compile", False), say)  # last: what runs is compiled
        return model, context

    def stage_objective(self, context) -> None:
        """4: the objective (how batches are built and the loss computed), sampler and collator."""
        cfg, runtime, tokenizer = self.cfg, self.runtime, self.tokenizer
        # 4. the objective (how batches are built and the loss computed), sampler and collator
        collator = Collator(tokenizer.pad_token_id, runtime.attention,
                            pad_to=cfg.sequence_len if cfg.pad_to_sequence_len else None,
                            pad_multiple=8 if runtime.device == "cuda" else 1,
                            positions_only=context is not None)  # CP builds its masks from positions, per slice
        self.objective = objective = objectives.build(cfg, collator, token_loss_sum if context is None else context.loss_sum)
        if context is not None:
            objective.eval_loss_sum = context.loss_sum
        self.batches()

    def stage_optimizer(self, model) -> None:
        cfg, runtime, say = self.cfg, self.runtime, self.say
        accelerator, mesh = self.accelerator, self.accelerator.mesh
        # 5. optimizer and schedule (Axolotl's choice of schedule: cosine floor, constant tail)
        # start-up: trainer.optim.optimizers, trainer.optim.schedule imported only when this runs
        from trainer.optim.optimizers import make_optimizer
        from trainer.optim.schedule import make_scheduler, warmup_steps

        optimizer = make_optimizer(cfg, model)
        self.scheduler = make_scheduler(cfg, optimizer, warmup_steps(cfg, self.total_steps), self.total_steps)
        if self.by_transformers:  # already sharded by transformers (TP, EP); accelerate would wrap it in DDP on CPU
            self.optimizer = accelerator.prepare(optimizer)
            self.model = parallelism.autocast(model, accelerator)
        else:  # the scheduler is stepped by us, once per step
            if kept := distributed.keep_quantized_experts_whole(accelerator, model):
                say(f"FSDP: the {kept} quantized expert tensors are kept whole on each rank (not sharded: their "
                    "quantization state cannot be split with them)")
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            distributed.register_lora_weights(self.model)  # ZeRO-3 + LoRA: the same parameter fetches every micro-batch
        self.unwrapped = unwrapped = accelerator.unwrap_model(self.model)
        if mesh is not None:
            say(f"parallelism: {mesh.describe()}; {parallelism.placement(unwrapped) or 'parameters not sharded'}")
        # FSDP and ZeRO-3 gather weights in every forward (other ZeRO stages pay one extra collective in evaluation)
        self.sharded = distributed.is_sharded(unwrapped) or bool(cfg.deepspeed)
        self.context = Run(cfg, self.device, self.rank, self.world, self.data_rank, self.data_world, self.timeout,
                       self.output_dir, self.sharded, say)  # what hooks, evaluation, reference and checkpoints read
        self.hooks = self.feature_hooks()

    def stage_reference(self) -> None:
        cfg, runtime, say = self.cfg, self.runtime, self.say
        objective, unwrapped, tokenizer, accelerator = self.objective, self.unwrapped, self.tokenizer, self.accelerator
        # 5b. reference log-probs (DPO, IPO, KTO): once, before any step and before a checkpoint's weights load,
        # from the cache when a previous run computed them. Never a second copy of the model.
        self.reference = {}
        if objective.needs_reference:
            # heavy: torch loads only when this runs
            from trainer.objectives.reference import reference_logps

            self.reference = reference_logps(objective, unwrapped, self.data, runtime, self.context,  # lock-step
                                             autocast=accelerator.autocast)  # forwards under FSDP/ZeRO-3
        # EBFT's feature network, GRPO's reference and tokenizer: from the starting weights, before a checkpoint loads
        objective.before_training(unwrapped, tokenizer=tokenizer, dtype=DTYPES[runtime.precision], rank=self.rank,
                                  timeout=self.timeout, output_dir=self.output_dir, say=say)
        self.make_loader()

    def stage_start(self) -> None:
        """6: resume (or start), the hooks' start, the step's loss scale and the metrics log."""
        # heavy: torch loads only when this runs
        from trainer.fit import auto_batch

        cfg, runtime, say = self.cfg, self.runtime, self.say
        tokenizer, group = self.tokenizer, self.tp * self.cp
        # 6. resume
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.batch_choice is not None and self.main:
            auto_batch.record(self.output_dir, self.batch_choice)
        self.step, self.epoch = 0, 0
        self.stepped = False  # an optimizer step done in this process (an OOM back-off only comes before one)
        state, resume = self.resume()
        self.hooks.start(state, Path(resume) if resume else None)  # sparsity's masks come from these weights

        # each step's loss is normalised by the step's totals on all ranks (target tokens for SFT, pairs or
        # examples for preference objectives), counted before the first backward in ONE all-reduce of a
        # fixed-size vector. DDP averages gradients over ranks and DeepSpeed divides by ga: scale to undo both.
        # (CP ranks are data ranks to DDP/FSDP/ZeRO, and each backward holds only its own slice's share)
        self.loss_scale = self.data_world * self.cp * (self.ga if cfg.deepspeed else 1)
        # each batch counts once: the other ranks of a tensor- or context-parallel group add zeros to the step's sums
        self.vote = 1.0 if self.rank % group == 0 else 0.0
        self.sync_every = sync_each_batch(cfg)  # accelerator_config: reduce after every micro-batch
        from trainer.objectives.causal_lm_eval import metrics as causal_lm_metrics

        # do_causal_lm_eval's metrics at every evaluation; the generations they score in a log like metrics.jsonl
        self.eval_extra = causal_lm_metrics(cfg, tokenizer, lambda name: loggers.MetricsLog(
            self.output_dir / name, self.main, fresh=self.step == 0, resumed_at=self.step if resume else None))
        self.metrics = loggers.Trackers(loggers.MetricsLog(self.output_dir / "metrics.jsonl", self.main,
                                                           fresh=self.step == 0,
                                                           resumed_at=self.step if resume else None),
                                        cfg, self.output_dir, self.main, resumed=self.step > 0, log=say)

    def batches(self) -> None:
        """The sampler for the config's micro_batch_size and gradient_accumulation_steps, and what follows from it:
        steps per epoch, total steps, evaluation and save cadence (again after an out-of-memory back-off)."""
        cfg, objective, tokenizer = self.cfg, self.objective, self.tokenizer
        self.ga = ga = cfg.gradient_accumulation_steps
        # rows per loader batch, loader batches per step (GRPO: one batch of prompts, generated into ga micro-batches)
        rows_per_batch, self.draws = objective.loader_batch(cfg.micro_batch_size, ga)
        if cfg.streamed:  # max_steps x accumulation micro-batches from the stream, every rank its own rows
            # heavy: torch loads only when this runs
            from trainer.data.streaming import StreamSampler

            self.sampler = StreamSampler(cfg, tokenizer, self.data_rank, self.data_world)
        else:
            self.sampler = MultipackBatchSampler(
                objective.lengths(self.data.train), rows_per_batch, objectives.capacity(cfg, cfg.sample_packing),
                Order(seed=cfg.seed, drop_last=True, shuffle=not cfg.curriculum_sampling,
                      group_by_length=cfg.group_by_length, group_size=cfg.micro_batch_size * ga,
                      sequential_packing=cfg.sample_packing_sequentially),
                rank=self.data_rank, world_size=self.data_world)
        self.steps_per_epoch = len(self.sampler) // self.draws
        if self.steps_per_epoch == 0:
            unit = "micro-batches" if self.draws == ga else f"batches of {rows_per_batch} prompts"
            raise DataError(f"{self.data.stats['train_rows']} training rows make {len(self.sampler)} {unit} per "
                            f"process, fewer than {f'gradient_accumulation_steps={ga}' if self.draws == ga else 'one per step'}"
                            ": add data or lower micro_batch_size/gradient_accumulation_steps")

        self.total_steps = cfg.max_steps or epoch_steps(cfg, self.steps_per_epoch)

        steps_from_fractions(cfg, self.total_steps)  # eval_steps: 0.05 and the like, as step counts now
        self.eval_every = (cadence(cfg.eval_steps, cfg.evals_per_epoch, self.steps_per_epoch)
                           if self.data.validation is not None else None)
        self.save_every = cadence(cfg.save_steps, cfg.saves_per_epoch, self.steps_per_epoch)

    def make_loader(self) -> None:
        # The loader gets its own generator: starting an iterator must not draw from the global RNG, or a
        # resumed run (which starts one after restoring the RNG) would see different dropout masks.
        # heavy: torch loads only when this runs
        from trainer.data.streaming import StreamRows

        cfg, objective = self.cfg, self.objective
        rows = StreamRows() if cfg.streamed else objective.rows(self.data.train, self.reference.get("train"))
        self.loader = torch.utils.data.DataLoader(rows, batch_sampler=self.sampler, collate_fn=objective.collate,
                                                  num_workers=cfg.dataloader_num_workers,
                                                  generator=torch.Generator().manual_seed(cfg.seed))

    def feature_hooks(self) -> Hooks:
        """Each feature's part in the loop (trainer/features.py: one list; None where the config does not use it)."""
        # start-up: trainer.features imported only when this runs
        from trainer import features

        return Hooks(features.hooks(self))

    def resume_path(self) -> Path | None:
        """resume_from_checkpoint; else the checkpoint a stop request saved (output_dir/stopped.json: running the
        same command again continues); else, with auto_resume_from_checkpoints, the newest in output_dir. Of the
        output_dir's checkpoints, the newest whose manifest verifies: damaged ones are named and skipped."""
        cfg = self.cfg
        if cfg.resume_from_checkpoint:
            path = Path(cfg.resume_from_checkpoint)
            if not path.is_dir():
                raise ConfigError(f"resume_from_checkpoint: not found: {path}")
            wrong = checkpoint.damage(path)
            if wrong:
                raise TrainingError(f"resume_from_checkpoint {path} is damaged: {wrong}; resume from another "
                                    "checkpoint")
            return path
        stopped = (self.output_dir / STOPPED).exists()
        if not (cfg.auto_resume_from_checkpoints or stopped):
            return None
        found = checkpoint.choose(self.output_dir, say=self.say)
        if found is not None and stopped and not cfg.auto_resume_from_checkpoints:
            try:
                during = json.loads((self.output_dir / STOPPED).read_text()).get("during")
            except (OSError, ValueError, AttributeError):
                during = None
            how = f"ended during {during}" if isinstance(during, str) else "was stopped by a signal"
            self.say(f"note: the previous run on {self.output_dir} {how}: continuing from {found}")
        if found is None and stopped:
            self.say(f"note: {self.output_dir / STOPPED} names a stop, but no checkpoint verifies: starting afresh")
        return found

    def keep_global_batch(self, cfg: Config, data_world: int) -> Config:
        """Resuming a checkpoint written by another number of data-parallel processes: the same global batch
        (micro_batch_size x processes x gradient_accumulation_steps) by rescaling the accumulation, so every step
        trains on the same rows as before; refused in one line with the nearest settings where it cannot."""
        if self.resume_from is None:
            return cfg
        # start-up: trainer.config.global_batch imported only when this runs
        from trainer.config.global_batch import accumulation_for, global_batch

        state = checkpoint.read_state(self.resume_from)
        sampler = state.get("sampler", {})
        before = state.get("data_world", sampler.get("world_size", state.get("world_size")))
        rows = state.get("global_batch")
        if before is None or before == data_world:
            return cfg
        rows = rows or global_batch(cfg.micro_batch_size, before, cfg.gradient_accumulation_steps)
        why = (f"{self.resume_from} was trained with a global batch of {rows} rows ({before} data-parallel "
               f"process(es))")
        ga = accumulation_for(rows, cfg.micro_batch_size, data_world, why=why)
        if ga != cfg.gradient_accumulation_steps:
            self.say(f"note: {why}; on {data_world} it continues with gradient_accumulation_steps {ga} "
                     f"(the config says {cfg.gradient_accumulation_steps}) to keep it")
        return cfg.model_copy(update={"gradient_accumulation_steps": ga})

    def continue_schedule(self, resume: Path) -> None:
        """The first step after a resume trains at the rate this run's schedule gives it. The optimizer's stored rate is
        the checkpoint's schedule's: where the length changed (max_steps raised after a finished run), that schedule
        had reached its end and one step trained at rate 0 before the new one took over. LambdaLR (every schedule
        here) computes a rate from its step alone, so the rate is set from it; another scheduler keeps its own."""
        # heavy: torch loads only when training
        from torch.optim.lr_scheduler import LambdaLR

        schedule = getattr(self.scheduler, "scheduler", self.scheduler)  # accelerate's wrapper
        if not isinstance(schedule, LambdaLR):
            return
        rates = [base * fn(schedule.last_epoch) for base, fn in zip(schedule.base_lrs, schedule.lr_lambdas)]
        groups = schedule.optimizer.param_groups
        if all(abs(float(group["lr"]) - rate) <= 1e-12 * max(1.0, abs(rate)) for group, rate in zip(groups, rates)):
            return
        self.say(f"note: the learning rate continues on this run's schedule: {rates[0]:.3g} at step {self.step + 1} "
                 f"({resume} had reached {float(groups[0]['lr']):.3g} on its own)")
        for group, rate in zip(groups, rates):
            if hasattr(group["lr"], "fill_"):  # torchao's optimizers keep it as a tensor
                group["lr"].fill_(rate)
            else:
                group["lr"] = rate
        schedule._last_lr = list(rates)  # what the step reports (get_last_lr)

    def check_same_data(self, resume: Path) -> None:
        """A checkpoint's data position counts rows of the data it was trained on: resumed onto other data (a dataset
        file rewritten, another tokenizer) it would continue into other rows without a word. The prepared data's
        key (trainer/data/prepare.py cache_key: the files' contents, the tokenizer, how rows are built) is recorded
        with each checkpoint and compared here; a checkpoint without one (an older envtool, streamed data) is not."""
        recorded = checkpoint.read_state(resume).get("data")
        here = self.data.path.name if self.data.path is not None else None
        if recorded and here and recorded != here:
            raise ConfigError(f"{resume} was trained on other data than this run reads (prepared data {recorded} "
                              f"there, {here} now: a dataset file, the tokenizer or how rows are built changed): "
                              "resuming would continue its data position into other rows; restore that data, or "
                              "start a new run (a new output_dir)")

    def resume(self) -> tuple[dict, str | None]:
        """The checkpoint chosen at the start: its weights, optimizer, schedule, RNG and data position; returns its
        trainer state and path."""
        resume = self.resume_from
        if resume is None:
            return {}, None
        self.check_same_data(resume)
        state = checkpoint.load(resume, self.unwrapped, self.optimizer, self.scheduler, self.accelerator.scaler,
                                self.rank, self.world, engine=self.model)
        self.step, self.epoch = state["step"], state["sampler"]["epoch"]
        position = dict(state["sampler"])
        before = state.get("data_world", position.get("world_size", self.data_world))
        if before != self.data_world and (self.cfg.streamed or self.draws != self.ga):
            raise TrainingError(f"checkpoint {resume} was written by {before} process(es); "
                                f"{'streamed data' if self.cfg.streamed else 'this objective'} resumes on the same "
                                f"number only (got {self.data_world}): each process's share of the data is its own")
        if before != self.data_world:  # micro-batches each process consumed: the same global count, spread anew
            position["consumed"] = position["consumed"] * before // self.data_world
            extra = " (a new rank takes the RNG state of rank `rank % " + str(before) + "`)" if self.data_world > before else ""
            self.say(f"note: {resume} was written by {before} process(es); resuming on {self.data_world} at the "
                     f"same place in the data{extra}")
        self.sampler.load_state_dict(position)
        self.say(f"resumed from {resume} at step {self.step}")
        self.continue_schedule(resume)
        if state.get("model_only"):
            self.say(f"note: {resume} was saved with save_only_model: its weights, step and data position continue, "
                     "the optimizer restarts with empty state (moments reset) and the RNG is not restored")
        if self.main:
            (self.output_dir / STOPPED).unlink(missing_ok=True)
        return state, str(resume)

    # --- the loop -------------------------------------------------------------------------------------------
    def run(self) -> Path:
        # optional: tqdm is imported only where it is used
        from tqdm.auto import tqdm

        progress = tqdm(total=self.total_steps, initial=self.step, disable=not self.main, desc="training", unit="step")
        self.model.train()
        stopped = False
        self.stop = StopRequest(say_rank0=self.main).install()  # from here a signal means: this step, a checkpoint
        self.stop_now = False
        server = getattr(self.objective, "server", None)
        if server is not None and self.world == 1:  # a wait for the server gives way to a stop (abandon_step)
            server.stopping = lambda: self.stop.requested
        try:  # close the progress bar on errors too, so the error is a line of its own
            while self.step < self.total_steps and not stopped:
                self.sampler.set_epoch(self.epoch)
                consumed = self.sampler.skip  # micro-batches of this epoch done before a resume
                batches = Lookahead(iter(self.loader))
                left = self.steps_per_epoch - consumed // self.draws
                for i in range(left):
                    started = time.perf_counter()
                    self.hooks.before_step(self.step)
                    micro_batches = batches.take(self.draws)  # to the device one at a time
                    ahead = i + 1 < left and self.step + 1 < self.total_steps  # the next step is of this epoch
                    self.objective.upcoming = (lambda b=batches: b.peek(self.draws)) if ahead else None
                    consumed += self.draws
                    oom = None
                    try:
                        report, extra = self.optimizer_step(micro_batches)
                    except torch.OutOfMemoryError as err:
                        err.__traceback__ = None  # its frames hold the step's activations
                        oom = err
                    except (StepAbandoned, ServerFailed) as err:
                        if self.world > 1:  # the ranks stop together at a step's end (trainer/runtime/stop.py)
                            raise
                        progress.close()
                        self.abandon_step(err, consumed - self.draws)
                    if oom is not None:
                        del micro_batches
                        self.out_of_memory(oom)  # raises unless it backed off to a smaller micro-batch
                        progress.total = self.total_steps
                        break  # the epoch again, from its first batch, in the smaller micro-batches
                    self.step += 1
                    for note in chunked_loss.notes():  # how the loss ran: a path's first use, once each
                        self.say(note)
                    progress.update(1)
                    self.log_step(report, extra, time.perf_counter() - started, consumed, progress)
                    self.hooks.after_step(self.step)
                    if self.eval_every and self.step % self.eval_every == 0 and self.step < self.total_steps:
                        stopped = self.hooks.after_evaluation(self.step, self.evaluate())
                    saved = None
                    if self.save_every and self.step % self.save_every == 0:
                        saved = self.save(consumed)
                    if self.stop_now and self.step < self.total_steps:
                        progress.close()
                        self.stopped_by_signal(saved or self.save(consumed))
                    if self.step >= self.total_steps or stopped:
                        break
                else:
                    self.epoch += 1
        except BaseException:
            self.metrics.close()  # finish the trackers' runs on errors too
            self.stop.uninstall()
            raise
        finally:
            progress.close()
        # a signal from now on (the final evaluation and save) lets them finish: the handler stays until the last
        # byte is written; a kill before then finds stopped.json naming the newest checkpoint (the same command
        # resumes from it and completes the run)
        self.stop.finishing()
        if self.main:
            self.mark_finishing()
        try:
            return self.finish(stopped)
        finally:
            self.stop.uninstall()

    def mark_finishing(self) -> None:
        """output_dir/stopped.json naming the newest checkpoint, while the final evaluation and save are under way:
        if the process dies before final/ is complete (a scheduler's kill after its signal, a lost node), the same
        command resumes from that checkpoint and completes the run. The finished save removes it (finish)."""
        newest = checkpoint.list_checkpoints(self.output_dir)
        if not newest:  # nothing to resume from: a rerun starts afresh either way
            return
        tmp = self.output_dir / f".{STOPPED}.tmp"
        tmp.write_text(json.dumps({"step": int(newest[-1].name.split("-")[-1]), "checkpoint": str(newest[-1]),
                                   "signal": None, "during": "the final evaluation and save"}))
        tmp.replace(self.output_dir / STOPPED)

    def out_of_memory(self, err: BaseException) -> None:
        """An out-of-memory error in a step: before the run's first optimizer step, with micro_batch_size: auto on
        one process, the micro-batch halves and the accumulation doubles (trainer/fit/auto_batch.py) and the
        loop starts over; otherwise one line that says what to change."""
        # start-up: trainer.fit.auto_batch, trainer.optim.schedule imported only when this runs
        from trainer.fit import auto_batch

        cfg, choice = self.cfg, self.batch_choice
        first = self.step == 0 and not self.stepped
        smaller = auto_batch.back_off(choice, err) if choice is not None else None
        why = None
        if choice is None:
            why = "set micro_batch_size: auto to find the largest that fits"
        elif not first:
            why = "micro_batch_size: auto backs off before the first optimizer step only; set it lower"
        elif self.world > 1 or cfg.deepspeed or self.draws != self.ga:
            why = ("micro_batch_size: auto backs off in a single process without DeepSpeed only; set "
                   "micro_batch_size lower (and gradient_accumulation_steps higher by as much)")
        elif smaller is None:
            why = "micro_batch_size is 1 already: see `envtool fit` for the changes that fit"
        if why:
            said = (str(err).splitlines() or [""])[0][:200]  # torch's "CUDA out of memory. Tried to allocate ..."
            raise TrainingError(f"out of memory at step {self.step + 1} with micro_batch_size {cfg.micro_batch_size} "
                                f"x gradient_accumulation_steps {cfg.gradient_accumulation_steps}: {why} "
                                f"(torch: {said})") from None
        self.optimizer.zero_grad(set_to_none=True)

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.batch_choice = smaller
        auto_batch.apply(cfg, smaller)
        total = self.total_steps
        self.batches()
        self.make_loader()
        if self.total_steps != total:  # the packing of smaller micro-batches can change the steps per epoch
            from trainer.optim.schedule import make_scheduler, warmup_steps

            self.scheduler = make_scheduler(cfg, getattr(self.optimizer, "optimizer", self.optimizer),
                                            warmup_steps(cfg, self.total_steps), self.total_steps)
        self.say(f"out of memory at micro_batch_size {smaller.backoffs[-1]['micro_batch_size']}: "
                 + auto_batch.describe(smaller))
        if self.main:
            auto_batch.record(self.output_dir, smaller)

    def stopped_by_signal(self, path: Path) -> None:
        """Every rank saw the stop flag in the same step's all-reduce and `path` holds that step: record it (the
        next run of the same command resumes from it), end cleanly, and leave with the stop's exit code."""
        name = self.stop.name or "a stop request on another rank"
        if self.main:
            tmp = self.output_dir / f".{STOPPED}.tmp"
            tmp.write_text(json.dumps({"step": self.step, "checkpoint": str(path), "signal": self.stop.name or None}))
            tmp.replace(self.output_dir / STOPPED)
        code = self.stop.exit_code
        if self.stop.signal is None:  # another rank was signalled: SIGINT reaches all of them, so: requeue

            code = REQUEUE_EXIT
        self.metrics.close()
        barrier("stopping", self.rank, self.timeout)
        if hasattr(self.model, "destroy"):
            self.model.destroy()
        self.accelerator.end_training()
        raise Stopped(f"stopped after step {self.step} of {self.total_steps} ({name}): saved {path}; run the same "
                      f"command again to continue from it (exit code {code})", code)

    def abandon_step(self, err: Exception, consumed: int) -> None:
        """One process, a step given up while it waited for a service, before it changed anything: a stop request
        (StepAbandoned) or the service failing (ServerFailed). The last finished step is kept in a checkpoint (the
        data position before this step's batches, which the resumed run draws again), then the run stops with the
        request's exit code, or ends with the failure's line and where to resume."""
        path = self.save(consumed) if self.step > 0 else None
        if isinstance(err, ServerFailed):
            if path is not None:  # the same command resumes from it (setup.py reads the file as a stop's)
                tmp = self.output_dir / f".{STOPPED}.tmp"
                tmp.write_text(json.dumps({"step": self.step, "checkpoint": str(path), "signal": None,
                                           "during": "a wait for the vLLM server, which failed"}))
                tmp.replace(self.output_dir / STOPPED)
            self.metrics.close()
            kept = (f"; {path} keeps step {self.step}: run the same command again to resume from it" if path else
                    "; no step had finished, so nothing was kept")
            raise ServerFailed(f"{err}{kept}") from None
        if path is not None:
            self.stopped_by_signal(path)
        self.metrics.close()
        raise Stopped(f"stopped before step 1 finished ({self.stop.name}, while waiting for a service): nothing to "
                      "keep; run the same command again to start", self.stop.exit_code)

    def optimizer_step(self, micro_batches: list) -> tuple[dict, dict]:
        """One optimizer step: the step's totals over all micro-batches and ranks first (ONE all-reduce), then
        each micro-batch's loss, already divided by those totals, backpropagated; clip, step. Returns the
        objective's report and the step's lr and grad_norm."""
        objective, accelerator, device, step = self.objective, self.accelerator, self.device, self.step
        objective.step = step  # objectives that draw noise key it by the step (diffusion, GRPO): resume is exact
        with accelerator.autocast():  # GRPO generates and scores the step's completions here (no grad)
            micro_batches = objective.expand(self.unwrapped, micro_batches, self.ga, self.world > 1)
        stats = torch.zeros(len(objective.stat_names), dtype=torch.float64, device=device)
        for batch in micro_batches:  # counts; KTO's KL forwards (no grad) run on the unwrapped model, ga per rank
            batch = to_device(batch, device) if objective.stats_need_model else batch  # on every rank (FSDP2, ZeRO-3)
            stats += torch.tensor(objective.step_stats(self.unwrapped, batch), dtype=torch.float64, device=device)
        # the stop flag rides in the same all-reduce: every rank learns of a request at this step, whichever got it
        flag = torch.tensor([1.0 if self.stop.requested else 0.0], dtype=torch.float64, device=device)
        stats = reduce_sum(torch.cat([stats * self.vote, flag]), f"step {step + 1} (counting the step's totals)",
                           self.rank, self.timeout)
        self.stop_now = bool(stats[-1].item() > 0)
        totals = dict(zip(objective.stat_names, stats[:-1].tolist()))
        sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
        for i, batch in enumerate(micro_batches):
            last = i == self.ga - 1
            sync = nullcontext() if last or self.sync_every else accelerator.no_sync(self.model)
            if self.cfg.deepspeed:  # accelerate steps the DeepSpeed engine in every backward made with
                accelerator.sync_gradients = last  # sync_gradients set: only in the step's last one
            with sync, phase(f"step {step + 1} (backward)", self.rank, self.timeout), self.hooks.forward():
                loss, values = objective.loss(self.model, to_device(batch, device), totals)
                accelerator.backward(loss * self.loss_scale)
            sums += values.to(device)
        sums = reduce_sum(sums * self.vote, f"step {step + 1} (summing the loss)", self.rank, self.timeout)
        report = objective.report(dict(zip(objective.metric_names, sums.tolist())), totals)
        if not math.isfinite(report["loss"]):
            raise TrainingError(f"loss is {report['loss']} at step {step + 1}; lower learning_rate, check the data, "
                                "or use bf16 instead of fp16")
        # EP + LoRA: the adapter's gradients averaged over the ranks, as DDP would
        parallelism.average_plain_gradients(self.model, accelerator.mesh, self.world, self.rank, self.timeout)
        grad_norm = None
        if self.cfg.max_grad_norm:
            norm = accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
            grad_norm = None if norm is None else float(norm)  # None under DeepSpeed, which clips itself
        lr = float(self.scheduler.get_last_lr()[0])  # torchao optimizers keep lr as a tensor
        self.optimizer.step()
        self.stepped = True
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return report, {"lr": lr, "grad_norm": grad_norm}

    def log_step(self, report: dict, extra: dict, elapsed: float, consumed: int, progress) -> None:
        if self.step % self.cfg.logging_steps and self.step != self.total_steps:
            return
        epoch = round(self.epoch + consumed / (self.steps_per_epoch * self.draws), 4)
        self.metrics.write({"step": self.step, "epoch": epoch, **report, **extra,
                            "tokens_per_s": report["tokens"] / elapsed, "step_time_s": elapsed})
        progress.set_postfix(loss=f"{report['loss']:.4f}", lr=f"{extra['lr']:.2e}",
                             **{k: f"{report[k]:.3f}" for k in self.objective.progress_names if k in report})

    def evaluate(self) -> dict:
        """The validation split, scored by the objective (each rank its share; fixed-size all-reduces only)."""
        cfg = self.cfg
        kwargs = {"reference": self.reference.get("validation")} if self.objective.needs_reference else {}
        result = self.objective.evaluate(self.unwrapped, self.data.validation, cfg.eval_batch_size or cfg.micro_batch_size,
                                         objectives.capacity(cfg, cfg.packing_for_eval), self.context, **kwargs)
        if self.tp * self.cp > 1:  # SFT only (rl: is refused with tensor parallelism): each batch was summed on tp ranks
            result["eval_tokens"] //= self.tp * self.cp
        extra = {} if self.eval_extra is None else self.eval_extra(self.unwrapped, self.data.validation, self.device,
                                                                   self.step)
        result.update(extra)
        self.say(f"step {self.step}: {self.objective.describe_eval(result)}"
                 + "".join(f", {name} {value:.4f}" for name, value in extra.items()))
        self.metrics.write({"step": self.step, **result})
        return result

    def save(self, consumed: int) -> Path:
        saved = self.hooks.on_save(self.step)
        state = {"step": self.step, "world_size": self.world, "data_world": self.data_world,
                 "global_batch": self.cfg.micro_batch_size * self.data_world * self.ga,
                 "sampler": self.sampler.state_dict(consumed), **saved.state, "config": self.recorded_config,
                 "data": self.data.path.name if self.data.path is not None else None}  # the prepared data's key
        path = checkpoint.save(self.context, self.unwrapped, self.optimizer, self.scheduler, self.accelerator.scaler,
                               state, engine=self.model, saved=saved)
        self.say(f"saved {path}")
        return path

    # --- finish ---------------------------------------------------------------------------------------------
    def finish(self, stopped: bool) -> Path:
        """The last evaluation, then the final model (or adapter) and tokenizer in HF format."""
        self.stop.pause_at("final-eval", self.say)
        if self.data.validation is not None and not stopped:  # (an early stop has just evaluated)
            self.hooks.after_evaluation(self.step, self.evaluate())
        self.metrics.close()
        self.hooks.end(self.step)  # early stopping: the best checkpoint's weights, as load_best_model_at_end
        final, tmp = self.output_dir / "final", self.output_dir / ".tmp-final"
        full_state = distributed.gathered_model_state(self.model, self.unwrapped)  # FSDP/ZeRO-3: every rank takes part
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.write_final(tmp, final, full_state)
        except (OSError, RuntimeError) as err:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays (and keeps the disk full)
            why = checkpoint.disk_full(err)
            if why is None:
                raise
            raise TrainingError(f"cannot write the final model to {final}: {why}; free space, then "
                                f"{checkpoint.how_to_continue(self.output_dir)}") from None
        if self.main:
            (self.output_dir / STOPPED).unlink(missing_ok=True)  # complete: the next run of the command is not a resume
            self.say(f"saved the final {'adapter' if self.cfg.adapter else 'model'} to {final}")
            if self.stop.requested:
                self.say(f"note: {self.stop.name or 'a stop request'} arrived during the final evaluation or save: "
                         "finished them first; the run is complete")
            # start-up: trainer.outputs.hub imported only when this runs
            from trainer.outputs import hub

            hub.push(self.cfg, self.unwrapped, self.tokenizer, self.say)
        barrier("final save", self.rank, self.timeout)
        if hasattr(self.model, "destroy"):  # a DeepSpeed engine: stop its hooks and helper threads first
            self.model.destroy()
        self.accelerator.end_training()
        self.release_collectives()
        return final

    def release_collectives(self) -> None:
        """A torchrun run's last act, every rank past the final barrier: the wrapped model (DDP's reducer holds a
        process group) and the optimizer are dropped and the process group destroyed here, while every peer is still
        in the run. Left to the interpreter's exit, gloo's process group was destroyed after a peer had gone, and its
        destructor waited for good: a finished 2-process run that never exited (seen once in CI's rehearsal, under
        load). Ray Train's workers are left to Ray, which tears its own group down."""
        if (self.world <= 1 or not torch.distributed.is_initialized()
                or os.environ.get("ENVTOOL_RAY_WORKER") == "1"):
            return
        self.accelerator.free_memory()
        self.model = self.optimizer = self.scheduler = None
        gc.collect()
        barrier("release", self.rank, self.timeout)
        torch.distributed.destroy_process_group()

    def write_final(self, tmp: Path, final: Path, full_state) -> None:
        """The final model (or adapter), tokenizer, processor and generation config into `tmp`, renamed to `final`
        once whole (rank 0 writes; a hook may save for every rank)."""
        if not self.hooks.save_final(self.unwrapped, tmp, self.tokenizer) and self.main:  # (ReLoRA: the merged model)
            self.unwrapped.save_pretrained(tmp, state_dict=full_state)
        if self.main:
            self.tokenizer.save_pretrained(tmp)
            if getattr(self.objective, "processor", None) is not None:  # vision-language: the processor beside it
                self.objective.processor.save_pretrained(tmp)
            self.write_generation_config(tmp)
            self.stop.pause_at("final-save", self.say)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)

    def write_generation_config(self, directory: Path) -> None:
        """final/generation_config.json whose eos_token_id includes the chat template's end-of-turn token, so the
        model (or the adapter on its base) stops where a turn ends (trainer/outputs/chat_check.py). Starts from the
        model's own generation config; a model that does not generate (a reward model) gets none."""
        base = self.unwrapped.get_base_model() if hasattr(self.unwrapped, "get_base_model") else self.unwrapped
        if not (getattr(base, "can_generate", lambda: False)() and getattr(base, "generation_config", None)):
            return
        # start-up: trainer.outputs.chat_check imported only when this runs
        from trainer.outputs.chat_check import write_generation_config

        eos = write_generation_config(directory, self.tokenizer, eot_tokens=self.cfg.eot_tokens,
                                      start=base.generation_config)
        try:
            names = ", ".join(self.tokenizer.convert_ids_to_tokens(eos))
        except Exception:  # a tokenizer without token names (mistral-common's): the ids
            names = str(eos)
        self.say(f"generation_config.json: generation stops on {names}")
