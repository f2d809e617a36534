"""Command line: parse arguments, call the module that does the work, print. No policy here.

Exit codes: 0 ok, 1 failure while doing the work, 2 bad input (config, GPU request, missing file).
Errors are one line on stderr; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainer import __version__
from trainer.errors import ConfigError, Stopped, TrainerError



def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _setup(args, gpu: str | None = None):
    # start-up: trainer.setup imported only when this runs
    from trainer.setup import start

    return start(args.config, gpu, getattr(args, "plan", None))


def cmd_validate(args) -> int:
    # heavy: torch loads only when this runs
    from trainer.model import quantization
    from trainer import features
    from trainer.fit import memory
    from trainer.optim import optimizers

    cfg, notes, runtime = _setup(args, args.gpu)
    from trainer.setup import check_inputs, needs

    check_inputs(cfg, model=_for_this_machine(args))  # the rows and (for this machine) the model, as the run reads them
    fit = fit_block(cfg, runtime)
    wanted = needs(cfg, {"features": {"liger": runtime.kernels}})  # (liger only where its kernels run)
    if args.json:
        print(json.dumps({"config": cfg.model_dump(), "runtime": runtime.to_dict(), "notes": notes,
                          "fit": fit.result if fit else None,
                          "needs": [{"key": n.key, "package": n.package, "step": n.step} for n in wanted]}, indent=2))
        return 0
    print(f"config {args.config} is valid")
    print(f"  gpu:        {runtime.gpu.describe()} (from {runtime.gpu.source})")
    print(f"  attention:  {runtime.attention}")
    print(f"  precision:  {runtime.precision}{' + tf32' if runtime.tf32 else ''}")
    print(f"  packing:    {'on' if cfg.sample_packing else 'off'} (sequence_len {cfg.sequence_len}), "
          f"eval packing {'on' if cfg.packing_for_eval else 'off'}")
    print(f"  rows apart: {runtime.isolation}")  # the plan's `packing`: varlen (cu_seqlens) or mask, and why
    if cfg.auto_find_batch_size:
        picked = next((n for n in (fit.notes if fit else []) if n.startswith("micro_batch_size auto: ")), None)
        batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
        print(f"  batch:      micro_batch_size auto: {batch} rows per step per process, split "
              + (picked.removeprefix("micro_batch_size auto: ") if picked else
                 "at start (the whole batch on the CPU)" if fit is None else "at start (1: the estimate is unknown)"))
    else:
        print(f"  batch:      micro_batch_size {cfg.micro_batch_size} x gradient_accumulation_steps "
              f"{cfg.gradient_accumulation_steps} x processes")
    print(f"  adapter:    {cfg.adapter or 'none (full fine-tune)'}"
          + {"load_in_4bit": " on 4-bit (NF4) base weights", "load_in_8bit": " on 8-bit (LLM.int8) base weights"}.get(
              quantization.mode(cfg) or "", ""))
    if cfg.reinit_weights:
        print("  weights:    fresh, from the model's config and the seed (reinit_weights)")
    print(f"  optimizer:  {cfg.optimizer} ({optimizers.check(cfg.optimizer)['library']})")
    for label, text in features.lines(cfg):  # trainer/features.py: each feature's line (qat, sharding ...)
        print(f"  {label + ':':<12}{text}")
    if cfg.use_ray:
        from trainer import ray_launch

        print(f"  launcher:   {ray_launch.describe(cfg, runtime)}")
    if cfg.streamed:
        from trainer.data.streaming import describe

        print(f"  data:       {describe(cfg)}")
    from trainer import objectives

    if described := objectives.describe(cfg):  # trainer/objectives/__init__.py OBJECTIVES: each class's describe
        print(f"  objective:  {described}")
    print(f"  loss:       {memory.loss_line(cfg)}")  # the path chunked_cross_entropy asks for, or by cost
    if wanted:  # trainer/features.py: what the plan for this config installs beside torch and transformers
        print(f"  packages:   {'; '.join(f'{n.package} ({n.key})' for n in wanted)}")
    if experts := (fit.experts if fit else memory.experts_line(cfg, runtime)):  # a k-bit MoE's experts, one line
        print(f"  experts:    {experts}")
    if fit is None:
        print("  fit:        not estimated: no GPU memory here (--gpu NAME estimates for that GPU)")
    else:
        from trainer.fit.memory import cheapest, one_line

        print(f"  fit:        {one_line(fit)}")
        change = cheapest(fit) if fit.result["verdict"] in ("tight", "does_not_fit") else None
        if change:
            print(f"              cheapest change that fits: {change['text']} -> {change['peak_gb']:.1f} GB")
    print("changes for this hardware:" if runtime.changes else "no changes for this hardware")
    for change in runtime.changes:
        print(f"  - {change}")
    if notes:
        print("notes:")
    for note in notes:
        print(f"  - {note}")
    return 0


def _for_this_machine(args) -> bool:
    """Whether validate judges for this machine (its GPU probed, or a plan made for what was detected here): then
    the model must be found here. A GPU named with --gpu, or a plan made for a named one, is another machine's."""
    # start-up: matrices.catalog, trainer.runtime.planfile imported only when this runs
    from matrices.catalog import NAMED_GPU_SOURCES
    from trainer.runtime.planfile import find_plan, read_plan

    if args.gpu not in (None, "auto"):
        return False
    found = read_plan(args.plan) if getattr(args, "plan", None) else (find_plan() or (None,))[0]
    return found is None or (found.get("gpu") or {}).get("source") not in NAMED_GPU_SOURCES


def fit_block(cfg, runtime):
    """The memory estimate on the GPU validate judges for (trainer/fit/memory.py, the one `envtool fit` and
    `envtool train --dry-run` print): None on the CPU. The model's config.json from its directory or a cache only."""
    # start-up: trainer.fit.memory_model imported only when this runs
    from trainer.fit import memory, memory_model

    gpu = runtime.gpu
    if gpu.memory_gb is None and gpu.compute_capability is None and gpu.vendor is None:
        return None
    on = memory.Gpu(gpu.name, gpu.memory_gb, max(1, gpu.count))
    try:
        return memory.report(cfg, runtime, on, local_only=True)
    except memory_model.ModelConfigError as err:  # the model is the loader's to refuse, at train time
        if err.bad_input:  # a config.json no model can have: bad input now, not at load time
            raise ConfigError(str(err)) from None
        reason = f"the model's shape is unknown: {err}"
        return memory.Report(memory.unknown(on, reason), cfg.base_model, [reason], None, reason)


def cmd_preprocess(args) -> int:
    # heavy: torch loads only when this runs
    from trainer.config import load_config
    from trainer.data.prepare import load_tokenizer
    from trainer.objectives import prepare

    cfg, _ = load_config(args.config)
    if cfg.streamed:
        from trainer.errors import ConfigError

        raise ConfigError("preprocess: streamed data (pretraining_dataset, streaming: true) is tokenized while "
                          "training; there is nothing to prepare")
    if cfg.skip_prepare_dataset:
        from trainer.errors import ConfigError

        raise ConfigError("preprocess: skip_prepare_dataset: true tokenizes while training and keeps no prepared "
                          "data; there is nothing to prepare (remove it to prepare once and reuse)")
    from trainer.runtime import hub_access

    hub_access.ensure(cfg, log)  # a hub model with no hub: one line now, not after a minute of retries
    prepared = prepare(cfg, load_tokenizer(cfg), int(os.environ.get("RANK", 0)), log=log)
    result = {"path": str(prepared.path), **prepared.stats}
    print(json.dumps(result, indent=2) if args.json else
          f"prepared {result['train_rows']} training and {result['validation_rows']} validation rows "
          f"({result['train_tokens']} tokens) in {result['path']}")
    return 0


def cmd_train(args) -> int:
    # heavy: torch loads only when this runs
    from trainer.train import train

    cfg, notes, runtime = _setup(args)
    from trainer import ray_launch
    from trainer.setup import check_earlier_run

    earlier = check_earlier_run(cfg)  # checkpoints of an earlier run: continued when the config says so, else refused
    notes = [*notes, earlier] if earlier else notes
    with_ray = cfg.use_ray and not ray_launch.in_worker()  # Ray Train starts the workers, each running this loop
    if with_ray:
        ray_launch.require_ray(launched_by_torchrun=int(os.environ.get("WORLD_SIZE", "1")) > 1)
    for line in runtime.changes + notes:
        if int(os.environ.get("RANK", 0)) == 0:
            log(line if line.startswith("warning: ") else f"note: {line}")
    if with_ray:
        ray_launch.launch(args.config, args.plan, cfg, runtime, log, debug=args.debug)
        return 0
    train(cfg, runtime, log=log)
    return 0


def cmd_evaluate(args) -> int:
    # heavy: torch loads only when this runs
    import torch

    from trainer.batch.collate import Collator
    from trainer.data.prepare import load_tokenizer
    from trainer.errors import ConfigError
    from trainer.model.load import load_trained
    from trainer.objectives import prepare
    from trainer.hooks import Run
    from trainer.objectives.evaluate import evaluate

    cfg, _, runtime = _setup(args)
    if cfg.streamed:
        raise ConfigError("evaluate: streamed data (pretraining_dataset, streaming: true) has no validation split; "
                          "evaluate with a config whose datasets are prepared, with val_set_size")
    if not cfg.val_set_size:
        raise ConfigError("evaluate needs a validation split: set val_set_size")
    model_dir = Path(args.model) if args.model else Path(cfg.output_dir) / "final"
    from trainer.runtime import hub_access

    hub_access.ensure(cfg, log)
    tokenizer = load_tokenizer(cfg)
    prepared = prepare(cfg, tokenizer, log=log)
    device = torch.device(runtime.device)
    collator = Collator(tokenizer.pad_token_id, runtime.attention)
    run = Run(cfg, device, timeout_s=cfg.ddp_timeout, say=log)  # one process
    if cfg.objective != "sft" or cfg.use_eaft or cfg.diffusion is not None or cfg.processor_type:  # the objective's loss
        # and metrics (vision-language: images through its processor)
        # (preference: against the cached reference log-probs; reward models, use_eaft and diffusion: their own losses)
        from trainer import objectives
        from trainer.model.load import load_model
        from trainer.objectives.reference import reference_logps

        objective = objectives.build(cfg, collator, None)
        kwargs = {}
        if objective.needs_reference:  # the reference is the base model as training loaded it
            base = load_model(cfg, runtime, tokenizer).to(device)
            kwargs["reference"] = reference_logps(objective, base, prepared, runtime, run)["validation"]
            del base
        model = load_trained(cfg, runtime, tokenizer, model_dir if model_dir.is_dir() else None).to(device)
        result = objective.evaluate(model, prepared.validation, cfg.eval_batch_size or cfg.micro_batch_size,
                                    objectives.capacity(cfg, cfg.packing_for_eval), run, **kwargs)
        result["model"] = str(model_dir) if model_dir.is_dir() else cfg.base_model
        print(json.dumps(result) if args.json else f"{objective.describe_eval(result)} ({result['model']})")
        return 0
    model = load_trained(cfg, runtime, tokenizer, model_dir if model_dir.is_dir() else None)
    model.to(device)
    result = evaluate(model, prepared.validation, collator, cfg.eval_batch_size or cfg.micro_batch_size,
                      cfg.sequence_len if cfg.packing_for_eval else None, run)
    result["model"] = str(model_dir) if model_dir.is_dir() else cfg.base_model
    print(json.dumps(result) if args.json else
          f"eval_loss {result['eval_loss']:.6f} over {result['eval_tokens']} tokens ({result['model']})")
    return 0


def cmd_make_tiny_model(args) -> int:
    # start-up: trainer.model.tiny imported only when this runs
    from trainer.model.tiny import make_tiny_model

    path = make_tiny_model(args.dir, family=args.family, seed=args.seed)
    print(f"wrote a tiny {args.family} model and tokenizer to {path}")
    return 0


def cmd_merge_lora(args) -> int:
    # start-up: trainer.outputs.merge imported only when this runs
    from trainer.outputs.merge import merge_lora

    result = merge_lora(args.config, args.output, args.dtype, log=log,
                        precision=lambda: _setup(args)[2].precision)  # asked only once the inputs are checked
    if args.json:
        print(json.dumps(result, indent=2))
    elif not result["merged"]:
        print(f"note: {result['note']}")
    else:
        print(f"merged {result['lora_weights']} LoRA weights ({result['whole_tensors']} tensors saved whole) into "
              f"{result['base']}: {result['shards']} shard(s), {result['bytes'] / 2**20:.1f} MiB in {result['dtype']}, "
              f"written to {result['model']} (eos_token_id {result['eos_token_id']})")
    return 0


def cmd_export(args) -> int:
    # start-up: trainer.outputs.gguf imported only when this runs
    from trainer.outputs.gguf import export_gguf

    result = export_gguf(args.config, args.outtype, args.output, log=log)
    print(json.dumps(result, indent=2) if args.json else
          f"wrote {result['path']} ({result['architecture']}, {result['outtype']}, {result['tensors']} tensors, "
          f"{result['bytes'] / 2**20:.1f} MiB; chat template {'included' if result['chat_template'] else 'absent'}, "
          f"eos {result['eos_token_id']}, eot {result['eot_token_id']})")
    return 0


def cmd_chat_check(args) -> int:
    # start-up: trainer.config, trainer.outputs.chat_check imported only when this runs
    from trainer.config import load_config
    from trainer.outputs.chat_check import chat_check, print_report

    from trainer.runtime import hub_access

    cfg, _ = load_config(args.config)
    hub_access.ensure(cfg, log)  # an adapter's hub base with no hub: one line, no retries
    report = chat_check(cfg, args.model, args.max_new_tokens)
    print_report(report, args.json)
    return 0 if report["stopped"] else 1


def cmd_preflight(args) -> int:
    # start-up: trainer.parallel.preflight imported only when this runs
    from trainer.parallel.preflight import main

    return main(args.timeout, args.device, args.config, args.report, args.json, log=log)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="envtool's bundled fine-tuning trainer")
    parser.add_argument("--version", action="version", version=f"trainer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    for add in (_add_run_commands, _add_after_commands, _add_tool_commands):
        add(sub)
    return parser


def _add_run_commands(sub) -> None:
    """validate, preprocess, train, evaluate: a run's commands."""
    p = sub.add_parser("validate", help="show the effective config for this (or another) GPU, each change explained: the attention that will "
                       "run and how packed rows are kept apart (varlen: cu_seqlens, no mask; or a mask), and why")
    p.add_argument("config")
    p.add_argument("--gpu", help="plan for this GPU instead: any name in matrices/gpus.toml (t4, a100, b200, \"NVIDIA H100 80GB HBM3\"), cpu, sm_75 or 7.5")
    p.add_argument("--plan", help="read the GPU and choices from this plan.json")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("preprocess", help="tokenize and cache the datasets once")
    p.add_argument("config")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_preprocess)

    p = sub.add_parser("train", help="train (use torchrun for several processes); SIGTERM/SIGUSR1/Ctrl-C: stop "
                       "after the step with a checkpoint, exit 138 (130 for Ctrl-C); run again to resume",
                       description="Train: checkpoints and final/ (with a generation_config.json that stops at the "
                       "chat template's end of turn) in output_dir. A run a signal stopped resumes when run again; "
                       "an output_dir holding other checkpoints of an earlier run is continued with "
                       "auto_resume_from_checkpoints: true (or resume_from_checkpoint: DIR), else refused (exit 2).")
    p.add_argument("config")
    p.add_argument("--plan", help="plan.json to read instead of ENVTOOL_PLAN, the environment's own plan.json, ./plan.json")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="loss on the validation split")
    p.add_argument("config")
    p.add_argument("--model", help="model or adapter directory (default: output_dir/final, else base_model)")
    p.add_argument("--plan")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)


def _add_after_commands(sub) -> None:
    """merge-lora, export, chat-check: the commands after a run."""
    p = sub.add_parser("merge-lora", help="merge output_dir/final's adapter into the base: a full model in "
                       "output_dir/merged, streamed shard by shard",
                       description="Merge the LoRA/QLoRA adapter in output_dir/final (SFT, DPO, ORPO, KTO, ...) into "
                       "base_model and write a full model to output_dir/merged (or --output): the base's safetensors "
                       "shards with the LoRA deltas added, config.json, the tokenizer and chat template the run saved, "
                       "and generation_config.json whose eos_token_id includes the chat template's end-of-turn token. "
                       "Streams one shard at a time (peak memory about one shard plus the adapter); writes to a "
                       "temporary directory renamed at the end. QLoRA: merged into the unquantized base, in the "
                       "training precision. A full fine-tune's final/ is already a full model: nothing is written. "
                       "Exit codes: 0 merged (or nothing to merge), 2 bad input (no adapter, base not available, "
                       "output exists), 1 failure while merging.")
    p.add_argument("config")
    p.add_argument("--output", help="directory to write (default output_dir/merged); must not exist")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="dtype of the merged weights (default: the precision the config trains in on this machine)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_merge_lora)

    p = sub.add_parser("export", help="the merged (or fully fine-tuned) model as one GGUF file for llama.cpp / Ollama: "
                       "output_dir/<name>-<outtype>.gguf",
                       description="Write output_dir/merged (after merge-lora) or output_dir/final (a full "
                       "fine-tune) as one GGUF file, with the tokenizer, chat template, eos and end-of-turn ids in its "
                       "metadata, using the gguf package (no llama.cpp checkout). Default file: "
                       "output_dir/<output_dir name>-<outtype>.gguf. Families: llama, mistral, qwen2, qwen3 (others "
                       "are refused in one line). Exit codes: 0 written, 2 bad input (no merged model, unsupported "
                       "family or tokenizer, file exists), 1 failure while writing.")
    p.add_argument("config")
    p.add_argument("--format", choices=["gguf"], default="gguf", help="output format (gguf)")
    p.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                   help="tensor type of the 2-D weights (norms and biases stay f32); default f16")
    p.add_argument("--output", help="GGUF file to write; must not exist")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("chat-check", help="does the trained model stop? one greedy chat turn on CPU; exit 0 when it "
                       "ends with an end-of-turn token, 1 when not",
                       description="Load output_dir/merged, else output_dir/final (a full model, or the adapter on "
                       "base_model), render one conversation with the saved chat template, generate up to "
                       "--max-new-tokens greedily on CPU with the saved generation_config.json, and report whether "
                       "the reply ends with an end-of-turn token (the template's, the eos, eot_tokens). Writes nothing. "
                       "Exit codes: 0 the reply ended with an end-of-turn token, 1 it did not (the report says why: "
                       "generation_config.json lacks the token, or the model never wrote it), 2 bad input (no model, "
                       "no chat template).")
    p.add_argument("config")
    p.add_argument("--model", help="model or adapter directory (default output_dir/merged, else output_dir/final)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_chat_check)


def _add_tool_commands(sub) -> None:
    """preflight (under torchrun) and make-tiny-model."""
    p = sub.add_parser("preflight", help="under torchrun: every rank joins, a timed all-reduce, /dev/shm, ulimit -l, "
                       "shared storage across machines; names a rank that does not answer",
                       description="Run under torchrun with the job's launch settings (envtool doctor --multi-gpu "
                       "and a multi-process envtool train do): every rank writes its host facts to the rendezvous "
                       "store and waits at most --timeout seconds for the others (a rank that never joins is named); "
                       "across machines, every machine must see output_dir and dataset_prepared_path (--config); then "
                       "a 4 MiB all-reduce over the training backend (gloo on CPU, NCCL/RCCL on GPUs) with a watchdog "
                       "that names the ranks that never reached it. Also /dev/shm (under 512 MiB: an error on GPUs) and "
                       "ulimit -l with RDMA devices. The lowest rank that joined prints the findings. Exit codes: 0 no "
                       "check failed, 1 a check failed, 2 bad input.")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds each phase waits for the other ranks (30)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPUs torch sees (NCCL/RCCL), else the CPU (gloo)")
    p.add_argument("--config", help="a trainer config: across machines, check that each sees its output_dir and "
                   "dataset_prepared_path")
    p.add_argument("--report", help="a directory: each rank writes rank-N.json there (what envtool reads)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("make-tiny-model", help="write a tiny local model + tokenizer (no downloads)")
    p.add_argument("dir")
    p.add_argument("--family", choices=["llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "llava", "gemma3_vision"],
                   default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # start-up: logging imported only when this runs
    import logging  # torchao (qat extra), when installed, is imported by transformers/peft and logs one warning per

    for name in ("torchao", "torch.utils._pytree"):  # CUDA-only extension it cannot load, and per enum it registers
        logging.getLogger(name).setLevel(logging.ERROR)
    rank = os.environ.get("RANK")
    prefix = f"error (rank {rank}): " if rank not in (None, "0") else "error: "
    from trainer.errors import capped, no_home, readable, record  # under envtool's torchrun launcher the line goes to it, printed once

    why = no_home()
    if why:
        print(prefix + why, file=sys.stderr)
        return 2

    try:
        return args.func(args)
    except Stopped as err:  # not a failure: where the checkpoint is and how to go on, with the stop's exit code
        if not record(str(err), err.exit_code) and rank in (None, "0"):
            print(str(err), file=sys.stderr)
        return err.exit_code
    except TrainerError as err:
        if args.debug:
            raise
        lines = [readable(prefix + line) for _, line in err.problems] or [readable(prefix + str(err))]
        lines = capped(lines, prefix)  # a config with thousands of bad values: the first ones, and a count
        if not record(readable(prefix + str(err)), err.exit_code):  # (envtool's launcher prints that one line)
            for line in lines:  # several problems: one line each
                print(line, file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C twice: at once, no checkpoint (trainer/runtime/stop.py)
        if not record(prefix + "interrupted", 130):
            print(prefix + "interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug or an environment problem: still one line unless --debug
        if args.debug:
            raise
        line = readable(f"{prefix}{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
                        "(run with --debug for the traceback)")
        if not record(line, 1):
            print(line, file=sys.stderr)
        return 1
