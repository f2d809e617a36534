"""A model's shape for the memory estimate (trainer/fit/memory.py), from its config.json alone.

Where the config.json comes from, in order: a local model directory (offline); the Hub cache; the Hub itself,
config.json only (never a weight file), cached where huggingface_hub caches it (or, without huggingface_hub,
under ~/.cache/envtool/configs/). HF_HUB_OFFLINE=1 keeps it to the first two.

How parameters are counted:
1. exactly, where torch and transformers import: the model is built from its config on the meta device (no
   memory, no weights; what accelerate's `estimate-memory` does), every architecture transformers builds from a
   config, MoE included, and its modules are read: each nn.Linear (what bitsandbytes quantizes and LoRA targets),
   embeddings and head (tied or not), 3-D expert tensors, 1-D norms and biases, and the decoder layers' structure;
2. otherwise (the resolver can run without torch), analytically from the config's sizes for the decoder families
   of matrices/model_families.toml, and the estimate widens its band and says so;
3. anything else: an error naming the model type (the estimate's verdict is then "unknown").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from trainer import facts
from trainer.runtime import kept


class ModelConfigError(Exception):
    """The model's config.json cannot be read or understood here (the message says why)."""

    def __init__(self, message: str, bad_input: bool = False):
        super().__init__(message)
        self.bad_input = bad_input  # True: the user named something that does not exist (exit 2)


@dataclass
class Linear:
    """nn.Linear modules of one name across the model (e.g. 'self_attn.q_proj' in every layer)."""

    name: str  # the module's name with the layer index removed: 'self_attn.q_proj', 'lm_head'
    fan_in: int
    fan_out: int
    count: int  # how many modules carry this name
    bias: bool = False
    in_layer: bool = True  # inside a decoder layer (False: lm_head, projectors, ...)
    quantized: bool = True  # bitsandbytes converts it (False: the head, the last module, modules kept in fp32)

    @property
    def params(self) -> int:
        return (self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)) * self.count


@dataclass
class Layer:
    """One decoder layer's shape, as the activation term needs it (layers of one shape are counted together)."""

    q_dim: int  # heads x head_dim
    kv_dim: int  # key/value heads x head_dim
    heads: int
    mlp_width: int  # the dense MLP's intermediate size (0: none); for MoE the shared expert's
    gated: bool = True  # act(gate(x)) * up(x) (SwiGLU/GeGLU); False: act(up(x))
    norms: int = 2  # norms over the hidden size per layer (Gemma 2/3: 4)
    norm_kind: str = "rms"  # rms | layer
    qk_norm: bool = False  # per-head norms on queries and keys (Qwen3, Gemma 3, OLMo 2)
    experts: int = 0  # routed experts (0: a dense layer)
    top_k: int = 0
    expert_width: int = 0
    count: int = 1


@dataclass
class ModelShape:
    model_type: str
    source: str  # where config.json was read
    counted: str  # "meta" (built on the meta device: exact) | "analytic" (from the config's sizes)
    hidden_size: int
    num_layers: int
    vocab_size: int
    params: int  # every parameter, tied ones once
    embedding: int  # input embedding parameters
    lm_head: int  # output head parameters (0 when tied to the embedding)
    tied: bool
    linears: list[Linear] = field(default_factory=list)
    expert_params: int = 0  # 3-D expert tensors (MoE) outside nn.Linear
    other_matrices: int = 0  # other >= 2-D parameters (position embeddings, convolutions, routers as tensors)
    vectors: int = 0  # 1-D parameters: norms and biases outside nn.Linear
    layers: list[Layer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    names: dict[str, int] = field(default_factory=dict)  # module name -> params, for unfrozen_parameters regexes
    max_positions: int | None = None  # max_position_embeddings: the context the model was trained for
    config: dict = field(default_factory=dict, repr=False)  # the config.json read (to build the model again)
    trust_remote_code: bool = False
    attn_softcap: bool = False  # attention logits soft-capped (Gemma 2): eager keeps tanh's output too
    final_softcap: bool = False  # output logits soft-capped inside the model (Gemma 2)
    vision_params: int = 0  # vision/audio towers and projectors (matrices/vision.toml [freeze]), in params

    @property
    def linear_params(self) -> int:
        return sum(lin.params for lin in self.linears)

    @property
    def head_dim_total(self) -> int:
        return self.layers[0].q_dim if self.layers else self.hidden_size


# --------------------------------------------------------------------------- reading config.json


def config_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "envtool" / "configs"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def read_config(model: str, revision: str | None = None, local_only: bool = False) -> tuple[dict, str, Path]:
    """(config dict, where it was read, the directory holding config.json) for a local directory or a hub id;
    `local_only`: the directory or a cache, never the network (what validate and envtool train's check read)."""
    path = Path(model).expanduser()
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"{model} has no config.json", bad_input=True)
        return _load(file), str(file), path
    if path.exists() or model.count("/") != 1 or model.startswith(("/", ".", "~")):
        raise ModelConfigError(f"base_model {model}: not a model directory here, nor a Hub id (org/name)",
                               bad_input=True)
    file = _hub_config(model, revision, local_only)
    return _load(file), f"{model} (config.json from the Hub{', revision ' + revision if revision else ''})", file.parent


def _load(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ModelConfigError(f"{file}: not a readable config.json ({err})", bad_input=True) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{file}: config.json is not a JSON object", bad_input=True)
    return data


def _hub_config(repo: str, revision: str | None, local_only: bool = False) -> Path:
    """config.json of a Hub repository: from the cache, else downloaded (that file only)."""
    plain = config_cache_dir() / repo / (revision or "main") / "config.json"
    try:
        # heavy: huggingface_hub loads only when this runs
        import huggingface_hub  # noqa: F401
    except ImportError:
        if local_only and not plain.is_file():
            raise ModelConfigError(f"{repo}: config.json is not on this machine (`envtool fit` fetches it once)")
        return _hub_config_plain(repo, revision)
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cached = try_to_load_from_cache(repo, "config.json", revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if plain.is_file():  # fetched without huggingface_hub before
        return plain
    if local_only:
        raise ModelConfigError(f"{repo}: config.json is not on this machine (`envtool fit` fetches it once)")
    if _offline():
        raise ModelConfigError(f"{repo}: config.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set")
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision))
    except GatedRepoError:
        raise ModelConfigError(f"{repo} is gated on the Hub: config.json needs a token with access (HF_TOKEN or "
                               "`hf auth login`), or a local copy of the model directory") from None
    except RepositoryNotFoundError:
        raise ModelConfigError(f"{repo}: no such model on the Hub (or private: set HF_TOKEN)", bad_input=True) from None
    except RevisionNotFoundError:
        raise ModelConfigError(f"{repo}: no revision {revision} on the Hub", bad_input=True) from None
    except LocalEntryNotFoundError as err:  # no network and not cached (a subclass of EntryNotFoundError: first)
        raise ModelConfigError(f"{repo}: cannot reach the Hub for config.json ({str(err).splitlines()[0][:160]})") \
            from None
    except EntryNotFoundError:
        raise ModelConfigError(f"{repo} has no config.json on the Hub", bad_input=True) from None
    except Exception as err:  # HTTP errors, timeouts: the estimate is then unknown, not a crash
        raise ModelConfigError(f"{repo}: cannot read config.json from the Hub ({str(err).splitlines()[0][:160]})") \
            from None


def _hub_config_plain(repo: str, revision: str | None) -> Path:
    """Without huggingface_hub: GET {HF_ENDPOINT}/{repo}/resolve/{revision}/config.json, cached by repo+revision."""
    # start-up: urllib imported only when this runs
    import urllib.error
    import urllib.request

    rev = revision or "main"
    cached = config_cache_dir() / repo / rev / "config.json"
    if cached.is_file():
        return cached
    if _offline():
        raise ModelConfigError(f"{repo}: config.json is not cached ({cached}) and HF_HUB_OFFLINE is set")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    request = urllib.request.Request(f"{endpoint}/{repo}/resolve/{rev}/config.json")
    token = os.environ.get("HF_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise ModelConfigError(f"{repo}: the Hub refused config.json (HTTP {err.code}: gated or private; set "
                                   "HF_TOKEN)") from None
        raise ModelConfigError(f"{repo}: no config.json on the Hub (HTTP {err.code})", bad_input=err.code == 404) \
            from None
    except (urllib.error.URLError, OSError) as err:
        raise ModelConfigError(f"{repo}: cannot reach the Hub for config.json ({err})") from None
    json.loads(body)  # only a JSON object is cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(body)
    tmp.replace(cached)
    return cached


# --------------------------------------------------------------------------- the shape


def model_shape(model: str, revision: str | None = None, trust_remote_code: bool = False,
                overrides: dict | None = None, exact: bool | None = None, local_only: bool = False) -> ModelShape:
    """The shape of `model` (a directory or hub id): exact on the meta device where transformers imports
    (exact=None: when it can; True: must; False: the analytic count). `local_only`: never the network."""
    config, source, directory = read_config(model, revision, local_only)
    config = {**config, **(overrides or {})}
    check_sizes(config, source, overrides or {})
    if exact is not False:
        key = _shape_key(config, trust_remote_code)
        try:
            shape = _kept_shape(key, source)
            if shape is None:
                shape = _meta_shape(config, source, directory, trust_remote_code)
                _keep_shape(key, shape)
            shape.config, shape.trust_remote_code = config, trust_remote_code
            return shape
        except ImportError:
            if exact:
                raise
        except ModelConfigError:
            if exact:
                raise
    shape = analytic_shape(config, source)
    shape.config = config
    shape.notes.append("parameters counted from config.json's sizes (transformers is not importable here, or "
                       "could not build this model on the meta device): the band is wider")
    return shape


# The sizes a model's shape is built from, each a whole number in a range some real model could have: a string
# ("64"), NaN, 0 or -1 gave a traceback, or "fits, 0.5 GB" for a model that cannot exist; 10^8 layers hung while
# the model was built. The upper bounds are far above any published model (Llama 3.1 405B: 126 layers, hidden
# 16384, vocab 128256; Gemma 3: vocab 262144; DeepSeek-V3: 256 experts) and keep building or counting it bounded.
SIZES = {  # key: (least, most)
    "hidden_size": (1, 1 << 18), "d_model": (1, 1 << 18), "n_embd": (1, 1 << 18),
    "num_hidden_layers": (1, 1024), "n_layer": (1, 1024), "num_layers": (1, 1024),
    "num_attention_heads": (1, 1 << 14), "n_head": (1, 1 << 14), "num_key_value_heads": (1, 1 << 14),
    "head_dim": (1, 1 << 14), "vocab_size": (1, 1 << 24), "intermediate_size": (0, 1 << 20),
    "moe_intermediate_size": (0, 1 << 20), "shared_expert_intermediate_size": (0, 1 << 20),
    "num_local_experts": (0, 1 << 14), "num_experts": (0, 1 << 14), "n_routed_experts": (0, 1 << 14),
    "num_experts_per_tok": (0, 1 << 14), "max_position_embeddings": (1, 1 << 31), "n_positions": (1, 1 << 31),
}


def check_sizes(config: dict, source: str, overrides: dict | None = None) -> None:
    """Refuse (ModelConfigError, bad input: exit 2) a config.json whose sizes no model can have, naming the file
    (or the training config's model_config_overrides) and the key: the one check before the shape is counted."""
    overrides = overrides or {}
    inner = config.get("text_config")
    for part, where in ((config, ""), (inner if isinstance(inner, dict) else {}, "text_config.")):
        for key, (least, most) in SIZES.items():
            value = part.get(key)
            if value is None:
                continue
            origin = "model_config_overrides" if not where and key in overrides else source
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelConfigError(f"{origin}: {where}{key} is {_shown(value)}: a model's sizes are whole "
                                       "numbers", bad_input=True)
            if not least <= value <= most:
                raise ModelConfigError(f"{origin}: {where}{key} is {value:,}: no model has that (expected "
                                       f"{least} to {most:,})", bad_input=True)
        heads, kv = part.get("num_attention_heads"), part.get("num_key_value_heads")
        if heads and kv and heads % kv:
            raise ModelConfigError(f"{source}: {where}num_key_value_heads {kv} does not divide num_attention_heads "
                                   f"{heads}", bad_input=True)
        hidden = part.get("hidden_size")
        latent = part.get("qk_nope_head_dim") is not None or part.get("kv_lora_rank") is not None  # MLA: own dims
        if heads and hidden and part.get("head_dim") is None and not latent and hidden % heads:
            raise ModelConfigError(f"{source}: {where}hidden_size {hidden} is not a multiple of num_attention_heads "
                                   f"{heads} and there is no head_dim", bad_input=True)


def _shown(value) -> str:
    text = json.dumps(value, allow_nan=True) if isinstance(value, (str, float, list, dict)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def text_config(config: dict) -> dict:
    """The language model's part of a multimodal config (text_config), else the config itself."""
    inner = config.get("text_config")
    return {**inner, "model_type": inner.get("model_type", config.get("model_type"))} if isinstance(inner, dict) \
        else config


def quiet_imports():
    """Import torch and transformers' model and quantizer modules without their import-time warnings (torchao's
    missing CUDA extensions on a CPU machine, torch's pytree deprecations): the estimate only reads shapes."""
    # start-up: logging imported only when this runs
    import logging

    @contextlib.contextmanager
    def quiet():
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            logging.disable(previous)

    return quiet()


# The meta-device count of a config, kept between processes (trainer/runtime/kept.py): building the model needs
# transformers' model code (5-8 s of CPU per fit or dry run), and the count never changes for the same config and
# transformers. Not for remote code (the Hub's code may change), nor where transformers does not import here (then
# the count is analytic, and says so).
SHAPES, SHAPE_FORMAT = "model-shapes", 1  # raised when ModelShape's fields change


def _shape_key(config: dict, trust_remote_code: bool) -> str | None:
    if trust_remote_code or not _importable("torch", "transformers"):
        return None
    try:
        return kept.key(SHAPE_FORMAT, json.dumps(config, sort_keys=True).encode())
    except (TypeError, ValueError):
        return None


def _importable(*names: str) -> bool:
    # start-up: importlib.util imported only when this runs
    import importlib.util

    try:
        return all(importlib.util.find_spec(name) is not None for name in names)
    except (ImportError, ValueError):
        return False


def _kept_shape(key: str | None, source: str) -> ModelShape | None:
    answer = kept.read(SHAPES, key)
    if answer is None:
        return None
    try:
        shape = ModelShape(**{**answer, "source": source, "linears": [Linear(**x) for x in answer["linears"]],
                              "layers": [Layer(**x) for x in answer["layers"]]})
    except (KeyError, TypeError):
        return None
    return shape


def _keep_shape(key: str | None, shape: ModelShape) -> None:
    if key is not None:
        answer = dataclasses.asdict(shape)
        for local in ("config", "trust_remote_code", "source"):
            answer.pop(local)
        kept.keep(SHAPES, key, answer)


def _meta_shape(config: dict, source: str, directory: Path, trust_remote_code: bool) -> ModelShape:
    with quiet_imports():
        # heavy: torch and transformers load only when this runs
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        import transformers.quantizers.base  # noqa: F401 (imports every quantizer: torchao's warnings)

    if config.get("auto_map") and not trust_remote_code:
        raise ModelConfigError("the model's code is on the Hub (auto_map) and trust_remote_code is off")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.for_model(**config) if "model_type" in config else None
            if cfg is None:
                raise ModelConfigError("config.json has no model_type")
            with torch.device("meta"):
                model = _build_on_meta(cfg, trust_remote_code)
    except ModelConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RuntimeError) as err:
        raise ModelConfigError(f"transformers cannot build {config.get('model_type')} from its config: "
                               f"{str(err).splitlines()[0][:200]}") from None
    return shape_of(model, source)


def _build_on_meta(cfg, trust_remote_code: bool):
    """The causal LM, else (a vision-language config: LLaVA, Qwen2-VL, ...) the image-text-to-text model, whose
    vision tower and projector are counted with the language tower."""
    # heavy: transformers loads only when this runs
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except ValueError:
        from transformers import AutoModelForImageTextToText
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        if cfg.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            raise
        return AutoModelForImageTextToText.from_config(cfg, trust_remote_code=trust_remote_code)


def vision_params(names: dict[str, int]) -> int:
    """Parameters of the vision/audio towers and projectors (the components freeze_mm_modules freezes)."""
    parts = set(facts.table("vision")["freeze"]["components"])
    return sum(n for name, n in names.items() if parts & set(name.split(".")))


def shape_of(model, source: str = "model") -> ModelShape:
    """Read a built model (meta or real) into a ModelShape: the exact count."""
    # heavy: torch and transformers load only when this runs
    import torch

    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    config = model.config
    tc = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = tc.hidden_size
    layers_list = _decoder_layers(model, tc.num_hidden_layers)
    layer_ids = {id(layer): k for k, layer in enumerate(layers_list or [])}
    layer_of = {}
    for k, layer in enumerate(layers_list or []):
        for name, module in layer.named_modules():
            layer_of[id(module)] = (k, name)
    skip = set(get_keys_to_not_convert(model))
    skip |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    linears: dict[tuple, Linear] = {}
    names: dict[str, int] = {}
    counted: set[int] = set()
    expert = other = vectors = 0
    towers = set(facts.table("vision")["freeze"]["components"])
    for full, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in counted:
                continue
            counted.add(id(param))
            names[f"{full}.{pname}" if full else pname] = param.numel()
            if isinstance(module, torch.nn.Linear) or isinstance(module, torch.nn.Embedding):
                continue
            if param.ndim >= 3 and not towers & set(full.split(".")):  # (a vision tower's convolutions: not experts)
                expert += param.numel()
            elif param.ndim >= 2:
                other += param.numel()
            else:
                vectors += param.numel()
        if isinstance(module, torch.nn.Linear):
            where = layer_of.get(id(module))
            key_name = where[1] if where else full
            key = (key_name, module.in_features, module.out_features, module.bias is not None, where is not None,
                   module is not head and should_convert_module(full, sorted(skip)))
            if module is head:
                continue  # the head is counted as lm_head
            if key in linears:
                linears[key].count += 1
            else:
                linears[key] = Linear(key_name, module.in_features, module.out_features, 1, key[3], key[4], key[5])
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    emb = embed.weight.numel() if embed is not None else 0
    head_params = 0 if tied or head is None else head.weight.numel()
    vectors += 0 if tied or head is None or head.bias is None else head.bias.numel()
    layers = _layer_shapes(model, layers_list, tc) if layers_list else []
    shape = ModelShape(model_type=tc.model_type, source=source, counted="meta", hidden_size=hidden,
                       num_layers=tc.num_hidden_layers, vocab_size=emb // hidden if emb else tc.vocab_size,
                       params=params, embedding=emb, lm_head=head_params, tied=tied, linears=list(linears.values()),
                       expert_params=expert, other_matrices=other, vectors=vectors, layers=layers, names=names,
                       max_positions=getattr(tc, "max_position_embeddings", None),
                       attn_softcap=bool(getattr(tc, "attn_logit_softcapping", None)),
                       final_softcap=bool(getattr(tc, "final_logit_softcapping", None)))
    tower = vision_params(names)
    if tower:
        shape.vision_params = tower
        shape.notes.append(f"vision tower and projector: {tower / 1e6:,.1f}M parameters, counted in the weights; the "
                           "activations of image tokens are not counted (unverified: they depend on image sizes)")
    if expert:
        shape.notes.append(f"{expert / 1e9:.2f}B parameters are 3-D expert tensors (MoE), outside nn.Linear: "
                           "bitsandbytes quantizes them only with quantize_moe_experts, and LoRA reaches them only "
                           "through lora_target_parameters")
    return shape


def _decoder_layers(model, num_layers: int):
    # heavy: torch loads only when this runs
    import torch

    best = None
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            if best is None or sum(p.numel() for p in module.parameters()) > sum(p.numel() for p in best.parameters()):
                best = module
    return best


def _layer_shapes(model, layers_list, tc) -> list[Layer]:
    # heavy: torch loads only when this runs
    import torch

    hidden = tc.hidden_size
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or hidden // heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    top_k = getattr(tc, "num_experts_per_tok", None) or getattr(tc, "moe_top_k", None) or 0
    shapes: list[Layer] = []
    for layer in layers_list:
        norms = sum(1 for _, m in layer.named_modules() if _is_norm(m) and _norm_width(m) == hidden)
        qk = any(_is_norm(m) and _norm_width(m) == head_dim for _, m in layer.named_modules())
        kind = "layer" if any(isinstance(m, torch.nn.LayerNorm) for _, m in layer.named_modules()) else "rms"
        lin = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        names = " ".join(lin)
        gated = any(k in names for k in ("gate_proj", "gate_up_proj", "w1", "w3", "fc1_gate")) or \
            any(p.ndim == 3 and "gate" in n for n, p in layer.named_parameters())
        experts = 0
        expert_width = 0
        for n, p in layer.named_parameters():
            if p.ndim == 3:
                experts = p.shape[0]
                if "down" in n or "w2" in n:
                    expert_width = p.shape[-1]
        if not experts:
            modlists = [m for _, m in layer.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
            for ml in modlists:
                downs = [m for n, m in ml.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features == hidden]
                if len(downs) == len(ml):
                    experts, expert_width = len(ml), downs[0].in_features
        dense = 0
        for name, m in lin.items():
            if m.out_features == hidden and ("mlp" in name or "feed_forward" in name or "ffn" in name) \
                    and ("expert" not in name or "shared" in name) and m.in_features != hidden:
                dense = max(dense, m.in_features)
        if not experts and not dense:
            dense = getattr(tc, "intermediate_size", 0) or 0
        shape = Layer(q_dim=heads * head_dim, kv_dim=kv_heads * head_dim, heads=heads, mlp_width=dense,
                      gated=gated, norms=max(norms, 1), norm_kind=kind, qk_norm=qk, experts=experts,
                      top_k=top_k if experts else 0, expert_width=expert_width)
        if shapes and _same(shapes[-1], shape):
            shapes[-1].count += 1
        else:
            shapes.append(shape)
    return shapes


def _same(a: Layer, b: Layer) -> bool:
    return {**a.__dict__, "count": 0} == {**b.__dict__, "count": 0}


def _is_norm(module) -> bool:
    name = type(module).__name__
    return name.endswith(("RMSNorm", "LayerNorm", "Norm")) and "Group" not in name and hasattr(module, "weight")


def _norm_width(module) -> int | None:
    weight = getattr(module, "weight", None)
    return weight.shape[0] if weight is not None and weight.ndim == 1 else None


# --------------------------------------------------------------------------- the analytic count


def families() -> dict[str, dict]:
    return {row["model_type"]: row for row in facts.rows("model_families", "family")}


def _moe_layers(get, layers_n: int, experts: int) -> int:
    """How many decoder layers route to experts (every `decoder_sparse_step`-th, less the dense ones named)."""
    moe_layers = layers_n if experts else 0
    if experts:
        step = get("decoder_sparse_step", default=1) or 1
        only_dense = set(get("mlp_only_layers", default=[]) or [])
        first_dense = get("first_k_dense_replace", default=0) or 0
        moe_layers = sum(1 for k in range(layers_n)
                         if (k + 1) % step == 0 and k not in only_dense and k >= first_dense)
    return moe_layers


def _block_linears(family: dict, hidden: int, q: int, kv: int, inter: int, layers_n: int, dense_layers: int,
                   bias: tuple[bool, bool, bool]) -> list:
    """The attention's linear layers (every layer) and the dense MLP's (the dense layers); `bias`: (q/k/v, o, mlp)."""
    qkv_bias, o_bias, mlp_bias = bias
    gated = family.get("mlp", "gated") == "gated"
    fused = family.get("fused", False)
    if fused:
        linears = [Linear("self_attn.qkv_proj", hidden, q + 2 * kv, layers_n, qkv_bias),
                   Linear("self_attn.o_proj", q, hidden, layers_n, o_bias)]
    else:
        linears = [Linear("self_attn.q_proj", hidden, q, layers_n, qkv_bias),
                   Linear("self_attn.k_proj", hidden, kv, layers_n, qkv_bias),
                   Linear("self_attn.v_proj", hidden, kv, layers_n, qkv_bias),
                   Linear("self_attn.o_proj", q, hidden, layers_n, o_bias)]
    if dense_layers:
        if fused:
            linears.append(Linear("mlp.gate_up_proj", hidden, 2 * inter, dense_layers, mlp_bias))
        else:
            linears += [Linear(n, hidden, inter, dense_layers, mlp_bias)
                        for n in (("mlp.gate_proj", "mlp.up_proj") if gated else ("mlp.up_proj",))]
        linears.append(Linear("mlp.down_proj", inter, hidden, dense_layers, mlp_bias))
    return linears


def analytic_shape(config: dict, source: str = "config") -> ModelShape:
    """Parameters from the config's sizes, for the decoder families of matrices/model_families.toml."""
    config = text_config(config)
    model_type = config.get("model_type")
    family = families().get(model_type)
    if family is None:
        known = ", ".join(sorted(families()))
        raise ModelConfigError(f"model_type {model_type!r}: no analytic count for it here (known: {known}); with "
                               "transformers installed any architecture it builds is counted exactly")
    get = lambda *keys, default=None: next((config[k] for k in keys if config.get(k) is not None), default)  # noqa: E731
    hidden = get("hidden_size", "d_model", "n_embd")
    layers_n = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    kv_heads = get("num_key_value_heads", default=heads)
    head_dim = get("head_dim", default=hidden // heads)
    vocab = get("vocab_size")
    inter = get("intermediate_size", default=4 * hidden)
    tied = bool(get("tie_word_embeddings", default=family.get("tied_default", False)))
    if None in (hidden, layers_n, heads, vocab):
        raise ModelConfigError(f"config.json of {model_type} lacks hidden_size/num_hidden_layers/"
                               "num_attention_heads/vocab_size", bad_input=True)
    qkv_bias = bool(get("attention_bias", default=family.get("qkv_bias", False))) or family.get("qkv_bias", False)
    o_bias = bool(get("attention_bias", default=False)) and not family.get("o_bias_never", False)
    mlp_bias = bool(get("mlp_bias", default=False))
    q, kv = heads * head_dim, kv_heads * head_dim
    experts = get("num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    top_k = get("num_experts_per_tok", default=0) or 0
    expert_width = get("moe_intermediate_size", default=inter)
    shared_width = get("shared_expert_intermediate_size", default=0) or 0
    if family.get("shared_experts_key"):
        shared_width = (get(family["shared_experts_key"], default=0) or 0) * expert_width
    gated = family.get("mlp", "gated") == "gated"
    norms = family.get("norms_per_layer", 2)
    qk_norm = family.get("qk_norm", False)
    moe_layers = _moe_layers(get, layers_n, experts)
    dense_layers = layers_n - moe_layers
    linears = _block_linears(family, hidden, q, kv, inter, layers_n, dense_layers, (qkv_bias, o_bias, mlp_bias))
    expert_params = 0
    other = 0
    vectors = layers_n * norms * hidden + hidden  # layer norms + the final norm
    if family.get("norm") == "layer":
        vectors *= 2  # weight and bias
    if qk_norm:
        vectors += layers_n * 2 * head_dim
    if experts:
        mats = 3 if gated else 2
        expert_params = moe_layers * experts * mats * hidden * expert_width
        if family.get("router", "linear") == "tensor":
            other += moe_layers * experts * hidden
        else:
            router = Linear("mlp.gate", hidden, experts, moe_layers, False)
            linears.append(router)
        if shared_width:
            linears += [Linear(f"mlp.shared_expert.{n}", hidden, shared_width, moe_layers)
                        for n in (("gate_proj", "up_proj") if gated else ("up_proj",))]
            linears.append(Linear("mlp.shared_expert.down_proj", shared_width, hidden, moe_layers))
            if family.get("shared_expert_gate"):
                linears.append(Linear("mlp.shared_expert_gate", hidden, 1, moe_layers))
    embedding = vocab * hidden
    lm_head = 0 if tied else vocab * hidden
    shape = ModelShape(model_type=model_type, source=source, counted="analytic", hidden_size=hidden,
                       num_layers=layers_n, vocab_size=vocab, params=0, embedding=embedding, lm_head=lm_head,
                       tied=tied, linears=linears, expert_params=expert_params, other_matrices=other,
                       vectors=vectors, max_positions=get("max_position_embeddings", "n_positions"),
                       attn_softcap=bool(get("attn_logit_softcapping")),
                       final_softcap=bool(get("final_logit_softcapping")))
    shape.params = embedding + lm_head + sum(lin.params for lin in linears) + expert_params + other + vectors
    norm_kind = family.get("norm", "rms")
    if dense_layers:
        shape.layers.append(Layer(q_dim=q, kv_dim=kv, heads=heads, mlp_width=inter, gated=gated, norms=norms,
                                  norm_kind=norm_kind, qk_norm=qk_norm, count=dense_layers))
    if moe_layers:
        shape.layers.append(Layer(q_dim=q, kv_dim=kv, heads=heads, mlp_width=shared_width, gated=gated, norms=norms,
                                  norm_kind=norm_kind, qk_norm=qk_norm, experts=experts, top_k=top_k,
                                  expert_width=expert_width, count=moe_layers))
    return shape


# --------------------------------------------------------------------------- what LoRA adds


@dataclass
class LoraLayout:
    """What peft wraps and trains for a LoraConfig, counted by applying peft itself to the meta-device model (its
    v4 -> v5 MoE conversion included: all-linear on Mixtral or Qwen2-MoE also wraps the fused 3-D experts)."""

    params: int  # trainable parameters (adapters, DoRA magnitudes, modules_to_save copies)
    tensors: list[tuple[int, int]]  # (values, how many) per trainable tensor: optimizers quantize per tensor
    wrapped: set[str]  # leaf names of the nn.Linear modules wrapped (q_proj, ...)
    expert_params: int  # base parameters wrapped whole (3-D experts): peft merges them with the adapter each forward
    layers_with_experts: int  # decoder layers holding such parameters


_LAYOUTS: dict[str, LoraLayout | None] = {}

# peft's layout, kept between processes like the model's shape (trainer/runtime/kept.py): applying peft to the
# meta-device model imports peft and transformers' model code (5-15 s of CPU per `envtool fit` or dry run of a
# LoRA/QLoRA config), and the layout never changes for the same config.json, LoraConfig, transformers and peft.
# Not for remote code. A layout peft refuses is kept too (as {"none": true}): the estimate counts by rule then.
LAYOUTS, LAYOUT_FORMAT = "lora-layouts", 1  # raised when LoraLayout's fields change


def lora_layout(shape: ModelShape, lora_kwargs: dict) -> LoraLayout | None:
    """LoraLayout for peft.LoraConfig(**lora_kwargs) on `shape`'s model, or None where peft or transformers do not
    import (the estimate then counts adapters on the nn.Linear layers by rule)."""
    key = json.dumps([shape.config, lora_kwargs], sort_keys=True, default=str)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    if not shape.config or "model_type" not in shape.config:
        return None
    if not _importable("torch", "peft", "transformers"):  # counted by rule, as without a kept answer
        return None
    disk = _layout_key(key, shape)
    answer = kept.read(LAYOUTS, disk)
    if answer is not None and (found := _kept_layout(answer)) is not False:
        _LAYOUTS[key] = found
        return found
    layout = _peft_layout(shape, lora_kwargs)
    if layout is False:
        return None
    _LAYOUTS[key] = layout
    kept.keep(LAYOUTS, disk, {"none": True} if layout is None else {
        **dataclasses.asdict(layout), "wrapped": sorted(layout.wrapped)})
    return layout


def _layout_key(key: str, shape: ModelShape) -> str | None:
    """The kept layout's name: the config and LoraConfig (`key`), with peft's version (transformers' is in every
    kept name); None for remote code or where peft is not installed (nothing kept)."""
    # start-up: importlib.metadata imported only when this runs
    from importlib import metadata

    if getattr(shape, "trust_remote_code", False):
        return None
    try:
        return kept.key(LAYOUT_FORMAT, key.encode(), metadata.version("peft").encode())
    except metadata.PackageNotFoundError:
        return None


def _kept_layout(answer: dict) -> LoraLayout | None | bool:
    """The kept answer as a LoraLayout (None: peft refused it), False where it is damaged (counted again)."""
    if answer.get("none") is True:
        return None
    try:
        return LoraLayout(params=answer["params"], tensors=[(int(n), int(c)) for n, c in answer["tensors"]],
                          wrapped=set(answer["wrapped"]), expert_params=answer["expert_params"],
                          layers_with_experts=answer["layers_with_experts"])
    except (KeyError, TypeError, ValueError):
        return False


def _peft_layout(shape: ModelShape, lora_kwargs: dict) -> LoraLayout | None | bool:
    """Apply peft to the meta-device model and read what it wraps and trains (None: peft refuses the config;
    False: peft, torch or transformers does not import)."""
    try:
        with quiet_imports():
            # heavy: torch and peft load only when this runs
            import torch
            from peft import LoraConfig, get_peft_model
            from transformers import AutoConfig, AutoModelForCausalLM
            from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
    except ImportError:  # (a broken install: not kept, so a repaired one counts with peft)
        return False
    classes = {"SEQ_CLS": AutoModelForSequenceClassification, "TOKEN_CLS": AutoModelForTokenClassification}
    try:
        with quiet_imports():
            cfg = AutoConfig.for_model(**shape.config)
            with torch.device("meta"):
                model = classes.get(lora_kwargs.get("task_type"), AutoModelForCausalLM).from_config(
                    cfg, trust_remote_code=getattr(shape, "trust_remote_code", False))
                model = get_peft_model(model, LoraConfig(**lora_kwargs))
    except Exception:  # a target peft refuses: the trainer says so when it loads; the estimate counts by rule
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    trained = {id(p): p for p in model.parameters() if p.requires_grad}
    tensors: dict[int, int] = {}
    for p in trained.values():
        tensors[p.numel()] = tensors.get(p.numel(), 0) + 1
    wrapped, expert, layers = set(), 0, set()

    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        base = module.get_base_layer()
        parameter = getattr(module, "parameter_name", None)  # peft's ParamWrapper: one parameter of `base`
        if parameter is not None:
            param = getattr(base, parameter, None)
            if param is not None and param.ndim >= 3:
                expert += param.numel()
                found = re.search(r"layers\.(\d+)\.", name)
                layers.add(found.group(1) if found else name)
        elif isinstance(base, torch.nn.Linear):
            wrapped.add(name.rsplit(".", 1)[-1])
    return LoraLayout(params=sum(p.numel() for p in trained.values()), tensors=sorted(tensors.items()),
                      wrapped=wrapped, expert_params=expert, layers_with_experts=len(layers))
