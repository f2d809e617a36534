"""merge-lora: the trained adapter folded into its base, one safetensors shard at a time.

``python -m trainer merge-lora CONFIG [--output DIR] [--dtype bf16|fp16|fp32]`` reads the adapter in
``output_dir/final`` and the base model's checkpoint (``base_model``: a local directory, or a hub id from the cache or
the hub), and writes a full model to ``output_dir/merged`` (or DIR): the same shards as the base, each with the LoRA
deltas of its tensors added, config.json, the tokenizer and chat template saved with the adapter, and a
generation_config.json whose eos_token_id includes the chat template's end-of-turn token (trainer/outputs/chat_check.py).

Streaming: the whole model is never in memory. The adapter is read once (it is small); then each base shard is
opened with safetensors' safe_open, its tensors are read one by one, merged where the adapter targets them, cast to
the output dtype and written as that shard; then the next. Peak memory is about one shard plus the adapter
(bench/merge_memory.py measures it). Everything goes to a temporary directory beside the output, renamed at the end,
so an interrupted merge leaves nothing half-written.

The arithmetic is peft's (peft/tuners/lora/layer.py and variants.py, the oracle in the tests), in fp32 whatever the
dtypes: W' = W + scaling * B @ A (transposed for fan_in_fan_out layers; embeddings: (B @ A)^T), scaling =
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, r and alpha per module from rank_pattern / alpha_pattern;
DoRA: W' = m / ||W + scaling * B @ A||_row * (W + scaling * B @ A); lora_bias: b' = b + scaling * B.bias. Tensors
the adapter saved whole (modules_to_save, embeddings resized for added tokens) replace the base's.

QLoRA: the base is the checkpoint's own (unquantized) weights, so the merged model is in the training precision,
never 4-bit; it differs from the 4-bit base + adapter the run trained by the base's NF4 rounding (README, "After
training", gives the measured figure). A full fine-tune's final/ is already a full model: nothing to merge.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError, TrainingError

PREFIX = "base_model.model."
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# adapter_config.json keys that change what the adapter computes in ways this merge does not reproduce
UNSUPPORTED = {
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}
TOKENIZER_SKIP = {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md",
                  "generation_config.json", "config.json", "model.safetensors", "model.safetensors.index.json"}


@dataclass
class Delta:
    """One LoRA-adapted weight: its factors and how to combine them (see the module docstring)."""

    module: str
    kind: str = "linear"  # linear | embedding | dense (an update computed whole: trainer/outputs/merge_params.py)
    A: object = None
    B: object = None
    bias: object = None  # lora_B.bias (lora_bias)
    magnitude: object = None  # DoRA's m
    scaling: float = 1.0
    fan_in_fan_out: bool = False
    dense: object = None  # kind dense: a function returning the update

    def delta(self):
        """scaling * B @ A in the base weight's layout, fp32."""
        if self.kind == "dense":
            return self.dense().float()
        A, B = self.A.float(), self.B.float()
        if self.kind == "embedding":
            return (B @ A).T * self.scaling
        product = B @ A * self.scaling
        return product.T if self.fan_in_fan_out else product

    def merge(self, weight):
        # heavy: torch loads only when this runs
        import torch

        w = weight.float()
        d = self.delta()
        if d.shape != w.shape:
            raise TrainingError(f"merge-lora: {self.module}: the adapter's update has shape {tuple(d.shape)} but the "
                                f"base weight has {tuple(w.shape)}; the adapter was not trained on this base")
        merged = w + d
        if self.magnitude is not None:  # DoRA: rescale each output row to the trained magnitude
            rows = merged.T if self.fan_in_fan_out else merged
            norm = torch.linalg.norm(rows, dim=1)
            factor = (self.magnitude.float() / norm).view(-1, 1)
            merged = (factor * rows).T if self.fan_in_fan_out else factor * rows
        return merged


@dataclass
class Adapter:
    deltas: dict = field(default_factory=dict)  # base tensor name -> Delta (weights)
    biases: dict = field(default_factory=dict)  # base tensor name -> Delta (lora_bias)
    whole: dict = field(default_factory=dict)  # base tensor name -> tensor saved whole by the adapter
    config: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.get("r", 0)


def read_adapter(final: Path, wrapped: dict | None = None) -> Adapter:
    """The adapter in final/ as deltas keyed by the base tensor they change. Raises ConfigError for adapters this
    merge cannot reproduce (named), before anything is written. `wrapped`: peft's ParamWrapper modules
    (trainer/outputs/merge_params.py wrappers), whose factors hold rank x experts rows."""
    # heavy: torch and safetensors load only when this runs
    import torch

    config = json.loads((final / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"merge-lora: {final} holds a {config.get('peft_type')} adapter; only LoRA adapters merge")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise ConfigError(f"merge-lora: {final} is a {config['task_type']} adapter (a reward or classification "
                          "head); merge-lora writes causal language models only")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ConfigError(f"merge-lora: the adapter uses {what}, which this streaming merge does not reproduce; "
                              "merge it with peft's merge_and_unload instead")
    if config.get("init_lora_weights") == "loftq" or config.get("loftq_config"):
        raise ConfigError("merge-lora: a LoftQ adapter trained against LoftQ's quantized base, not the checkpoint's "
                          "weights, so merging it into the checkpoint would be wrong; it is not supported")
    if (final / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(final / "adapter_model.safetensors")
    elif (final / "adapter_model.bin").is_file():
        tensors = torch.load(final / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"merge-lora: {final} has adapter_config.json but no adapter_model.safetensors")
    adapter = Adapter(config=config)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    parts: dict[str, Delta] = {}
    copies = {}
    for key, tensor in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        for suffix, slot, kind in ((".lora_A.weight", "A", "linear"), (".lora_B.weight", "B", "linear"),
                                   (".lora_B.bias", "bias", "linear"), (".lora_magnitude_vector", "magnitude", None),
                                   (".lora_magnitude_vector.weight", "magnitude", None),
                                   (".lora_embedding_A", "A", "embedding"), (".lora_embedding_B", "B", "embedding")):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                part = parts.setdefault(module, Delta(module, fan_in_fan_out=bool(config.get("fan_in_fan_out"))))
                setattr(part, slot, tensor)
                if kind:
                    part.kind = kind
                break
        else:
            if "lora_" in name or "trainable_tokens" in name:
                raise ConfigError(f"merge-lora: the adapter holds {key}, a kind of tensor this merge does not know; "
                                  "merge it with peft's merge_and_unload instead")
            if ".original_module." in name:  # the wrapped base layer (saved with resized embeddings): not used
                continue
            if ".modules_to_save." in name:  # the same trained copy as the plain key, which peft loads
                copies[name.replace(".modules_to_save.", ".")] = tensor
                continue
            adapter.whole[name.replace(".base_layer.", ".")] = tensor
    for name, tensor in copies.items():
        adapter.whole.setdefault(name, tensor)
    for module, part in parts.items():
        if part.A is None or part.B is None:
            raise ConfigError(f"merge-lora: the adapter has only half of {module}'s LoRA factors")
        if part.magnitude is not None and part.kind == "embedding":
            raise ConfigError(f"merge-lora: DoRA on the embedding {module} is not supported by this merge")
        r = rank_pattern.get(pattern_key(final, "rank_pattern", rank_pattern, module), config.get("r", part.A.shape[0]))
        experts = wrapped[module][2] if wrapped and module in wrapped else 1  # ParamWrapper: rank x experts rows
        check_rank(final, module, part, r * experts if type(r) is int else r)
        alpha = alpha_pattern.get(pattern_key(final, "alpha_pattern", alpha_pattern, module),
                                  config.get("lora_alpha", r))
        part.scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        adapter.deltas[f"{module}.weight"] = part
        if part.bias is not None:
            adapter.biases[f"{module}.bias"] = part
    return adapter


PATTERN_SECONDS = 1.0  # one rank_pattern / alpha_pattern key against one module name (a plain key takes microseconds)


def pattern_key(final: Path, field: str, patterns: dict, module: str) -> str:
    """peft's get_pattern_key (the first key K with `(.*\\.)?(K)$` matching the module's name, else the name), with
    the `regex` module's time limit: a key like `(.|.)*X` backtracks for ever on a 60-character module name with
    Python's `re`. `regex` is transformers' own dependency, so always here when a merge runs. A key that is not a
    regular expression, or takes longer than PATTERN_SECONDS, is ConfigError naming adapter_config.json and the key."""
    # optional: regex is imported only where it is used
    import regex

    where = final / "adapter_config.json"
    for key in patterns:
        if not isinstance(key, str):
            raise ConfigError(f"merge-lora: {where}: {field} key {key!r} is not a module name or pattern")
        try:
            if regex.match(rf"(.*\.)?({key})$", module, timeout=PATTERN_SECONDS):
                return key
        except regex.error as err:
            raise ConfigError(f"merge-lora: {where}: {field} key {key[:80]!r} is not a regular expression "
                              f"({err})") from None
        except TimeoutError:
            raise ConfigError(f"merge-lora: {where}: {field} key {key[:80]!r} took more than {PATTERN_SECONDS:g} s "
                              f"to match the module name {module!r} (a pattern that backtracks without end): write "
                              "the module names plainly (e.g. 'q_proj' or 'layers.0.self_attn.q_proj')") from None
    return module


def check_rank(final: Path, module: str, part: Delta, r) -> None:
    """The rank the scaling divides by must be the tensors' own: A is (r, in), B is (out, r) (embeddings: A (r,
    vocab), B (dim, r)). adapter_config.json's `r` (or its rank_pattern) saying otherwise scales the update wrongly
    (r 4 on rank-8 tensors doubles it) and peft refuses to load the adapter: ConfigError, before anything is written."""
    shape_a, shape_b = tuple(part.A.shape), tuple(part.B.shape)
    if len(shape_a) != 2 or len(shape_b) != 2 or shape_a[0] != shape_b[1]:
        raise ConfigError(f"merge-lora: {final}: {module}'s LoRA factors have shapes {shape_a} and {shape_b}, which "
                          "do not multiply (A must be rank x in, B out x rank): the adapter file is damaged")
    if isinstance(r, bool) or not isinstance(r, int) or r != shape_a[0]:
        raise ConfigError(f"merge-lora: {final / 'adapter_config.json'} says r {r!r} for {module}, but its tensors "
                          f"have rank {shape_a[0]}: the config does not belong to these weights (peft refuses to load "
                          "it too)")


def base_dir(cfg) -> Path:
    """The base model's directory: base_model itself when it is one, else its hub snapshot (cache, or download).
    ConfigError when it is neither."""
    path = Path(cfg.base_model).expanduser()
    if path.is_dir():
        return path
    if cfg.base_model.startswith(("/", "./", "../", "~")) or cfg.base_model.count("/") > 1:
        raise ConfigError(f"merge-lora: base_model {cfg.base_model}: no such directory (the adapter merges into the "
                          "base it was trained on)")
    # heavy: huggingface_hub loads only when this runs
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(cfg.base_model, revision=cfg.revision_of_model,
                                      allow_patterns=["*.safetensors", "*.safetensors.index.json", "config.json",
                                                      "generation_config.json", "*.py"]))
    except Exception as err:  # offline, gated, unknown repository: all "not available here"
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"merge-lora: base_model {cfg.base_model} is not available here ({first})") from None


def base_shards(base: Path) -> tuple[list[str], dict[str, str]]:
    """(shard file names, tensor name -> shard) of a safetensors checkpoint."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    elif (base / "model.safetensors").is_file():
        # heavy: safetensors loads only when this runs
        from safetensors import safe_open

        with safe_open(base / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
        shards = ["model.safetensors"]
    else:
        found = ", ".join(sorted(p.name for p in base.iterdir() if p.suffix in (".bin", ".pt", ".gguf"))) or "none"
        raise ConfigError(f"merge-lora: {base} has no safetensors checkpoint (model.safetensors or an index); "
                          f"weight files found: {found}")
    missing = [s for s in shards if not (base / s).is_file()]
    if missing:
        raise ConfigError(f"merge-lora: {base} lacks the shard(s) {', '.join(missing)} its index names")
    return shards, weight_map


def checkpoint_renames(base: Path, weight_map: dict, trust_remote_code: bool) -> list[tuple[str, str]]:
    """(name in the checkpoint, name in the loaded model) for every tensor that transformers renames while loading
    (its checkpoint conversion mapping: a model built on the meta device says which); [] where it cannot tell."""
    # heavy: torch and transformers load only when this runs
    import torch

    try:
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        config = transformers.AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            for auto in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
                try:
                    model = auto.from_config(config, trust_remote_code=trust_remote_code)
                    break
                except ValueError:
                    model = None
        if model is None:
            return []
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        meta = model.state_dict()
        pairs = [(name, *rename_source_key(name, renamings, converters, model.base_model_prefix, meta))
                 for name in weight_map]
    except (ImportError, OSError, ValueError, TypeError):  # an older transformers, an unreadable config
        return []
    return [(saved, loaded) for saved, loaded, converted in pairs if converted is None and loaded != saved]


SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOATS = {"F64", "F32", "F16", "BF16"}


def st_dtype(dtype) -> str:
    """safetensors' name for a torch dtype."""
    # heavy: torch loads only when this runs
    import torch

    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    return names.get(dtype, str(dtype))


def write_safetensors(path: Path, header: dict, tensors) -> int:
    """Write a safetensors file tensor by tensor: the header (name -> (dtype, shape)) first, then each tensor's bytes
    as `tensors` yields them, so the shard being written is never whole in memory (safetensors' save_file takes a
    dict of every tensor). The layout is safetensors' own (8-byte little-endian header length, JSON header padded
    with spaces to 8 bytes, data in header order); the tests read the files back with safe_open and
    from_pretrained. Returns the bytes of tensor data written."""
    # heavy: torch loads only when this runs
    import struct

    import torch

    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in header.items():
        if dtype not in SIZES:
            raise ConfigError(f"merge-lora: {name} is stored as {dtype}, which this merge does not write")
        nbytes = SIZES[dtype] * math.prod(shape)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name, tensor in tensors:
            dtype, shape = header[name]
            if st_dtype(tensor.dtype) != dtype or list(tensor.shape) != shape:
                raise TrainingError(f"merge-lora: {name} came out as {tensor.dtype} {list(tensor.shape)}, "
                                    f"not the {dtype} {shape} its header says")
            out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return offset


def merge_lora(config: str | Path, output: str | Path | None = None, dtype: str | None = None, log=print,
               precision=None) -> dict:
    """Merge output_dir/final into the base, streaming shard by shard; return what was written (see module doc).
    dtype: bf16 | fp16 | fp32, else `precision()` (the CLI passes the run's training precision on this machine,
    from trainer.setup, which this layer does not import), else the base checkpoint's own dtype."""
    # heavy: torch loads only when this runs
    import torch

    from trainer.config import load_config

    cfg, _ = load_config(config)
    final = Path(cfg.output_dir) / "final"
    if not final.is_dir():
        raise ConfigError(f"merge-lora: no trained output at {final}; train first: python -m trainer train {config}")
    if not (final / "adapter_config.json").is_file():
        if (final / "config.json").is_file():  # full fine-tune (or ReLoRA, which saves the merged model)
            return {"merged": False, "model": str(final),
                    "note": f"{final} is a full model (no adapter), so there is nothing to merge; export it directly"}
        raise ConfigError(f"merge-lora: {final} holds no adapter (no adapter_config.json) and no model")
    out = Path(output) if output else Path(cfg.output_dir) / "merged"
    from trainer.runtime.signals import remove_leftovers, stop_cleanly

    remove_leftovers(out.parent, out.name, log)  # a merge killed before its rename (trainer/runtime/signals.py)
    if out.exists():
        raise ConfigError(f"merge-lora: {out} already exists; remove it or pass --output DIR")
    base = base_dir(cfg)
    found = {}
    if json.loads((final / "adapter_config.json").read_text()).get("target_parameters"):  # LoRA on bare parameters
        from trainer.outputs import merge_params

        found = merge_params.wrappers(final, base, cfg.trust_remote_code)
    adapter = read_adapter(final, found)
    base_config = json.loads((base / "config.json").read_text()) if (base / "config.json").is_file() else None
    if base_config is None:
        raise ConfigError(f"merge-lora: {base} has no config.json")
    if base_config.get("quantization_config"):
        method = base_config["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"merge-lora: the base checkpoint {base} is quantized ({method}); the merge needs the "
                          "unquantized weights")
    shards, weight_map = base_shards(base)
    if found:  # each adapted parameter's update, in the checkpoint's own (unfused) tensors
        merge_params.add_param_deltas(adapter, found, base, weight_map, cfg.trust_remote_code, Delta)
    missing = [name for name in [*adapter.deltas, *adapter.biases, *adapter.whole] if name not in weight_map]
    if missing:  # a base saved in an older layout than the model's names (LLaVA's language_model.model.*)
        as_saved = {loaded: saved for saved, loaded in checkpoint_renames(base, weight_map, cfg.trust_remote_code)}
        for part in (adapter.deltas, adapter.biases, adapter.whole):
            for name in [n for n in part if n not in weight_map and n in as_saved]:
                part[as_saved[name]] = part.pop(name)
        missing = [name for name in [*adapter.deltas, *adapter.biases, *adapter.whole] if name not in weight_map]
    if missing:
        raise ConfigError(f"merge-lora: the adapter changes {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the base checkpoint "
                          f"{base} does not hold (tied weights, or a different base)")
    if dtype is None and precision is not None:
        dtype = precision()
    if dtype is None:
        dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(base_config.get("dtype") or base_config.get("torch_dtype"),
                                                            "fp32")
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    with stop_cleanly("merge-lora"):  # SIGTERM, SIGUSR1, SIGHUP end in the except below, which removes tmp
        tmp.mkdir()
        return _write_merged(cfg, Merge(final, base, base_config, adapter, shards, dtype, target), tmp, out, log)


@dataclass(frozen=True)
class Merge:
    """What merge_lora found and checked before writing: the run's `final` adapter directory, the `base` model
    directory, its config.json and safetensors `shards`, the adapter's parts, and the dtype to write (its name,
    `dtype`, and torch's, `target`)."""

    final: Path
    base: Path
    base_config: dict
    adapter: Any
    shards: list
    dtype: str
    target: Any


def _write_merged(cfg, merge: Merge, tmp: Path, out: Path, log) -> dict:
    """The merged shards, config, tokenizer and generation config into `tmp`, renamed to `out` at the end (tmp is
    removed on any error or stop signal)."""
    final, base, base_config, adapter, shards = merge.final, merge.base, merge.base_config, merge.adapter, merge.shards
    dtype = merge.dtype
    try:
        new_map, total, changed, vocab_rows = _merge_shards(merge, tmp, log)
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": new_map}, indent=2))
        model_config = dict(base_config, **(cfg.model_config_overrides or {}))
        model_config["dtype"] = DTYPE_NAMES[dtype]
        model_config.pop("torch_dtype", None)
        if vocab_rows is not None:
            model_config["vocab_size"] = vocab_rows
        (tmp / "config.json").write_text(json.dumps(model_config, indent=2))
        for path in final.iterdir():  # the tokenizer and chat template the run saved
            if path.is_file() and path.name not in TOKENIZER_SKIP:
                shutil.copy2(path, tmp / path.name)
        if cfg.trust_remote_code:
            for path in base.glob("*.py"):
                shutil.copy2(path, tmp / path.name)
        # start-up: trainer.outputs.chat_check, trainer.outputs.made_from imported only when this runs
        from trainer.outputs.chat_check import _tokenizer, write_generation_config

        eos = write_generation_config(tmp, _tokenizer(cfg, final), base=base, eot_tokens=cfg.eot_tokens)
        from trainer.outputs.made_from import MADE_FROM, adapter_fingerprint

        (tmp / MADE_FROM).write_text(json.dumps({"adapter": str(final.resolve()), "base": str(base),
                                                 "files": adapter_fingerprint(final)}, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"merged": True, "model": str(out), "base": str(base), "adapter": str(final), "dtype": dtype,
            "shards": len(shards), "lora_weights": changed, "whole_tensors": len(adapter.whole),
            "bytes": total, "eos_token_id": eos}


def _merge_shards(merge: Merge, tmp: Path, log) -> tuple[dict, int, int, int | None]:
    """Each base shard with the adapter merged in, written to `tmp` one shard at a time: (the weight map, the bytes
    written, the LoRA weights merged, the vocabulary rows of embeddings resized in training or None)."""
    # heavy: safetensors loads only when this runs
    from safetensors import safe_open

    from trainer.runtime.signals import pause_at

    base, base_config, adapter, shards, target = merge.base, merge.base_config, merge.adapter, merge.shards, merge.target
    new_map, total, changed, vocab_rows = {}, 0, 0, None
    for number, shard in enumerate(shards, 1):
        with safe_open(base / shard, framework="pt") as f:
            header = {}  # name -> (dtype, shape) of what will be written, from the headers alone
            for name in f.keys():
                stored = f.get_slice(name)
                shape = list(stored.get_shape())
                if name in adapter.whole:
                    shape = list(adapter.whole[name].shape)
                    if shape != list(stored.get_shape()) and stored.get_shape()[0] == base_config.get("vocab_size"):
                        vocab_rows = shape[0]  # embeddings resized for tokens added in training
                kind = stored.get_dtype()
                header[name] = (st_dtype(target) if kind in FLOATS else kind, shape)
                new_map[name] = shard

            def tensors():
                nonlocal changed
                for name in header:
                    tensor = adapter.whole.get(name)
                    if tensor is None:
                        tensor = f.get_tensor(name)
                    if name in adapter.deltas:
                        tensor = adapter.deltas[name].merge(tensor)
                        changed += 1
                    elif name in adapter.biases:
                        part = adapter.biases[name]
                        tensor = tensor.float() + part.bias.float() * part.scaling
                    yield name, tensor.to(target) if tensor.is_floating_point() else tensor

            total += write_safetensors(tmp / shard, header, tensors())
        log(f"merge-lora: shard {number}/{len(shards)} {shard} written")
        if number == 1:
            pause_at("merge-shard", log)
    return new_map, total, changed, vocab_rows
