"""MoE experts as transformers 5 stores them (fused 3-D parameters): k-bit preparation keeps them in their dtype
(never fp32), quantize_moe_experts quantizes them as they load, and the quantized experts' forward is
dequantize-then-matmul within the format's rounding (an oracle computed apart from trainer/model/experts.py:
bitsandbytes' own 2-D NF4 round trip, and LLM.int8's row-wise absmax written out in torch)."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from trainer.cli import main
from trainer.config import load_config
from trainer.model import experts
from trainer.model.load import load_model
from trainer.runtime.hardware import adapt, gpu_from_name


def moe_config(tmp_path, model, **keys):
    cfg = {"base_model": str(model), "datasets": [{"path": str(tmp_path / "rows.jsonl"), "type": "alpaca"}],
           "output_dir": str(tmp_path / "out"), "learning_rate": 1e-3, "adapter": "qlora", "load_in_4bit": True,
           "lora_target_modules": ["q_proj", "v_proj"], "bf16": True, **keys}
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n' * 8)
    path = tmp_path / "moe.yml"
    path.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
    return path


def loaded(config):
    cfg, _ = load_config(config)
    return load_model(cfg, adapt(cfg, gpu_from_name("cpu")), AutoTokenizer.from_pretrained(cfg.base_model))


def expert_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n}


def test_a_qlora_keeps_frozen_experts_in_the_training_dtype(tmp_path, tiny_mixtral):
    """peft's k-bit preparation casts every 16-bit parameter that is not bitsandbytes' to fp32: the experts (45B of
    Mixtral-8x7B's 46.7B parameters) must stay in bf16, frozen, while the norms still go to fp32 as peft sets them."""
    model = loaded(moe_config(tmp_path, tiny_mixtral))
    found = expert_tensors(model)
    assert {n.rsplit(".", 1)[-1] for n in found} == {"gate_up_proj", "down_proj"}
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in found.values())
    norms = [p for n, p in model.named_parameters() if n.endswith("input_layernorm.weight")]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    layer = model.base_model.model.model.layers[0].mlp.experts  # the module's own parameter order is kept
    assert list(layer._parameters) == ["gate_up_proj", "down_proj"]


@pytest.mark.parametrize("family,keys", [("mixtral", {}), ("qwen3_moe", {"adapter": "lora", "load_in_4bit": None,
                                                                         "load_in_8bit": True})])
def test_quantize_moe_experts_quantizes_each_expert_tensor_as_it_loads(tmp_path, request, family, keys, monkeypatch):
    model_dir = request.getfixturevalue(f"tiny_{family}")
    import transformers.core_model_loading as loading

    during_load, handed = [], {}
    real, real_set = experts.quantize, loading.set_param_for_module

    def spy(module, name, how):  # quantized inside transformers' per-tensor setter, not after the load
        during_load.append(loading.set_param_for_module.__name__ == "set_and_quantize")
        return real(module, name, how)

    def handed_over(model, target_name, param_value, *args):  # what transformers' loader hands the setter
        handed[target_name] = param_value
        return real_set(model, target_name, param_value, *args)

    monkeypatch.setattr(experts, "quantize", spy)
    monkeypatch.setattr(loading, "set_param_for_module", handed_over)
    model = loaded(moe_config(tmp_path, model_dir, quantize_moe_experts=True, **keys))
    assert during_load == [True] * 4  # 2 layers x (gate_up_proj, down_proj)
    assert loading.set_param_for_module is handed_over  # restored after the load
    loaded_experts = {n: t for n, t in handed.items() if ".experts." in n}
    assert len(loaded_experts) == 4 and all(t.numel() == 0 for t in loaded_experts.values())  # 16-bit copies freed
    assert all(t.numel() > 0 for n, t in handed.items() if n not in loaded_experts)
    stored = {p.dtype for p in expert_tensors(model).values()}
    assert stored == ({torch.int8} if keys else {torch.uint8})
    assert not list(experts.float_experts(model))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def mixtral_experts(seed=0):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(seed)
    module = MixtralExperts(MixtralConfig(hidden_size=64, intermediate_size=128, num_local_experts=4))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return module


def routed(seed=1, tokens=24, experts_n=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(experts_n, generator=g)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return x, index, weights


def nf4_per_matrix(w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' NF4 of each expert's 2-D matrix on its own, as it quantizes an nn.Linear weight (absmax per
    block of 64 in fp32: the blocks fall where they fall in the fused tensor)."""
    import bitsandbytes.functional as F

    out = []
    for matrix in w:
        q, state = F.quantize_4bit(matrix.contiguous(), quant_type="nf4", compress_statistics=False)
        out.append(F.dequantize_4bit(q, state))
    return torch.stack(out)


def nf4_nested(w: torch.Tensor) -> torch.Tensor:
    """With double quantization the absmax values are themselves quantized over the whole tensor: its round trip."""
    import bitsandbytes.functional as F

    q, state = F.quantize_4bit(w.contiguous(), quant_type="nf4", compress_statistics=True)
    return F.dequantize_4bit(q, state)


def int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """LLM.int8's row-wise format: each row scaled by its absmax to [-127, 127] and rounded (written out here)."""
    rows = w.float().reshape(-1, w.shape[-1])
    scale = rows.abs().amax(dim=1, keepdim=True) / 127
    return (torch.round(rows / scale) * scale).reshape(w.shape)


@pytest.mark.parametrize("how,round_trip,step", [  # step: half the widest gap between the format's levels
    ({"bits": 4, "quant_type": "nf4", "double_quant": False}, nf4_per_matrix, 0.17),
    ({"bits": 4, "quant_type": "nf4", "double_quant": True}, nf4_nested, 0.17),
    ({"bits": 8}, int8_round_trip, 0.5 / 127)], ids=["nf4", "nf4-double-quant", "int8"])
def test_quantized_experts_forward_is_dequantize_then_matmul(how, round_trip, step):
    module, x, index, weights = mixtral_experts(), *routed()
    originals = {n: p.detach().clone() for n, p in module.named_parameters()}
    reference = mixtral_experts()
    with torch.no_grad():
        for name, w in originals.items():
            getattr(reference, name).copy_(round_trip(w))
            # the format's rounding: within half a quantization step of each block's (row's) absmax
            assert (round_trip(w) - w).abs().max() <= step * w.abs().max() + 1e-3
    for name in list(originals):
        experts.quantize(module, name, how)
    assert all(not p.is_floating_point() for p in module.parameters())
    with torch.no_grad():
        got, want = module(x, index, weights), reference(x, index, weights)
        plain = mixtral_experts()(x, index, weights)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)  # the same weights: float rounding only
    assert not torch.allclose(got, plain, rtol=1e-4, atol=1e-7)  # it runs on the quantized weights, not the originals


def test_validate_says_what_unquantized_experts_cost(tmp_path, tiny_mixtral, capsys):
    """One line, in validate (for a named GPU and on the CPU): how many expert parameters stay unquantized and their
    GB in the training dtype, or with quantize_moe_experts the format they are stored in."""
    plain = moe_config(tmp_path, tiny_mixtral)
    for gpu in ("a100-80gb", "cpu"):
        assert main(["validate", str(plain), "--gpu", gpu]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("experts:")]
        assert len(lines) == 1 and "0.20M parameters in 3-D expert tensors stay unquantized" in lines[0], lines
        assert ": 0.4 MB in bf16; quantize_moe_experts: true stores them in NF4 as they load (0.1 MB)" in lines[0]
    quantized = moe_config(tmp_path, tiny_mixtral, quantize_moe_experts=True)
    assert main(["validate", str(quantized), "--gpu", "a100-80gb"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("experts:"))
    assert "the 0.20M expert parameters (3-D tensors) quantized to NF4 as they load: 0.1 MB instead of 0.4 MB" in line


def test_quantize_moe_experts_needs_quantized_loading(tmp_path, tiny_mixtral, capsys):
    config = moe_config(tmp_path, tiny_mixtral, adapter="lora", load_in_4bit=None, quantize_moe_experts=True)
    assert main(["validate", str(config), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantize_moe_experts needs adapter: lora or qlora with load_in_4bit or load_in_8bit" \
        in err[0]


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("keys", [{}, {"adapter": "lora", "load_in_4bit": None, "load_in_8bit": True}],
                         ids=["nf4", "int8"])
def test_expert_lora_on_quantized_experts_is_peft_on_the_dequantized_experts(tmp_path, tiny_mixtral, keys):
    """Oracle: the model the trainer builds (experts quantized as they load, LoRA on them through
    lora_target_parameters) against the same model with its experts turned back into plain tensors of their
    dequantized values, where peft runs its own unpatched path. Equal logits, equal gradients for every adapter tensor
    (peft 0.22 alone: the inner of two nested wrappers gets none), a second forward equal to the first (peft 0.22
    alone: the delta stays on the tensor and is added again), and the adapter keys of plain peft on the unquantized
    model (so the adapter loads onto the unquantized base: merge-lora, evaluate, vLLM)."""
    import copy

    import torch.nn.utils.parametrize as P
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = moe_config(tmp_path, tiny_mixtral, quantize_moe_experts=True, lora_dropout=0.0,
                        lora_target_parameters=EXPERT_TARGETS, **keys)
    model = loaded(config)
    ours = {k: v for k, v in model.state_dict().items() if ".experts." in k and "lora_" in k}
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_mixtral), LoraConfig(
        r=8, target_modules=[], target_parameters=EXPERT_TARGETS))
    assert len(ours) == 8 and set(ours) == {k for k in plain.state_dict() if ".experts." in k and "lora_" in k}
    with torch.no_grad():  # lora_B starts at zero: give the adapter something to say
        for k, v in ours.items():
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(len(k))) * 0.1)
    reference = loaded(config)  # built again (a deep copy would share parametrize's per-module classes)
    reference.load_state_dict(copy.deepcopy(ours), strict=False)
    unquantized = 0
    for module in [m for m in reference.modules() if P.is_parametrized(m)]:
        for name in list(module.parametrizations):
            value = getattr(module, name).detach().clone()
            P.remove_parametrizations(module, name, leave_parametrized=False)
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))  # a plain tensor of its value
            unquantized += 1
    assert unquantized == 4 and not any(".experts." in n and not p.is_floating_point()
                                        for n, p in reference.named_parameters())
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
        with reference.disable_adapter():
            without = reference(input_ids=ids).logits
    assert torch.equal(first, second)
    assert (want - without).abs().max() > 1e-3  # the adapter changes the output, so the comparison can fail
    assert torch.allclose(first, want, rtol=1e-4, atol=1e-5)
    model(input_ids=ids).logits.pow(2).mean().backward()
    reference(input_ids=ids).logits.pow(2).mean().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if ".experts." in name and "lora_" in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
            assert torch.allclose(param.grad, grads[name].grad, rtol=1e-3, atol=1e-6), name


@pytest.mark.parametrize("keys,line", [
    ({"lora_dropout": 0.05}, "lora_dropout: 0.05 with lora_target_parameters: dropout cannot apply"),
    ({"lora_dropout": 0.0, "lora_target_linear": True}, "lora_target_linear with quantize_moe_experts: the experts")])
def test_expert_lora_rules_are_axolotls_in_one_line(tmp_path, tiny_mixtral, capsys, keys, line):
    config = moe_config(tmp_path, tiny_mixtral, quantize_moe_experts=True, lora_target_parameters=EXPERT_TARGETS,
                        **keys)
    assert main(["validate", str(config), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err


def test_quantize_moe_experts_under_deepspeed_is_refused_before_anything_runs(tmp_path, tiny_mixtral, capsys):
    """DeepSpeed would partition the quantized storage apart from its quantization state (Axolotl has not tested it
    either); FSDP2 keeps the quantized experts whole (tests/trainer/parallel/test_moe_fsdp.py)."""
    config = moe_config(tmp_path, tiny_mixtral, quantize_moe_experts=True, deepspeed="deepspeed_configs/zero2.json")
    assert main(["validate", str(config), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantize_moe_experts with deepspeed is not supported" in err[0], err


@pytest.mark.slow  # three model loads and two validations (~10 s)
def test_experts_implementation_is_set_on_the_model_and_each_computes_the_same(tmp_path, tiny_mixtral, capsys):
    """Axolotl's experts_implementation: transformers' eager, batched_mm and grouped_mm set on the model the trainer
    builds (the eager loop is the oracle: the same logits to float rounding); an unknown value is one line."""
    logits = {}
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    for impl in ("eager", "batched_mm", "grouped_mm"):
        model = loaded(moe_config(tmp_path, tiny_mixtral, adapter=None, load_in_4bit=None, bf16=None,
                                  experts_implementation=impl))
        assert model.config._experts_implementation == impl
        with torch.no_grad():
            logits[impl] = model(input_ids=ids).logits
    for impl in ("batched_mm", "grouped_mm"):
        assert torch.allclose(logits[impl], logits["eager"], rtol=1e-5, atol=1e-6), impl
    capsys.readouterr()  # (the loads' progress bars)
    assert main(["validate", str(moe_config(tmp_path, tiny_mixtral, experts_implementation="fastest"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "experts_implementation: 'fastest' is not one of eager, batched_mm" in err[0], err


@pytest.mark.parametrize("keys, gpu, said", [
    ({"use_sonicmoe": True}, "h100", "use_sonicmoe: true: SonicMoE's CuTe DSL kernels (kernels-community/sonic-moe, "
                                     "through transformers' sonicmoe experts forward) on NVIDIA H100"),
    ({"expert_backend": "sonicmoe"}, "a100", "expert_backend: sonicmoe: SonicMoE not used: it needs compute "
                                             "capability 9.0 or newer"),
    ({"experts_implementation": "scattermoe"}, "h100", "experts_implementation: scattermoe: Axolotl's own triton "
                                                       "kernels (its kernels plugin, libs/scattermoe_lora), which no "
                                                       "package publishes"),
    ({"experts_implementation": "deepgemm"}, "b200", "experts_implementation: deepgemm: DeepGEMM's kernels, which "
                                                     "JIT-compile with a system CUDA toolkit's nvcc"),
], ids=["sonicmoe-h100", "sonicmoe-a100", "scattermoe", "deepgemm"])
def test_validate_says_which_experts_kernel_runs_on_the_gpu(tmp_path, tiny_mixtral, capsys, keys, gpu, said):
    assert main(["validate", str(moe_config(tmp_path, tiny_mixtral, **keys)), "--gpu", gpu]) == 0
    out = capsys.readouterr().out
    assert said in out, out
    if gpu != "h100" or "scattermoe" in str(keys):
        assert "the experts run transformers' grouped_mm (the same matmuls; slower)" in out


@pytest.mark.parametrize("keys, line", [
    ({"use_sonicmoe": True, "use_scattermoe": True}, "use_scattermoe and use_sonicmoe are both true"),
    ({"use_sonicmoe": True, "expert_backend": "scattermoe"}, "expert_backend: scattermoe conflicts with use_sonicmoe"),
    ({"expert_backend": "fastest"}, "expert_backend"),
])
def test_expert_backend_rules_are_axolotls_in_one_line(tmp_path, tiny_mixtral, capsys, keys, line):
    assert main(["validate", str(moe_config(tmp_path, tiny_mixtral, **keys))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err


def test_sonicmoe_that_cannot_load_is_one_note_and_grouped_mm_before_training(tmp_path, tiny_mixtral):
    """On a GPU whose floor admits SonicMoE, the trainer loads the kernel at model load (transformers' own
    load_sonicmoe_kernel): where it cannot load (here: no `kernels` package, no CUDA; on a GPU: no Hub build for
    this torch/CUDA) the run says so in one line and the experts run grouped_mm, the same logits as eager."""
    from trainer.model import expert_kernels

    config = moe_config(tmp_path, tiny_mixtral, adapter=None, load_in_4bit=None, bf16=None, use_sonicmoe=True)
    cfg, _ = load_config(config)
    model = loaded(config)
    said = []
    choice = expert_kernels.apply(cfg, model, gpu_from_name("h100"), said.append)
    assert choice.runs == "grouped_mm" and model.config._experts_implementation == "grouped_mm"
    assert len(said) == 1 and said[0].startswith("note: use_sonicmoe: true: SonicMoE not used: it cannot run here: "
                                                 "sonic-moe requires the `kernels` package"), said
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = model(input_ids=ids).logits
        model.set_experts_implementation("eager")
        assert torch.allclose(model(input_ids=ids).logits, grouped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-head", "full-logits"])
def test_router_aux_loss_is_added_as_transformers_adds_it(tiny_mixtral, chunked, monkeypatch):
    """Axolotl's Mixtral examples set model_config: output_router_logits: true: the model's own loss is then its mean
    cross-entropy plus router_aux_loss_coef x the load-balancing loss. The trainer's token loss sum over one
    micro-batch, divided by its target tokens, is that loss (the oracle: transformers' own forward with labels), and
    without output_router_logits it is the cross-entropy alone."""
    from transformers import AutoModelForCausalLM

    from trainer.objectives import chunked_loss
    from trainer.objectives.loss import token_loss_sum

    if not chunked:
        monkeypatch.setattr(chunked_loss, "decide", lambda model, inputs: None)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    targets = (labels[:, 1:] != -100).sum()
    for router in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32, output_router_logits=router,
                                                     router_aux_loss_coef=0.5).eval()
        with torch.no_grad():
            want = model(**batch)
            got = token_loss_sum(model, batch) / targets
        assert (want.aux_loss is not None) == router
        assert got.item() == pytest.approx(want.loss.item(), rel=1e-5)
        if router:
            assert want.aux_loss.item() * 0.5 > 1e-3  # the term is there to be missed
