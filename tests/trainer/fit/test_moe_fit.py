"""The fit counts a MoE's 3-D expert tensors by the load path really taken: the bytes the trainer's own load and step
hold on a tiny Mixtral (transformers' MixtralConfig), for a QLoRA without quantize_moe_experts (experts in the
training dtype, never fp32), with it in NF4, and an 8-bit LoRA with int8 experts; and on Mixtral-8x7B's published
config.json, `quantize_moe_experts` is the change `envtool fit` names when it is the one that fits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.fit.test_memory import config, one_step, parameter_bytes, runtime, storage_bytes
from trainer.fit import memory, memory_model

MOE_REGIMES = {
    "qlora": {"adapter": "qlora", "load_in_4bit": True, "lora_target_modules": ["q_proj", "v_proj"], "bf16": True},
    "qlora-quantized-experts": {"adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True,
                                "lora_target_modules": ["q_proj", "v_proj"], "bf16": True},
    "int8-lora-quantized-experts": {"adapter": "lora", "load_in_8bit": True, "quantize_moe_experts": True,
                                    "lora_target_modules": ["q_proj", "v_proj"], "bf16": True},
}


def expert_state_bytes(model) -> int:
    """What the quantized experts keep beside their parameters: bitsandbytes' 4-bit quantization state (absmax,
    code tables, offset) on the parametrization, or the int8 rows' fp32 absmax buffer."""
    extra = []
    for module in model.modules():
        qs = getattr(module, "quant_state", None)
        if type(module).__name__ == "Bnb4bitParametrization" and qs is not None:
            extra += [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
        if type(module).__name__ == "Int8Rows":
            extra.append(module.row_stats)
    return storage_bytes(extra, keep_scalars=True)


@pytest.mark.parametrize("regime", list(MOE_REGIMES))
def test_the_weights_term_equals_a_moe_load_s_bytes(tiny_mixtral, regime):
    cfg = config(tiny_mixtral, **MOE_REGIMES[regime])
    rt = runtime(cfg, "bf16")
    model, _ = one_step(cfg, rt)
    experts = {p.dtype for n, p in model.named_parameters() if ".experts." in n}
    assert experts == {"qlora": {torch.bfloat16}, "qlora-quantized-experts": {torch.uint8},
                       "int8-lora-quantized-experts": {torch.int8}}[regime]
    shape = memory_model.model_shape(str(tiny_mixtral))
    static = memory.static_terms(shape, memory.setup_from(cfg, rt, 1))
    assert parameter_bytes(model) + expert_state_bytes(model) == static.weights


# mistralai/Mixtral-8x7B-v0.1's config.json (https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json)
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
                "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
                "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
                "use_cache": True, "vocab_size": 32000}


def test_fit_suggests_quantize_moe_experts_for_a_mixtral_8x7b_qlora(tmp_path):
    """Micro-batch 4 x 4096, QLoRA on the attention, one A100-80GB: the 45.1B expert parameters in bf16 (84 GB)
    do not fit, and quantize_moe_experts (NF4 experts, 21.7 GB) is the cheapest change that does."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    shape = memory_model.model_shape(str(tmp_path), exact=False)
    keys = {"adapter": "qlora", "load_in_4bit": True, "lora_r": 32, "bf16": True, "sequence_len": 4096,
            "micro_batch_size": 4, "gradient_checkpointing": True, "optimizer": "adamw_bnb_8bit",
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    cfg = config(tmp_path, **keys)
    s = memory.setup_from(cfg, runtime(cfg, "bf16"), 1)
    gpu = memory.Gpu("a100-80gb", 80.0)
    plain = memory.estimate(shape, s, gpu)
    assert shape.expert_params == 45_097_156_608
    assert plain.verdict == "does_not_fit" and plain.peak < 120 * memory.GB  # not the 194 GB of fp32 experts
    assert memory.expert_bytes(shape, s) == shape.expert_params * 2
    first = next(x for x in plain.suggestions if not x["kind"].startswith("max_"))
    assert first["change"] == {"quantize_moe_experts": True}
    quantized = memory.estimate(shape, memory.setup_from(config(tmp_path, quantize_moe_experts=True, **keys),
                                                         runtime(cfg, "bf16"), 1), gpu)
    assert quantized.verdict == "fits" and first["peak_gb"] == pytest.approx(quantized.peak / memory.GB, abs=0.01)
    line = memory.experts_note(shape, s)
    assert line.startswith("MoE experts: 45.10B parameters") and "84.00 GB in bf16" in line and "(21.67 GB)" in line
    adapted = memory.replace(s, lora_target_parameters=["mlp.experts.gate_up_proj"])  # LoRA on the experts: allowed
    assert any(x["change"].get("quantize_moe_experts") for x in memory.estimate(shape, adapted, gpu).suggestions)
    sharded = memory.replace(s, zero=3)  # refused with DeepSpeed: not suggested, and the line says why
    assert not any(x["change"].get("quantize_moe_experts") for x in memory.estimate(shape, sharded, gpu).suggestions)
    assert "but not with DeepSpeed" in memory.experts_note(shape, sharded)
