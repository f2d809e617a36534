"""Parallelism keys and their rules, read without torch: FSDP/DeepSpeed, the N-D mesh sizes, context parallelism,
Ray Train's launcher (the mesh, FSDP, DeepSpeed and context parallelism themselves are trainer/parallel/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, Field

from trainer.errors import ConfigError


class ParallelKeys(BaseModel):
    """More than one process: FSDP or DeepSpeed, the N-D mesh sizes, timeouts, and Ray Train's launcher."""

    deepspeed: str | None = None  # passed through to accelerate's DeepSpeed plugin
    fsdp: list[str] | str | None = None  # legacy Axolotl/HF list: full_shard, auto_wrap, offload, ...
    fsdp_config: dict[str, Any] | None = None  # Axolotl's keys, with or without the fsdp_ prefix
    fsdp_version: Literal[1, 2] | None = None
    ddp_find_unused_parameters: bool | None = None
    ddp_timeout: int = Field(1800, ge=1)  # seconds a collective may wait before the run stops
    # seconds the preflight before the first step waits for every rank under torchrun (trainer/parallel/preflight.py);
    # 0: no preflight
    preflight_timeout: int = Field(60, ge=0)
    # --- N-D parallelism (trainer/parallel/mesh.py; context_parallel_size: trainer/parallel/context_parallel.py) -------
    dp_shard_size: int | None = Field(None, ge=1)  # FSDP shards over this many ranks (unset/1: all left)
    dp_replicate_size: int | None = Field(None, ge=1)  # replicas of the sharded model (HSDP with dp_shard_size)
    tensor_parallel_size: int | None = Field(None, ge=1)
    context_parallel_size: int | None = Field(None, ge=1)
    # each MoE layer's experts split over this many ranks, tokens exchanged by all-to-all (trainer/parallel/mesh.py)
    expert_parallel_size: int | None = Field(None, ge=1)
    # accelerate's AcceleratorConfig, as Axolotl passes it: only gradient_accumulation_kwargs.sync_each_batch
    accelerator_config: dict[str, Any] | None = None
    # --- Ray Train launching (trainer/ray_launch.py; Axolotl's names and defaults) ----------------------------
    use_ray: bool = False  # `train` starts a local Ray cluster and runs the loop on ray_num_workers workers
    ray_num_workers: int = Field(1, ge=1)  # Ray Train workers (processes), each one rank
    resources_per_worker: dict[str, float] | None = None  # Ray resources per worker; unset: Axolotl's {GPU: 1}
    ray_run_name: str | None = None  # the Ray run's directory under output_dir (unset: "ray")

    def _check_launch(self) -> None:
        for name, amount in (self.resources_per_worker or {}).items():
            if amount < 0:
                raise ValueError(f"resources_per_worker.{name}: {amount:g} is negative (give 0 or more)")
        if self.ray_run_name is not None and (not self.ray_run_name.strip() or "/" in self.ray_run_name
                                              or self.ray_run_name in (".", "..")):
            raise ValueError(f"ray_run_name: {self.ray_run_name!r} must be a plain directory name")


# --- FSDP and DeepSpeed (trainer/parallel/distributed.py runs them) ----------------------------------------------
# FSDP is configured as Axolotl configures it: `fsdp_version` (1 or 2), `fsdp_config` with Axolotl's keys, with or
# without the `fsdp_` prefix, and the legacy `fsdp:` list (full_shard, auto_wrap, offload, ...). `deepspeed:` is a
# JSON file; Axolotl's configs name its own deepspeed_configs/*.json relative to Axolotl's checkout, and when such a
# path does not exist here the copy bundled in trainer/deepspeed_configs/ (same file, source in its SOURCES.toml)
# is used, with a note.
BUNDLED_DS = Path(__file__).parents[1] / "deepspeed_configs"

# Axolotl's fsdp_config keys (prefix removed) -> accelerate's FullyShardedDataParallelPlugin argument.
FSDP_KEYS = {
    "version": "fsdp_version",
    "sharding_strategy": "sharding_strategy",
    "reshard_after_forward": "reshard_after_forward",
    "offload_params": "cpu_offload",
    "auto_wrap_policy": "auto_wrap_policy",
    "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
    "state_dict_type": "state_dict_type",
    "backward_prefetch": "backward_prefetch",
    "forward_prefetch": "forward_prefetch",
    "use_orig_params": "use_orig_params",
    "sync_module_states": "sync_module_states",
    "cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "limit_all_gathers": "limit_all_gathers",
    "activation_checkpointing": "activation_checkpointing",
    "min_num_params": "min_num_params",
}
# The legacy `fsdp:` list.
FSDP_LIST = {"full_shard": ("sharding_strategy", "FULL_SHARD"), "shard_grad_op": ("sharding_strategy", "SHARD_GRAD_OP"),
             "hybrid_shard": ("sharding_strategy", "HYBRID_SHARD"), "no_shard": ("sharding_strategy", "NO_SHARD"),
             "offload": ("cpu_offload", True), "auto_wrap": ("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")}


def fsdp_enabled(cfg) -> bool:
    return bool(cfg.fsdp or cfg.fsdp_config or cfg.fsdp_version)




def fsdp_settings(cfg, cpu: bool = False) -> dict:
    """The FSDP settings as accelerate's plugin arguments (raises ConfigError naming a bad key). cpu: FSDP1
    configs become FSDP2, which runs over gloo."""
    settings: dict = {}
    items = cfg.fsdp if isinstance(cfg.fsdp, list) else (cfg.fsdp or "").split()
    for item in items:
        if item not in FSDP_LIST:
            raise ConfigError(f"fsdp: unknown option '{item}' (known: {', '.join(FSDP_LIST)})")
        key, value = FSDP_LIST[item]
        settings[key] = value
    for raw_key, value in (cfg.fsdp_config or {}).items():
        key = raw_key.removeprefix("fsdp_")
        if key not in FSDP_KEYS:
            raise ConfigError(f"fsdp_config.{raw_key}: unknown FSDP setting (known: {', '.join(sorted(FSDP_KEYS))}, "
                              "each also with an fsdp_ prefix)")
        if value is not None:
            settings[FSDP_KEYS[key]] = value
    if cfg.fsdp_version:
        settings["fsdp_version"] = cfg.fsdp_version
    settings.setdefault("fsdp_version", 1)
    if cpu:
        settings["fsdp_version"] = 2
    names = settings.get("transformer_cls_names_to_wrap")
    if isinstance(names, str):
        settings["transformer_cls_names_to_wrap"] = [n.strip() for n in names.split(",") if n.strip()]
    if isinstance(settings.get("auto_wrap_policy"), str):
        settings["auto_wrap_policy"] = settings["auto_wrap_policy"].lower()
    if settings["fsdp_version"] == 2:
        # FSDP2 has no sharding strategies: FULL_SHARD is reshard_after_forward=True, SHARD_GRAD_OP False.
        strategy = str(settings.pop("sharding_strategy", "") or "").upper()
        if strategy and "reshard_after_forward" not in settings:
            settings["reshard_after_forward"] = strategy != "SHARD_GRAD_OP"
        for legacy in ("use_orig_params", "sync_module_states", "limit_all_gathers", "forward_prefetch",
                       "backward_prefetch"):
            settings.pop(legacy, None)  # FSDP1-only; FSDP2 always behaves as these ask
    return settings


def check_backend(cfg) -> list[str]:
    """FSDP or DeepSpeed (not both), the FSDP settings, the DeepSpeed file; returns notes."""
    notes = []
    if fsdp_enabled(cfg):
        if cfg.deepspeed:
            raise ConfigError("deepspeed and fsdp/fsdp_config are both set; choose one sharding backend")
        settings = fsdp_settings(cfg)
        if settings["fsdp_version"] == 1:
            notes.append("fsdp_version: 1 (FSDP1, as accelerate runs it); fsdp_version: 2 is the newer API")
        if settings.get("activation_checkpointing") and cfg.gradient_checkpointing:
            notes.append("fsdp_config.activation_checkpointing and gradient_checkpointing are both on: "
                         "the model's own gradient checkpointing is used")
    if cfg.deepspeed:
        resolved = deepspeed_path(cfg.deepspeed)
        if resolved != cfg.deepspeed:
            notes.append(f"deepspeed: {cfg.deepspeed} not found here; using the bundled copy of Axolotl's {resolved.name}")
    return notes


def deepspeed_path(path: str):
    """The DeepSpeed JSON to use: the path as given, else Axolotl's file of that name bundled here."""
    given = Path(path).expanduser()
    if given.exists():
        return path
    bundled = BUNDLED_DS / given.name
    if bundled.exists() and given.parent.name == "deepspeed_configs":
        return bundled
    return path


# --- the N-D mesh sizes (trainer/parallel/mesh.py builds the mesh) ---------------------------------------------
SIZE_KEYS = ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size",
             "expert_parallel_size")

# Sizes above 1 that this trainer refuses, with the reason (a size of 1 is "none" and accepted).
REFUSED: dict[str, str] = {}


def given(cfg) -> dict[str, int]:
    """The size keys the config sets (to any value)."""
    return {k: getattr(cfg, k) for k in SIZE_KEYS if getattr(cfg, k) is not None}


def check_sizes(cfg, fsdp: bool) -> list[str]:
    """The N-D parallelism sizes (trainer/parallel/mesh.py), checked before the world size is known; returns notes."""
    sync_each_batch(cfg)
    sizes = given(cfg)
    if not sizes:
        return []
    problems = [f"{key}: {sizes[key]} ({reason})" for key, reason in REFUSED.items() if sizes.get(key, 1) > 1]
    shard, replicate, tp, cp = (sizes.get(k, 1) for k in ("dp_shard_size", "dp_replicate_size",
                                                          "tensor_parallel_size", "context_parallel_size"))
    if shard > 1 and not fsdp:
        problems.append(f"dp_shard_size: {shard} shards the model with FSDP, so it needs fsdp_version: 2 and "
                        "fsdp_config (as Axolotl requires)" + (", not deepspeed (which shards by its ZeRO stage)" if cfg.deepspeed else ""))
    if fsdp and replicate > 1 and (cfg.fsdp_version or (cfg.fsdp_config or {}).get("fsdp_version")
                                   or (cfg.fsdp_config or {}).get("version") or 1) != 2:
        problems.append(f"dp_replicate_size: {replicate} with FSDP (HSDP) needs fsdp_version: 2 (accelerate "
                        "builds HSDP on FSDP2's device mesh)")
    if tp > 1:
        for clash, why in ((cfg.deepspeed, "deepspeed (Axolotl's DeepSpeed AutoTP is not supported)"),
                           (cfg.adapter, f"adapter: {cfg.adapter} (LoRA on tensor-parallel weights is not supported)"),
                           (cfg.rl, f"rl: {cfg.rl} (the reference pass runs each rank's own share of pairs)")):
            if clash:
                problems.append(f"tensor_parallel_size: {tp} with {why}")
    ep = sizes.get("expert_parallel_size", 1)
    if ep > 1:
        problems += expert_parallel_problems(cfg, ep, shard, replicate, tp, cp)
    if problems:
        raise ConfigError("; ".join(problems))
    if ep > 1:
        return check_expert_parallel(cfg, ep, shard, cp, fsdp) + check_context_parallel(cfg)
    fixed = (shard if shard > 1 else 1) * replicate * tp * cp
    notes = check_context_parallel(cfg)
    if tp > 1:
        notes.append(f"tensor_parallel_size: {tp}: the model is loaded sharded by transformers (the model's tp_plan, "
                     "DistributedConfig" + (" with FSDP2 over the other ranks; fsdp_config's wrapping and offload "
                                            "settings are transformers' own there)" if fsdp else ")"))
    if fsdp:
        kind = (f"HSDP, {replicate} replicas of the sharded model" if replicate > 1 else "FSDP")
        shard_text = f"{shard}-way shards" if shard > 1 else "shards over the processes the other sizes leave"
        if cp > 1:  # the CP ranks shard with the data ranks (torchtitan's dp_shard_cp)
            shard_text += f", each shard group also spanning the {cp} ranks of a context-parallel group"
        count = f"{fixed}" if shard > 1 and replicate > 1 else f"a multiple of {fixed}"
        return notes + [f"parallelism: {kind}, {shard_text}; needs {count} processes, checked at launch"
                        if fixed > 1 else f"parallelism: sizes of 1 mean none; FSDP {shard_text}"]
    if tp > 1:
        return notes + [f"parallelism: tensor parallel alone needs exactly {tp} processes, checked at launch"]
    if cp > 1:
        return notes
    return [f"parallelism: data parallel (DDP), dp_replicate_size {replicate} must equal the number of processes, "
            "checked at launch" if replicate > 1 else "parallelism: sizes of 1 mean none"]


# --- expert parallelism (trainer/parallel/mesh.py: transformers' DistributedConfig ep_size) -----------------------
# What expert_parallel_size composes with here, and why not the rest (each a one-line refusal naming both keys).
EP_CLASHES = (
    ("deepspeed", "deepspeed (ZeRO shards the experts by its own stage; use FSDP: fsdp_version: 2 and dp_shard_size)"),
    ("tensor_parallel_size", "tensor_parallel_size: {v} (EP x TP is not supported, as in Axolotl)"),
    ("dp_replicate_size", "dp_replicate_size: {v} (EP x HSDP is not supported here: give dp_shard_size alone)"),
    ("lora_target_parameters", "lora_target_parameters (LoRA on the fused expert tensors, which the ranks hold "
                               "in parts: target the attention and shared linear layers)"),
    ("rl", "rl: {v} (the reference pass runs each rank's own share of pairs through collective layers)"),
    ("load_in_4bit", "load_in_4bit (bitsandbytes layers are not sharded by transformers' plans)"),
    ("load_in_8bit", "load_in_8bit (bitsandbytes layers are not sharded by transformers' plans)"),
)
# config.json keys that hold the number of routed experts (Mixtral, Qwen3-MoE, DeepSeek, ...)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_parallel_problems(cfg, ep: int, shard: int, replicate: int, tp: int, cp: int) -> list[str]:
    """What expert_parallel_size above 1 cannot be combined with, and a local model's expert count."""
    values = {"tensor_parallel_size": tp, "context_parallel_size": cp, "dp_replicate_size": replicate}
    problems = []
    for key, why in EP_CLASHES:
        value = values.get(key, getattr(cfg, key, None))
        if value and not (type(value) is int and value == 1):  # a size of 1 is none; True is a flag
            problems.append(f"expert_parallel_size: {ep} with {why.format(v=value)}")
    if cfg.objective != "sft" and not cfg.rl:
        problems.append(f"expert_parallel_size: {ep} with the {cfg.objective} objective (SFT's token loss only)")
    local = _local_config(cfg.base_model)
    if local is not None:
        reason = expert_count_reason(local, ep)
        if reason is not None:
            problems.append(reason)
    return problems


def expert_count(config) -> int | None:
    """The number of routed experts per MoE layer, from a model config (None: not a mixture of experts)."""
    for c in (config, getattr(config, "text_config", None)):
        for key in EXPERT_COUNT_KEYS:
            value = getattr(c, key, None) if c is not None else None
            if isinstance(value, int) and value > 1:
                return value
    return None


def expert_count_reason(config, ep: int) -> str | None:
    """Why this model's experts cannot be split over ep ranks (None: they can)."""
    count = expert_count(config)
    kind = getattr(config, "model_type", "") or "this model"
    if count is None:
        return (f"expert_parallel_size: {ep}: model_type {kind} is not a mixture-of-experts model (its config names "
                f"no experts: {', '.join(EXPERT_COUNT_KEYS)}); use expert_parallel_size: 1")
    if count % ep:
        return (f"expert_parallel_size: {ep} does not divide the model's {count} experts per layer (model_type "
                f"{kind}); use a divisor of {count}")
    return None


def check_expert_parallel(cfg, ep: int, shard: int, cp: int, fsdp: bool) -> list[str]:
    """Notes for expert_parallel_size above 1 (its refusals are expert_parallel_problems)."""
    sizes = "expert_parallel_size" + (" x context_parallel_size" if cp > 1 else "")
    if shard > 1:
        count = f"exactly {ep * cp * shard} processes ({sizes} x dp_shard_size, as Axolotl)"
    elif fsdp:
        count = f"a multiple of {ep * cp} processes (FSDP takes the ranks EP leaves)"
    else:
        count = f"exactly {ep * cp} processes (without FSDP, {sizes} is the number of processes, as Axolotl)"
    notes = [f"expert_parallel_size: {ep}: each MoE layer's experts are split over {ep} ranks (transformers' expert "
             "parallelism, DistributedConfig ep_size), every rank trains its own batches and sends each token to "
             "its experts' rank with torch.distributed all-to-all; the other weights are FSDP2-sharded over all "
             f"ranks; needs {count}, checked at launch"]
    if fsdp:
        notes.append("fsdp_config: with expert_parallel_size transformers applies FSDP2 as the model loads (its "
                     "fsdp_plan); fsdp_config's wrapping and offload settings are transformers' own there")
    return notes  # expert_parallel_backend and DeepEP's buffer sizes: the "ignored:" note says why (the matrix)


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    cp: int = 1  # context parallel (trainer/parallel/context_parallel.py): between the data ranks and tp
    ep: int = 1  # expert parallel: the experts split over ep of the data ranks (dp_shard), tokens exchanged

    @property
    def data_world(self) -> int:
        """Ranks that see different batches (the ranks of one tensor-parallel group share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.data_world * self.cp * self.tp

    def data_rank(self, rank: int) -> int:
        """tp is the innermost mesh dimension (accelerate's and transformers' order): consecutive ranks form
        one tensor-parallel group; cp comes next (the ranks of a CP group read the same batches)."""
        return rank // (self.tp * self.cp)

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def describe(self) -> str:
        if self.ep > 1:
            copies = self.world // self.ep
            held = f", each expert held by {copies} ranks" if copies > 1 else ""
            context = f" x {self.cp}-way context parallel" if self.cp > 1 else ""
            return f"{self.ep}-way expert parallel{held}{context}; other weights FSDP over all {self.world} processes"
        if self.cp > 1:
            rest = Mesh(self.dp_replicate, self.dp_shard, self.tp).describe()
            return f"{self.cp}-way context parallel x {rest.rsplit(' (', 1)[0]} ({self.world} processes)"
        if self.tp > 1:
            dp = (f"{self.dp_replicate} replicas x {self.dp_shard}-way FSDP shards" if self.hybrid else
                  f"{self.dp_shard}-way FSDP shards" if self.dp_shard > 1 else "no data parallelism")
            return f"{self.tp}-way tensor parallel x {dp} ({self.world} processes)"
        if self.hybrid:
            return (f"HSDP: {self.dp_replicate} replicas x {self.dp_shard}-way FSDP shards "
                    f"({self.world} processes)")
        if self.dp_shard > 1:
            return f"FSDP over {self.dp_shard} processes"
        return f"data parallel over {self.dp_replicate} process(es)"


def mesh_for(cfg, world: int, fsdp: bool) -> Mesh | None:
    """The mesh for `world` processes (None when no size key is set). Raises ConfigError naming the sizes when
    they do not fit the number of processes."""
    sizes = given(cfg)
    if not sizes:
        return None
    check_sizes(cfg, fsdp)
    shard = sizes.get("dp_shard_size") or 1
    replicate = sizes.get("dp_replicate_size")
    tp = sizes.get("tensor_parallel_size") or 1
    cp = sizes.get("context_parallel_size") or 1
    asked = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
    ep = sizes.get("expert_parallel_size") or 1
    if ep > 1:  # Axolotl's rule: expert_parallel_size x context_parallel_size x dp_shard_size = world (FSDP alone
        # may take what EP leaves); the ranks of a CP group read the same batches, as without EP
        exact, fixed = shard > 1 or not fsdp, ep * cp * shard
        if (world != fixed) if exact else world % (ep * cp):
            need = f"= {fixed} processes" if exact else f"needs a multiple of {ep * cp} processes"
            raise ConfigError(f"{asked} {need}, but this run has {world} (WORLD_SIZE): launch that many processes "
                              "(torchrun --nproc-per-node, times the nodes) or change the sizes")
        return Mesh(dp_replicate=1, dp_shard=world // cp, cp=cp, ep=ep)

    def mismatch() -> ConfigError:
        fixed = shard * (replicate or 1) * tp * cp
        exact = (shard > 1 and replicate and replicate > 1) or (not fsdp and cp == 1)
        need = f"= {fixed} processes" if exact else f"needs a multiple of {fixed} processes"
        return ConfigError(f"{asked} {need}, but this run has {world} (WORLD_SIZE): launch that many processes "
                           "(torchrun --nproc-per-node, times the nodes) or change the sizes")

    if world % (tp * cp):
        raise mismatch()
    rest = world // (tp * cp)  # the ranks of a CP x TP block share their batches
    if replicate and replicate > 1:
        if rest % replicate:
            raise mismatch()
        rest //= replicate
    if shard > 1:
        if rest % shard:
            raise mismatch()
        left = rest // shard
        if left > 1:  # ranks over: they replicate, unless dp_replicate_size was given (then it is a mismatch)
            if replicate and replicate > 1:
                raise mismatch()
            replicate = left
        return Mesh(dp_replicate=replicate or 1, dp_shard=shard, tp=tp, cp=cp)
    # dp_shard_size unset or 1: under FSDP the ranks left shard (Axolotl's fill); without FSDP they are DDP
    # replicas, and dp_replicate_size, when given, must account for all of them; tensor parallelism without
    # FSDP takes every rank (accelerate does not compose DDP replicas with it)
    if fsdp:
        return Mesh(dp_replicate=replicate or 1, dp_shard=rest, tp=tp, cp=cp)
    if (replicate and replicate > 1 or tp > 1) and rest != 1:
        raise mismatch()
    return Mesh(dp_replicate=world // (tp * cp), dp_shard=1, tp=tp, cp=cp)


def sync_each_batch(cfg) -> bool:
    """accelerator_config.gradient_accumulation_kwargs.sync_each_batch: reduce gradients after every micro-batch
    instead of once per step (FSDP then keeps only sharded gradients between micro-batches: less memory, the same
    sums). The rest of accelerate's AcceleratorConfig concerns accelerate's data loaders and accumulation, which
    this loop does not use: refused with the reason."""
    options = dict(cfg.accelerator_config or {})
    accumulation = options.pop("gradient_accumulation_kwargs", None) or {}
    if not isinstance(accumulation, dict):
        raise ConfigError("accelerator_config.gradient_accumulation_kwargs: must be a mapping")
    accumulation = dict(accumulation)
    value = accumulation.pop("sync_each_batch", False)
    unknown = [f"accelerator_config.{k}" for k in options] + [
        f"accelerator_config.gradient_accumulation_kwargs.{k}" for k in accumulation]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not supported (this trainer shards, batches and accumulates "
                          "itself; only gradient_accumulation_kwargs.sync_each_batch applies)")
    if not isinstance(value, bool):
        raise ConfigError("accelerator_config.gradient_accumulation_kwargs.sync_each_batch: must be true or false")
    return value


# --- context parallelism (trainer/parallel/context_parallel.py) --------------------------------------------------
# Model types whose layers mix tokens with something other than attention (state passed along the sequence).
RECURRENT_TYPES = {"mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2", "bamba",
                   "nemotron_h", "granitemoehybrid", "rwkv", "recurrent_gemma", "lfm2", "lfm2_moe", "qwen3_next",
                   "minimax", "plamo2", "xlstm", "kimi_linear"}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global",
                         "local", "hybrid"}


def check_context_parallel(cfg) -> list[str]:
    """Config-time checks for context_parallel_size above 1 (trainer/parallel/context_parallel.py); returns notes."""
    cp = cfg.context_parallel_size or 1
    if cp == 1:
        return []
    problems = []
    if cfg.sample_packing and cfg.micro_batch_size > 1:
        problems.append(f"context_parallel_size: {cp} with sample_packing needs micro_batch_size: 1 (as Axolotl "
                        f"requires; got {cfg.micro_batch_size}): raise gradient_accumulation_steps instead")
    if cfg.objective != "sft" or cfg.use_eaft or getattr(cfg, "diffusion", None) is not None:
        what = f"rl: {cfg.rl}" if cfg.rl else ("use_eaft" if cfg.use_eaft else
                                               "diffusion" if getattr(cfg, "diffusion", None) is not None
                                               else cfg.objective)
        problems.append(f"context_parallel_size: {cp} with {what}: context parallelism here splits SFT's "
                        "token loss only (preference, reward and diffusion losses are per sequence)")
    if cfg.do_causal_lm_eval:
        problems.append(f"context_parallel_size: {cp} with do_causal_lm_eval: its generation runs whole sequences "
                        "in one process, not split over the CP group")
    if cfg.tensor_parallel_size and cfg.tensor_parallel_size > 1 and not (cfg.fsdp_version or cfg.fsdp_config
                                                                           or cfg.fsdp):
        problems.append(f"context_parallel_size: {cp} with tensor_parallel_size: {cfg.tensor_parallel_size} "
                        "needs FSDP (fsdp_version: 2): the CP ranks shard the model with the data ranks")
    local = _local_config(cfg.base_model)
    reason = recurrent_reason(local) if local is not None else None
    if reason is not None:
        problems.append(context_refusal(cp, reason))
    if problems:
        raise ConfigError("; ".join(problems))
    return [f"context_parallel_size: {cp}: each sequence is split over {cp} ranks, keys and values all-gathered "
            "in every attention layer (exact attention; the attention backend becomes SDPA over the gathered "
            "keys); needs a multiple of {cp} processes, checked at launch; a model with Mamba/SSM layers "
            "(nemotron_h, falcon_h1, jamba, ...) is refused when it loads".replace("{cp}", str(cp))]


def _local_config(base_model):
    """A local model directory's config.json as attributes (None for hub ids: validate reads no network)."""
    path = Path(str(base_model or "")).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    wrap = lambda d: SimpleNamespace(**{k: wrap(v) if isinstance(v, dict) else v for k, v in d.items()})  # noqa: E731
    return wrap(raw)


def context_refusal(cp: int, reason: str) -> str:
    return (f"context_parallel_size: {cp}: {reason}, which carry state from token to token, so a sequence "
            "cannot be split over ranks here; use context_parallel_size: 1")


def recurrent_reason(config) -> str | None:
    """Why this model's sequence cannot be split (None: every token mixer is attention)."""
    configs = [config] + [getattr(config, k) for k in ("text_config", "language_config")
                          if getattr(config, k, None) is not None]
    for c in configs:
        kind = getattr(c, "model_type", "") or ""
        if kind in RECURRENT_TYPES:
            return f"model_type {kind} has Mamba/SSM or other recurrent token-mixing layers"
        pattern = getattr(c, "hybrid_override_pattern", None)
        if isinstance(pattern, str) and "M" in pattern:
            return f"model_type {kind} has Mamba layers (hybrid_override_pattern {pattern})"
        for key in ("layer_types", "layers_block_type", "block_types"):
            types = getattr(c, key, None)
            if isinstance(types, (list, tuple)):
                other = sorted({str(t) for t in types} - ATTENTION_LAYER_TYPES)
                if other:
                    return f"model_type {kind} has {', '.join(other)} layers ({key})"
    return None
