"""export --format gguf: the merged (or fully fine-tuned) model as one GGUF file for llama.cpp and Ollama.

``python -m trainer export CONFIG --format gguf [--outtype f32|f16|bf16|q8_0] [--output FILE]`` reads
``output_dir/merged`` (written by merge-lora) or ``output_dir/final`` when that is a full model, and writes one GGUF
file (default ``output_dir/<output_dir name>-<outtype>.gguf``) with the `gguf` package from PyPI (llama.cpp's own
gguf-py: its GGUFWriter, tensor-name maps, quantizers and SpecialVocab); no llama.cpp checkout, nothing built.

What goes in, following llama.cpp's convert_hf_to_gguf.py for these families:
- hyperparameters under the architecture's keys (llama.cpp converts Mistral as `llama`);
- mixtures of experts (Mixtral as `llama`, Qwen3-MoE as `qwen3moe`): a layer's per-expert tensors stacked into one
  [experts, out, in] tensor per projection (ffn_{gate,up,down}_exps), the router as ffn_gate_inp, and the expert
  count, experts per token and expert width in the header, as convert_hf_to_gguf.py's MoE models write them;
- the tensors renamed by gguf.TensorNameMap; llama's q_proj/k_proj rows permuted the way llama.cpp's converter
  permutes them (its rope pairs dimensions i, i+d/2 interleaved; transformers undoes the permutation when it reads a
  GGUF, which the round-trip test checks); 1-D tensors (norms, biases) in f32, the rest in --outtype (q8_0: rows
  whose length is not a multiple of 32 fall back to f16, as llama.cpp does);
- the tokenizer (byte-level BPE as `gpt2` with its pre-tokenizer's llama.cpp name, or a sentencepiece-style BPE as
  `llama`), merges, special token ids, add_bos/add_eos, the chat template, and the template's end-of-turn token as
  tokenizer.ggml.eot_token_id, so llama.cpp and Ollama stop where the model ends a turn.

Streaming: tensor infos are computed from the shards' headers first, then each tensor is read, converted and
written in turn, so memory holds about one tensor. The file is written under a temporary name, renamed at the end.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ConfigError

# model_type -> (GGUF architecture name, permute q/k rows as llama.cpp's LlamaModel does)
FAMILIES = {
    "llama": ("llama", True),
    "mistral": ("llama", True),  # llama.cpp's converter registers MistralForCausalLM as LlamaModel
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),  # + per-head q/k norms (attn_q_norm, attn_k_norm)
    # mixtures of experts: each layer's experts stacked into one tensor per projection (ffn_{gate,up,down}_exps,
    # [experts, out, in]) and the router as ffn_gate_inp, as convert_hf_to_gguf.py writes them
    "mixtral": ("llama", True),  # llama.cpp's converter registers MixtralForCausalLM as LlamaModel
    "qwen3_moe": ("qwen3moe", False),
}
EXPERT_KEY = re.compile(r"^(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight$")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def readable_by_transformers() -> list[str]:
    """The model types transformers can load from a GGUF (its legacy config mapping and its new loader)."""
    names: set[str] = set()
    try:
        # heavy: transformers loads only when this runs
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names |= set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    except ImportError:
        pass
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(names)


def source_dir(cfg) -> Path:
    """output_dir/merged, else output_dir/final when it holds a full model."""
    out = Path(cfg.output_dir)
    if (out / "merged" / "config.json").is_file():
        # start-up: trainer.outputs.made_from imported only when this runs
        from trainer.outputs.made_from import stale_merge

        stale = stale_merge(out)
        if stale:
            raise ConfigError(f"export: {stale}")
        return out / "merged"
    final = out / "final"
    if (final / "config.json").is_file() and not (final / "adapter_config.json").is_file():
        return final
    if (final / "adapter_config.json").is_file():
        raise ConfigError(f"export: {final} is an adapter; merge it first: python -m trainer merge-lora CONFIG "
                          f"(writes {out / 'merged'})")
    raise ConfigError(f"export: no trained model in {out} (neither merged/ nor a full final/); train first")


def check_vocab(model_dir: Path, vocab_size, plan: list[dict], tokenizer) -> None:
    """config.json's vocab_size is the embedding's (and the output head's) rows, and holds the tokenizer: a GGUF
    whose vocabulary and embedding disagree loads with the wrong tokens (or not at all). ConfigError otherwise."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ConfigError(f"export: {model_dir / 'config.json'}: vocab_size {vocab_size!r} is not a positive whole number")
    for entry in plan:
        if entry["name"] in ("token_embd.weight", "output.weight") and entry["shape"][0] != vocab_size:
            raise ConfigError(f"export: {model_dir / 'config.json'} says vocab_size {vocab_size}, but {entry['key']} "
                              f"has {entry['shape'][0]} rows: the config does not match the weights")
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ConfigError(f"export: the tokenizer in {model_dir} has {len(tokenizer)} tokens, more than vocab_size "
                          f"{vocab_size} rows of the embedding: the model cannot embed them")


def rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def rope_scaling(config: dict) -> dict:
    """The rope scaling the model runs with, as transformers reads it: a `rope_scaling` (Axolotl's key, written into
    merged/config.json as an override) wins over `rope_parameters`, which transformers 5 fills from it."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict) and value:
            return value
    return {}


def check_config(config: dict, log) -> tuple[str, bool]:
    """(GGUF architecture, permute q/k) for this model config; ConfigError for what this exporter does not write."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        others = [n for n in readable_by_transformers() if n not in FAMILIES]
        raise ConfigError(f"export: model_type {model_type!r} is not exported to GGUF here; supported: "
                          f"{', '.join(FAMILIES)} (transformers also reads GGUF for {', '.join(others)}, which this "
                          "exporter does not write)")
    if model_type == "qwen3_moe":  # what llama.cpp's qwen3moe graph assumes (src/models/qwen3moe.cpp)
        if not config.get("norm_topk_prob", False):
            raise ConfigError("export: this Qwen3-MoE does not normalize its top-k routing weights (norm_topk_prob: "
                              "false in its config.json) and llama.cpp's qwen3moe always does: its GGUF would route "
                              "the experts differently; not exported")
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise ConfigError("export: this Qwen3-MoE has dense layers between its MoE layers (mlp_only_layers / "
                              "decoder_sparse_step), which llama.cpp's qwen3moe does not have; not exported")
    rope = rope_scaling(config)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "linear"):
        raise ConfigError(f"export: rope scaling {rope_type!r} is not written by this exporter (llama.cpp needs its "
                          "own scaling keys and rope_freqs tensor for it); models without rope scaling, or with "
                          "linear scaling, export")
    factor = rope.get("factor")
    if rope_type == "linear" and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                  or not math.isfinite(factor) or factor <= 0):
        raise ConfigError(f"export: linear rope scaling needs a positive factor; the model's config has {factor!r}")
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and window < config.get("max_position_embeddings", 0):
        log(f"export: note: sliding_window {window} is not part of GGUF's {FAMILIES[model_type][0]} architecture; "
            "llama.cpp attends over the whole context")
    return FAMILIES[model_type]


def permute(weights, n_head: int, n_head_kv: int):
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py): HF's rotate-half rows to GGML's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# ---- tokenizer -----------------------------------------------------------------------------------------------------

def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for a byte-level BPE's pre-tokenizer: `gpt-2` for ByteLevel's own regex, else the name
    transformers' GGUF reader gives the same split regex (llama-bpe, qwen2, tekken, ...). ConfigError otherwise."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    splits = [s for s in steps if s.get("type") == "Split"]
    if len(splits) == 1 and "ByteLevel" in kinds:
        regex = (splits[0].get("pattern") or {}).get("Regex")
        # heavy: transformers loads only when this runs
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

        preferred = ("llama-bpe", "qwen2", "tekken", "gpt-4o")
        names = [n for n, r in GGUF_PRE_TOKENIZER_SPLITS.items() if r == regex]
        for name in preferred + tuple(names):
            if name in names:
                return name
    raise ConfigError(f"export: the tokenizer's pre-tokenizer ({' + '.join(str(k) for k in kinds)}) has no name "
                      "llama.cpp knows, so a GGUF of it would tokenize differently; not exported")


def add_tokenizer(writer, model_dir: Path, vocab_size: int, eot_id: int | None) -> dict:
    """Vocabulary, merges, special ids, chat template and end-of-turn id into the writer's metadata."""
    # heavy: transformers loads only when this runs
    import gguf
    from transformers import AutoTokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        what = "mistral-common's tekken.json" if (model_dir / "tekken.json").is_file() else "no tokenizer.json"
        raise ConfigError(f"export: the model's tokenizer is {what}; GGUF export needs a Hugging Face tokenizer.json "
                          "with a Jinja chat template")
    tokenizer_json = json.loads(path.read_text())
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        raise ConfigError(f"export: the tokenizer is a {model.get('type')} model; GGUF export writes BPE tokenizers")
    if model.get("byte_fallback"):  # sentencepiece-style BPE (Llama 2, Mistral v0.1): llama.cpp's `llama` model
        vocab = gguf.LlamaHfVocab(model_dir)
        tokens, scores, types = [], [], []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(kind)
        tokens += [f"[PAD{i}]".encode() for i in range(len(tokens), vocab_size)]
        scores += [-1000.0] * (vocab_size - len(scores))
        types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        kind = "llama"
    else:  # byte-level BPE: llama.cpp's `gpt2` model (convert_hf_to_gguf.py's get_vocab_base)
        tokpre = pre_tokenizer_name(tokenizer_json)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        reverse = {i: t for t, i in tokenizer.get_vocab().items()}
        added = tokenizer.get_added_vocab()
        decoder = tokenizer.added_tokens_decoder
        tokens, types = [], []
        for i in range(vocab_size):
            if i not in reverse:
                tokens.append(f"[PAD{i}]")
                types.append(gguf.TokenType.UNUSED)
            elif reverse[i] in added:
                tokens.append(reverse[i])
                types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
            else:
                tokens.append(reverse[i])
                types.append(gguf.TokenType.NORMAL)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tokpre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        kind = f"gpt2 ({tokpre})"
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    if eot_id is not None and eot_id != special.special_token_ids.get("eos"):
        writer.add_eot_token_id(eot_id)
    return {"tokenizer": kind, "chat_template": special.chat_template is not None,
            "eos_token_id": special.special_token_ids.get("eos"),
            "eot_token_id": eot_id if eot_id != special.special_token_ids.get("eos") else None}


# ---- tensors -------------------------------------------------------------------------------------------------------

def plan_tensors(model_dir: Path, arch_name: str, blocks: int, outtype: str) -> list[dict]:
    """One entry per tensor to write (GGUF name, source shard and key, shape, GGML type), in checkpoint order,
    from the shards' headers only. ConfigError for a tensor with no GGUF name."""
    # heavy: safetensors loads only when this runs
    import gguf
    from safetensors import safe_open

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, blocks)
    index = model_dir / "model.safetensors.index.json"
    shards = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
              else ["model.safetensors"])
    wide = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    plan, stacked = [], {}
    for shard in shards:
        with safe_open(model_dir / shard, framework="pt") as f:
            for key in f.keys():
                if key.endswith(".rotary_emb.inv_freq"):  # a buffer older checkpoints saved; llama.cpp skips it
                    continue
                shape = list(f.get_slice(key).get_shape())
                expert = EXPERT_KEY.match(key)
                if expert:  # one expert's projection: stacked with the layer's others into one GGUF tensor
                    stem = f"{expert['stem']}.{expert['proj']}"
                    entry = stacked.get(stem)
                    if entry is None:
                        entry = stacked[stem] = _entry(names, arch_name, f"{stem}.weight", stem, "weight", shard,
                                                       shape, wide)
                        entry["experts"] = {}
                        plan.append(entry)
                    elif shape != entry["expert_shape"]:
                        raise ConfigError(f"export: {key} is {shape}, unlike the layer's other experts "
                                          f"({entry['expert_shape']})")
                    entry["experts"][int(expert["expert"])] = (shard, key)
                    continue
                stem, suffix = key.rsplit(".", 1) if key.endswith((".weight", ".bias")) else (key, "")
                plan.append(_entry(names, arch_name, key, stem, suffix, shard, shape, wide))
    for stem, entry in stacked.items():
        count = len(entry["experts"])
        if sorted(entry["experts"]) != list(range(count)):
            raise ConfigError(f"export: {stem}: the checkpoint's experts are numbered {sorted(entry['experts'])}, "
                              f"not 0 to {count - 1}")
        entry["parts"] = [entry["experts"].pop(i) for i in range(count)]
        del entry["experts"]
        entry["shape"] = [count, *entry["expert_shape"]]
    return plan


def _entry(names, arch_name: str, key: str, stem: str, suffix: str, shard: str, shape: list[int], wide) -> dict:
    """One GGUF tensor: its name for the architecture, where it is read from, its shape and its GGML type."""
    # heavy: gguf loads only when this runs
    import gguf

    name = names.get_name(stem)
    if name is None:
        raise ConfigError(f"export: {key} has no GGUF tensor name for the {arch_name} architecture")
    qtype = gguf.GGMLQuantizationType.F32 if len(shape) == 1 else wide
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % block:
        qtype = gguf.GGMLQuantizationType.F16  # as llama.cpp falls back for rows q8_0 cannot split
    return {"name": f"{name}.{suffix}" if suffix else name, "shard": shard, "key": key, "shape": shape,
            "expert_shape": shape, "type": qtype}


def tensor_data(tensor, entry: dict, config: dict, permute_qk: bool):
    """The tensor as the bytes GGUF stores: permuted where llama.cpp permutes, converted to the entry's type."""
    # heavy: numpy loads only when this runs
    import gguf
    import numpy as np

    data = tensor.float().numpy()
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    if permute_qk and entry["key"].endswith("q_proj.weight"):
        data = permute(data, heads, heads)
    elif permute_qk and entry["key"].endswith("k_proj.weight"):
        data = permute(data, heads, kv_heads)
    if entry["type"] == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    return gguf.quants.quantize(np.ascontiguousarray(data), entry["type"])


def export_gguf(config: str | Path, outtype: str = "f16", output: str | Path | None = None, log=print) -> dict:
    """Write the trained model as one GGUF file (see the module docstring); return what was written."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"export: --outtype {outtype}: use one of {', '.join(OUTTYPES)}")
    try:
        # optional: gguf is imported only where it is used
        import gguf
    except ImportError:
        raise ConfigError("export: the gguf package is not installed (pip install 'envtool-llm[export]', or gguf)") from None

    from trainer.config import load_config
    from trainer.outputs.chat_check import _tokenizer, end_of_turn

    cfg, _ = load_config(config)
    model_dir = source_dir(cfg)
    target = Path(output) if output else Path(cfg.output_dir) / f"{Path(cfg.output_dir).resolve().name}-{outtype}.gguf"
    from trainer.runtime.signals import remove_leftovers, stop_cleanly

    remove_leftovers(target.parent, target.name, log)  # an export killed before its rename (trainer/runtime/signals.py)
    if target.exists():
        raise ConfigError(f"export: {target} already exists; remove it or pass --output FILE")
    try:
        model_config = json.loads((model_dir / "config.json").read_text(errors="replace"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"export: {model_dir / 'config.json'} is not a readable config.json ({err})") from None
    if not isinstance(model_config, dict):
        raise ConfigError(f"export: {model_dir / 'config.json'} is not a JSON object")
    from trainer.fit.memory_model import ModelConfigError, check_sizes

    try:  # the sizes `envtool fit` checks, with the same words: "vocab_size is 2e9" never reaches the writer
        check_sizes(model_config, str(model_dir / "config.json"))
    except ModelConfigError as err:
        raise ConfigError(f"export: {err}") from None
    arch_name, permute_qk = check_config(model_config, log)
    vocab_size = model_config.get("vocab_size")  # checked against the embedding before anything is written
    tokenizer = _tokenizer(cfg, model_dir) if (model_dir / "tokenizer.json").is_file() else None
    eot = end_of_turn(tokenizer) if tokenizer is not None else None
    eot_id = tokenizer.convert_tokens_to_ids(eot) if eot else None
    plan = plan_tensors(model_dir, arch_name, model_config["num_hidden_layers"], outtype)
    check_vocab(model_dir, vocab_size, plan, tokenizer)

    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    model = Model(model_dir, model_config, arch_name, permute_qk, vocab_size, eot_id)
    with stop_cleanly("export"):  # SIGTERM, SIGUSR1, SIGHUP end in write_gguf's except, which removes tmp
        tokens = write_gguf(gguf.GGUFWriter(tmp, arch_name), cfg, model, plan, outtype, tmp, target, log)
    return {"path": str(target), "source": str(model_dir), "architecture": arch_name,
            "model_type": model_config["model_type"], "outtype": outtype, "tensors": len(plan),
            "bytes": target.stat().st_size, **tokens}


@dataclass(frozen=True)
class Model:
    """The model export_gguf writes, as it read and checked it: its directory and config.json, the GGUF
    architecture (and whether q/k are permuted as llama.cpp does), the vocabulary size and the end-of-turn id."""

    directory: Path
    config: dict
    arch_name: str
    permute_qk: bool
    vocab_size: int | None
    eot_id: int | None


def write_gguf(writer, cfg, model: Model, plan, outtype, tmp, target, log=print) -> dict:
    """The header, tokenizer and tensors into `tmp` (already open in `writer`), renamed to `target` at the end;
    `tmp` is removed on any error or stop signal. Returns the tokenizer's part of the report."""
    # heavy: numpy and safetensors load only when this runs
    import gguf
    import numpy as np
    from safetensors import safe_open

    from trainer.runtime.signals import pause_at

    model_config, model_dir = model.config, model.directory
    try:
        _add_header(writer, cfg, model, outtype)
        tokens = add_tokenizer(writer, model_dir, model.vocab_size, model.eot_id)
        for entry in plan:  # the header first (names, shapes, types, offsets), from the plan alone
            byte_shape = gguf.quant_shape_to_byte_shape(entry["shape"], entry["type"])
            if entry["type"] == gguf.GGMLQuantizationType.F32:
                writer.add_tensor_info(entry["name"], entry["shape"], np.float32, math.prod(byte_shape))
            else:
                writer.add_tensor_info(entry["name"], byte_shape, np.uint8, math.prod(byte_shape),
                                       raw_dtype=entry["type"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        pause_at("export-tensors", log)
        for shard, entries in itertools.groupby(plan, key=lambda e: e["shard"]):  # then the data, a tensor at a time
            with safe_open(model_dir / shard, framework="pt") as f:
                for entry in entries:
                    tensor = _stacked(model_dir, f, shard, entry["parts"]) if "parts" in entry else \
                        f.get_tensor(entry["key"])
                    writer.write_tensor_data(tensor_data(tensor, entry, model_config, model.permute_qk))
        writer.close()
        os.replace(tmp, target)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return tokens


def _stacked(model_dir: Path, opened, shard: str, parts: list[tuple[str, str]]):
    """One layer's experts of one projection, stacked [experts, out, in] (llama.cpp's ffn_*_exps); an expert kept in
    another shard is read from there."""
    # heavy: torch and safetensors load only when this runs
    import torch
    from safetensors import safe_open

    tensors = []
    for part_shard, key in parts:
        if part_shard == shard:
            tensors.append(opened.get_tensor(key))
        else:
            with safe_open(model_dir / part_shard, framework="pt") as other:
                tensors.append(other.get_tensor(key))
    return torch.stack(tensors)


def _add_header(writer, cfg, model: Model, outtype) -> None:
    """The GGUF metadata llama.cpp reads: the model's shapes, rope, norm epsilon and the file's tensor type."""
    # optional: gguf is imported only where it is used
    import gguf

    model_config = model.config
    writer.add_name(Path(cfg.output_dir).resolve().name)
    hidden, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    writer.add_context_length(model_config.get("max_position_embeddings", cfg.sequence_len))
    writer.add_embedding_length(hidden)
    writer.add_block_count(model_config["num_hidden_layers"])
    writer.add_feed_forward_length(model_config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(model_config.get("num_key_value_heads", heads))
    writer.add_rope_freq_base(rope_theta(model_config))
    rope = rope_scaling(model_config)
    if (rope.get("rope_type") or rope.get("type")) == "linear":  # as llama.cpp's convert_hf_to_gguf.py writes it
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(model_config.get("rms_norm_eps", 1e-6))
    experts = model_config.get("num_local_experts") or model_config.get("num_experts")
    if experts:  # a mixture of experts: as convert_hf_to_gguf.py's TextModel and Qwen2MoeModel write it
        writer.add_expert_count(experts)
        writer.add_expert_used_count(model_config["num_experts_per_tok"])
        if model_config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(model_config["moe_intermediate_size"])
    if model.arch_name == "llama":
        writer.add_vocab_size(model.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if model_config.get("head_dim"):  # as llama.cpp's TextModel writes a head size the config states
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    writer.add_file_type(file_type)
    if outtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
