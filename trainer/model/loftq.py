"""peft.loftq_config.loftq_bits (Axolotl's LoftQ, arXiv 2310.08659): LoRA starts from the low-rank part of
what 4-bit quantization loses, so base + LoRA equals the original weights better than the quantized base alone.

For every LoRA-wrapped linear layer W: Q = dequantize(NF4(W)) (bitsandbytes, blocksize 64, no double
quantization), the residual W - Q is decomposed by SVD, B = U_r sqrt(S_r) and A = sqrt(S_r) V_r^T, and the
base weight becomes Q (one iteration: peft's loftq_iter default, which Axolotl does not expose). On a CUDA
GPU this is peft's own LoftQ (LoraConfig(init_lora_weights="loftq")); peft computes it on CUDA only, so on
CPU the same steps run here through the same bitsandbytes calls.

The initialisation is deterministic, so a resumed run rebuilds the same base before loading the adapter, and
`evaluate` rebuilds it too: the saved adapter belongs to the quantized base, not to base_model's weights.
"""

from __future__ import annotations


def lora_kwargs(cfg, cuda_available: bool) -> dict:
    """Extra LoraConfig arguments: peft's own LoftQ where it runs (a CUDA device is there)."""
    if not loftq_bits(cfg) or not cuda_available:
        return {}
    # heavy: peft loads only when this runs
    from peft import LoftQConfig

    return {"init_lora_weights": "loftq", "loftq_config": LoftQConfig(loftq_bits=loftq_bits(cfg))}


def loftq_bits(cfg) -> int | None:
    return cfg.peft.loftq_config.loftq_bits if cfg.peft and cfg.peft.loftq_config else None


def decompose(weight, rank: int):
    """(quantized-dequantized weight, lora_A, lora_B) for one weight matrix, as peft's loftq_init."""
    # heavy: bitsandbytes and torch load only when this runs
    import bitsandbytes as bnb
    import torch

    w = weight.detach().to(torch.float32)
    q = bnb.nn.Params4bit(w.cpu(), requires_grad=False, compress_statistics=False, quant_type="nf4").to(w.device)
    dequantized = bnb.functional.dequantize_4bit(q.data, q.quant_state)
    u, s, vh = torch.linalg.svd(w - dequantized, full_matrices=False)
    root = torch.sqrt(s[:rank])
    return dequantized.to(weight.dtype), root[:, None] * vh[:rank], u[:, :rank] * root


def apply_on_cpu(cfg, model) -> int:
    """LoftQ-initialise every LoRA linear layer of a peft model (where peft's CUDA-only path cannot run)."""
    # heavy: torch and peft load only when this runs
    import torch
    from peft.tuners.lora import Linear

    done = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, Linear):
                continue
            for name in module.lora_A:
                base = module.get_base_layer()
                dequantized, lora_a, lora_b = decompose(base.weight, module.r[name])
                module.lora_A[name].weight.data = lora_a.to(module.lora_A[name].weight.dtype)
                module.lora_B[name].weight.data = lora_b.to(module.lora_B[name].weight.dtype)
                base.weight.data = dequantized
                done += 1
    return done
