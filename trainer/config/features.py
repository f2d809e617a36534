"""The one ordered list of the trainer's features, `FEATURES`: what each is, the config keys it declares, and
where its behaviour lives (issue 30: a feature is one object on one list).

The list sits here, in the config's wing, because the config's schema and the resume table read it: a feature
that brings config keys declares them on its entry (`config`: name -> Key: the annotation, pydantic's Field with
its default and bounds, and what a resume may do with it), and trainer/config/schema.py composes them into
Config, trainer/config/resume.py into its table. Everything above reads the same list through trainer/features.py
(setup's notes, validate's lines, the plan's packages, the loop's hooks), which says what each field means.

A feature's behaviour lives in modules above the config (the model, the optimizer, the loop's outputs ...), which
the config must not import. An entry names each of its functions as `Ref("module:function")`, imported at its
first call (the way a package names its entry points): the list reads as data here, and the import happens in the
layer that calls it. tests/trainer/config/test_feature_list.py checks that every Ref resolves to a function and
names only a module trainer/features.py may import by the layers of pyproject.toml [tool.importlinter].

Adding a feature: its module (its behaviour: `hook(training)`, `line(cfg)` ...) and one entry on this list (with
its config keys, where it has any); its decision in matrices/axolotl_keys.toml where Axolotl has the key.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple

from pydantic import Field

SONICMOE_PACKAGES = ("kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi")  # trainer/model/expert_kernels.py
RESUME_CLASSES = ("trains", "may change")  # trainer/config/resume.py's classes a feature's key may take


@dataclass(frozen=True)
class Ref:
    """A function of a module above the config, by name ("trainer.model.qat:hook"); called like the function."""

    target: str

    def function(self) -> Callable:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args):
        return self.function()(*args)


def _at(name: str) -> Ref:
    """One of trainer/features.py's adapters (the feature's module takes other arguments than the list passes)."""
    return Ref(f"trainer.features:{name}")


class Key(NamedTuple):
    """A config key a feature declares: a field of Config (trainer/config/schema.py) and a row of the resume table."""

    annotation: Any  # its type, as a section would annotate it ("int | None")
    field: Any  # pydantic's Field(default, bounds ...), or a plain default
    resume: str  # what a resume may do with it (trainer/config/resume.py): "trains" (refused) | "may change" (noted)


def _nothing(cfg, plan) -> list:
    return []


@dataclass(frozen=True)
class Feature:
    name: str
    summary: str  # one line, for validate and the dry-run
    keys: tuple[str, ...]  # the config keys that can turn it on
    packages: tuple[str, ...]  # the distributions it needs installed (packages.toml [[package]] or [[stack]])
    imports: tuple[str, ...]  # the modules the trainer imports for it
    hardware: str  # where it runs (the floors themselves are [[feature]] / [[package]] rows)
    uses: Callable = _nothing  # (cfg, plan dict | None) -> list[Use]; [] when the config does not use it
    step: str = "train"  # "train"; "export": imported only by `python -m trainer export --format gguf`; "serve": by a
    # server run beside training from the same environment (vllm), never by the trainer
    hook: Callable | None = None  # (training) -> Hook | None: its part in the training loop, where it has one
    notes: Callable | None = None  # (cfg, runtime, plan) -> list[str]: on this GPU; raises HardwareError
    line: Callable | None = None  # (cfg) -> "label: text" | None: validate's line about it
    # the config keys it declares (most features' keys live in the config's sections); not hashed: a dict
    config: dict[str, Key] = field(default_factory=dict, hash=False)


FEATURES: list[Feature] = [
    Feature("quantized_loading", "bitsandbytes 4-bit (NF4) or 8-bit (LLM.int8) base weights",
            ("load_in_4bit", "load_in_8bit", "adapter: qlora"), ("bitsandbytes",), ("bitsandbytes",),
            "floors per mode: packages.toml [[feature]] bnb_4bit, bnb_int8_loading; CPU backend too", _at("_quantized"),
            notes=_at("_quantized_notes")),
    Feature("bnb_optimizer", "bitsandbytes' 8-bit and paged optimizers", ("optimizer",), ("bitsandbytes",),
            ("bitsandbytes",), "packages.toml [[feature]] bnb_8bit_optimizer", _at("_bnb_optimizer"),
            notes=_at("_optimizer_notes")),
    Feature("torchao_optimizer", "torchao's 8-bit/4-bit AdamW (adamw_torch_8bit, adamw_torch_4bit, ao_adamw_*)",
            ("optimizer",), ("torchao",), ("torchao.optim",), "Python over torch ops (torch.compile); any device",
            _at("_torchao_optimizer")),
    Feature("qat", "quantization-aware training (torchao fake quantization)", ("qat",), ("torchao",),
            ("torchao.quantization.qat",), "floors per dtype: packages.toml [[feature]] torchao_*", _at("_qat"),
            notes=_at("_qat_notes"), line=_at("_qat_line"), hook=_at("_qat_hook")),
    Feature("bitnet", "BitNet b1.58 training (onebitllms' BitNetLinear)", ("use_onebitllms",), ("onebitllms",),
            ("onebitllms",), "triton kernels: a CUDA GPU triton compiles for", _at("_bitnet"), notes=_at("_bitnet_notes")),
    Feature("deepspeed", "DeepSpeed ZeRO sharding", ("deepspeed",), ("deepspeed",), ("deepspeed",),
            "CUDA GPUs (ZeRO over gloo on the CPU): packages.toml [[gpu_requirement]]", _at("_deepspeed"),
            line=_at("_deepspeed_line")),
    Feature("fsdp", "torch's FSDP1/FSDP2 sharding through accelerate", ("fsdp", "fsdp_config", "fsdp_version"), (),
            (), "any device torch runs on (FSDP1 on the CPU: a note)", notes=_at("_fsdp_notes"), line=_at("_fsdp_line")),
    Feature("ray", "Ray Train launcher (workers on a local Ray cluster)", ("use_ray",), ("ray",),
            ("ray.train.torch",), "any device torch runs on", _at("_ray")),
    Feature("liger", "liger-kernel's triton kernels (RoPE, RMSNorm, SwiGLU, LayerNorm)",
            ("liger_rope", "liger_rms_norm", "liger_layer_norm", "liger_glu_activation", "liger_swiglu"),
            ("liger-kernel",), ("liger_kernel.transformers",),
            "where the plan says triton kernels run (plan features.liger); off elsewhere", _at("_liger"), notes=_at("_liger_notes")),
    Feature("wandb", "Weights & Biases logging (offline without credentials)", ("wandb_project", "use_wandb"),
            ("wandb",), ("wandb",), "any", _at("_wandb")),
    Feature("tensorboard", "TensorBoard event files in output_dir/runs", ("use_tensorboard",), ("tensorboard",),
            ("tensorboard", "torch.utils.tensorboard"), "any", _at("_tensorboard")),
    Feature("mlflow", "MLflow logging (a local file store unless mlflow_tracking_uri)",
            ("use_mlflow", "mlflow_tracking_uri", "mlflow_experiment_name"), ("mlflow-skinny",), ("mlflow",),
            "any", _at("_mlflow")),
    Feature("mistral_common", "Mistral's own tokenizer (mistral-common)", ("tokenizer_use_mistral_common",),
            ("mistral-common",), ("mistral_common", "transformers.tokenization_mistral_common"), "any", _at("_mistral")),
    Feature("expert_kernels", "fused MoE expert kernels: SonicMoE through transformers' experts interface",
            ("experts_implementation", "use_sonicmoe", "use_scattermoe", "expert_backend"), SONICMOE_PACKAGES,
            ("kernels", "cutlass", "tvm_ffi"), "SonicMoE: CUDA GPUs at sm_90+ (packages.toml [[feature]] "
            "sonicmoe_experts); ScatterMoE and DeepGEMM: no package installs them (grouped_mm, with a note)",
            _at("_expert_kernels"), notes=_at("_expert_kernels_notes"),
            # Axolotl's kernels plugin (src/axolotl/integrations/kernels/args.py at 067b021): the flags set
            # experts_implementation unless it is given; expert_backend sets the flag
            config={"use_sonicmoe": Key(bool | None, None, "may change"),
                    "use_scattermoe": Key(bool | None, None, "may change"),
                    "expert_backend": Key(Literal["scattermoe", "sonicmoe", "eager", "builtin"] | None, None,
                                          "may change")}),
    Feature("causal_lm_eval", "do_causal_lm_eval's sacrebleu, ter and chrf: greedy generations on the validation "
            "split, scored by the sacrebleu package", ("do_causal_lm_eval", "eval_causal_lm_metrics"), ("sacrebleu",),
            ("sacrebleu",), "any (pure Python)", _at("_causal_lm_eval")),
    Feature("gguf_export", "`python -m trainer export --format gguf`, printed as a next step after training", (),
            ("gguf",), ("gguf",), "any (pure Python)", _at("_gguf"), step="export"),
    # the trainer imports no vllm (it talks to the server over HTTP: trainer/objectives/grpo_server.py); the plan
    # installs it for the server, run from the same environment (`vllm serve`), where a vLLM release fits the stack
    Feature("vllm_server", "vLLM, the generation server GRPO's completions come from (`vllm serve` in this "
            "environment)", ("trl.use_vllm",), ("vllm",), (), "CUDA GPUs: packages.toml [[package]] vllm rows",
            _at("_vllm"), step="serve"),
    # the loop's features: no package beyond the training stack, a hook each (in the order the loop calls them)
    Feature("lisa", "LISA: a few randomly drawn layers trained at a time", ("lisa_n_layers",), (), (), "any",
            hook=_at("_lisa_hook")),
    Feature("relora", "ReLoRA: LoRA merged into the base every jagged_restart_steps", ("relora",), (), (), "any",
            hook=_at("_relora_hook")),
    Feature("sparsity", "llmcompressor's sparse weights kept sparse while training", ("llmcompressor",), (), (),
            "any", hook=_at("_sparsity_hook")),
    Feature("diffusion_samples", "diffusion samples written every N steps", ("diffusion",), (), (), "any",
            hook=_at("_diffusion_hook")),
    Feature("grpo_ref_sync", "TR-DPO's reference sync for GRPO: the policy mixed into the reference every N steps "
            "(TRL's SyncRefModelCallback)", ("trl.sync_ref_model",), (), (), "any",
            hook=Ref("trainer.objectives.grpo_ref_sync:hook")),
    Feature("early_stopping", "stop after early_stopping_patience evaluations without a better eval_loss; end with "
            "the best checkpoint (with it, or load_best_model_at_end alone)",
            ("early_stopping_patience", "load_best_model_at_end"), (), (), "any", hook=_at("_early_stopping_hook"),
            config={"load_best_model_at_end": Key(bool, False, "may change")}),
    Feature("neftune", "NEFTune: noise on the input embeddings while training", ("neftune_noise_alpha",), (), (),
            "any", hook=_at("_neftune_hook")),
    Feature("memory_options", "activation offloading, selective checkpointing, ALST's tiled MLP, torch.compile "
            "(torch's own APIs)", ("activation_offloading", "selective_checkpointing", "tiled_mlp", "torch_compile"),
            (), (), "any; activation offloading does nothing on the CPU; torch.compile needs the plan's triton on a GPU",
            hook=_at("_memory_hook"), notes=_at("_memory_notes"), line=_at("_memory_line")),
    Feature("empty_cache", "the accelerator's cached memory released every N steps (transformers' own key)",
            ("torch_empty_cache_steps",), (), (), "any",
            hook=_at("_empty_cache_hook"), line=_at("_empty_cache_line")),
    Feature("gc_collect", "Python's garbage collector (and the accelerator's cache) every N steps, before evaluations "
            "and saves (Axolotl's GCCallback)", ("gc_collect_steps",), (), (), "any",
            hook=Ref("trainer.runtime.gc_collect:hook"), line=Ref("trainer.runtime.gc_collect:line"),
            config={"gc_collect_steps": Key(int | None, Field(None, ge=-1), "may change")}),  # -1: evals/saves only
]


def keys() -> dict[str, Key]:
    """Every config key the features declare, in FEATURES' order (a key declared twice is a bug of this list)."""
    out: dict[str, Key] = {}
    for feature in FEATURES:
        for name, key in feature.config.items():
            if name in out:
                raise ValueError(f"config key {name} declared by two features")
            out[name] = key
    return out
