"""The memory and speed options (trainer/config/speed.py), each with torch's own API:

- selective checkpointing: `torch.utils.checkpoint.checkpoint(..., context_fn=...)` with
  `create_selective_checkpoint_contexts` and a policy that keeps the named ops' outputs (MUST_SAVE) and recomputes
  the rest (PREFER_RECOMPUTE), as Axolotl's monkeypatch/selective_checkpointing.py: "attention" is SDPA's and
  flash-attention's forward ops (torch's varlen_attn included), any other entry a substring of the op's name
  ("aten::mm": every matmul); the attention of sliding/chunked-window layers (config.layer_types) is recomputed
  unless save_sliding_window.
  Handed to transformers' gradient checkpointing through its kwargs (trainer/model/load.py).
- activation offloading: `torch.autograd.graph.save_on_cpu` around each micro-batch's forward, loss and backward
  (the Hook's `forward` context): what autograd
  keeps for the backward (with gradient checkpointing, which Axolotl requires for it: each layer's input and what
  lies outside the layers) is held in pinned CPU memory and copied back when the backward needs it. Axolotl's
  values all become this: `legacy` (its synchronous copies, as here), `disk` (Axolotl's own disk path is keyed on
  a value its validator never leaves, so `disk` offloads to CPU memory there too: loaders/patch_manager.py) and
  `hidden_states` (the checkpointed layers' inputs, as here). On the CPU there is nothing to offload.
- ALST's tiled MLP: each decoder layer's MLP run over `tiled_mlp_num_shards` slices of the sequence (Axolotl's
  default: one slice per 32768 tokens, monkeypatch/tiled_mlp/patch.py), each slice under
  `torch.utils.checkpoint.checkpoint`: only the MLP's input is kept and one slice's intermediate exists at a time.
- torch.compile: `nn.Module.compile` on each decoder layer of the loaded model (PyTorch's regional compilation: one
  graph every layer reuses, in place, so the state dict's names do not change and the chunked loss's head swap stays
  outside the graphs; the whole model where it has no such layers) with the config's backend and mode, after
  Axolotl's allow-listed `torch._inductor.config` flags are set. It needs triton
  on a GPU: where the plan switches triton off (e.g. Volta under torch >= 2.x's triton floor) `torch_compile: true`
  is refused in one line naming the GPU, `auto` is off with a note; on the CPU inductor's C++ backend runs.
"""

from __future__ import annotations

import math
from functools import partial

from trainer import facts
from trainer.config.speed import TOKENS_PER_SHARD, compiling, offloading, selective
from trainer.errors import ConfigError
from trainer.errors import HardwareError
from trainer.hooks import Hook

ATTENTION_GROUP = "attention"
_ATEN_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
# flash-attention's forward ops by name (the flash-attn package's, and torch's own varlen_attn: FA2 built in, the
# trainer's packing path on sm_80+, torch/nn/attention/varlen.py's torch_attn::_varlen_attn)
FLASH_OPS = ("flash_attn", "flash_attention", "torch_attn::_varlen_attn")
DEFAULT_RECOMPUTE_LAYER_TYPES = ("sliding_attention", "chunked_attention")


# ---------------------------------------------------------------------------- selective checkpointing


def _op_name(op) -> str:
    try:
        return op.name()
    except (AttributeError, TypeError):
        return getattr(op, "__name__", str(op))


class SavePolicy:
    """The policy_fn of create_selective_checkpoint_contexts; `saved` records the op names it kept (the first
    step's note, and the tests' proof that the policy matched something)."""

    def __init__(self, save: list[str], skip_layer_types: set[str]):
        # heavy: torch loads only when this runs
        import torch

        self.exact = set()
        self.substrings = []
        self.flash = False
        for spec in save:
            if spec == ATTENTION_GROUP:
                self.exact |= {getattr(torch.ops.aten, n).default for n in _ATEN_ATTENTION
                               if hasattr(torch.ops.aten, n)}
                self.flash = True
            else:
                self.substrings.append(spec)
        self.skip = skip_layer_types
        self.layer_type: str | None = None  # set by the decoder layers' hooks while each runs
        self.saved: set[str] = set()

    def matches(self, op) -> bool:
        if op in self.exact:
            return True
        name = _op_name(op)
        lowered = name.lower()
        if self.flash and any(k in lowered for k in FLASH_OPS) and not ("backward" in lowered or "bwd" in lowered):
            return True
        return any(s in name for s in self.substrings)

    def __call__(self, ctx, op, *args, **kwargs):
        # heavy: torch loads only when this runs
        from torch.utils.checkpoint import CheckpointPolicy

        if self.matches(op) and self.layer_type not in self.skip:
            self.saved.add(_op_name(op))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _layer_type(module) -> str | None:
    for obj in (module, getattr(module, "self_attn", None), getattr(module, "attention", None)):
        if obj is None:
            continue
        kind = getattr(obj, "layer_type", None) or getattr(obj, "attention_type", None)
        if isinstance(kind, str):
            return kind
        if getattr(obj, "is_sliding", None) is True:
            return "sliding_attention"
    return None


def selective_policy(cfg, model) -> SavePolicy | None:
    """The policy for `cfg.selective_checkpointing` on `model` (None when off), with each checkpointed decoder
    layer publishing its attention type while it runs (forward and recompute alike)."""
    sac = selective(cfg)
    if sac is None:
        return None
    skip = set() if sac.save_sliding_window else set(
        DEFAULT_RECOMPUTE_LAYER_TYPES if sac.recompute_layer_types is None else sac.recompute_layer_types)
    policy = SavePolicy(sac.save, skip)
    if skip:
        # heavy: transformers loads only when this runs
        from transformers import GradientCheckpointingLayer

        for module in model.modules():
            kind = _layer_type(module) if isinstance(module, GradientCheckpointingLayer) else None
            if kind is None:
                continue

            def enter(mod, args, kind=kind):
                policy.layer_type = kind

            def leave(mod, args, output):
                policy.layer_type = None

            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)
    return policy


def checkpoint_kwargs(cfg, model) -> dict:
    """What selective checkpointing adds to transformers' gradient_checkpointing_kwargs (torch's checkpoint's
    own arguments): a context_fn, non-reentrant."""
    policy = selective_policy(cfg, model)
    if policy is None:
        return {}

    # heavy: torch loads only when this runs
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    model._selective_policy = policy  # (read by tests and the first step's note)
    return {"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, policy)}


# ---------------------------------------------------------------------------- ALST's tiled MLP


def shards(cfg, seqlen: int) -> int:
    """Tiles for a sequence of `seqlen` tokens: tiled_mlp_num_shards, else Axolotl's one per 32768 tokens."""
    return cfg.tiled_mlp_num_shards or max(1, math.ceil(seqlen / TOKENS_PER_SHARD))


def tiled(forward, count):
    """`forward` (an MLP's, over [..., seq, hidden]) run over `count(seq)` slices of the sequence, each under
    non-reentrant checkpointing (only its input kept; its intermediate rebuilt in the backward)."""
    # heavy: torch loads only when this runs
    import torch
    from torch.utils.checkpoint import checkpoint

    def run(x):
        n = min(count(x.shape[-2]), x.shape[-2])
        if n <= 1 and not torch.is_grad_enabled():
            return forward(x)
        pieces = x.chunk(n, dim=-2)
        if not torch.is_grad_enabled():
            return torch.cat([forward(p) for p in pieces], dim=-2)
        return torch.cat([checkpoint(forward, p, use_reentrant=False) for p in pieces], dim=-2)

    return run


def tile_mlps(cfg, model) -> int:
    """Replace each decoder layer's dense MLP forward by its tiled run; return how many. A model whose layers
    have no dense `mlp` (mixture-of-experts blocks, as Axolotl tiles only dense MLPs without its scattermoe
    kernels) is refused in one line."""
    if not cfg.tiled_mlp:
        return 0
    # heavy: transformers loads only when this runs
    from transformers import GradientCheckpointingLayer

    done = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None) if isinstance(layer, GradientCheckpointingLayer) else None
        if mlp is None or hasattr(mlp, "experts"):
            continue
        mlp.forward = tiled(mlp.forward, lambda seq: shards(cfg, seq))
        done += 1
    if not done:
        raise ConfigError(f"tiled_mlp: {type(model).__name__} has no decoder layer with a dense `mlp` to tile "
                          "(mixture-of-experts blocks are not tiled, as in Axolotl); remove tiled_mlp")
    return done


# ---------------------------------------------------------------------------- activation offloading


class OffloadActivations(Hook):
    """Each micro-batch's forward and loss under torch.autograd.graph.save_on_cpu (pinned host memory)."""

    def forward(self):
        # heavy: torch loads only when this runs
        import torch

        return torch.autograd.graph.save_on_cpu(pin_memory=True)


def offload_hook(run) -> Hook | None:
    if not offloading(run.cfg) or str(run.device).startswith("cpu"):
        return None
    return OffloadActivations()


# ---------------------------------------------------------------------------- torch.compile


def compile_runs(gpu, plan: dict | None) -> tuple[bool, str]:
    """Whether torch.compile's backend runs here (the plan's `torch_compile` feature: triton for the GPU), and
    why not."""
    if gpu.cc is None and not gpu.other_vendor:
        return True, ""  # inductor's C++ backend
    below = [r for r in facts.rows("packages", "triton_support")
             if gpu.cc is not None and gpu.cc < tuple(int(x) for x in r["min_cc"].split("."))]
    why = (f"triton compiles for sm_{below[0]['min_cc'].replace('.', '')}+ only: {below[0]['reason']}" if below
           else "")
    if plan is not None and "features" in plan:
        ok = bool(plan["features"].get("torch_compile"))
        return ok, "" if ok else (why or "the plan has no triton that compiles for it")
    return not below, why


def compile_model(cfg, model, on: bool, say) -> bool:
    """model.compile(backend, mode) in place where `on` (notes' verdict); the allow-listed inductor flags first."""
    if not (on and compiling(cfg)):
        return False
    # heavy: torch and transformers load only when this runs
    import torch

    if cfg.torch_compile_options:
        import torch._inductor.config as inductor

        for key, value in cfg.torch_compile_options.items():
            target, _, leaf = key.rpartition(".")
            setattr(getattr(inductor, target) if target else inductor, leaf, value)
    torch._dynamo.config.accumulated_cache_size_limit = 256  # as Axolotl: rows of many lengths recompile
    from transformers import GradientCheckpointingLayer

    kwargs = {"backend": cfg.torch_compile_backend or "inductor", "mode": cfg.torch_compile_mode}
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers or [model]:
        layer.compile(**kwargs)
    say(f"torch.compile: {f'each of the {len(layers)} decoder layers' if layers else 'the model'} compiled "
        f"({kwargs['backend']}{', ' + cfg.torch_compile_mode if cfg.torch_compile_mode else ''}); the first steps "
        "compile")
    return True


# ---------------------------------------------------------------------------- what each becomes on this GPU


def notes(cfg, runtime, plan) -> list[str]:
    """One line per option the config turns on (raises HardwareError where torch_compile: true cannot run)."""
    out = []
    gpu = runtime.gpu
    cpu = runtime.device == "cpu"
    mode = offloading(cfg)
    if mode:
        out.append("activation_offloading: nothing to offload on the CPU (activations are in CPU memory already; "
                   "the estimate's activations term is the same either way)" if cpu else
                   f"activation_offloading{'' if mode == 'true' else ': ' + mode}: each checkpointed layer's input "
                   "and what lies outside the layers kept in pinned CPU memory (torch.autograd.graph.save_on_cpu), "
                   "copied back for the backward")
    sac = selective(cfg)
    if sac is not None:
        out.append(f"selective_checkpointing: the checkpointed layers keep {', '.join(sac.save)} instead of "
                   "recomputing it (torch.utils.checkpoint's selective policy)")
    if cfg.tiled_mlp:
        n = cfg.tiled_mlp_num_shards
        out.append(f"tiled_mlp: each layer's MLP run over {n or 'one slice per 32768 tokens of the'} "
                   f"{'slices of the ' if n else ''}sequence under checkpointing (ALST)")
    if compiling(cfg):
        ok, why = compile_runs(gpu, plan)
        if not ok and cfg.torch_compile is True:
            raise HardwareError(f"torch_compile: true cannot run on {gpu.describe()}: {why} (torch.compile's GPU "
                                "backend is triton); remove torch_compile, or set it to auto")
        out.append(f"torch_compile: off on {gpu.describe()} ({why}; same training, slower)" if not ok else
                   f"torch_compile: on ({'inductor C++ on the CPU' if cpu else 'inductor with triton'}; the first "
                   "steps compile)")
    return out


def line(cfg) -> str | None:
    sac = selective(cfg)
    on = [k for k, v in (("gradient_checkpointing", bool(cfg.gradient_checkpointing)),
                         (f"activation_offloading ({offloading(cfg)})", bool(offloading(cfg))),
                         (f"selective_checkpointing (keeps {', '.join(sac.save) if sac else ''})", sac is not None),
                         (f"tiled_mlp ({cfg.tiled_mlp_num_shards or 'one per 32768 tokens'} slices)",
                          bool(cfg.tiled_mlp)),
                         ("torch_compile", compiling(cfg))) if v]
    return f"options: {', '.join(on)}" if on else None
