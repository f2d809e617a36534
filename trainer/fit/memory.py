"""Will it fit? The peak GPU memory of a training config, per GPU, term by term, with a band that says how sure.

The estimate follows what this trainer does (trainer/model/load.py, trainer/train.py, trainer/optim/optimizers.py), term by term:

- weights: the dtype each parameter is held in. Full fine-tunes hold bf16 weights under bf16 (Axolotl's regime) and
  fp32 master weights with fp32_master_weights: true or under fp16 (trainer/runtime/hardware.py full_weights); LoRA
  keeps the frozen base in the training precision and the adapter in fp32; QLoRA stores each nn.Linear in NF4
  (4 bits per weight, plus bitsandbytes' quantization state: one absmax per 64 weights, itself quantized to 8 bits
  per 256 blocks with double quantization, and a code table per tensor) or LLM.int8 (1 byte per weight and an fp32
  scale per output row), and peft's prepare_model_for_kbit_training casts everything else (embeddings, head,
  norms) to fp32.
- gradients: one per trained parameter, in its dtype; DDP's bucket copy on top with several processes.
- optimizer: matrices/optimizers.toml's states per trained parameter (8/4-bit states in blocks with fp32 scales,
  small tensors unquantized), and the update's temporaries (torch's foreach AdamW: one more tensor of the trained
  size).
- activations: what autograd saves per token per decoder layer, counted op by op from the layer's shape (norms keep
  an fp32 copy of their input; each linear layer whose weight trains keeps its input, once per distinct input, or
  once per layer under autocast with fp32 weights, which casts the input anew for each; LoRA keeps the input of
  lora_A in its own cast; the attention keeps q, k, v, the output and the log-sum-exp: keys and values repeated to
  every query head and the boolean mask converted to the compute dtype when a mask is passed (sdpa with packed or
  padded rows, as this trainer always passes one), and the seq x seq probabilities in fp32 and again in the compute
  dtype for eager attention; the MLP keeps its gate, up and activation outputs). With gradient checkpointing each
  layer keeps only its input, and one layer's full set is rebuilt at a time in the backward.
- logits and loss: the head's output over the vocabulary, its fp32 copy and log-softmax (trainer/objectives/loss.py), and the
  same again in the backward: about 12 bytes per token per vocabulary entry (liger's fused linear cross-entropy
  and cut_cross_entropy never build it).
- overhead: the CUDA context, cuBLAS workspaces and NCCL buffers, and the caching allocator's slack.

The peak is the largest of four moments: the end of the forward, the loss (logits at their largest), the backward
(with checkpointing: one layer rebuilt) and the optimizer step (gradients, states and the update's temporaries at
once). Gradients from earlier micro-batches stay across the forward when gradient_accumulation_steps > 1.
ZeRO 1/2/3 and FSDP divide what they shard by the processes they shard over; context parallelism divides the
tokens; tensor parallelism the layers' matrices.

Units: bytes inside, GB (2^30 bytes, as nvidia-smi's MiB / 1024 and the GPUs' memory labels) outside. Standard
library only at import: the resolver runs this without torch (the model's shape then comes from the analytic
count in memory_model.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from trainer import facts
from trainer.errors import ConfigError
from trainer.runtime import loss_chunks


GB = 2 ** 30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# The CUDA context torch creates on first use (kernels loaded lazily, CUDA >= 11.7) and cuBLAS's workspaces.
CUDA_CONTEXT_GB = (0.35, 0.5, 0.9)  # low, estimate, high
NCCL_GB = (0.2, 0.4, 1.0)  # NCCL's communicator buffers, with more than one process
ALLOCATOR_SLACK = (0.0, 0.05, 0.15)  # reserved above allocated, as a fraction of the allocated peak
# How far each term may be off (fraction below, fraction above). Counted exactly: parameters from the meta build.
UNCERTAINTY = {
    "weights": (0.01, 0.01), "gradients": (0.01, 0.01), "optimizer": (0.01, 0.02),
    "activations": (0.10, 0.20), "logits": (0.10, 0.10), "weight_copies": (0.02, 0.05),
    "temporaries": (0.30, 0.50), "buffers": (0.50, 0.50),
}
ANALYTIC_EXTRA = 0.03  # the analytic count: a family's small parameters may be missed


@dataclass
class Gpu:
    name: str
    memory_gb: float | None  # per GPU (None: unknown)
    count: int = 1


@dataclass
class Setup:
    """What the memory depends on, read from the trainer's Config and Runtime."""

    precision: str  # bf16 | fp16 | fp32 (compute)
    attention: str  # transformers' attn_implementation
    adapter: str | None  # lora | qlora | None
    quant: str | None  # nf4 | fp4 | int8 | None
    double_quant: bool
    lora_r: int
    lora_targets: object  # "all-linear" | list of names | str regex
    lora_dropout: float
    lora_dora: bool
    lora_modules_to_save: list[str]
    lora_target_parameters: list[str]
    unfrozen: list[str] | None
    optimizer: str
    micro_batch: int
    sequence_len: int
    packing: bool
    grad_accum: int
    checkpointing: bool
    chunked_loss: bool  # the loss runs in chunks, the logits never whole (trainer/objectives/chunked_loss.py)
    objective: str
    world: int  # processes
    shard: int  # processes the sharded states are divided over (1: not sharded)
    zero: int  # DeepSpeed ZeRO stage (0: no DeepSpeed)
    fsdp: str | None  # full | grad_op | None
    offload_optimizer: bool
    offload_params: bool
    ds: dict = field(default_factory=dict)  # the DeepSpeed zero_optimization block
    tp: int = 1
    cp: int = 1
    full_weight_bytes: int = 4  # a full fine-tune's weights: 2 in bf16 (the default under bf16), 4 as fp32 masters
    attention_dropout: float = 0.0
    device: str = "cuda"  # cuda | cpu: dropout's mask is 1 byte on CUDA (native_dropout), the input's dtype on CPU
    liger_norm: bool = False  # liger's RMSNorm/LayerNorm kernels (trainer/model/kernels.py applies them where triton runs)
    liger_glu: bool = False  # liger's SwiGLU/GeGLU kernel
    lora_kwargs: dict = field(default_factory=dict)  # peft.LoraConfig's arguments, as trainer/model/load.py builds them
    # the memory options (trainer/config/speed.py, trainer/model/memory_options.py)
    offload: bool = False  # activation_offloading on a GPU: what autograd keeps goes to host memory
    selective: tuple = ()  # selective_checkpointing.save: the ops a checkpointed layer keeps ("attention", "aten::mm")
    tiled_shards: int = 0  # tiled_mlp: the MLP over this many slices of a row (0: off; -1: Axolotl's 1 per 32768)
    compiled: bool = False  # torch_compile where it runs (no term of its own: its memory is not counted)
    freeze_mm: bool = False  # freeze_mm_modules: the vision tower and projector are not trained (shape.vision_params)
    moe_quant: bool = False  # quantize_moe_experts: the 3-D experts quantized as they load (trainer/model/experts.py)
    loss_chunks: int | None = None  # chunked_cross_entropy_num_chunks: the target tokens in that many chunks
    loss_setting: bool | None = None  # chunked_cross_entropy (None: each step's loss path chosen by cost)
    every_target: bool = False  # train_on_inputs / pretraining: every token a target (the full logits where they fit)
    loss_room: float | None = None  # bytes free for the loss as a step starts (the GPU less the static terms)

    @property
    def e(self) -> int:
        """Bytes of an activation element: the compute dtype."""
        return DTYPE_BYTES[self.precision]

    @property
    def full(self) -> bool:
        return self.adapter is None

    @property
    def weight_bytes(self) -> int:
        """The dtype the (frozen or trained) base weights are held in on the GPU."""
        if self.full:
            return 2 if self.zero and self.precision != "fp32" else self.full_weight_bytes
        return self.e

    @property
    def autocast(self) -> bool:
        """Mixed precision: the forward runs in 16 bits over weights held in fp32 (accelerate's autocast)."""
        return self.precision != "fp32"

    @property
    def recast(self) -> bool:
        """Autocast over fp32 weights: each linear layer casts its weight and its fp32 input anew."""
        return self.autocast and self.weight_bytes == 4

    @property
    def kbit_fp32(self) -> bool:
        """peft's prepare_model_for_kbit_training casts every parameter that is not 4/8-bit (embeddings, norms,
        head) to fp32: the embeddings' output and so the residual stream are fp32, and bitsandbytes' layers return
        their output in their input's dtype (Linear4bit: `.to(inp_dtype)`), so q/k/v, gate, up and down come out
        in fp32 too."""
        return self.quant is not None

    @property
    def stream_bytes(self) -> int:
        """The residual stream's dtype: fp32 when the weights are fp32 (autocast's outputs add onto it) or after
        peft's k-bit preparation (fp32 embeddings)."""
        return 4 if self.weight_bytes == 4 or self.kbit_fp32 else self.e

    @property
    def mlp_bytes(self) -> int:
        """The MLP's intermediate activations: the compute dtype, fp32 behind bitsandbytes layers fed fp32."""
        return 4 if self.kbit_fp32 else self.e

    @property
    def attention_kind(self) -> str:
        """varlen (flash: q/k/v as computed, no mask) | mask (sdpa with a 4-D mask: k/v repeated, mask
        converted) | eager (seq x seq probabilities kept)."""
        # start-up: trainer.runtime.hardware imported only when this runs
        from trainer.runtime.hardware import packing

        how = packing(self.attention)
        if how in ("position_ids", "row_position_ids"):
            return "varlen"
        return "eager" if how == "float_mask" else "mask"


def setup_from(cfg, runtime, world: int) -> Setup:
    """The Setup of a trainer Config on a Runtime (precision, attention) with `world` processes."""
    # start-up: trainer.config.speed, trainer.runtime.hardware imported only when this runs
    from trainer.config.speed import offloading, selective

    quant = None
    double_quant = True
    if cfg.load_in_4bit or cfg.adapter == "qlora":
        extra = cfg.bnb_config_kwargs or {}
        quant = str(extra.get("bnb_4bit_quant_type", "nf4"))
        double_quant = bool(extra.get("bnb_4bit_use_double_quant", True))
    elif cfg.load_in_8bit:
        quant = "int8"
    tp, cp, zero, ds, offload_opt, offload_params, fsdp, shard = _sharding(cfg, world)
    targets, lora_kwargs = _lora(cfg)
    kernels_on = bool(getattr(runtime, "kernels", False))  # trainer/model/kernels.py's verdict: triton runs here
    from trainer.runtime.hardware import full_weights

    return Setup(
        full_weight_bytes=DTYPE_BYTES[full_weights(cfg, runtime.precision)],
        precision=runtime.precision, attention=runtime.attention, adapter=cfg.adapter, quant=quant,
        double_quant=double_quant, lora_r=cfg.lora_r, lora_targets=targets, lora_dropout=cfg.lora_dropout,
        lora_dora=cfg.peft_use_dora, lora_modules_to_save=list(cfg.lora_modules_to_save or []),
        lora_target_parameters=list(cfg.lora_target_parameters or []), unfrozen=cfg.unfrozen_parameters,
        optimizer=cfg.optimizer, micro_batch=cfg.micro_batch_size, sequence_len=cfg.sequence_len,
        packing=cfg.sample_packing, grad_accum=cfg.gradient_accumulation_steps,
        # FSDP's own activation checkpointing (fsdp_config.activation_checkpointing, Axolotl's FSDP2 examples)
        checkpointing=bool(cfg.gradient_checkpointing) or bool(fsdp and fsdp_checkpointing(cfg)),
        offload=bool(offloading(cfg)) and runtime.device != "cpu",
        selective=tuple(sac.save) if (sac := selective(cfg)) is not None else (),
        tiled_shards=(cfg.tiled_mlp_num_shards or -1) if cfg.tiled_mlp else 0,
        compiled=bool(getattr(runtime, "compile", False) or (cfg.torch_compile and not hasattr(runtime, "compile"))),
        # SFT's loss runs in chunks wherever the head is whole in one process and the model does not change its
        # logits after it (trainer/objectives/chunked_loss.py decides the same at the first step, and says so)
        chunked_loss=(cfg.objective == "sft" and not cfg.use_eaft and tp == 1 and cp == 1 and zero != 3
                      and cfg.chunked_cross_entropy is not False
                      and not fsdp and not cfg.ddp_find_unused_parameters
                      and not cfg.processor_type),  # vision-language SFT: full logits (trainer/objectives/vision.py)
        freeze_mm=cfg.freeze_mm_modules,
        moe_quant=bool(getattr(cfg, "quantize_moe_experts", False)) and quant is not None,
        loss_chunks=cfg.chunked_cross_entropy_num_chunks, loss_setting=cfg.chunked_cross_entropy,
        every_target=bool(cfg.train_on_inputs or cfg.pretraining_dataset),
        liger_norm=kernels_on and bool(cfg.liger_rms_norm or cfg.liger_layer_norm),
        liger_glu=kernels_on and bool(cfg.liger_glu_activation or cfg.liger_swiglu),
        objective=cfg.objective, world=world, shard=shard, zero=zero, fsdp=fsdp, offload_optimizer=offload_opt,
        offload_params=offload_params, ds=ds, tp=tp, cp=cp, device=runtime.device, lora_kwargs=lora_kwargs)


# --------------------------------------------------------------------------- static terms


class _Sharding(NamedTuple):
    tp: int
    cp: int
    zero: int
    ds: dict
    offload_optimizer: bool
    offload_params: bool
    fsdp: str | None
    shard: int


def _sharding(cfg, world: int) -> _Sharding:
    """How the weights and states are split over `world` processes: the mesh's tp/cp, DeepSpeed's stage and
    offloads (from its JSON), FSDP's strategy, and the number of processes a shard is split over."""
    # start-up: trainer.config.parallel imported only when this runs
    from trainer.config.parallel import deepspeed_path, fsdp_enabled, fsdp_settings, mesh_for

    fsdp_on = fsdp_enabled(cfg)
    try:
        mesh = mesh_for(cfg, world, fsdp_on)
    except ConfigError:  # validated on one process (or fewer than the sizes ask): estimate for the sizes' own count
        from trainer.config.parallel import given

        mesh = mesh_for(cfg, math.prod(v for v in given(cfg).values() if v), fsdp_on)
    tp = mesh.tp if mesh else 1
    cp = mesh.cp if mesh else 1
    zero, ds, offload_opt, offload_params = 0, {}, False, False
    if cfg.deepspeed:
        try:
            ds_file = deepspeed_path(cfg.deepspeed)
            ds = json.loads(open(ds_file).read()).get("zero_optimization", {}) or {}
        except (OSError, ValueError):
            ds = {}
        zero = int(ds.get("stage", 0) or 0)
        offload_opt = (ds.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
        offload_params = (ds.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    fsdp = None
    if fsdp_on:
        settings = fsdp_settings(cfg)
        if settings.get("fsdp_version") == 2:
            fsdp = "full" if settings.get("reshard_after_forward", True) else "grad_op"
        else:
            strategy = str(settings.get("sharding_strategy", "FULL_SHARD")).upper()
            fsdp = {"SHARD_GRAD_OP": "grad_op", "NO_SHARD": None}.get(strategy, "full")
        offload_params = offload_opt = bool(settings.get("cpu_offload"))
    if mesh and mesh.ep > 1:  # transformers' FSDP2 over every rank; each expert split over ep x efsdp = every rank
        fsdp = fsdp or "full"
    data_world = world // (tp * cp)
    shard = data_world if (zero or fsdp) else 1
    if mesh and fsdp:
        shard = mesh.dp_shard * (cp if cp > 1 else 1)
    return _Sharding(tp, cp, zero, ds, offload_opt, offload_params, fsdp, shard)


def _lora(cfg) -> tuple:
    """(the LoRA targets as the estimate reads them, peft.LoraConfig's arguments as trainer/model/load.py builds them)."""
    # start-up: trainer.config.model imported only when this runs
    from trainer.config.model import lora_exclusions, lora_task_type

    targets = cfg.lora_target_modules
    if cfg.lora_target_linear or targets is None:
        targets = "all-linear"
    if cfg.lora_target_parameters and cfg.lora_target_modules is None and not cfg.lora_target_linear:
        targets = []
    lora_kwargs = {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                   "target_modules": targets, "target_parameters": cfg.lora_target_parameters,
                   "use_rslora": cfg.peft_use_rslora, "use_dora": cfg.peft_use_dora,
                   "modules_to_save": cfg.lora_modules_to_save, "task_type": lora_task_type(cfg),
                   "exclude_modules": lora_exclusions(cfg)} if cfg.adapter else {}
    return targets, lora_kwargs


def optimizer_row(name: str) -> dict:
    row = next((r for r in facts.rows("optimizers", "optimizer") if r["name"] == name), None)
    if row is None or "states" not in row:
        raise KeyError(f"optimizer {name!r} has no memory columns in matrices/optimizers.toml")
    return row


def nf4_bytes(n: int, double_quant: bool = True, blocksize: int = 64) -> int:
    """A 4-bit bitsandbytes weight of n values and its quantization state (bitsandbytes 0.50, functional.py
    quantize_4bit): packed codes, absmax per block (uint8 + fp32 per 256 blocks + a 256-entry code table when
    nested), the 16-entry NF4/FP4 code table and the nested offset."""
    blocks = -(-n // blocksize)
    packed = -(-n // 2)
    code = 16 * 4
    if double_quant:
        return packed + blocks + 4 * -(-blocks // 256) + 256 * 4 + 4 + code
    return packed + 4 * blocks + code


def int8_bytes(fan_in: int, fan_out: int) -> int:
    """LLM.int8 weight: int8 values and an fp32 scale per output row (bitsandbytes Int8Params CB/SCB)."""
    return fan_in * fan_out + 4 * fan_out


def layout(shape, s: Setup):
    """peft's own LoRA layout for the Setup's LoraConfig (memory_model.lora_layout), None without peft."""
    if s.full or not s.lora_kwargs:
        return None
    # start-up: trainer.fit.memory_model imported only when this runs
    from trainer.fit.memory_model import lora_layout

    return lora_layout(shape, s.lora_kwargs)


def lora_targeted(shape, targets) -> list:
    """The nn.Linear groups peft wraps for `targets` ("all-linear": every linear layer but the output head, as
    peft's _maybe_include_all_linear_layers; names: a module whose name is the target or ends with '.target';
    a string: re.fullmatch on the name)."""
    chosen = []
    for lin in shape.linears:
        if targets == "all-linear":
            ok = True  # the head is not among shape.linears
        elif isinstance(targets, str):
            ok = re.fullmatch(targets, lin.name) is not None or re.search(rf"(^|\.){targets}$", lin.name) is not None
        else:
            ok = any(lin.name == t or lin.name.endswith("." + t) for t in targets)
        if ok:
            chosen.append(lin)
    return chosen


@dataclass
class Static:
    """Per-GPU bytes of the terms that do not depend on the batch."""

    weights: float
    gradients: float
    optimizer: float
    temporaries: float  # the optimizer step's
    weight_copies: float  # autocast's 16-bit copies of fp32 weights, alive through the forward
    buffers: float  # DDP buckets, ZeRO buckets, FSDP's gathered layers
    trained: int  # parameters trained
    total: int  # parameters
    notes: list[str] = field(default_factory=list)


def _base_weights(shape, s: Setup, notes: list[str]) -> float:
    """The model's own weights in memory (k-bit linears packed, the rest in fp32 after k-bit preparation)."""
    e_w = s.weight_bytes
    kbit = s.quant is not None
    # ---- weights
    linear_groups = shape.linears
    base = 0.0
    for lin in linear_groups:
        n_w = lin.fan_in * lin.fan_out * lin.count
        n_b = lin.fan_out * lin.count if lin.bias else 0
        if kbit and lin.quantized:
            one = nf4_bytes(lin.fan_in * lin.fan_out, s.double_quant) if s.quant in ("nf4", "fp4") \
                else int8_bytes(lin.fan_in, lin.fan_out)
            base += one * lin.count + n_b * 4  # biases: fp32 after prepare_model_for_kbit_training
        else:
            base += (n_w + n_b) * (4 if kbit else e_w)
    rest = shape.embedding + shape.lm_head + shape.other_matrices + shape.vectors
    base += rest * (4 if kbit else e_w) + expert_bytes(shape, s)
    if line := experts_note(shape, s):
        notes.append(line)
    return base


def expert_bytes(shape, s: Setup) -> float:
    """The 3-D expert tensors as the load leaves them: quantized with quantize_moe_experts (NF4/FP4 as a
    bitsandbytes 4-bit weight, int8 with an fp32 absmax per row), else in the load dtype; k-bit preparation does not
    upcast them (trainer/model/experts.py keeps them out of it)."""
    n = shape.expert_params
    if not n or not s.moe_quant:
        return n * s.weight_bytes
    tensors = expert_tensors(shape)
    if s.quant in ("nf4", "fp4"):
        return sum(nf4_bytes(numel, s.double_quant) for numel, _ in tensors)
    return sum(numel + 4 * numel // rows_of for numel, rows_of in tensors)  # an fp32 absmax per row


def expert_tensors(shape) -> list[tuple[int, int]]:
    """(values, row length) of each 3-D expert tensor, laid out as Mixtral's and Qwen3-MoE's
    ([experts, 2 x width, hidden] gate_up_proj, [experts, hidden, width] down_proj); one lump of hidden-size rows
    where the layers' sizes do not add up to the counted expert parameters (another layout)."""
    h, out = shape.hidden_size, []
    for ly in shape.layers:
        if ly.experts:
            up = ly.experts * (2 if ly.gated else 1) * ly.expert_width * h
            out += [(up, h), (ly.experts * ly.expert_width * h, ly.expert_width)] * ly.count
    return out if sum(n for n, _ in out) == shape.expert_params else [(shape.expert_params, max(1, h))]


def experts_note(shape, s: Setup) -> str | None:
    """A k-bit MoE's experts in one line: what the load keeps unquantized and what it costs, or what
    quantize_moe_experts stores instead (validate, the dry run and `envtool fit` print it)."""
    n = shape.expert_params
    if not n or s.quant is None:
        return None
    held, packed = _size(n * s.weight_bytes / GB), _size(expert_bytes(shape, replace(s, moe_quant=True)) / GB)
    fmt, dtype = ("int8" if s.quant == "int8" else s.quant.upper()), {2: s.precision, 4: "fp32"}[s.weight_bytes]
    count = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    if s.moe_quant:
        return (f"quantize_moe_experts: the {count} expert parameters (3-D tensors) quantized to {fmt} as they "
                f"load: {packed} instead of {held} in {dtype}")
    line = (f"MoE experts: {count} parameters in 3-D expert tensors stay unquantized (bitsandbytes quantizes "
            f"nn.Linear layers only): {held} in {dtype}")
    if why := moe_quant_refused(s):  # the config's rules rule quantize_moe_experts out (trainer/config/model.py)
        return line + f" (quantize_moe_experts would store them in {fmt}, {packed}, but not {why})"
    return line + f"; quantize_moe_experts: true stores them in {fmt} as they load ({packed})"


def fsdp_checkpointing(cfg) -> bool:
    """fsdp_config.activation_checkpointing: FSDP checkpoints each wrapped layer (trainer/parallel/distributed.py
    hands it to accelerate's plugin)."""
    from trainer.config.parallel import fsdp_settings  # start-up: imported where FSDP is asked for, as _sharding does

    return bool(fsdp_settings(cfg).get("activation_checkpointing"))


def moe_quant_refused(s: Setup) -> str | None:
    """Why the config would refuse quantize_moe_experts here (trainer/config/model.py), or None."""
    if s.zero:
        return "with DeepSpeed"
    return None


def _trained_params(shape, s: Setup, base: float, notes: list[str]) -> tuple[float, float, float]:
    """(weights with the adapters and saved copies added, trained parameters, adapter parameters)."""
    # ---- trained parameters
    adapters = 0
    if s.full:
        trained = shape.params
        if s.unfrozen:
            pats = [re.compile(p) for p in s.unfrozen]
            hit = sum(n for name, n in shape.names.items() if any(p.search(name) for p in pats))
            if shape.names:
                trained = hit
            else:
                notes.append("unfrozen_parameters: the analytic count has no parameter names; counted as a full "
                             "fine-tune")
        if s.freeze_mm:  # freeze_mm_modules: the vision tower and projector keep no gradients or optimizer states
            trained -= min(trained, getattr(shape, "vision_params", 0))
    elif layout(shape, s) is not None:  # counted by peft itself on the meta-device model
        adapters = layout(shape, s).params
        base += adapters * 4  # adapters (and modules_to_save copies) train in fp32 (trainer/model/load.py)
        trained = adapters
    else:
        notes.append("LoRA counted on the nn.Linear layers by rule (peft is not importable here)")
        targeted = lora_targeted(shape, s.lora_targets)
        adapters = sum(s.lora_r * (lin.fan_in + lin.fan_out) * lin.count for lin in targeted)
        if s.lora_dora:
            adapters += sum(lin.fan_out * lin.count for lin in targeted)
        if s.lora_target_parameters:
            adapters += s.lora_r * 2 * shape.hidden_size * len(s.lora_target_parameters) * shape.num_layers
            notes.append("lora_target_parameters: adapters on expert tensors counted approximately")
        saved = 0
        for name in s.lora_modules_to_save:
            if name in ("embed_tokens", "wte") or name.endswith("embed_tokens"):
                saved += shape.embedding
            elif name == "lm_head":
                saved += shape.lm_head or shape.embedding
            else:
                saved += sum(n for k, n in shape.names.items() if k.rsplit(".", 1)[0].endswith(name))
        base += saved * 4  # the trainable copy (fp32); the original stays
        trained = adapters + saved
        base += adapters * 4  # adapters train in fp32 (trainer/model/load.py)
    return base, trained, adapters


def static_terms(shape, s: Setup) -> Static:
    notes: list[str] = []
    e_w = s.weight_bytes
    kbit = s.quant is not None
    linear_groups = shape.linears
    base = _base_weights(shape, s, notes)
    base, trained, adapters = _trained_params(shape, s, base, notes)
    total = shape.params
    # ---- gradients, optimizer (per trained parameter); trained parameters are fp32 except the bf16 module
    # DeepSpeed makes of a full fine-tune
    grad_bytes = 4 if (not s.full or e_w == 4) else 2
    opt = optimizer_bytes(shape, s, trained)
    gradients = trained * grad_bytes
    temporaries = 0.0
    row = optimizer_row(s.optimizer)
    if row.get("step_temp") == "foreach":
        temporaries = trained * (4 if grad_bytes == 4 else 2)
    weights = base
    buffers = 0.0
    # ---- sharding
    n = s.shard
    if s.zero:
        # DeepSpeed keeps the module in 16 bits and fp32 master weights, gradient and optimizer partitions
        # (ZeRO paper's 2 + 2 + K/N for stage 2; mixed precision Adam: K = 12, plus the fp32 gradient partition)
        master = trained * 4 if s.full and s.precision != "fp32" else 0
        part_grad = trained * 4
        bucket = ds_bucket_bytes(s, shape)
        buffers += bucket
        if s.zero >= 3:
            weights = weights / n + zero3_live_bytes(shape, s)
        gradients = trained * grad_bytes / (n if s.zero >= 2 else 1)
        opt_part = (opt + master + part_grad) / n
        optimizer = 0.0 if s.offload_optimizer else opt_part
        if s.offload_optimizer:
            notes.append("DeepSpeed offload_optimizer: optimizer states and fp32 master weights live in host memory")
        temporaries = 0.0 if s.offload_optimizer else temporaries / n
        if s.offload_params and s.zero >= 3:
            weights = zero3_live_bytes(shape, s)
            notes.append("DeepSpeed offload_param: the parameters live in host memory, gathered layer by layer")
        return Static(weights, gradients, optimizer, temporaries, 0.0, buffers, trained, total, notes)
    if s.fsdp:
        # FSDP: parameters, gradients and optimizer states sharded; each layer gathered in the compute dtype for
        # its forward and backward (with the next one prefetched); SHARD_GRAD_OP keeps them gathered between the
        # forward and the backward
        # quantize_moe_experts: the quantized experts are kept whole on each rank, never gathered
        # (trainer/parallel/distributed.py keep_quantized_experts_whole)
        whole = expert_bytes(shape, s) if s.moe_quant else 0.0
        gathered_params = shape.params - (shape.expert_params if s.moe_quant else 0)
        layer_params = (gathered_params - shape.embedding - shape.lm_head) / max(1, shape.num_layers)
        gathered = 2 * layer_params * (s.e if s.autocast else 4)
        if s.fsdp == "grad_op":
            gathered = gathered_params * (s.e if s.autocast else 4)
        sharded_w = (weights - whole) / n + whole
        if whole:
            notes.append("quantize_moe_experts under FSDP: the quantized experts are held whole on every rank")
        weights = (0 if s.offload_params else sharded_w)
        buffers += gathered + max(shape.embedding, shape.lm_head) * (s.e if s.autocast else 4)
        gradients = gradients / n
        optimizer = 0.0 if s.offload_optimizer else opt / n
        temporaries = temporaries / n
        return Static(weights, gradients, optimizer, temporaries, 0.0, buffers, trained, total, notes)
    if s.world > 1 and trained:
        buffers += trained * grad_bytes  # DDP's flat gradient buckets (gradient_as_bucket_view off)
    weight_copies = adapters * s.e if s.autocast and not s.full else 0.0  # the fp32 adapters' casts
    if kbit and s.autocast:  # the fp32 head (k-bit preparation) cast for its matmul, kept for the backward
        weight_copies += (shape.lm_head or shape.embedding) * s.e
    if s.recast:
        cast = sum(lin.fan_in * lin.fan_out * lin.count for lin in linear_groups) + shape.lm_head + \
            (shape.embedding if shape.tied else 0) + shape.expert_params
        weight_copies = cast * s.e
    if s.tp > 1:
        weights, gradients, opt, temporaries, weight_copies = (x / s.tp for x in
                                                              (weights, gradients, opt, temporaries, weight_copies))
    return Static(weights, gradients, opt, temporaries, weight_copies, buffers, trained, total, notes)


def optimizer_bytes(shape, s: Setup, trained: int) -> float:
    """The optimizer's state for the trained parameters (matrices/optimizers.toml's memory columns)."""
    row = optimizer_row(s.optimizer)
    p_bytes = 4 if (not s.full or s.weight_bytes == 4 or s.zero) else 2
    if s.optimizer == "muon":
        # momentum for the hidden matrices, AdamW's two states for embeddings and head
        if s.full:
            adamw = shape.embedding + shape.lm_head
            return (trained - adamw - shape.vectors) * p_bytes + adamw * 2 * p_bytes
        return trained * p_bytes
    if row.get("factored"):
        # Adafactor: a row and a column vector per matrix, the full second moment for vectors
        if s.full:
            mats = [(lin.fan_in, lin.fan_out, lin.count) for lin in shape.linears]
            heads = 1 + (0 if shape.tied else 1)  # embedding, and the head unless tied
            vec = sum((a + b) * c for a, b, c in mats) + heads * (shape.vocab_size + shape.hidden_size)
            return (vec + shape.vectors) * p_bytes
        return trained * 0.02 * p_bytes
    states = row["states"]
    bits = row["state_bits"]
    if bits == "param":
        return trained * states * p_bytes
    if bits == 32:
        return trained * states * 4
    # block-quantized states: each tensor of >= min_quantized values quantized, the rest unquantized
    block = row["block"]
    small_bytes = 4 if row["library"] == "bitsandbytes" else p_bytes
    tensors = trained_tensors(shape, s)
    total = 0.0
    per_value = bits / 8
    table = 4 * 2 ** bits  # the code table: torchao's per state tensor, bitsandbytes' per optimizer
    for numel, count in tensors:
        if numel >= row.get("min_quantized", 0) and (row["library"] == "bitsandbytes" or numel % block == 0):
            total += count * states * (numel * per_value + 4 * -(-numel // block))
            total += count * states * table if row["library"] != "bitsandbytes" else 0
        else:
            total += count * states * numel * small_bytes
    if row["library"] == "bitsandbytes":
        total += table * min(states, 2)  # the signed and unsigned dynamic maps, shared by every tensor
    if s.full and row["library"] == "bitsandbytes":
        # the trainer keeps embeddings' state in 32 bits (trainer/optim/optimizers.py, as the HF Trainer)
        emb = shape.embedding
        total += states * emb * (4 - per_value) - states * 4 * -(-emb // block)
    return total


def trained_tensors(shape, s: Setup) -> list[tuple[int, int]]:
    """(values, how many) of each trained tensor: the optimizer quantizes per tensor."""
    if s.full:
        out = [(lin.fan_in * lin.fan_out, lin.count) for lin in shape.linears]
        out += [(lin.fan_out, lin.count) for lin in shape.linears if lin.bias]
        out += [(shape.embedding, 1)] + ([(shape.lm_head, 1)] if shape.lm_head else [])
        if shape.expert_params:
            out.append((shape.expert_params, 1))
        if shape.vectors:
            out.append((shape.hidden_size, max(1, shape.vectors // shape.hidden_size)))
        return out
    found = layout(shape, s)
    if found is not None:
        return list(found.tensors)
    out = []
    for lin in lora_targeted(shape, s.lora_targets):
        out += [(s.lora_r * lin.fan_in, lin.count), (s.lora_r * lin.fan_out, lin.count)]
    return out


def ds_bucket_bytes(s: Setup, shape) -> float:
    """DeepSpeed's communication buckets: reduce_bucket_size and allgather_bucket_size elements of 16 bits (5e8 by
    default, 'auto' = hidden^2 under the HF integration); overlap_comm keeps 4.5x as much (DeepSpeed's config
    documentation: "overlap_comm ... uses 4.5x the allgather_bucket_size and reduce_bucket_size values")."""
    def size(key, default):
        value = s.ds.get(key, default)
        return shape.hidden_size ** 2 if value == "auto" else float(value)

    if s.zero >= 3:
        return 2 * size("stage3_prefetch_bucket_size", 5e7) + 2 * size("reduce_bucket_size", 5e8)
    both = size("reduce_bucket_size", 5e8) + size("allgather_bucket_size", 5e8)
    return both * 2 * (4.5 if s.ds.get("overlap_comm") else 1.0) / (2 if s.zero == 1 else 1)


def zero3_live_bytes(shape, s: Setup) -> float:
    """ZeRO-3's gathered parameters: the layers in flight (the current and the prefetched one) in 16 bits, and the
    parameters below the persistence threshold kept whole."""
    layer_params = (shape.params - shape.embedding - shape.lm_head) / max(1, shape.num_layers)
    return 2 * layer_params * 2 + max(shape.embedding, shape.lm_head) * 2


# --------------------------------------------------------------------------- activations


def _kernel_kept(shape, s: Setup, q: float, kv: float, heads: float, per_token: float,
                 per_key: float) -> tuple[float, float]:
    """What the attention kernel keeps, added to one layer's (bytes per token, bytes per token per key position)."""
    e = s.e
    kind = s.attention_kind
    if kind == "varlen":  # q and k after RoPE, v, the output, the fp32 log-sum-exp per head
        per_token += e * (q + 2 * kv) + e * q + 4 * heads
    elif kind == "mask":  # k and v repeated to every query head (repeat_kv); the mask converted per layer
        per_token += e * 3 * q + e * q + 4 * heads
        per_key += e
    else:  # eager: q, repeated k and v; fp32 softmax probabilities and their cast
        per_token += e * 3 * q
        per_key += heads * (4 + (e if e != 4 else 0)) + (heads if s.attention_dropout > 0 else 0)
        if getattr(shape, "attn_softcap", False):  # Gemma 2: tanh(scores / cap) * cap keeps tanh's output
            per_key += heads * e
    return per_token, per_key


def layer_bytes_per_token(layer, shape, s: Setup, targeted: set[str], first: bool = False,
                          experts_train: bool = False) -> tuple[float, float]:
    """(bytes per token, bytes per token per key position) autograd keeps for one decoder layer of this shape.
    `first`: the first layer of a model whose embeddings do not train (its input requires no gradient, so its
    first norm keeps nothing)."""
    h = shape.hidden_size
    e, st = s.e, s.stream_bytes
    q, kv, heads = layer.q_dim / s.tp, layer.kv_dim / s.tp, layer.heads / s.tp
    trains = s.full  # the base weights (norms, linear layers) train

    def norm(width: float, input_grad: bool = True) -> float:
        """RMSNorm keeps its input in fp32 (x.float(), kept by pow) and rsqrt, and the normalized input in the
        stream's dtype when its weight trains; LayerNorm keeps its fp32 input, mean and rstd. Liger's kernels
        keep the input as it comes and an fp32 rstd per row (Liger-Kernel ops/rms_norm.py and layer_norm.py:
        save_for_backward(X, W, RSTD) / (X, W, B, Mean, RSTD))."""
        if not input_grad and not trains:
            return 0.0
        if s.liger_norm:
            return st * width + (8 if layer.norm_kind == "layer" else 4)
        if not input_grad:
            return 0.0
        if layer.norm_kind == "layer":
            return 4 * width + 8
        return 4 * width + 4 + (st * width if trains else 0)

    def linear_inputs(width: float, in_dtype: int, modules: list[str], shared_elsewhere: bool = False,
                      input_grad: bool = True) -> float:
        """What the linear layers reading one input of `width` keep: the input once when their weights train
        (a cast copy per layer under autocast over fp32 weights, which casts an fp32 input anew for each; nothing
        when another op keeps it already), and per LoRA-wrapped layer lora_A's input in its own copy (autocast's
        16-bit cast; without autocast the fp32 input itself, or dropout's output) and lora_A's output."""
        out = 0.0
        recast = s.recast and in_dtype == 4
        if trains and not shared_elsewhere:
            out += e * width * len(modules) if recast else in_dtype * width
        wrapped = [m for m in modules if m in targeted]
        drop = s.lora_dropout > 0
        mask = 1 if s.device == "cuda" else 4  # dropout's mask (on CPU a float tensor of the fp32 input's dtype)
        for _ in wrapped:
            if s.autocast:
                out += e * width
            elif drop or in_dtype != 4:
                out += 4 * width
            out += mask * width if drop and input_grad else 0  # no mask kept when nothing flows back
            out += (e if s.autocast else 4) * s.lora_r  # lora_A's output, kept by lora_B
        if wrapped and not s.autocast and not drop and in_dtype == 4 and not trains and not shared_elsewhere:
            out += 4 * width  # lora_A keeps the shared fp32 input itself
        return out

    per_token = per_key = 0.0
    # attention block: norm, q/k/v, (q/k norms), the attention kernel, o_proj
    per_token += norm(h, input_grad=not first)
    per_token += linear_inputs(h, st, ["q_proj", "k_proj", "v_proj"], input_grad=not first)
    if layer.qk_norm:
        per_token += 4 * (q + kv) + 4 * 2 * heads + (e * (q + kv) if trains else 0)
    kind = s.attention_kind
    per_token, per_key = _kernel_kept(shape, s, q, kv, heads, per_token, per_key)
    # o_proj reads the attention's output, which flash/sdpa keep already; eager's is a fresh contiguous copy
    per_token += linear_inputs(q, e, ["o_proj"], shared_elsewhere=kind != "eager")
    # MLP block
    per_token += norm(h)
    if layer.norms > 2:  # Gemma 2/3: norms after the attention and after the MLP too
        per_token += (layer.norms - 2) * norm(h)
    if layer.experts:
        k, iw = layer.top_k, layer.expert_width / s.tp
        per_token += k * (e * 3 * iw + e * h)  # per routed token: gate/up output, activation, weighted output
        if trains or experts_train:
            per_token += k * e * (h + iw)  # the gathered input of gate_up and of down
        per_token += (4 + e) * layer.experts  # router logits and their fp32 softmax
    if layer.mlp_width:
        iw = layer.mlp_width / s.tp
        m = s.mlp_bytes
        per_token += linear_inputs(h, st, ["gate_proj", "up_proj"] if layer.gated else ["up_proj"])
        # gate and up outputs and the activation's output; liger's fused SiLU/GELU x up keeps only gate and up
        # (Liger-Kernel ops/swiglu.py, geglu.py: save_for_backward(a, b))
        per_token += m * ((2 if s.liger_glu else 3) if layer.gated else 1) * iw
        per_token += linear_inputs(iw, m, ["down_proj"])
    return per_token, per_key


@dataclass
class Activations:
    saved: float  # bytes kept from the forward for the backward (all layers, the end of the forward)
    layer_full: float  # one layer's full set (rebuilt at a time in the backward under checkpointing)
    grads: float  # the backward's gradient tensors in flight
    tokens: int  # per micro-batch per GPU
    tile: float = 0.0  # tiled_mlp: one slice's MLP set, rebuilt at a time in the backward


def activation_terms(shape, s: Setup, tokens: int | None = None, row_len: int | None = None) -> Activations:
    """What the forward keeps for the backward, for `tokens` tokens per micro-batch in rows of `row_len`."""
    row_len = row_len or s.sequence_len
    tokens = tokens if tokens is not None else s.micro_batch * s.sequence_len * pair_factor(s)
    tokens = tokens / s.cp
    key_len = row_len  # a query row attends over its row (the whole sequence under context parallelism)
    found = layout(shape, s)
    if s.full:
        targeted = set()
    elif found is not None:
        targeted = found.wrapped
    else:
        targeted = {lin.name.rsplit(".", 1)[-1] for lin in lora_targeted(shape, s.lora_targets)}
    experts_wrapped = bool(found and found.expert_params)
    embeddings_train = s.full
    saved = 0.0
    full_layer = 0.0
    widest_tile = 0.0
    first_done = False
    # peft's ParamWrapper merges each wrapped 3-D expert tensor with its adapter in every forward and keeps the
    # merged copy for the backward: weight-sized, per layer
    merged = s.e * found.expert_params / max(1, found.layers_with_experts) if experts_wrapped else 0.0
    if s.moe_quant and not merged:  # quantize_moe_experts: the layer's experts dequantized once per forward and
        # kept for the backward of its input (the expert matmuls save their weight)
        merged = s.e * shape.expert_params / max(1, sum(ly.count for ly in shape.layers if ly.experts))
    for layer in shape.layers:
        per_tok, per_key = layer_bytes_per_token(layer, shape, s, targeted, experts_train=experts_wrapped)
        tile = 0.0
        if s.tiled_shards and layer.mlp_width:  # the MLP keeps its input only; one slice's set rebuilt at a time
            mlp = per_tok - layer_bytes_per_token(replace(layer, mlp_width=0), shape, s, targeted,
                                                  experts_train=experts_wrapped)[0]
            per_tok += s.stream_bytes * shape.hidden_size - mlp
            tile = tokens * mlp / mlp_shards(s, row_len)
        one = tokens * (per_tok + per_key * key_len) + (merged if layer.experts else 0.0)
        full_layer = max(full_layer, one + tile)
        widest_tile = max(widest_tile, tile)
        count = layer.count
        if not first_done and not embeddings_train:
            f_tok, f_key = layer_bytes_per_token(layer, shape, s, targeted, first=True,
                                                 experts_train=experts_wrapped)
            if s.tiled_shards and layer.mlp_width:
                f_tok += per_tok - layer_bytes_per_token(layer, shape, s, targeted, experts_train=experts_wrapped)[0]
            first = tokens * (f_tok + f_key * key_len) + (merged if layer.experts else 0.0)
            layer_sum = first + one * (count - 1)
        else:
            layer_sum = one * count
        first_done = True
        if s.checkpointing:
            saved += tokens * s.stream_bytes * shape.hidden_size * count  # each layer's input
            saved += tokens * selective_bytes_per_token(layer, shape, s) * count  # the ops selective checkpointing keeps
        else:
            saved += layer_sum
        if s.cp > 1:  # every layer keeps the gathered keys and values of the whole sequence
            saved += tokens * s.cp * 2 * layer.kv_dim * s.e * count * (0 if s.checkpointing else 1)
    h = shape.hidden_size
    # outside the layers: the token ids (when the embeddings train), the final norm, the head's input when the
    # head trains (a cast copy under autocast over fp32 weights)
    outside = tokens * 8 if embeddings_train else 0.0
    head_dim = shape.layers[0].q_dim // max(1, shape.layers[0].heads) if shape.layers else 0
    outside += tokens * 2 * head_dim * s.stream_bytes  # RoPE's cos and sin per position, shared by the layers
    if getattr(shape, "final_softcap", False):  # Gemma 2 soft-caps the logits inside the model: tanh's output
        outside += tokens * shape.vocab_size / s.tp * s.e
    outside += tokens * (4 * h + 4 + (s.stream_bytes * h if s.full else 0))
    if s.full:
        outside += tokens * (s.e if s.recast else s.stream_bytes) * h
    saved += outside
    widest = max([h] + [ly.mlp_width for ly in shape.layers] + [ly.expert_width * max(1, ly.top_k)
                                                                   for ly in shape.layers])
    grads = tokens * s.e * (2 * h + 2 * widest)
    return Activations(saved=saved, layer_full=full_layer, grads=grads, tokens=int(tokens), tile=widest_tile)


def mlp_shards(s: Setup, row_len: int) -> int:
    """tiled_mlp's slices of a row of `row_len` tokens (trainer/model/memory_options.py `shards`)."""
    # start-up: trainer.config.speed imported only when this runs
    from trainer.config.speed import TOKENS_PER_SHARD

    if s.tiled_shards > 0:
        return min(s.tiled_shards, row_len)
    return max(1, math.ceil(row_len / TOKENS_PER_SHARD))


MATMUL_SPECS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "mm")


def selective_bytes_per_token(layer, shape, s: Setup) -> float:
    """What selective checkpointing keeps per token in one checkpointed layer beyond its input: "attention" keeps
    the attention kernel's output and fp32 log-sum-exp (none under eager attention, which is no such op); an
    entry matching the matmuls keeps every linear layer's output (q, k, v, o, gate, up, down). Other op names are
    not counted (a note says so)."""
    out = 0.0
    q, kv, heads = layer.q_dim / s.tp, layer.kv_dim / s.tp, layer.heads / s.tp
    if "attention" in s.selective and s.attention_kind != "eager":
        out += q * s.e + heads * 4
    if any(spec in op for spec in s.selective if spec != "attention" for op in MATMUL_SPECS):
        iw = layer.mlp_width / s.tp
        out += s.e * (q + 2 * kv + 2 * shape.hidden_size + (2 if layer.gated else 1) * iw)
    return out


def pair_factor(s: Setup) -> int:
    """Paired preference methods run the chosen and rejected sequences of a pair together."""
    return 2 if s.objective in ("dpo", "ipo", "orpo", "simpo") else 1


def loss_line(cfg) -> str:
    """How the config's loss runs, as validate and the dry run print it (trainer/runtime/loss_chunks.py describe):
    the path chunked_cross_entropy asks for, or how each step's is chosen by cost."""
    every_token = bool(cfg.train_on_inputs or cfg.pretraining_dataset)  # train_on_inputs, pretraining: all targets
    return loss_chunks.describe(cfg.chunked_cross_entropy, cfg.chunked_cross_entropy_num_chunks, every_token)


def chunked(shape, s: Setup) -> bool:
    """Whether the chunked loss runs: the setup allows it, the model keeps its logits as the head gives them, and the
    step's path chosen by cost is it (trainer/runtime/loss_chunks.py choose_path, as the run chooses: with every token a
    target, the full logits where they fit in a quarter of what the static terms leave free)."""
    if not (s.chunked_loss and not getattr(shape, "final_softcap", False)
            and not loss_chunks.after_head(getattr(shape, "config", None) or {})):
        return False
    if s.loss_setting is not None or not s.every_target:
        return True  # the config's true (false never allows it), or prompts that make it the cheaper path
    tokens = int(s.micro_batch * s.sequence_len * pair_factor(s) / s.cp)
    path = loss_chunks.choose_path(tokens, tokens, (int(shape.vocab_size / s.tp), shape.hidden_size),
                                   head_trains=s.full, num_chunks=s.loss_chunks, free_bytes=s.loss_room)
    return path.path == "chunked"


def logits_bytes(shape, s: Setup, tokens: float) -> float:
    """The loss's peak: the head's output, its fp32 copy and log-softmax in the forward, and in the backward the
    kept log-softmax, the gradient of the loss and of the log-softmax, all over the vocabulary (trainer/objectives/loss.py):
    12 bytes per token per entry. The chunked loss holds that for one chunk of tokens at a time
    (trainer/runtime/loss_chunks.py), plus the target tokens' hidden states it gathers and, where the head trains, a
    second head-sized gradient while a chunk's is added to it."""
    v = shape.vocab_size / s.tp
    tokens = tokens / s.cp
    if chunked(shape, s):
        chunk = loss_chunks.chunk_tokens(tokens, int(v), num_chunks=s.loss_chunks)
        return chunk * v * 12 + tokens * shape.hidden_size * s.e + (v * shape.hidden_size * 4 if s.full else 0.0)
    return tokens * v * 12


# --------------------------------------------------------------------------- the estimate


@dataclass
class Moment:
    name: str  # forward | loss | backward | optimizer_step
    terms: dict[str, float]  # bytes resident at that moment, by term

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass
class Estimate:
    gpu: Gpu
    setup: Setup
    shape: object
    static: Static
    acts: Activations
    logits: float
    moments: list[Moment]
    peak_moment: Moment
    allocated: float  # bytes: the largest moment
    overhead: float
    low: float
    high: float
    allocated_low: float = 0.0  # the band of `allocated` alone (what torch.cuda.max_memory_allocated reports)
    allocated_high: float = 0.0
    notes: list[str] = field(default_factory=list)
    suggestions: list[dict] = field(default_factory=list)
    options: list[dict] = field(default_factory=list)  # what each memory option saves or costs (option_effects)

    @property
    def host(self) -> float:
        """Bytes kept in host memory instead (activation offloading)."""
        return self.acts.saved if self.setup.offload else 0.0

    @property
    def chunked_loss(self) -> bool:
        """The loss runs in chunks (the logits never whole): what the trainer says at its first step."""
        return chunked(self.shape, self.setup)

    @property
    def peak(self) -> float:
        return self.allocated + self.overhead

    @property
    def verdict(self) -> str:
        if self.gpu.memory_gb is None:
            return "unknown"
        cap = self.gpu.memory_gb * GB
        if self.high <= cap:
            return "fits"
        if self.low > cap:
            return "does_not_fit"
        return "tight"

    @property
    def fits(self) -> bool | None:
        return None if self.gpu.memory_gb is None else self.peak <= self.gpu.memory_gb * GB

    def breakdown(self) -> dict[str, float]:
        keys = ("weights", "gradients", "optimizer", "activations", "logits")
        out = {k: round(self.peak_moment.terms.get(k, 0.0) / GB, 3) for k in keys}
        out["overhead"] = round(self.overhead / GB, 3)
        for k in ("weight_copies", "temporaries", "buffers"):
            out[k] = round(self.peak_moment.terms.get(k, 0.0) / GB, 3)
        return out

    def to_json(self) -> dict:
        return {"gpu": {"name": self.gpu.name, "memory_gb": self.gpu.memory_gb, "count": self.gpu.count},
                "unit": "GB", "peak_gb": round(self.peak / GB, 2), "low_gb": round(self.low / GB, 2),
                "high_gb": round(self.high / GB, 2), "fits": self.fits, "verdict": self.verdict,
                "breakdown": self.breakdown(), "suggestions": self.suggestions, "options": self.options}


def estimate(shape, s: Setup, gpu: Gpu, suggest: bool = True) -> Estimate:
    """The peak per GPU of training `shape` as `s` sets it up, on `gpu`."""
    st = static_terms(shape, s)
    acts = activation_terms(shape, s)
    tokens = s.micro_batch * s.sequence_len * pair_factor(s)
    persist_grads = st.gradients if s.grad_accum > 1 else 0.0
    if s.zero >= 2 or s.fsdp:
        persist_grads = st.gradients  # sharded gradients are allocated once and kept
    if gpu.memory_gb is not None and s.loss_room is None:  # what the run's loss path choice sees free (chunked)
        s = replace(s, loss_room=gpu.memory_gb * GB - (st.weights + st.optimizer + st.buffers + persist_grads))
    logits = logits_bytes(shape, s, tokens)
    base = {"weights": st.weights, "optimizer": st.optimizer, "buffers": st.buffers}
    transient_kbit = 0.0
    if s.quant:
        widest = max((lin.fan_in * lin.fan_out for lin in shape.linears if lin.quantized), default=0)
        transient_kbit = widest * s.e  # one weight dequantized at a time
    # activation offloading: what autograd keeps lies in host memory; the GPU holds what is being computed
    gpu_saved = 0.0 if s.offload else acts.saved
    ckpt_saved = gpu_saved
    rebuilt = acts.layer_full if s.checkpointing else acts.tile  # rebuilt one at a time in the backward
    forward_copies = st.weight_copies
    moments = [
        Moment("forward", {**base, "gradients": persist_grads, "activations": gpu_saved + transient_kbit,
                           "weight_copies": forward_copies,
                           "logits": tokens / s.cp * shape.vocab_size / s.tp * s.e if not chunked(shape, s) else 0.0}),
        Moment("loss", {**base, "gradients": persist_grads, "activations": ckpt_saved,
                        "weight_copies": 0.0 if s.checkpointing else st.weight_copies, "logits": logits}),
        Moment("backward", {**base, "gradients": persist_grads or st.gradients * 0.5,
                            "activations": gpu_saved + rebuilt + acts.grads + transient_kbit,
                            "weight_copies": (st.weight_copies / max(1, shape.num_layers) if s.checkpointing
                                              else st.weight_copies)}),
        Moment("optimizer_step", {**base, "gradients": st.gradients, "temporaries": st.temporaries}),
    ]
    peak_moment = max(moments, key=lambda m: m.total)
    allocated = peak_moment.total
    overhead = CUDA_CONTEXT_GB[1] * GB + (NCCL_GB[1] * GB if s.world > 1 else 0) + ALLOCATOR_SLACK[1] * allocated
    analytic = getattr(shape, "counted", "meta") == "analytic"

    def bound(side: int) -> tuple[float, float]:
        """(allocated, whole) at the low (side 0) or high (side 2) end of the band."""
        best = 0.0
        for m in moments:
            total = 0.0
            for k, v in m.terms.items():
                lo, hi = UNCERTAINTY.get(k, (0.2, 0.2))
                if analytic and k in ("weights", "gradients", "optimizer"):
                    lo, hi = lo + ANALYTIC_EXTRA, hi + ANALYTIC_EXTRA
                total += v * (1 - lo if side == 0 else 1 + hi)
            best = max(best, total)
        ctx = CUDA_CONTEXT_GB[side] * GB
        nccl = (NCCL_GB[side] * GB) if s.world > 1 else 0
        return best, best * (1 + ALLOCATOR_SLACK[side]) + ctx + nccl

    (alloc_low, low), (alloc_high, high) = bound(0), bound(2)
    est = Estimate(gpu=gpu, setup=s, shape=shape, static=st, acts=acts, logits=logits, moments=moments,
                   peak_moment=peak_moment, allocated=allocated, overhead=overhead, low=low, high=high,
                   allocated_low=alloc_low, allocated_high=alloc_high,
                   notes=list(st.notes) + list(getattr(shape, "notes", [])))
    if s.objective in ("grpo", "gdpo", "kto", "ebft", "reward", "prm"):
        est.notes.append(f"{s.objective}: estimated as supervised training of the same batches (generation, "
                         "reference models and per-method buffers not counted): the band is a guide only")
        est.high *= 1.3
        est.allocated_high *= 1.3
    if optimizer_row(s.optimizer).get("paged"):
        est.notes.append(f"{s.optimizer}: paged states live in CUDA unified memory; under pressure the driver "
                         "pages them out to host memory (slower, not an out-of-memory error)")
    if suggest and gpu.memory_gb is not None:
        est.suggestions = suggestions(shape, s, gpu, est)
    if suggest:
        est.options = option_effects(shape, s, gpu, est)
    return est


# --------------------------------------------------------------------------- what each memory option saves or costs


def _size(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 or gb == 0 else f"{gb * 1024:.1f} MB"


def _largest(e: Estimate, term: str) -> float:
    """A term at its largest over the moments (GB)."""
    return round(max(m.terms.get(term, 0.0) for m in e.moments) / GB, 4)


def option_effects(shape, s: Setup, gpu: Gpu, current: Estimate) -> list[dict]:
    """For each memory option, the term it changes with the option as configured and the other way round:
    {key, on, term, gb, other_gb, peak_gb, other_peak_gb, text}. GB of the term at its largest over the moments;
    `other_*`: the same estimate with the option switched (an option the rules need another for, such as
    activation offloading without checkpointing, switched together with it)."""
    out = []

    def add(key: str, on: bool, term: str, other: Setup, how: str) -> None:
        e = estimate(shape, other, gpu, suggest=False)
        gb, other_gb = _largest(current, term), _largest(e, term)
        state = "on" if on else "off"
        text = (f"{key}: {state}: {term} {_size(gb)} ({_size(other_gb)} {'without' if on else 'with it'}); peak "
                f"{current.peak / GB:.1f} GB ({e.peak / GB:.1f} GB {'without' if on else 'with it'}){how}")
        out.append({"key": key, "on": on, "term": term, "gb": gb, "other_gb": other_gb,
                    "peak_gb": round(current.peak / GB, 2), "other_peak_gb": round(e.peak / GB, 2), "text": text})

    add("gradient_checkpointing", s.checkpointing, "activations",
        replace(s, checkpointing=not s.checkpointing, offload=False, selective=()) if s.checkpointing
        else replace(s, checkpointing=True), "; each layer's forward recomputed in the backward (~30% more compute)")
    if s.device != "cpu":
        other = replace(s, offload=not s.offload, checkpointing=True)
        e = estimate(shape, other if not s.offload else s, gpu, suggest=False)
        add("activation_offloading", s.offload, "activations", other,
            f"; {_size(e.host / GB)} in host memory instead, copied over PCIe/NVLink each micro-batch")
    if s.checkpointing or s.selective:
        add("selective_checkpointing", bool(s.selective), "activations",
            replace(s, selective=() if s.selective else ("attention",)),
            "; the kept ops are not recomputed" + ("" if all(x == "attention" or any(x in op for op in MATMUL_SPECS)
                                                         for x in s.selective) else
                                                     " (ops other than attention and matmuls are not counted)"))
    if any(layer.mlp_width for layer in shape.layers):
        n = mlp_shards(replace(s, tiled_shards=s.tiled_shards or -1), s.sequence_len)
        add("tiled_mlp", bool(s.tiled_shards), "activations", replace(s, tiled_shards=0 if s.tiled_shards else -1),
            f"; the MLP over {n} slice{'s' if n != 1 else ''} of a row, each recomputed in the backward")
    if s.chunked_loss or chunked(shape, s):
        add("chunked loss", chunked(shape, s), "logits", replace(s, chunked_loss=not s.chunked_loss),
            "; the head run a chunk at a time (on by default where it runs)")
    if s.compiled:
        out.append({"key": "torch_compile", "on": True, "term": None, "gb": None, "other_gb": None,
                    "peak_gb": round(current.peak / GB, 2), "other_peak_gb": round(current.peak / GB, 2),
                    "text": "torch_compile: on: no term of its own counted (fused kernels keep less; the first steps "
                            "compile)"})
    return out


# --------------------------------------------------------------------------- suggestions


def _fits(shape, s: Setup, gpu: Gpu, surely: bool = False) -> tuple[bool, float]:
    """(fits at the estimate, or with `surely` at the band's high end; the estimated peak in GB)."""
    e = estimate(shape, s, gpu, suggest=False)
    return (e.high if surely else e.peak) <= gpu.memory_gb * GB, e.peak / GB


def suggestions(shape, s: Setup, gpu: Gpu, current: Estimate) -> list[dict]:
    """The cheapest changes that fit, cheapest first (same training before different training), then the largest
    micro-batch and sequence length that fit as configured."""
    out: list[dict] = []
    cap = gpu.memory_gb * GB
    if current.peak > cap:
        for kind, keys, text, changed in candidates(shape, s):
            fits, peak = _fits(shape, changed, gpu)
            if fits:
                out.append({"kind": kind, "change": keys, "text": text, "peak_gb": round(peak, 2)})
                break
        if not out:  # none alone: the changes that keep the training the same, together, then the rest
            changed, keys, texts = s, {}, []
            for kind, k, text, c in candidates(shape, s):
                if kind in ("more_gpus",):
                    continue
                changed = _merge(changed, c, s)
                keys.update(k)
                texts.append(text)
                fits, peak = _fits(shape, changed, gpu)
                if fits:
                    out.append({"kind": "combined", "change": dict(keys), "text": "; ".join(texts),
                                "peak_gb": round(peak, 2)})
                    break
    mb = largest(lambda v: replace(s, micro_batch=v), shape, gpu, 1, 1024)
    if mb:
        safe = largest(lambda v: replace(s, micro_batch=v), shape, gpu, 1, mb, surely=True)
        out.append({"kind": "max_micro_batch_size", "change": {"micro_batch_size": mb},
                    "text": f"largest micro_batch_size that fits at sequence_len {s.sequence_len}: {mb}"
                            + (f" ({safe} with the band's high end)" if safe != mb else ""),
                    "peak_gb": round(_fits(shape, replace(s, micro_batch=mb), gpu)[1], 2)})
    longest = max(s.sequence_len, shape.max_positions or 0) or 1 << 20  # the model's trained context at most
    seq = largest(lambda v: replace(s, sequence_len=v), shape, gpu, 128, longest, step=128)
    if seq:
        cap = " (the model's max_position_embeddings)" if shape.max_positions and seq + 128 > longest else ""
        safe = largest(lambda v: replace(s, sequence_len=v), shape, gpu, 128, seq, step=128, surely=True)
        if safe != seq:
            cap += f" ({safe or 'none'} with the band's high end)"
        out.append({"kind": "max_sequence_len", "change": {"sequence_len": seq},
                    "text": f"longest sequence_len that fits at micro_batch_size {s.micro_batch}: {seq}{cap}",
                    "peak_gb": round(_fits(shape, replace(s, sequence_len=seq), gpu)[1], 2)})
    return out


def _merge(a: Setup, b: Setup, orig: Setup) -> Setup:
    """b's changes from orig, applied on top of a."""
    changes = {k: v for k, v in b.__dict__.items() if orig.__dict__[k] != v}
    return replace(a, **changes)


def candidates(shape, s: Setup):
    """(kind, config keys, sentence, changed Setup), cheapest first."""
    has_mlp = any(layer.mlp_width for layer in shape.layers)
    if not s.checkpointing:
        yield ("gradient_checkpointing", {"gradient_checkpointing": True},
               "gradient_checkpointing: true (same training; ~30% more compute)", replace(s, checkpointing=True))
    if s.selective:
        yield ("selective_checkpointing", {"selective_checkpointing": False},
               "selective_checkpointing: false (same training; the kept ops recomputed instead)",
               replace(s, selective=()))
    if s.micro_batch > 1:
        for mb in _halvings(s.micro_batch):
            ga = s.grad_accum * s.micro_batch // mb
            yield ("micro_batch", {"micro_batch_size": mb, "gradient_accumulation_steps": ga},
                   f"micro_batch_size: {mb}, gradient_accumulation_steps: {ga} (same global batch; the loss is "
                   "normalised per token, so the same training)", replace(s, micro_batch=mb, grad_accum=ga))
    if not s.tiled_shards and has_mlp:
        yield ("tiled_mlp", {"tiled_mlp": True},
               "tiled_mlp: true (same training; the MLP run over slices of each row, recomputed in the backward)",
               replace(s, tiled_shards=-1))
    if not s.offload and s.device != "cpu":
        keys = {"activation_offloading": True} if s.checkpointing else {"gradient_checkpointing": True,
                                                                         "activation_offloading": True}
        yield ("activation_offloading", keys, f"{', '.join(f'{k}: true' for k in keys)} (same training; each "
               "layer's input kept in host memory, copied over PCIe each micro-batch)",
               replace(s, offload=True, checkpointing=True))
    row = optimizer_row(s.optimizer)
    if row["state_bits"] not in (8, 4) and row["states"] > 0 and not s.offload_optimizer:
        yield ("optimizer_8bit", {"optimizer": "adamw_bnb_8bit"},
               "optimizer: adamw_bnb_8bit (8-bit AdamW states: 2 bytes per trained parameter instead of 8)",
               replace(s, optimizer="adamw_bnb_8bit"))
    if s.world > 1 and s.full:
        if not s.zero and not s.fsdp:
            yield ("fsdp", {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}},
                   f"FSDP2 full sharding over the {s.world} processes", replace(s, fsdp="full", shard=s.world))
        elif s.zero and s.zero < 3:
            yield ("zero3", {"deepspeed": "deepspeed_configs/zero3_bf16.json"},
                   "DeepSpeed ZeRO-3 (parameters sharded too)", replace(s, zero=3))
    if s.full:
        for n in (2, 4, 8):
            if n > s.world:
                yield ("more_gpus", {"nproc": n, "fsdp_version": 2},
                       f"{n} GPUs with FSDP2 full sharding", replace(s, world=n, shard=n, fsdp=s.fsdp or "full"))
        yield ("lora", {"adapter": "lora", "lora_r": 16, "lora_target_linear": True},
               "adapter: lora (r 16 on every linear layer; trains an adapter, not the model)",
               replace(s, adapter="lora", lora_r=16, lora_targets="all-linear"))
    if s.quant and not s.moe_quant and shape.expert_params and not moe_quant_refused(s):
        yield ("quantize_moe_experts", {"quantize_moe_experts": True},
               f"quantize_moe_experts: true (the 3-D expert tensors stored in {s.quant} as they load, as the linear "
               "layers are; the adapters train through their quantization error)", replace(s, moe_quant=True))
    if s.adapter != "qlora":
        yield ("qlora", {"adapter": "qlora", "load_in_4bit": True, "lora_r": 16, "lora_target_linear": True},
               "adapter: qlora with load_in_4bit (NF4 base weights; trains an adapter)",
               replace(s, adapter="qlora", quant="nf4", double_quant=True, lora_r=16 if s.full else s.lora_r,
                       lora_targets="all-linear" if s.full else s.lora_targets))
    for seq in _halvings(s.sequence_len, floor=256):
        yield ("sequence_len", {"sequence_len": seq},
               f"sequence_len: {seq} (longer examples are dropped or cut: different data)",
               replace(s, sequence_len=seq))


def _halvings(value: int, floor: int = 1):
    v = value // 2
    while v >= floor:
        yield v
        v //= 2


def largest(make, shape, gpu: Gpu, lo: int, hi: int, step: int = 1, surely: bool = False) -> int | None:
    """The largest value in [lo, hi] (a multiple of step) whose Setup fits, by bisection (memory grows with it)."""
    if not _fits(shape, make(lo), gpu, surely)[0]:
        return None
    good, bad = lo, None
    probe = lo * 2
    while probe <= hi and _fits(shape, make(probe), gpu, surely)[0]:
        good, probe = probe, probe * 2
    bad = min(probe, hi + step)
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        if _fits(shape, make(mid), gpu, surely)[0]:
            good = mid
        else:
            bad = mid
    return good


# --------------------------------------------------------------------------- micro_batch_size: auto


def auto_micro_batch(shape, s: Setup, gpu: Gpu) -> int:
    """The largest micro-batch dividing the step's batch per process (micro_batch x grad_accum) whose estimate fits
    `gpu` (1 when none does: the run then says so through its fit block)."""
    batch = s.micro_batch * s.grad_accum
    for m in sorted((d for d in range(1, batch + 1) if batch % d == 0), reverse=True):
        if m == 1 or _fits(shape, replace(s, micro_batch=m, grad_accum=batch // m), gpu)[0]:
            return m
    return 1


# --------------------------------------------------------------------------- one config, one GPU: the fit block


@dataclass
class Report:
    """The fit block of `envtool fit`, `python -m trainer validate` and `envtool train --dry-run` (one estimator)."""

    result: dict  # the JSON object (README: `envtool fit --json`)
    model: str
    notes: list[str] = field(default_factory=list)  # what the estimate assumed or could not count
    estimate: Estimate | None = None  # None when unknown
    reason: str | None = None  # why the verdict is unknown
    experts: str | None = None  # a k-bit MoE's experts in one line (experts_note), printed by validate and the dry run


def unknown(gpu: Gpu, reason: str) -> dict:
    return {"gpu": {"name": gpu.name, "memory_gb": gpu.memory_gb, "count": gpu.count}, "unit": "GB",
            "peak_gb": None, "low_gb": None, "high_gb": None, "fits": None, "verdict": "unknown", "breakdown": {},
            "suggestions": [], "options": [], "reason": reason}


def report(cfg, runtime, gpu: Gpu, local_only: bool = False) -> Report:
    """The estimate for `cfg` as the trainer runs it on `runtime` (precision, attention) over gpu.count processes
    of `gpu`: the model's shape from its config.json (`local_only`: the model directory or a cache, never the
    network). With auto_find_batch_size, at the micro-batch the run would pick. Raises ModelConfigError with
    bad_input for a base_model that does not exist; every other unknown is a verdict of "unknown" with its reason."""
    # start-up: trainer.fit.memory_model imported only when this runs
    from trainer.fit import memory_model

    s = setup_from(cfg, runtime, gpu.count)
    try:
        with memory_model.quiet_imports():
            shape = memory_model.model_shape(cfg.base_model, revision=cfg.revision_of_model,
                                             trust_remote_code=cfg.trust_remote_code,
                                             overrides=cfg.model_config_overrides, local_only=local_only)
    except memory_model.ModelConfigError as err:
        if err.bad_input:
            raise
        reason = f"the model's shape is unknown: {err}"
        return Report(unknown(gpu, reason), cfg.base_model, [reason], None, reason)
    notes = []
    if getattr(cfg, "auto_find_batch_size", False) and gpu.memory_gb is not None:
        m = auto_micro_batch(shape, s, gpu)
        batch = s.micro_batch * s.grad_accum
        s = replace(s, micro_batch=m, grad_accum=batch // m)
        notes.append(f"micro_batch_size auto: {m} x gradient_accumulation_steps {batch // m} (the largest that "
                     "fits at the estimate)")
    est = estimate(shape, s, gpu)
    notes += list(est.notes)
    notes += [o["text"] for o in est.options]  # what each memory option saves or costs, on and off
    reason = None
    result = est.to_json()
    if gpu.memory_gb is None:
        reason = f"{gpu.name}'s memory is not in matrices/gpus.toml: name the GPU (e.g. --gpu a100-80gb)"
        notes.append(reason)
        result["reason"] = reason
    return Report(result, cfg.base_model, notes, est, reason, experts_note(shape, s))


def experts_line(cfg, runtime) -> str | None:
    """experts_note for a config without a GPU to estimate for (validate on the CPU): the model's config.json from
    its directory or a cache only; None when its shape is unknown here."""
    # start-up: trainer.fit.memory_model imported only when this runs
    from trainer.fit import memory_model

    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        return None
    try:
        raw = memory_model.read_config(cfg.base_model, cfg.revision_of_model, True)[0]
        raw = {**raw, **(raw.get("text_config") or {})}
        if not any(raw.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            return None  # a dense model: no count to build
        with memory_model.quiet_imports():
            shape = memory_model.model_shape(cfg.base_model, revision=cfg.revision_of_model,
                                             trust_remote_code=cfg.trust_remote_code,
                                             overrides=cfg.model_config_overrides, local_only=True)
    except memory_model.ModelConfigError:
        return None
    return experts_note(shape, setup_from(cfg, runtime, 1))


def one_line(r: Report) -> str:
    """The block in one line: `peak 71.3 GB per GPU (band 66.0-80.2) on a100-80gb (80 GB) x 1 -> tight`."""
    res, gpu = r.result, r.result["gpu"]
    memory = f"{gpu['memory_gb']:g} GB" if gpu["memory_gb"] else "memory unknown"
    where = f"{gpu['name']} ({memory}) x {gpu['count']}"
    if res["peak_gb"] is None:
        return f"unknown on {where} ({r.reason})"
    return (f"peak {res['peak_gb']:.1f} GB per GPU (band {res['low_gb']:.1f}-{res['high_gb']:.1f}) on {where} -> "
            f"{res['verdict'].replace('_', ' ')}")


def cheapest(r: Report) -> dict | None:
    """The cheapest change that fits (the first suggestion that is a change, not a largest-value line)."""
    return next((x for x in r.result.get("suggestions", []) if not x["kind"].startswith("max_")), None)
