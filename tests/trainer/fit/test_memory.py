"""The fit estimate (trainer/fit/memory.py) against the real thing, on CPU with real tiny models:

- static terms, exactly: after a real step through the trainer's own loading and optimizer code, the bytes of the
  parameters (with bitsandbytes' quantization state), gradients and optimizer states equal the estimate's, for full
  fine-tunes, LoRA, QLoRA and LLM.int8, and for every optimizer with memory columns in matrices/optimizers.toml;
- activations, measured: the bytes autograd saves in the model's forward (torch.autograd.graph.saved_tensors_hooks,
  each storage once, parameters left out) within 10% of the activation term, for eager and SDPA attention, with
  and without gradient checkpointing, packed and padded batches, in each weight regime the trainer uses (fp32
  on CPU, LoRA and QLoRA in bf16 under autocast, full fine-tunes with fp32 master weights under autocast, bf16
  weights); autocast's weight copies equal the weight_copies term.
"""

from __future__ import annotations

import json

import contextlib
import tomllib

import pytest
import torch

from matrices.catalog import matrix_dir
from trainer.batch.collate import Collator
from trainer.config import parse_config
from trainer.errors import ConfigError
from trainer.data.prepare import load_tokenizer
from trainer.model.load import load_model
from trainer.objectives.loss import token_loss_sum
from trainer.optim.optimizers import make_optimizer
from trainer.fit import memory, memory_model
from trainer.runtime.hardware import Runtime, adapt, gpu_from_name


def config(model_dir, **keys):
    raw = {"base_model": str(model_dir), "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
           "sequence_len": 128, "micro_batch_size": 2, "sample_packing": True, "attn_implementation": "sdpa", **keys}
    cfg, _ = parse_config(raw)
    return cfg


def runtime(cfg, precision="fp32"):
    rt = adapt(cfg, gpu_from_name("cpu"))
    return Runtime(gpu=rt.gpu, attention=rt.attention, precision=precision, tf32=False)


def batch_for(tokenizer, attention, packed: bool, rows: int = 2, width: int = 100):
    """Real collated batches: packed rows of several examples (block-diagonal masks), or one example per row
    padded to the longest."""
    g = torch.Generator().manual_seed(0)

    def example(n):
        return {"input_ids": torch.randint(5, 300, (n,), generator=g).tolist(),
                "labels": torch.randint(5, 300, (n,), generator=g).tolist()}

    if packed:
        first, second = width * 37 // 100, width * 41 // 100
        grouped = [[example(first), example(second), example(width - first - second)] for _ in range(rows)]
    else:
        grouped = [[example(width - 9 * r)] for r in range(rows)]
    return Collator(tokenizer.pad_token_id, attention)(grouped)


def storage_bytes(tensors, keep_scalars=False) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.dim() or keep_scalars):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_bytes(model) -> int:
    """Parameters and bitsandbytes' quantization state (4-bit: absmax, code tables, offset; int8: the per-row
    scales, which move to the layer's state after the first forward)."""
    params = list({id(p): p for p in model.parameters()}.values())
    extra = []
    for p in params:
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            extra += [qs.absmax, qs.code, qs.offset] + ([qs.state2.absmax, qs.state2.code] if qs.nested else [])
    for module in model.modules():
        state = getattr(module, "state", None)
        if type(module).__name__ == "Linear8bitLt" and getattr(state, "SCB", None) is not None:
            extra.append(state.SCB)
    return storage_bytes(params + extra, keep_scalars=True)


def optimizer_bytes(optimizer) -> int:
    """Every state tensor (torchao's quantized states by their codes, scales and code tables; bitsandbytes' shared
    code tables once), without the 0-d step counters (host scalars, not GPU memory on CUDA)."""
    tensors = []
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "codes"):
                tensors += [value.codes, value.scale, value.qmap]
            elif isinstance(value, torch.Tensor):
                tensors.append(value)
    return storage_bytes(tensors)


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """A 4-layer Llama (hidden 128, GQA 4/2 heads) with the tiny tokenizer: big enough that every layer shape
    term shows, small enough for CPU."""
    from trainer.model.tiny import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("mid-llama")
    tokenizer = build_tokenizer()
    build_model(tokenizer, "llama", seed=0, hidden_size=128, layers=4).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def one_step(cfg, rt):
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = load_model(cfg, rt, tokenizer)
    optimizer = make_optimizer(cfg, model)
    batch = batch_for(tokenizer, rt.attention, packed=True, width=60)
    token_loss_sum(model, batch).backward()
    optimizer.step()
    return model, optimizer


REGIMES = {
    "full": {},
    "full-bf16": {"bf16": True},  # Axolotl's regime, the default under bf16: 2 + 2 + 4 bytes per parameter
    "lora": {"adapter": "lora", "lora_target_linear": True, "lora_r": 8},
    "lora-qv": {"adapter": "lora", "lora_target_modules": ["q_proj", "v_proj"], "lora_r": 4},
    "qlora": {"adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True},
    "qlora-no-double-quant": {"adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True,
                              "bnb_config_kwargs": {"bnb_4bit_use_double_quant": False}},
    "int8-lora": {"adapter": "lora", "load_in_8bit": True, "lora_target_linear": True},
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_static_terms_equal_the_bytes_after_a_step(tiny_llama, regime):
    cfg = config(tiny_llama, **REGIMES[regime])
    rt = runtime(cfg, "bf16" if cfg.bf16 is True else "fp32")
    model, optimizer = one_step(cfg, rt)
    if regime == "full-bf16":
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    static = memory.static_terms(memory_model.model_shape(str(tiny_llama)), memory.setup_from(cfg, rt, 1))
    grads = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    assert (parameter_bytes(model), grads, optimizer_bytes(optimizer)) == \
        (static.weights, static.gradients, static.optimizer)
    assert static.trained == sum(p.numel() for p in model.parameters() if p.requires_grad)


def memory_optimizers() -> list[str]:
    rows = tomllib.loads((matrix_dir() / "optimizers.toml").read_text())["optimizer"]
    return [r["name"] for r in rows if "states" in r]


@pytest.mark.parametrize("name", memory_optimizers())
def test_optimizer_state_equals_its_memory_columns(tiny_llama, name, monkeypatch):
    """Full fine-tune, one real step: the optimizer's state is what optimizers.toml's columns say (8-bit and
    4-bit states in blocks with fp32 scales, small tensors unquantized, embeddings' 8-bit state kept in 32 bits)."""
    # torchao compiles its per-parameter update; on CPU that takes a minute per optimizer and allocates nothing
    # the update run as written does not (the state is allocated before the compiled call)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    cfg = config(tiny_llama, optimizer=name)
    rt = runtime(cfg)
    try:
        model, optimizer = one_step(cfg, rt)
    except ConfigError as err:  # the `qat` extra's torchao, for its optimizers
        if "torchao package, which is not installed" not in str(err):
            raise
        from tests.support.oracle import missing

        missing(str(err))
    static = memory.static_terms(memory_model.model_shape(str(tiny_llama)), memory.setup_from(cfg, rt, 1))
    assert optimizer_bytes(optimizer) == static.optimizer


def nf4_state(n: int) -> int:
    """Independent of memory.nf4_bytes: bitsandbytes quantizes a tensor of n values and we count what it keeps."""
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(torch.randn(n), blocksize=64, compress_statistics=True, quant_type="nf4")
    return storage_bytes([packed, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code],
                         keep_scalars=True)


@pytest.mark.parametrize("n", [4096, 64 * 1000 + 5, 11008 * 4096 // 64])
def test_nf4_bytes_match_bitsandbytes(n):
    assert memory.nf4_bytes(n) == nf4_state(n)


# --------------------------------------------------------------------------- activations


def saved_in_forward(model, batch, autocast: bool) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) autograd saves during the model's forward: each storage once,
    parameters left out; autocast's 16-bit casts of parameters counted apart."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            copy = autocast and t.dtype == torch.bfloat16 and tuple(t.shape) in shapes
            seen[ptr] = ("copy" if copy else "act", t.untyped_storage().nbytes())
        return t

    model.train()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        model(**inputs, use_cache=False)
    acts = sum(n for kind, n in seen.values() if kind == "act")
    copies = sum(n for kind, n in seen.values() if kind == "copy")
    return acts, copies


# (regime keys, precision, autocast, weights converted to bf16 after loading)
ACT_REGIMES = {
    "full-fp32": ({}, "fp32", False, False),
    "lora-fp32-dropout": ({"adapter": "lora", "lora_target_linear": True, "lora_dropout": 0.1}, "fp32", False, False),
    "qlora-fp32": ({"adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True}, "fp32", False, False),
    "lora-bf16-autocast": ({"adapter": "lora", "lora_target_linear": True}, "bf16", True, False),
    "lora-qv-bf16-autocast": ({"adapter": "lora", "lora_target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05},
                              "bf16", True, False),
    "qlora-bf16-autocast": ({"adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True}, "bf16", True,
                            False),
    "full-fp32-master-autocast": ({"fp32_master_weights": True}, "bf16", True, False),
    "full-bf16-weights": ({}, "bf16", True, False),  # the default under bf16: loaded in bf16 (Axolotl's regime)
}


def activation_cases():
    """Every regime with each attention, with and without checkpointing; packed and padded batches alternate so
    each regime sees both."""
    for regime in ACT_REGIMES:
        for attention in ("sdpa", "eager"):
            for checkpointing in (False, True):
                packed = (attention == "sdpa") != checkpointing
                yield pytest.param(regime, attention, checkpointing, packed,
                                   id=f"{regime}-{attention}-{'ckpt' if checkpointing else 'no-ckpt'}-"
                                      f"{'packed' if packed else 'padded'}")


@pytest.mark.parametrize("regime,attention,checkpointing,packed", list(activation_cases()))
def test_activations_measured_within_10_percent(mid_model, regime, attention, checkpointing, packed):
    keys, precision, autocast, to_bf16 = ACT_REGIMES[regime]
    cfg = config(mid_model, attn_implementation=attention, gradient_checkpointing=checkpointing, **keys)
    rt = runtime(cfg, precision)
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = load_model(cfg, rt, tokenizer)
    setup = memory.setup_from(cfg, rt, 1)
    if to_bf16:  # Axolotl's regime: the weights themselves in bf16
        model = model.to(torch.bfloat16)
        from dataclasses import replace

        setup = replace(setup, full_weight_bytes=2)
    batch = batch_for(tokenizer, rt.attention, packed)
    measured, copies = saved_in_forward(model, batch, autocast)
    shape = memory_model.model_shape(str(mid_model))
    term = memory.activation_terms(shape, setup, tokens=batch["input_ids"].numel(),
                                   row_len=batch["input_ids"].shape[1]).saved
    assert abs(term - measured) <= 0.10 * measured, f"term {term:.0f} B, measured {measured} B"
    if autocast and not checkpointing:  # the casts are kept for the backward: the weight_copies term
        expected = memory.static_terms(shape, setup).weight_copies
        if not setup.full:  # autocast casts every adapter, but the first layer's q/k/v lora_A keep no cast for
            # the backward: their input (from the frozen embeddings) needs no gradient
            first = [lin for lin in memory.lora_targeted(shape, setup.lora_targets)
                     if lin.name.split(".")[-1] in ("q_proj", "k_proj", "v_proj")]
            expected -= sum(setup.lora_r * lin.fan_in * 2 for lin in first)
        assert copies == expected


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_activations_measured_within_10_percent(mid_model, checkpointing):
    """tiled_mlp: the MLP keeps its input only (the slices' checkpoints keep views of it); measured as the other
    regimes are (autograd's saved tensors), and below the untiled term without checkpointing."""
    cfg = config(mid_model, tiled_mlp=True, tiled_mlp_num_shards=4, gradient_checkpointing=checkpointing)
    rt = runtime(cfg)
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, rt, tokenizer)
    batch = batch_for(tokenizer, rt.attention, packed=True)
    measured, _ = saved_in_forward(model, batch, autocast=False)
    shape = memory_model.model_shape(str(mid_model))
    setup = memory.setup_from(cfg, rt, 1)
    acts = memory.activation_terms(shape, setup, tokens=batch["input_ids"].numel(), row_len=batch["input_ids"].shape[1])
    assert abs(acts.saved - measured) <= 0.10 * measured, f"term {acts.saved:.0f} B, measured {measured} B"
    from dataclasses import replace

    plain = memory.activation_terms(shape, replace(setup, tiled_shards=0), tokens=batch["input_ids"].numel(),
                                    row_len=batch["input_ids"].shape[1])
    assert (acts.saved < plain.saved) if not checkpointing else (acts.layer_full < plain.layer_full)


def test_eager_attention_grows_with_the_square_of_the_sequence(mid_model):
    """Eager keeps seq x seq probabilities per head (fp32 and a cast): at twice the row length its activations per
    token grow by the per-key term, which flash-style kernels do not have."""
    shape = memory_model.model_shape(str(mid_model))
    cfg = config(mid_model, attn_implementation="eager")
    setup = memory.setup_from(cfg, runtime(cfg, "bf16"), 1)
    per_token = [memory.activation_terms(shape, setup, tokens=n, row_len=n).saved / n for n in (512, 1024)]
    varlen = memory.replace(setup, attention="flash_attention_2")
    flat = [memory.activation_terms(shape, varlen, tokens=n, row_len=n).saved / n for n in (512, 1024)]
    assert flat[0] == flat[1]
    heads, layers = 4, 4
    assert per_token[1] - per_token[0] == pytest.approx(layers * heads * (4 + 2) * 512)


# --------------------------------------------------------------------------- the model's shape


def family_configs():
    from transformers import AutoConfig

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=500, head_dim=16)
    extra = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
             "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                           "shared_expert_intermediate_size": 48},
             "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
             "phi3": {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}}
    for model_type in memory_model.families():
        yield model_type, AutoConfig.for_model(model_type, **small, **extra.get(model_type, {})).to_dict()
    yield "llama-tied-biased", AutoConfig.for_model("llama", **small, tie_word_embeddings=True, attention_bias=True,
                                                    mlp_bias=True).to_dict()


@pytest.mark.parametrize("model_type,cfg", list(family_configs()), ids=lambda v: v if isinstance(v, str) else "")
def test_analytic_count_equals_the_meta_build(tmp_path, model_type, cfg):
    """Without transformers the estimate counts from config.json's sizes: for every family in
    matrices/model_families.toml, the same parameters, matrices, vectors and layer shapes as the meta build."""
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    exact = memory_model.model_shape(str(tmp_path), exact=True)
    analytic = memory_model.model_shape(str(tmp_path), exact=False)
    assert (analytic.counted, exact.counted) == ("analytic", "meta")
    fields = ("params", "embedding", "lm_head", "expert_params", "other_matrices", "vectors", "linear_params")
    assert {f: getattr(analytic, f) for f in fields} == {f: getattr(exact, f) for f in fields}
    assert [(ly.q_dim, ly.kv_dim, ly.mlp_width, ly.experts, ly.top_k, ly.expert_width, ly.norms, ly.qk_norm)
            for ly in analytic.layers] == [(ly.q_dim, ly.kv_dim, ly.mlp_width, ly.experts, ly.top_k,
                                            ly.expert_width, ly.norms, ly.qk_norm) for ly in exact.layers]


def test_a_kept_shape_is_the_meta_build(tmp_path, monkeypatch):
    """The meta count is kept between processes (trainer/runtime/kept.py): read back, it equals the build (a dense
    model, an MoE, a tied and biased one), is read without building again, and a damaged one is built again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = []
    real = memory_model._meta_shape
    monkeypatch.setattr(memory_model, "_meta_shape", lambda *args: built.append(args[0]) or real(*args))
    kinds = ("gemma3_text", "qwen2_moe", "llama-tied-biased")  # dense with 4 norms, MoE with a shared expert, tied
    for model_type, cfg in (c for c in family_configs() if c[0] in kinds):
        model = tmp_path / model_type
        model.mkdir()
        (model / "config.json").write_text(json.dumps(cfg))
        first = memory_model.model_shape(str(model))
        again = memory_model.model_shape(str(model))
        assert again == first and again.counted == "meta", model_type
    assert len(built) == len(kinds)  # each built once, then read
    kept = list((tmp_path / "cache" / "envtool" / memory_model.SHAPES).glob("*.json"))
    assert len(kept) == len(built)
    for file in kept:
        file.write_text('{"model_type": "llama"}')  # damaged: fields missing
    assert memory_model.model_shape(str(model)) == first  # (the last family's) built again, equal
    assert len(built) == len(kept) + 1


def test_meta_count_equals_the_loaded_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    shape = memory_model.model_shape(str(tiny_llama))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.counted == "meta"


def test_a_directory_without_config_json_is_bad_input(tmp_path):
    with pytest.raises(memory_model.ModelConfigError) as err:
        memory_model.model_shape(str(tmp_path))
    assert err.value.bad_input and "config.json" in str(err.value)


def test_analytic_count_refuses_an_unknown_family(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "rwkv", "hidden_size": 8}')
    with pytest.raises(memory_model.ModelConfigError, match="rwkv"):
        memory_model.model_shape(str(tmp_path), exact=False)


# --------------------------------------------------------------------------- other decoder families


def family_model(root, model_type: str, **extra):
    """A 3-layer model of `model_type` with random weights and the tiny tokenizer (its vocabulary)."""

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / model_type
    if not folder.exists():
        config = AutoConfig.for_model(model_type, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=384,
                                      pad_token_id=2, bos_token_id=0, eos_token_id=1, **extra)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        from trainer.model.tiny import build_tokenizer

        build_tokenizer().save_pretrained(folder)
    return folder


FAMILIES = {"qwen3": {}, "gemma2": {}, "gemma3_text": {}, "phi3": {}, "qwen2": {},
            "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}}


def family_cases():
    for model_type in FAMILIES:
        for regime, attention in (("full-fp32", "sdpa"), ("lora-bf16-autocast", "eager")):
            if model_type == "gemma2" and attention == "sdpa":
                attention = "eager"  # transformers has no sdpa path for Gemma 2 (soft-capped attention)
            yield pytest.param(model_type, regime, attention, id=f"{model_type}-{regime}-{attention}")


@pytest.mark.parametrize("model_type,regime,attention", list(family_cases()))
def test_activations_of_other_families_within_10_percent(tmp_path_factory, model_type, regime, attention):
    """Qwen 3 and Gemma 3 (per-head q/k norms), Gemma 2 (four norms, soft-capped attention and logits), Phi-3
    (fused q/k/v and gate/up), Mixtral (routed experts; LoRA reaches them through peft's ParamWrapper, which keeps
    each layer's merged expert weights for the backward)."""
    root = tmp_path_factory.getbasetemp() / "families"
    model_dir = family_model(root, model_type, **FAMILIES[model_type])
    keys, precision, autocast, _ = ACT_REGIMES[regime]
    if regime.startswith("lora"):
        keys = {"adapter": "lora", "lora_target_linear": True}
    cfg = config(model_dir, attn_implementation=attention, **keys)
    rt = runtime(cfg, precision)
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, rt, tokenizer)
    batch = batch_for(tokenizer, rt.attention, packed=True)
    measured, _ = saved_in_forward(model, batch, autocast)
    shape = memory_model.model_shape(str(model_dir))
    term = memory.activation_terms(shape, memory.setup_from(cfg, rt, 1), tokens=batch["input_ids"].numel(),
                                   row_len=batch["input_ids"].shape[1]).saved
    assert abs(term - measured) <= 0.10 * measured, f"term {term:.0f} B, measured {measured} B"


def test_moe_lora_static_terms_equal_the_bytes_after_a_step(tmp_path_factory):
    """LoRA all-linear on Mixtral: peft wraps the attention's linear layers, the router and the fused 3-D experts;
    the estimate counts what peft creates (built on the meta device), exactly."""
    model_dir = family_model(tmp_path_factory.getbasetemp() / "families", "mixtral", **FAMILIES["mixtral"])
    cfg = config(model_dir, adapter="lora", lora_target_linear=True)
    rt = runtime(cfg)
    model, optimizer = one_step(cfg, rt)
    static = memory.static_terms(memory_model.model_shape(str(model_dir)), memory.setup_from(cfg, rt, 1))
    grads = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    assert (parameter_bytes(model), grads, optimizer_bytes(optimizer)) == \
        (static.weights, static.gradients, static.optimizer)
