"""Packing through torch's own varlen attention (torch.nn.attention.varlen.varlen_attn), the plan's `packing`, and
cuDNN SDPA kept off masked calls (issue 19, the trainer's side).

The real kernel runs only on a CUDA GPU (torch 2.13's CPU build has no CPU kernel: checked below), so the wiring is
tested on CPU with a stand-in of the same signature that computes flash-attention's semantics one sequence at a time
(tests/trainer/varlen_standin.py), put where the trainer looks the kernel up. The oracle is transformers' own sdpa
path on each sequence alone: packed == unpacked, logits, per-sequence losses and gradients, through the real
transformers model code (llama with GQA; qwen2 and gemma3 with sliding-window layers, gemma3 with its own softmax
scale). The arguments the trainer passes are also checked against the real op's schema on meta tensors."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

from tests.trainer import varlen_standin
from tests.trainer.helpers import run_cli, train_losses
from tests.trainer.batch.test_attention import examples
from tests.trainer.runtime.test_hardware import plan_for
from trainer.batch.collate import Collator
from trainer.cli import main
from trainer.config import parse_config
from trainer.model import attention_varlen
from trainer.model.attention import for_model
from trainer.runtime.hardware import gpu_from_plan
from trainer.setup import fit

NAME = attention_varlen.NAME
CONFIG = {"base_model": "tiny", "datasets": [{"path": "d.jsonl", "type": "completion"}]}


class Flags:  # what install() reads from a Runtime
    def __init__(self, mask_without_cudnn=False):
        self.mask_without_cudnn = mask_without_cudnn


@pytest.fixture
def standin(monkeypatch):
    """The stand-in where trainer/model/attention_varlen.py looks the kernel up; install() done."""
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", varlen_standin.varlen_attn)
    varlen_standin.CALLS.clear()
    attention_varlen.install(Flags())
    yield varlen_standin
    attention_varlen.install(Flags())


def tiny(tmp_path_factory, config) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp(config.model_type)
    model.save_pretrained(path)
    return str(path)


SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """llama: GQA, causal; qwen2: a full and a sliding layer (window 4); gemma3: sliding and full layers and a
    softmax scale of query_pre_attn_scalar ** -0.5, not 1/sqrt(head_dim)."""
    return {
        "llama": tiny(tmp_path_factory, LlamaConfig(**SIZES)),
        "qwen2_sliding": tiny(tmp_path_factory, Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4,
                                                            max_window_layers=1)),
        "gemma3_sliding_scaled": tiny(tmp_path_factory, Gemma3TextConfig(
            **SIZES, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"])),
    }


def load(path, attention):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)


def per_sequence(model, rows, batch):
    """(logits of each sequence, its summed loss) from one forward of the packed batch."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    out, start = [], 0
    flat = logits.reshape(-1, logits.shape[-1])
    for row in rows:
        for example in row:
            n = len(example["input_ids"])
            seq = flat[start:start + n]
            out.append((seq, torch.nn.functional.cross_entropy(seq[:-1], torch.tensor(example["labels"][1:]),
                                                               reduction="sum")))
            start += n
    return out


def alone(model, rows):
    out = []
    for row in rows:
        for example in row:
            seq = model(torch.tensor([example["input_ids"]])).logits[0]
            out.append((seq, torch.nn.functional.cross_entropy(seq[:-1], torch.tensor(example["labels"][1:]),
                                                               reduction="sum")))
    return out


# ---------------------------------------------------------------------------- the kernel


def test_the_stand_in_takes_exactly_what_the_installed_torchs_varlen_attn_takes():
    from torch.nn.attention.varlen import varlen_attn

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(varlen_standin.varlen_attn) == shape(varlen_attn)


def test_torchs_varlen_attn_has_no_cpu_kernel_in_this_torch():
    """If a torch release runs it on CPU, this fails: then test against the real kernel directly."""
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(10, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward.*CPU"):
        varlen_attn(q, q, q, cu, cu, 6, 6, window_size=(-1, 0))


@pytest.mark.parametrize("window", [None, 4])
def test_the_trainers_calls_fit_the_real_ops_schema(window):
    """The real varlen_attn and its custom op (forward and backward) on meta tensors: GQA heads, a window, a scale."""
    q = torch.empty(33, 4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(33, 2, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.empty(5, device="meta", dtype=torch.int32)
    out = attention_varlen.call_kernel(q, kv, kv, attention_varlen.Seqlens(cu, cu, 12, 12), causal=True, window=window,
                                       scale=0.3)
    assert out.shape == (33, 4, 16) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape


# ---------------------------------------------------------------------------- packed == unpacked


@pytest.mark.parametrize("family", ["llama", "qwen2_sliding", "gemma3_sliding_scaled"])
def test_packed_through_varlen_equals_each_sequence_alone(family, families, standin):
    packed_model, reference = load(families[family], NAME), load(families[family], "sdpa")
    rows = examples(300)  # sequences of 7, 12, 5 and 9 tokens: longer than the window of 4
    batch = Collator(pad_token_id=0, attention=NAME)(rows)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, 33)  # one row, position_ids only
    packed, single = per_sequence(packed_model, rows, batch), alone(reference, rows)
    for (p_logits, p_loss), (s_logits, s_loss) in zip(packed, single):
        assert (p_logits - s_logits).abs().max().item() < 1e-4
        assert p_loss.item() == pytest.approx(s_loss.item(), rel=1e-5)
    sum(loss for _, loss in packed).backward()
    sum(loss for _, loss in single).backward()
    for (name, p), q in zip(packed_model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-4 * q.grad.abs().max(), name  # fp32 sums in another order
    calls = standin.CALLS
    assert calls and all(c["sequences"] == 4 and c["max_q"] == 12 and c["enable_gqa"] for c in calls)
    windows = {c["window_size"] for c in calls}
    assert windows == ({(-1, 0)} if family == "llama" else {(-1, 0), (3, 0)})  # flash-attn's inclusive bounds
    scale = {c["scale"] for c in calls}
    assert scale == {24 ** -0.5 if family.startswith("gemma3") else 16 ** -0.5}


def test_packed_through_flash_attention_3_equals_each_sequence_alone(families, monkeypatch):
    """H100 plans train with flash_attention_3 (the flash_attn_3 wheel): transformers' own flash_attention_3 path,
    fed the collator's one flattened row, calls flash_attn_interface.flash_attn_varlen_func (here a stand-in of its
    signature, tests/trainer/varlen_standin.py) with cu_seqlens from position_ids: the same logits and losses as
    sdpa on each sequence alone. transformers refuses to load flash_attention_3 without the wheel and CUDA, so the
    model is loaded with sdpa and switched to it, the way transformers sets it after its check."""
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn_interface", varlen_standin.fa3_module())
    rows = examples(300)
    batch = Collator(pad_token_id=0, attention="flash_attention_3")(rows)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, 33)
    for family in ("llama", "gemma3_sliding_scaled"):
        varlen_standin.CALLS.clear()
        model = load(families[family], "sdpa")
        model.config._attn_implementation = "flash_attention_3"
        packed, single = per_sequence(model, rows, batch), alone(load(families[family], "sdpa"), rows)
        for (p_logits, p_loss), (s_logits, s_loss) in zip(packed, single):
            assert (p_logits - s_logits).abs().max().item() < 1e-4, family
            assert p_loss.item() == pytest.approx(s_loss.item(), rel=1e-5)
        calls = varlen_standin.CALLS
        assert calls and all(c["form"] == "fa3_varlen" and c["sequences"] == 4 and c["causal"] for c in calls)
        if family.startswith("gemma3"):
            assert {c["window_size"] for c in calls} == {(-1, -1), (3, 3)}  # transformers passes (w-1, w-1) + causal
            assert {c["scale"] for c in calls} == {24 ** -0.5}


def test_torch_2_10s_form_of_the_kernel(families, standin, monkeypatch, tmp_path):
    """torch 2.10: is_causal, no scale/window/GQA keywords: the heads are repeated, the query scaled; a sliding
    window cannot be expressed, so such a model stays on sdpa's mask."""
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", varlen_standin.varlen_attn_2_10)
    rows = examples(300)
    batch = Collator(pad_token_id=0, attention=NAME)(rows)
    for family in ("llama", "gemma3_sliding_scaled"):
        if family == "gemma3_sliding_scaled":
            with pytest.raises(ValueError, match="no window_size"):
                per_sequence(load(families[family], NAME), rows, batch)
            continue
        packed, single = per_sequence(load(families[family], NAME), rows, batch), alone(load(families[family], "sdpa"), rows)
        assert all((p - s).abs().max().item() < 1e-4 for (p, _), (s, _) in zip(packed, single))
    assert {c["form"] for c in standin.CALLS} == {"2.10"} and all(c["is_causal"] for c in standin.CALLS)
    cfg, _ = parse_config({**CONFIG, "base_model": families["qwen2_sliding"]})
    runtime = fit(cfg, gpu_from_plan(plan_for("A100", "8.0", "sdpa", "bf16") | {"packing": "varlen"}, "plan"),
                  plan_for("A100", "8.0", "sdpa", "bf16") | {"packing": "varlen"}, model_class=False)
    assert runtime.attention == NAME
    notes = for_model(cfg, runtime, local_only=True)
    assert runtime.attention == "sdpa" and runtime.packing == "mask"
    assert "has a sliding window and this torch's varlen_attn has no window_size" in notes[0]


def test_padding_and_generation_go_through_varlen_too(families, standin):
    """A padded batch (a 2-D mask: unpadded to the real tokens) and greedy generation with a KV cache (one query
    against the cached keys: aligned bottom-right) give sdpa's logits and tokens."""
    model, reference = load(families["qwen2_sliding"], NAME).eval(), load(families["qwen2_sliding"], "sdpa").eval()
    ids = torch.tensor([[0, 0, 0, 11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27, 28, 29]])
    mask = (ids != 0).long()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
        assert (got - want)[mask.bool()].abs().max().item() < 1e-4
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert model.generate(ids, **kwargs).tolist() == reference.generate(ids, **kwargs).tolist()
    assert any(c["max_q"] == 1 for c in standin.CALLS)  # the decoding steps ran through it


def test_models_varlen_cannot_run_stay_on_sdpas_mask(tmp_path_factory):
    """Gemma 2 soft-caps its attention logits: no varlen kernel takes that (nor sdpa: transformers runs it eager)."""
    path = tiny(tmp_path_factory, Gemma2Config(**SIZES, head_dim=16))
    plan = plan_for("A100", "8.0", "sdpa", "bf16") | {"packing": "varlen"}
    cfg, _ = parse_config({**CONFIG, "base_model": path})
    runtime = fit(cfg, gpu_from_plan(plan, "plan"), plan)
    assert runtime.attention == "eager" and runtime.packing == "mask"
    assert any("soft-caps its attention logits, which varlen_attn cannot" in c for c in runtime.changes)
    assert "soft-caps" in runtime.isolation


# ---------------------------------------------------------------------------- the plan's packing


def resolver_plan(gpu: str, **request) -> dict:
    from resolver import hardware as resolver_hardware
    from resolver import matrix as matrix_module
    from resolver.solve import Request, solve

    m = matrix_module.load()
    return solve(Request(gpu=resolver_hardware.lookup(gpu, m), driver=request.pop("driver", None), python="3.11",
                         target=gpu, **request), m).to_dict()


@pytest.mark.parametrize("gpu", ["a100", "h100", "b200", "rtx5090", "t4", "cpu"])
def test_the_trainer_packs_as_the_plan_says(gpu):
    plan = resolver_plan(gpu, driver="610.43.02")
    cfg, _ = parse_config(CONFIG)
    runtime = fit(cfg, gpu_from_plan(plan, "plan"), plan, model_class=False)
    assert runtime.packing == plan["packing"], (plan["attention"], runtime.attention, runtime.isolation)
    assert runtime.isolation.startswith(plan["packing"] + ":")
    expected = {"a100": NAME, "b200": NAME, "rtx5090": NAME, "h100": "flash_attention_3"}.get(gpu, "sdpa")
    assert runtime.attention == expected
    if expected == NAME:
        assert "attention: sdpa -> varlen_attn" in " ".join(runtime.changes)
        assert "the plan's packing: varlen" in " ".join(runtime.changes)
    assert runtime.mask_without_cudnn == (gpu in ("b200", "h100"))  # torch 2.15 CUDA 13: cuDNN first on sm90/sm100
    assert not [c for c in runtime.changes if c.startswith("cuDNN SDPA off")]  # no SDPA call with a mask is made


def test_a_b200_run_on_sdpas_mask_keeps_cudnn_off_masked_calls_and_says_why():
    """--attention sdpa with packing: mask (the plan's choice where a model cannot take varlen): cuDNN off, said once."""
    plan = resolver_plan("b200", driver="610.43.02") | {"packing": "mask"}
    cfg, _ = parse_config(CONFIG)
    runtime = fit(cfg, gpu_from_plan(plan, "plan"), plan, model_class=False)
    assert runtime.attention == "sdpa" and runtime.mask_without_cudnn
    assert runtime.isolation == "mask: a boolean 4-D block-diagonal mask (the plan's packing: mask)"
    notes = [c for c in runtime.changes if c.startswith("cuDNN SDPA off")]
    assert len(notes) == 1 and "NVIDIA B200" in notes[0] and "trl#7181" in notes[0]


def test_without_a_plan_the_same_rule_reads_torch_and_the_gpu():
    from trainer.runtime.hardware import gpu_from_name

    cfg, _ = parse_config({**CONFIG, "attn_implementation": "sdpa"})
    for gpu, attention in (("a100", NAME), ("t4", "sdpa"), ("cpu", "sdpa")):
        runtime = fit(cfg, gpu_from_name(gpu), None, model_class=False)  # torch 2.13 installed here
        assert runtime.attention == attention, gpu
    runtime = fit(cfg, gpu_from_name("t4"), None, model_class=False)
    assert "varlen_attn needs sm_80+" in runtime.isolation
    assert "varlen_attn runs on NVIDIA GPUs (sm_80+), not on the CPU" in fit(cfg, gpu_from_name("cpu"), None,
                                                                            model_class=False).isolation
    diffusion, _ = parse_config({**CONFIG, "attn_implementation": "sdpa",
                                 "plugins": ["axolotl.integrations.diffusion.DiffusionPlugin"]})
    assert fit(diffusion, gpu_from_name("a100"), None, model_class=False).attention == "sdpa"


@pytest.mark.slow
def test_validate_says_how_packed_rows_are_kept_apart_as_the_plan_does(make_config, tmp_path):
    config = make_config(attn_implementation=None, sample_packing=True)
    for gpu, words in (("a100", "varlen: varlen_attn keeps packed rows apart by cu_seqlens from position_ids, "
                                "no mask"),
                       ("t4", "mask: a boolean 4-D block-diagonal mask (the plan's packing: mask; varlen_attn needs "
                              "sm_80+; Tesla T4 (sm_75, turing) is older)")):
        plan = tmp_path / f"{gpu}.json"
        plan.write_text(json.dumps(resolver_plan(gpu, driver="610.43.02")))
        result = run_cli("validate", str(config), "--plan", str(plan))
        assert result.returncode == 0, result.stderr
        assert words in result.stdout
        result = run_cli("validate", str(config), "--plan", str(plan), "--json")
        assert json.loads(result.stdout)["runtime"]["packing"] == json.loads(plan.read_text())["packing"]


# ---------------------------------------------------------------------------- python -m trainer train


@pytest.mark.slow
def test_train_with_a_plan_saying_varlen_packs_through_it_and_builds_no_mask(make_config, tmp_path, monkeypatch,
                                                                              capsys, standin):
    """The same run through varlen (the stand-in) and through the block-diagonal mask: the same losses."""
    import trainer.batch.collate as collate
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    built, returned = [], []
    real_block = collate.block_causal_mask
    monkeypatch.setattr(collate, "block_causal_mask", lambda *a: built.append(1) or real_block(*a))
    real_mask = ALL_MASK_ATTENTION_FUNCTIONS[NAME]
    install = attention_varlen.install

    def spying_install(runtime):  # install() registers NAME's mask function: spy on what it returns
        install(runtime)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, lambda *a, **k: returned.append(real_mask(*a, **k)) or returned[-1])

    monkeypatch.setattr(attention_varlen, "install", spying_install)
    losses = {}
    for packing in ("varlen", "mask"):
        plan = tmp_path / f"{packing}.json"
        plan.write_text(json.dumps(plan_for("cpu", None, "sdpa", "fp32") | {"packing": packing}))
        monkeypatch.setenv("ENVTOOL_PLAN", str(plan))
        out = tmp_path / packing
        varlen_standin.CALLS.clear()
        built.clear()
        config = make_config(f"{packing}.yml", attn_implementation=None, sample_packing=True, output_dir=str(out),
                             max_steps=2)
        assert main(["train", str(config)]) == 0
        err = capsys.readouterr().err
        losses[packing] = train_losses(out)
        if packing == "varlen":
            assert "attention: sdpa -> varlen_attn" in err and "the plan's packing: varlen" in err
            assert varlen_standin.CALLS and not built  # the kernel ran; the collator built no mask
            assert returned and all(m is None for m in returned)  # nor did transformers
        else:
            assert not varlen_standin.CALLS and built
    assert losses["varlen"].keys() == losses["mask"].keys() and len(losses["mask"]) == 2
    assert all(losses["varlen"][s] == pytest.approx(losses["mask"][s], rel=1e-5) for s in losses["mask"])


# ---------------------------------------------------------------------------- cuDNN off masked SDPA calls


def test_masked_sdpa_calls_run_without_cudnn_where_the_run_asks(tiny_llama, monkeypatch):
    """torch.nn.attention.sdpa_kernel sets the flags SDPA's CUDA dispatch reads (cudnn_sdp_enabled); on CPU they
    are read back at every SDPA call: off for calls with a mask, as they were for calls without one, and the
    numbers unchanged."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is not None, torch.backends.cuda.cudnn_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    rows = examples(300)
    batch = Collator(pad_token_id=0, attention="sdpa")(rows)  # the block-diagonal mask
    logits = {}
    try:
        for on in (False, True):
            attention_varlen.install(Flags(mask_without_cudnn=on))
            model = load(tiny_llama, "sdpa").eval()
            seen.clear()
            with torch.no_grad():
                logits[on] = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
                model(torch.tensor([rows[1][0]["input_ids"]]))  # one unpadded row: no mask (is_causal)
            masked = [cudnn for has_mask, cudnn in seen if has_mask]
            unmasked = [cudnn for has_mask, cudnn in seen if not has_mask]
            assert masked and unmasked
            assert all(unmasked) and masked == [not on] * len(masked)
        assert torch.equal(logits[False], logits[True])
        assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call
    finally:
        attention_varlen.install(Flags())
