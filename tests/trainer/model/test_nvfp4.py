"""NVFP4 QAT without FP4 tensor cores (trainer/model/nvfp4.py): torchao's NVFP4FakeQuantizedLinear with its FP4 GEMM
emulated in float32.

The oracle for "matches the FP4 GEMM" is the exact value of that GEMM: torchao's quantized representation
(packed FP4 codes, e4m3 block scales, float32 per-tensor scales) decoded here from the OCP spec and summed in
float64. The emulated float32 forward must be within float32 rounding of it; the bf16 emulation pytorch/ao issue
#3102 found wanting is not. The operands the layer trains with are torchao's to_nvfp4(...).dequantize() bit for
bit. A tiny llama trains with Axolotl's 3b-qat-nvfp4 qat block on CPU and resumes exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.oracle import require_extra

require_extra("torchao", "qat")  # before the imports that need it: skipped here without it, fails under CI

from tests.trainer.helpers import example_full_then_resumed, run_cli, train_losses, train_then_resume
from trainer.cli import main
from trainer.model import nvfp4, qat

NVFP4 = {"activation_dtype": "nvfp4", "weight_dtype": "nvfp4", "group_size": 16}  # examples/llama-3/3b-qat-nvfp4
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # OCP MX spec, FP4 E2M1


def nvfp4_layer(in_features=128, out_features=64, bias=True, seed=0) -> nvfp4.EmulatedNVFP4FakeQuantizedLinear:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias))
    with torch.no_grad():
        model[0].weight.mul_(torch.linspace(0.1, 3.0, in_features))  # uneven blocks: block scales differ
        if bias:
            model[0].bias.normal_()
    assert qat.prepare(model, qat.QatConfig(**NVFP4)) == 1
    return model[0]


def torchao_nvfp4(t: torch.Tensor):
    """torchao's NVFP4 quantization (to_nvfp4 with the per-tensor scale from the amax; plain block scales)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(t.abs().max()))


def decode64(q) -> torch.Tensor:
    """An NVFP4Tensor's value in float64, decoded from its bytes: two FP4 codes a byte (low nibble first; sign
    bit 3, magnitude E2M1), times the e4m3 scale of each block of 16, times the per-tensor scale."""
    packed = q.qdata.view(torch.uint8).to(torch.int64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    values = E2M1[codes & 0x7] * torch.where(codes & 0x8 != 0, -1.0, 1.0).to(torch.float64)
    blocks = q.scale.view(torch.float8_e4m3fn).to(torch.float64)
    values = (values.view(*blocks.shape, 16) * blocks.unsqueeze(-1)).flatten(-2)
    return values * q.per_tensor_scale.to(torch.float64)


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    reference = reference.double()
    return 10 * math.log10(reference.pow(2).sum() / (reference - value.double()).pow(2).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulated_forward_is_the_fp4_gemm_to_float32_rounding(seed):
    layer = nvfp4_layer(seed=seed)
    torch.manual_seed(100 + seed)
    x = torch.randn(3, 40, 128) * torch.logspace(-2, 1, 128)  # a 3-D batch, blocks of very different ranges
    x[0, :5] = 0  # padded positions: all-zero blocks
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (3, 40, 64)
    qa, qw = torchao_nvfp4(x.reshape(-1, 128)), torchao_nvfp4(layer.weight.detach())
    for q in (qa, qw):  # the operands the emulated GEMM multiplies lose nothing in bf16, so nothing in TF32 either
        operand = nvfp4.block_scaled(q)
        assert torch.equal(operand, decode64(q).div(q.per_tensor_scale.double()).float())
        assert torch.equal(operand.bfloat16().float(), operand)
    a, w = decode64(qa), decode64(qw)
    exact = (a @ w.T + layer.bias.detach().double()).view(3, 40, 64)
    # float32 rounding: at most K+3 roundings of size 2^-24 of the sum of the products' magnitudes (and the bias)
    bound = (128 + 3) * 2.0 ** -24 * ((a.abs() @ w.abs().T).view(3, 40, 64) + layer.bias.detach().double().abs())
    assert ((out.double() - exact).abs() <= bound).all()
    fp32 = sqnr(exact, out)
    # issue #3102's emulation: dequantize both to bf16, F.linear in bf16
    with torch.no_grad():
        bf16 = torch.nn.functional.linear(torchao_nvfp4(x.reshape(-1, 128)).dequantize(torch.bfloat16),
                                          torchao_nvfp4(layer.weight.detach()).dequantize(torch.bfloat16),
                                          layer.bias.detach().bfloat16()).view(3, 40, 64)
    assert not ((bf16.double() - exact).abs() <= bound).all()
    print(f"SQNR vs the exact FP4 GEMM: emulated fp32 {fp32:.1f} dB, bf16 dequantize + F.linear "
          f"{sqnr(exact, bf16):.1f} dB")
    assert fp32 > 120 and sqnr(exact, bf16) < 60


def test_under_autocast_the_gemm_stays_float32():
    """The trainer runs the layer outside autocast (qat._master_precision_forward); the GEMM itself also keeps
    float32 if called inside a bf16 autocast region."""
    layer = nvfp4_layer(seed=8)
    x = torch.randn(32, 128)
    with torch.no_grad():
        plain = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, w = nvfp4.quantize(x, layer.activation_config), nvfp4.quantize(layer.weight, layer.weight_config)
            inside = nvfp4.emulated_addmm(a, w, layer.bias)
    assert inside.dtype == torch.float32 and torch.equal(inside, plain)


def test_bf16_inputs_follow_torchaos_dispatch_rounding():
    """A bf16 layer: torchao's dispatch rounds the fp32-accumulated GEMM to bf16, then multiplies by the
    per-tensor scales cast to bf16 and adds the bias in bf16; the emulation takes the same steps."""
    layer = nvfp4_layer(seed=3).to(torch.bfloat16)
    torch.manual_seed(7)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
    qa, qw = torchao_nvfp4(x), torchao_nvfp4(layer.weight.detach())
    a, w = decode64(qa) / qa.per_tensor_scale.double(), decode64(qw) / qw.per_tensor_scale.double()
    steps = (a @ w.T).to(torch.bfloat16) * (qa.per_tensor_scale * qw.per_tensor_scale).to(torch.bfloat16)
    steps = steps + layer.bias.detach()
    assert out.dtype == torch.bfloat16
    same = out == steps  # the fp32 sums may differ in their last bits, which bf16 rounding nearly always hides
    assert same.float().mean() > 0.99
    ulp = torch.finfo(torch.bfloat16).eps * steps.float().abs().clamp_min(2.0 ** -126)
    assert ((out.float() - steps.float()).abs() <= 2 * ulp).all()


def test_operands_are_torchaos_dequantized_nvfp4_bit_for_bit_and_the_bias_trains():
    """The backward pass multiplies by the dequantized operands (torchao's straight-through): with the identity as
    the output's gradient, the input's gradient is the dequantized weight and the weight's the dequantized input."""
    layer = nvfp4_layer(in_features=64, out_features=48, seed=4)
    torch.manual_seed(5)
    x = (torch.randn(48, 64) * 3).requires_grad_()
    layer(x).backward(torch.eye(48))
    assert torch.equal(x.grad, torchao_nvfp4(layer.weight.detach()).dequantize(torch.float32))
    assert torch.equal(layer.weight.grad, torchao_nvfp4(x.detach()).dequantize(torch.float32))
    assert torch.equal(layer.bias.grad, torch.ones(48))  # the sum of the output's gradient over the rows
    # and those operands are not the unquantized ones: fake quantization is on
    assert not torch.equal(x.grad, layer.weight.detach())


def test_the_same_steps_as_torchaos_forward_with_its_gemm_swapped(monkeypatch):
    """Where FP4 tensor cores exist the layer runs torchao's own forward; with torchao's FP4 GEMM swapped for the
    emulated one (no FP4 tensor cores here) that forward gives the emulated path's output bit for bit."""
    import torchao.prototype.qat.nvfp4 as torchao_qat

    layer = nvfp4_layer(seed=6)
    x = torch.randn(2, 16, 128)
    with torch.no_grad():
        emulated = layer(x)
    calls = []

    def gemm(a, b_t, aten_op, bias):
        calls.append((a.per_tensor_scale, b_t.is_swizzled_scales))
        return nvfp4.emulated_addmm(a, b_t.t(), bias)

    monkeypatch.setattr(torchao_qat, "_addmm_nvfp4_dispatch", gemm)
    monkeypatch.setattr(nvfp4, "runs_natively", lambda device: True)
    with torch.no_grad():
        native = layer(x)
    assert len(calls) == 1 and calls[0][0] is not None and calls[0][1]  # per-tensor scales, swizzled weight scales
    assert torch.equal(native, emulated)


def test_the_native_floor_comes_from_the_matrix(monkeypatch):
    from trainer import facts

    floor = facts.feature("torchao_nvfp4_gemm")
    assert floor["min_cc"] == "10.0" and not floor["cpu"] and floor["source"]
    assert facts.feature("torchao_qat_nvfp4")["cpu"]
    assert not nvfp4.runs_natively(torch.device("cpu"))
    for capability, native in (((9, 0), False), ((8, 0), False), ((10, 0), True), ((12, 0), True)):
        monkeypatch.setattr(nvfp4, "_cuda_capability", lambda index, cc=capability: cc)
        assert nvfp4.runs_natively(torch.device("cuda", 0)) is native, capability


@pytest.mark.slow
def test_validate_says_emulated_below_blackwell_and_native_on_it(make_config):
    cfg = make_config("nvfp4.yml", qat=NVFP4, bf16=True)
    for gpu in ("a100", "h100", "cpu"):
        result = run_cli("validate", str(cfg), "--gpu", gpu)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "qat (activations nvfp4, weights nvfp4): emulated on" in result.stdout
        assert "FP4 tensor cores need sm_100+" in result.stdout and "slower" in result.stdout
    b200 = run_cli("validate", str(cfg), "--gpu", "b200")
    assert b200.returncode == 0 and "with the real FP4 GEMM" in b200.stdout and "emulated on" not in b200.stdout


@pytest.fixture
def captured(monkeypatch):
    seen, real = [], qat.prepare

    def prepare(model, config):
        count = real(model, config)
        seen.append(dict(model.named_modules()))
        return count

    monkeypatch.setattr(qat, "prepare", prepare)
    return seen


@pytest.mark.slow
def test_axolotls_3b_qat_nvfp4_block_trains_emulated_on_cpu(make_config, tmp_path, captured):
    """Axolotl's examples/llama-3/3b-qat-nvfp4.yaml: qat nvfp4/nvfp4, group_size 16, bf16, gradient
    checkpointing. Every linear layer is the emulated NVFP4 one, the loss falls, and the first step's loss
    differs from the unquantized model's by the quantization error (small, not zero)."""
    plain, fq = tmp_path / "plain", tmp_path / "nvfp4"
    common = dict(bf16=True, gradient_checkpointing=True, max_steps=6, learning_rate=3e-3)
    assert main(["train", str(make_config("plain.yml", output_dir=str(plain), **common))]) == 0
    assert main(["train", str(make_config("nvfp4.yml", output_dir=str(fq), qat=NVFP4, **common))]) == 0
    modules = captured[0]
    layers = {n: m for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    assert len(layers) == 2 * 7 + 1
    assert all(type(m) is nvfp4.EmulatedNVFP4FakeQuantizedLinear for m in layers.values())
    a, b = train_losses(plain), train_losses(fq)
    print("losses without qat", a, "with nvfp4 qat", b)
    assert all(math.isfinite(v) for v in b.values())
    assert b[6] < b[1]
    assert b[1] != pytest.approx(a[1], rel=1e-5) and b[1] == pytest.approx(a[1], rel=0.05)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(fq / "final")  # converted back: a plain HF model
    assert all(type(m) is torch.nn.Linear for n, m in final.named_modules() if isinstance(m, torch.nn.Linear))


def test_nvfp4_qat_checkpoint_resumes_exactly(make_config, tmp_path):
    train_then_resume(main, make_config, tmp_path, checkpoint=2, save_steps=2, qat=NVFP4)


def test_qwen2_linear_biases_train_under_emulated_nvfp4(make_config, tmp_path, tiny_qwen2):
    """Qwen2.5's q/k/v projections have biases (Axolotl's Qwen2.5-72B_qat example): they train."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert main(["train", str(make_config(base_model=str(tiny_qwen2), output_dir=str(out), max_steps=2,
                                          qat=NVFP4))]) == 0
    before, after = load_file(tiny_qwen2 / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    biases = [k for k in before if k.endswith("q_proj.bias")]
    assert biases and all(not torch.equal(before[k], after[k]) for k in biases)


# ------------------------------------------------------------------ Axolotl's example, as Axolotl wrote it
EXAMPLE = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "qat_nvfp4__Qwen2.5-72B_qat.yml"


@pytest.mark.distributed
@pytest.mark.slow
def test_axolotls_qwen25_nvfp4_qat_example_trains_on_2_processes_and_resumes(tmp_path, tiny_qwen2):
    """examples/qat_nvfp4/Qwen2.5-72B_qat.yml (nvfp4 QAT, FSDP2 with activation checkpointing, sample packing,
    bf16, liger) with only the model (a tiny Qwen2: q/k/v biases) and data swapped, on 2 CPU processes; its
    checkpoint resumes exactly."""
    from safetensors.torch import load_file

    runs, stderr = example_full_then_resumed(yaml.safe_load(EXAMPLE.read_text()), tiny_qwen2, tmp_path, rows=60)
    for text in stderr.values():
        assert "qat: 15 layers fake-quantized" in text and "sharding: FSDP" in text
        assert "emulated on the CPU" in text
    assert sorted(runs["resumed"]) == [3, 4]
    assert [runs["resumed"][s] for s in (3, 4)] == pytest.approx([runs["full"][s] for s in (3, 4)], rel=1e-6)
    before = load_file(tiny_qwen2 / "model.safetensors")
    after = load_file(tmp_path / "full" / "final" / "model.safetensors")
    assert all(not torch.equal(before[k], after[k]) for k in before if k.endswith(("q_proj.bias", "q_proj.weight")))
