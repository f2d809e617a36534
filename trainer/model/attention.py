"""The attention backend a model's own transformers class accepts, fitted after the hardware's choice
(trainer/runtime/hardware.py): gpt-oss, for one, has no sdpa path and runs flash attention only through kernels that
apply its attention sinks. And how packed rows are kept apart (`choose_packing`): by cu_seqlens where a varlen
kernel runs (flash-attn 2/3, torch's own varlen_attn: trainer/model/attention_varlen.py), else by a mask, with cuDNN
SDPA kept off masked calls on builds that put it first. No torch import here: validate calls it and stays fast."""

from __future__ import annotations


from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
import importlib.util
import inspect
import sys
from matrices import catalog
from trainer import facts
from trainer.runtime import kept
from trainer.runtime.hardware import attention_backends, packing, varlen_kernels
from trainer.config.diffusion import enabled as diffusion
from trainer.runtime.hardware import attention_backend


def for_model(cfg, runtime, local_only: bool) -> list[str]:
    """Fit runtime.attention to what the model's transformers class accepts, with a note for each change:
    - a class without sdpa (gpt-oss: its attention sinks) gets eager, as transformers itself would;
    - a class that lists its own flash implementations (gpt-oss: `_compatible_flash_implementations`, kernels
      that apply the sinks) would be switched by transformers to the first of them, fetched from the Hub, even
      where attention.toml says it does not run: the first of them that runs here, else flex_attention where it
      runs and the class supports it, else eager;
    - flex_attention on a class without flex support: sdpa, else eager.
    The model's config is read from the local files or cache only when `local_only` (validate, no download); a
    model that cannot be read keeps the hardware's choice."""
    found = _model_class(cfg, local_only)
    if found is None:
        return []
    config, cls = found
    notes = _varlen_for_model(config, cls, runtime)
    cc = runtime.gpu.compute_capability
    runs = [b for b in attention_backends() if catalog.backend_runs_on(b, cc) and _installed(b, runtime.gpu)]
    attention, why = runtime.attention, ""
    compatible = getattr(cls, "_compatible_flash_implementations", None) or []
    if packing(attention) == "position_ids" and compatible and attention not in compatible:
        kernel = next((b["transformers"] for b in runs if b["transformers"] in compatible), None)
        flex = cls._supports_flex_attn and any(b["transformers"] == "flex_attention" for b in runs)
        attention = kernel or ("flex_attention" if flex else "eager")
        why = (f"{cls.__name__} runs flash attention only through {', '.join(compatible)}, "
               f"{'of which ' + kernel + ' runs here' if kernel else 'none of which runs on ' + runtime.gpu.describe()}")
    elif attention == "sdpa" and not cls._supports_sdpa:
        attention, why = "eager", f"{cls.__name__} has no sdpa path (transformers' _supports_sdpa is False)"
    elif attention == "flex_attention" and not cls._supports_flex_attn:
        attention = "sdpa" if cls._supports_sdpa else "eager"
        why = f"{cls.__name__} has no flex_attention path"
    if attention == runtime.attention:
        return notes
    note = f"attention: {runtime.attention} -> {attention} ({why})"
    runtime.attention = attention
    runtime.changes.append(note)
    runtime.isolation = _isolation(attention, why)
    return notes + [note]


# ---------------------------------------------------------------------------- how packed rows are kept apart


def choose_packing(cfg, runtime, plan: dict | None) -> None:
    """Where the run's attention is sdpa and torch's own varlen kernel runs (torch.toml [[varlen]]: torch >= 2.10,
    sm_80+), packed rows are kept apart by cu_seqlens through it (runtime.attention becomes its registered name);
    with a plan, its `packing` decides, as the plan's torch is what is installed. Else a mask, with the reason.
    Sets runtime.isolation (the sentence validate and the run print) and runtime.mask_without_cudnn, each change
    with its note in runtime.changes."""
    runtime.mask_without_cudnn, cudnn_note = _cudnn_first(runtime.gpu, plan)
    why_not = None
    if runtime.attention == "sdpa":
        why_not = _varlen_refused(cfg, runtime, plan)
        if why_not is None:
            row = varlen_kernels()[0]
            torch_version = (plan or {}).get("torch", {}).get("version") or _installed_torch()[0]
            source = "the plan's packing: varlen" if (plan or {}).get("packing") == "varlen" else \
                f"torch {torch_version} on {runtime.gpu.describe()}"
            runtime.attention = row["name"]
            runtime.changes.append(f"attention: sdpa -> {row['name']} (packed rows kept apart by cu_seqlens from "
                                   f"position_ids, no mask: {row['function']}, FA2 kernels built into torch"
                                   f"{row['torch']}, sm_{row['min_cc'].replace('.', '')}+; {source})")
    runtime.isolation = _isolation(runtime.attention, why_not)
    if runtime.mask_without_cudnn and runtime.attention == "sdpa":  # varlen_attn makes no SDPA call: no note
        runtime.changes.append(cudnn_note)


def _isolation(attention: str, why_not_varlen: str | None = None) -> str:
    how = packing(attention)
    if how == "position_ids":
        return f"varlen: {attention} keeps packed rows apart by cu_seqlens from position_ids, no mask"
    if how == "row_position_ids":
        return ("mask: flex_attention's BlockMask, which transformers builds from position_ids restarting per "
                "sequence")
    kind = "an additive 0/-inf" if how == "float_mask" else "a boolean"
    because = f" ({why_not_varlen})" if why_not_varlen else " (no varlen kernel for " + attention + ")"
    return f"mask: {kind} 4-D block-diagonal mask{because}"


def _varlen_refused(cfg, runtime, plan: dict | None) -> str | None:
    """Why torch's varlen kernel does not run this sdpa run (None: it does)."""
    row = varlen_kernels()[0]
    name = row["name"]
    if diffusion(cfg):
        return "diffusion attends both ways through its own mask"
    installed, _ = _installed_torch()
    version = (plan or {}).get("torch", {}).get("version") or installed
    local = None  # the rule itself, on the plan's torch (else the installed one) and this GPU
    if version is None:
        local = f"torch is not installed here, and {name} needs torch{row['torch']}"
    elif not _in_range(version, row["torch"]):
        local = f"torch {version} has no {name} (torch{row['torch']})"
    elif runtime.gpu.cc is None:
        local = (f"{name} runs on NVIDIA GPUs (sm_{row['min_cc'].replace('.', '')}+), not on "
                 f"{'the CPU' if runtime.gpu.kind == 'cpu' else runtime.gpu.describe()}")
    elif catalog.cc_tuple(runtime.gpu.compute_capability) < catalog.cc_tuple(row["min_cc"]):
        local = f"{name} needs sm_{row['min_cc'].replace('.', '')}+; {runtime.gpu.describe()} is older"
    if plan is not None and plan.get("packing") and _plan_runs_sdpa(plan):  # the plan decides (its torch is here)
        if plan["packing"] != "varlen":
            return f"the plan's packing: {plan['packing']}" + (f"; {local}" if local else "")
    elif local:  # no plan, or one that does not say (older plans; a plan for another attention): the rule
        return local
    if installed is not None and not _in_range(installed, row["torch"]):
        return f"the plan says packing: varlen, but torch {installed} here has no {name} (torch{row['torch']})"
    if runtime.gpu.cc is not None and runtime.precision == "fp32":
        return f"{name}'s flash kernels take fp16/bf16 and this run's precision is fp32"
    return None


def _plan_runs_sdpa(plan: dict) -> bool:
    backend = attention_backend(plan.get("attention") or "")
    return backend is not None and backend["transformers"] == "sdpa"


def _model_class(cfg, local_only: bool):
    """(config, causal-LM class) of the config's model, or None where it cannot be read here (a hub id with no cache
    when `local_only`, remote code): transformers decides at load then.

    What the rules read of the two (MODEL_FACTS) is kept on disk, keyed by the config.json's bytes and transformers'
    version, so a validate, dry run or fit of a model read before does not import transformers' model code (8 s of
    CPU, most of those commands' time); a model that transformers must import to answer (remote code) is not kept."""
    file = _config_file(cfg.base_model)
    if local_only and file is None:
        return None  # (cheap check first: validate stays fast, no transformers import for a model not here)
    key = None if file is None or cfg.trust_remote_code else _facts_key(file)
    kept = _kept_facts(key) if local_only else None  # the planners' shortcut: a training run asks transformers
    if kept is not None:
        return _overridden(kept, cfg)
    try:
        # heavy: transformers loads only when this runs
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(cfg.base_model, trust_remote_code=cfg.trust_remote_code,
                                            local_files_only=local_only)
        found = config, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:
        return None
    _keep_facts(key, *found)
    return _overridden(found, cfg)


def _overridden(found, cfg):
    """(config, class) with the config's model_config_overrides applied to the facts the rules read: the model
    trains with them (an override's attention_dropout: 0.1 is dropout varlen_attn does not do)."""
    overrides = {k: v for k, v in (cfg.model_config_overrides or {}).items() if k in MODEL_FACTS["config"]}
    if not overrides:
        return found
    config, cls = found
    missing = object()
    facts = {a: v for a in MODEL_FACTS["config"] if (v := getattr(config, a, missing)) is not missing}
    return SimpleNamespace(**{**facts, **overrides}), cls


# What the rules above read of a model's config and of its class: nothing else may be read of what _model_class
# returns, as a kept answer holds only these (tests/trainer/model/test_model_facts.py checks both ways agree).
MODEL_FACTS = {"config": ("attn_logit_softcapping", "attention_dropout", "layer_types", "sliding_window",
                          "use_sliding_window"),
               "class": ("__name__", "_supports_sdpa", "_supports_flex_attn", "_supports_attention_backend",
                         "_compatible_flash_implementations")}
FACTS_FORMAT = 1  # raised when MODEL_FACTS changes: older kept answers are then never read


KIND = "model-facts"  # trainer/runtime/kept.py


def _facts_key(config_file: Path) -> str | None:
    try:
        return kept.key(FACTS_FORMAT, config_file.read_bytes())
    except OSError:
        return None


def _kept_facts(key: str | None):
    """The (config, class) kept for `key`, as namespaces holding MODEL_FACTS; None where none is (or it is damaged)."""
    answer = kept.read(KIND, key)
    try:
        config, cls = SimpleNamespace(**answer["config"]), SimpleNamespace(**answer["class"])
    except (KeyError, TypeError):
        return None
    if {*vars(cls)} != {*MODEL_FACTS["class"]} or not {*vars(config)} <= {*MODEL_FACTS["config"]}:
        return None
    typed = all(isinstance(getattr(config, a, None), FACT_TYPES[a]) for a in MODEL_FACTS["config"]) \
        and all(isinstance(getattr(cls, a), FACT_TYPES[a]) for a in MODEL_FACTS["class"]) \
        and all(isinstance(x, str) for a in ("layer_types", "_compatible_flash_implementations")
                for x in (getattr(config, a, None) or getattr(cls, a, None) or []))
    return (config, cls) if typed else None  # a wrong type is damage, never a decision: asked again


NUMBER = (int, float, type(None))
FACT_TYPES = {"attn_logit_softcapping": NUMBER, "attention_dropout": NUMBER, "layer_types": (list, type(None)),
              "sliding_window": (int, type(None)), "use_sliding_window": (bool, type(None)), "__name__": str,
              "_supports_sdpa": (bool, type(None)), "_supports_flex_attn": (bool, type(None)),
              "_supports_attention_backend": (bool, type(None)),
              "_compatible_flash_implementations": (list, tuple, type(None))}


def _keep_facts(key: str | None, config, cls) -> None:
    missing = object()
    kept.keep(KIND, key, {
        "config": {a: v for a in MODEL_FACTS["config"] if (v := getattr(config, a, missing)) is not missing},
        "class": {a: getattr(cls, a, None) for a in MODEL_FACTS["class"]}})


WINDOW_SIZE_FROM = "2.11"  # varlen_attn takes window_size from torch 2.11 (torch.toml [[varlen]] source)


def varlen_limit(config, cls, takes_window: bool) -> tuple[str, str] | None:
    """What torch's varlen kernel cannot do that the model needs, as (what, why): "softcap" (soft-capped attention
    logits: Gemma 2), "sinks" (attention sinks: gpt-oss), "dropout" (attention dropout), "interface" (a class whose
    attention does not go through transformers' AttentionInterface) or "sliding_window" (a sliding window, on a torch
    whose varlen_attn has no window_size: `takes_window` False). None where it runs the model. flash_attn.toml's
    [[impl]] `handles` names the ones a flash-attn wheel does."""
    name = varlen_kernels()[0]["name"]
    if getattr(config, "attn_logit_softcapping", None):
        return "softcap", f"{cls.__name__} soft-caps its attention logits, which {name} cannot"
    if getattr(cls, "_compatible_flash_implementations", None):
        return "sinks", f"{cls.__name__} has attention sinks, which {name} cannot apply"
    if (getattr(config, "attention_dropout", 0) or 0) > 0:
        return "dropout", f"{cls.__name__} has attention dropout {config.attention_dropout}, which {name} does not do"
    if not getattr(cls, "_supports_attention_backend", False):
        return "interface", f"{cls.__name__}'s attention does not go through transformers' AttentionInterface"
    if _slides(config) and not takes_window:
        return "sliding_window", (f"{cls.__name__} has a sliding window and this torch's {name} has no window_size "
                                  f"(torch >= {WINDOW_SIZE_FROM})")
    return None


def model_varlen_limit(cfg, torch_version: str) -> tuple[str, str] | None:
    """`varlen_limit` for the config's model under a plan's torch, for a planner: the model's config read from this
    machine's files only (a local directory or the Hub cache); None where it is not at hand (the trainer checks again
    at start, with the model's files) or where torch's varlen kernel runs it."""
    found = _model_class(cfg, local_only=True)
    if found is None:
        return None
    return varlen_limit(*found, takes_window=_in_range(torch_version, f">={WINDOW_SIZE_FROM}"))


def _varlen_for_model(config, cls, runtime) -> list[str]:
    """Back from torch's varlen kernel to sdpa's mask for a model it cannot run (`varlen_limit`)."""
    name = varlen_kernels()[0]["name"]
    if runtime.attention != name:
        return []
    limit = varlen_limit(config, cls, _kernel_takes_window())
    if limit is None:
        return []
    why = limit[1]
    fallback = "sdpa" if cls._supports_sdpa else "eager"  # Gemma 2: no sdpa path either (its soft-capping)
    note = f"attention: {name} -> {fallback} ({why}; packed rows kept apart by a mask)"
    runtime.attention = fallback
    runtime.changes.append(note)
    if fallback == "sdpa" and runtime.mask_without_cudnn:
        runtime.changes.append("cuDNN SDPA off for masked SDPA calls (the plan's mask_without_cudnn: this build puts "
                               "cuDNN attention first on this GPU, and it has open correctness bugs with masks)")
    runtime.isolation = _isolation(fallback, why)
    return [note]


def _slides(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return "sliding_attention" in layer_types
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def _kernel_takes_window() -> bool:
    """Whether this torch's varlen_attn takes window_size: from its signature where torch is already imported (the
    run), else from the installed version against WINDOW_SIZE_FROM (validate, the dry run and fit stay without
    torch, whose varlen module imports torch._dynamo: 3-5 s). No torch here: the plan's torch decides, and plans
    with varlen name torch >= 2.10."""
    if "torch" not in sys.modules:
        version = _installed_torch()[0]
        return version is None or _in_range(version, f">={WINDOW_SIZE_FROM}")
    try:
        # heavy: torch's varlen module loads only when this runs (torch itself is already imported here)
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return True
    return "window_size" in inspect.signature(varlen_attn).parameters


def _cudnn_first(gpu, plan: dict | None) -> tuple[bool, str]:
    """Whether this build puts cuDNN attention first for SDPA on this GPU (torch.toml [[cudnn_sdpa]]), so masked
    SDPA calls run with it off: the plan's `mask_without_cudnn`, or the rows read for the plan's torch (or the
    installed one) where the plan's attention was not sdpa."""
    if gpu.cc is None:
        return False, ""
    if plan is not None:
        version, cuda = plan.get("torch", {}).get("version"), plan.get("torch", {}).get("cuda")
    else:
        version, cuda = _installed_torch()
    if version is None or (plan is not None and cuda is None):
        return False, ""
    cc = catalog.cc_tuple(gpu.compute_capability)
    for row in facts.rows("torch", "cudnn_sdpa"):
        if _in_range(version, row["torch"]) and (cuda == "?" or cuda is not None and _in_range(cuda, row["cuda"])) \
                and catalog.cc_tuple(row["min_cc"]) <= cc <= catalog.cc_tuple(row["max_cc"]):
            build = f"torch {version}" + (f" (CUDA {cuda})" if cuda != "?" else "")
            return True, (f"cuDNN SDPA off for masked SDPA calls (mask_without_cudnn): {build} puts cuDNN attention "
                          f"first on {gpu.describe()}, and cuDNN SDPA has open correctness bugs with explicit masks: "
                          f"{row['bugs']}; those calls run on the flash, memory-efficient or math kernels")
    return bool((plan or {}).get("mask_without_cudnn")), (
        "cuDNN SDPA off for masked SDPA calls (the plan's mask_without_cudnn)")


def _installed_torch() -> tuple[str | None, str | None]:
    """(version, CUDA) of the torch installed here, without importing it: the CUDA version from the local tag
    (+cu128 -> 12.8; +cpu, +rocm, +xpu -> None), "?" for PyPI's untagged Linux builds (CUDA 12.8 or newer since
    2.9: torch.toml), exact from torch itself when it is already imported."""
    torch = sys.modules.get("torch")  # (None where a caller blocked the import: read the metadata then)
    if torch is not None:
        return torch.__version__.split("+")[0], getattr(torch.version, "cuda", None)

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None, None
    public, _, local = version.partition("+")
    if not local:
        return public, "?"
    if local.startswith("cu") and local[2:].isdigit():
        return public, f"{local[2:-1]}.{local[-1]}"
    return public, None


def _in_range(version: str, spec: str) -> bool:
    # start-up: packaging imported only when this runs
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version.split("+")[0]) in SpecifierSet(spec)


def _installed(backend: dict, gpu) -> bool:
    """A backend's module is importable here; for `--gpu NAME` (another machine) it is assumed, as
    trainer/runtime/hardware.py does."""
    module = backend.get("module")
    return module is None or gpu.source == "--gpu" or importlib.util.find_spec(module) is not None


def _config_file(model: str) -> Path | None:
    """The model's config.json on this machine: in a local directory, or in the Hub cache; None where it is not."""
    if Path(model, "config.json").is_file():
        return Path(model, "config.json")
    if Path(model).exists() or model.count("/") != 1:
        return None
    try:
        # heavy: huggingface_hub loads only when this runs
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def packed_masks(model) -> bool:
    """Per-layer-type masks for hybrid models (gpt-oss: sliding-window and full layers alternate), built by
    transformers' own mask functions from the position_ids the collator restarts per packed sequence.

    A single 4D mask from the collator reaches every layer as given, so sliding layers would attend past their
    window; and gpt-oss's forward does not pass position_ids to its mask creation, so position_ids alone would
    let packed sequences see each other. These models take `attention_mask` as a {layer type: mask} dict, which
    a forward pre-hook on the decoder fills (causal and sliding, per sequence, in the backend's form: bool,
    additive, or flex's BlockMask). Returns whether it was installed (not for models without sliding layers, nor
    for those whose forward takes no such dict)."""
    layer_types = set(getattr(model.config, "layer_types", None) or [])
    if layer_types - {"full_attention"} != {"sliding_attention"}:
        return False

    # heavy: torch and transformers load only when this runs
    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    decoder = model.get_decoder()
    try:  # transformers' hybrid models take a prepared {layer type: mask} dict; a few do not (then as before)
        if "causal_mask_mapping := attention_mask, dict)" not in inspect.getsource(type(decoder).forward):
            return False
    except (OSError, TypeError):
        return False

    def hook(module, args, kwargs):
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or positions is None or isinstance(kwargs.get("attention_mask"), dict) \
                or packing(module.config._attn_implementation) == "position_ids":  # flash: cu_seqlens, its own window
            return None
        dtype = module.get_input_embeddings().weight.dtype  # the additive mask's dtype, as the model's own
        shape = dict(config=module.config, inputs_embeds=torch.empty(*ids.shape, 1, dtype=dtype, device=ids.device),
                     attention_mask=None, past_key_values=None, position_ids=positions)
        kwargs["attention_mask"] = {"full_attention": create_causal_mask(**shape),
                                    "sliding_attention": create_sliding_window_causal_mask(**shape)}
        return args, kwargs

    decoder.register_forward_pre_hook(hook, with_kwargs=True)
    return True
