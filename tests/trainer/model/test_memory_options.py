"""The memory and speed options (trainer/model/memory_options.py) against the plain path on CPU, through the trainer's
own loading (trainer/model/load.py): selective checkpointing vs plain checkpointing, ALST's tiled MLP vs the plain
MLP, activation offloading's save_on_cpu vs nothing, torch.compile vs eager: the same loss and the same gradients.

Tolerances: fp32 on CPU. Selective checkpointing and offloading replay the same ops on the same inputs: equal to
1e-6 relative. The tiled MLP runs the same per-token ops over slices of the rows (matmuls of other shapes, weight
gradients summed slice by slice): 1e-5 relative. torch.compile fuses ops (inductor's C++ kernels): 1e-4."""

from __future__ import annotations

import pytest
import torch

from trainer.config import parse_config
from trainer.data.prepare import load_tokenizer
from trainer.errors import HardwareError
from trainer.model import memory_options
from trainer.model.load import load_model
from trainer.runtime.hardware import Runtime, adapt, gpu_from_name


def config(model_dir, **keys):
    raw = {"base_model": str(model_dir), "datasets": [{"path": "data.jsonl", "type": "alpaca"}], "learning_rate": 1e-3,
           "sequence_len": 64, "micro_batch_size": 2, "attn_implementation": "sdpa", **keys}
    cfg, _ = parse_config(raw)
    return cfg


def runtime(cfg):
    rt = adapt(cfg, gpu_from_name("cpu"))
    return Runtime(gpu=rt.gpu, attention=rt.attention, precision="fp32", tf32=False)


def loss_and_grads(model_dir, context=None, prepare=None, **keys):
    """One forward and backward of a fixed batch through the model as the trainer loads it for `keys`."""
    cfg = config(model_dir, **keys)
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = load_model(cfg, runtime(cfg), tokenizer)
    if prepare is not None:
        prepare(cfg, model)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (2, 48), generator=g)
    with context() if context is not None else torch.enable_grad():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model


def assert_same(a, b, rtol):
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=0)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        scale = float(grads_a[name].abs().max()) or 1.0
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.parametrize("save", [["attention"], ["aten::mm"]])
def test_selective_checkpointing_matches_plain_checkpointing(tiny_llama, save):
    plain = loss_and_grads(tiny_llama, gradient_checkpointing=True)
    sac = loss_and_grads(tiny_llama, gradient_checkpointing=True, selective_checkpointing={"save": save})
    assert_same(plain, sac, rtol=1e-6)
    saved = sac[2]._selective_policy.saved
    assert saved and all(("attention" in name) if save == ["attention"] else ("aten::mm" in name) for name in saved)


def test_tiled_mlp_matches_the_plain_mlp(tiny_llama):
    plain = loss_and_grads(tiny_llama)
    tiled = loss_and_grads(tiny_llama, tiled_mlp=True, tiled_mlp_num_shards=3)
    assert_same(plain, tiled, rtol=1e-5)
    # under checkpointing too (the tiles' checkpoints nested in the layers')
    assert_same(loss_and_grads(tiny_llama, gradient_checkpointing=True),
                loss_and_grads(tiny_llama, gradient_checkpointing=True, tiled_mlp=True, tiled_mlp_num_shards=2),
                rtol=1e-5)


def test_tiled_mlp_keeps_one_slice_of_the_intermediate(tiny_llama):
    """What the MLP keeps for the backward: its input only (the slices' intermediates are rebuilt)."""
    cfg = config(tiny_llama, tiled_mlp=True, tiled_mlp_num_shards=4)
    model = load_model(cfg, runtime(cfg), load_tokenizer(cfg))
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 32, model.config.hidden_size, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        mlp(x)
    assert sum(kept) == x.numel()  # each slice's input is a view of x (4 x 8 tokens)


def test_activation_offloading_saves_on_cpu_with_the_same_gradients(tiny_llama):
    """On a GPU each micro-batch runs under save_on_cpu; on the CPU the hook is not made (nothing to offload).
    save_on_cpu's copies give the same numbers (checked here on the CPU, where it also runs)."""
    plain = loss_and_grads(tiny_llama, gradient_checkpointing=True)
    offloaded = loss_and_grads(tiny_llama, context=memory_options.OffloadActivations().forward,
                               gradient_checkpointing=True, activation_offloading=True)
    assert_same(plain, offloaded, rtol=1e-6)
    from trainer.hooks import Run

    cfg = config(tiny_llama, gradient_checkpointing=True, activation_offloading=True)
    assert memory_options.offload_hook(Run(cfg, "cpu")) is None
    assert isinstance(memory_options.offload_hook(Run(cfg, "cuda")), memory_options.OffloadActivations)


@pytest.mark.slow  # inductor compiles the layers' graphs: ~20 s of CPU
def test_torch_compile_matches_eager(tiny_llama):
    eager = loss_and_grads(tiny_llama)
    compiled = loss_and_grads(tiny_llama, prepare=lambda cfg, model: memory_options.compile_model(cfg, model, True,
                                                                                                  print),
                              torch_compile=True)
    assert_same(eager, compiled, rtol=1e-4)
    assert sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled[2].modules()) == \
        compiled[2].config.num_hidden_layers  # each decoder layer ran compiled


# ---------------------------------------------------------------------------- what each becomes on a GPU


def gpu_runtime(cfg, name):
    rt = adapt(cfg, gpu_from_name(name))
    return rt


@pytest.mark.parametrize("plan", [{"features": {"torch_compile": False, "liger": False}}, None])
def test_torch_compile_true_is_refused_where_triton_is_off_naming_the_gpu(tiny_llama, plan):
    cfg = config(tiny_llama, torch_compile=True)
    with pytest.raises(HardwareError) as err:
        memory_options.notes(cfg, gpu_runtime(cfg, "v100"), plan)
    line = str(err.value)
    assert "\n" not in line and line.startswith("torch_compile: true cannot run on Tesla V100") and "sm_70" in line
    auto = config(tiny_llama, torch_compile="auto")
    assert any(n.startswith("torch_compile: off on Tesla V100") for n in
               memory_options.notes(auto, gpu_runtime(auto, "v100"), plan))
    assert any(n.startswith("torch_compile: on") for n in
               memory_options.notes(cfg, gpu_runtime(cfg, "a100"), {"features": {"torch_compile": True}}))


# ---------------------------------------------------------------------------- through `python -m trainer validate`

OPTIONS = [  # (keys, the note validate prints for the CPU)
    ({"gradient_checkpointing": True, "activation_offloading": True}, "activation_offloading: nothing to offload"),
    ({"gradient_checkpointing": "offload"}, "activation_offloading: nothing to offload"),
    ({"gradient_checkpointing": True, "selective_checkpointing": {"save": ["aten::mm"]}},
     "selective_checkpointing: the checkpointed layers keep aten::mm"),
    ({"tiled_mlp": True, "tiled_mlp_num_shards": 2}, "tiled_mlp: each layer's MLP run over 2 slices"),
    ({"torch_compile": True}, "torch_compile: on (inductor C++ on the CPU"),
]


@pytest.mark.parametrize("keys,note", OPTIONS, ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_validate_names_each_option_and_ignores_none(make_config, capsys, keys, note):
    from trainer.cli import main

    assert main(["validate", str(make_config(**keys)), "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert note in out and "  options:" in out
    ignored = out.split("ignored", 1)[1] if "ignored" in out else ""
    assert not any(k in ignored for k in keys)  # honoured, not in the ignored note


@pytest.mark.parametrize("keys,gpu,line", [
    ({"torch_compile": True}, "v100", "torch_compile: true cannot run on Tesla V100"),
    ({"activation_offloading": True}, "a100", "activation_offloading needs gradient_checkpointing: true"),
    ({"gradient_checkpointing": True, "adapter": "lora", "selective_checkpointing": {"save": ["aten::mm"]}}, "a100",
     "selective_checkpointing.save: ['aten::mm'] match matmuls"),
    ({"torch_compile": True, "torch_compile_options": {"max_fusion_size": 8}}, "a100",
     "torch_compile_options: max_fusion_size not allowed"),
])
def test_validate_refuses_in_one_line(make_config, capsys, keys, gpu, line):
    from trainer.cli import main

    assert main(["validate", str(make_config(**keys)), "--gpu", gpu]) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and len(err.splitlines()) == 1, err


def test_selective_checkpointing_offload_is_named_in_the_memory_note():
    """Axolotl moves the ops selective checkpointing keeps to CPU memory and back: the same values, less GPU memory.
    Not implemented here, so the run is the same and may need more memory: said in the one memory note."""
    cfg, notes = parse_config({"base_model": "m", "learning_rate": 1e-4, "datasets": [{"path": "d", "type": "alpaca"}],
                               "gradient_checkpointing": True, "selective_checkpointing": {"offload": True}})
    assert cfg.gradient_checkpointing is True
    assert any(n.startswith("ignored memory options: selective_checkpointing.offload") for n in notes), notes
