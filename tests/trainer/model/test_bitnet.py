"""use_onebitllms (Axolotl's examples/falcon-e): onebitllms' BitNetLinear swapped in after loading, as Axolotl does.

onebitllms' quantizers are triton kernels only, so training with it needs a GPU where triton runs: validate and
train refuse it on the CPU and below triton's floor, with the reason and its source (matrices/packages.toml).
What runs here is onebitllms' own swap (its real code), imported with a stand-in `triton` module, since the CPU
build of torch ships no triton and the kernels cannot run without a GPU; no forward pass is run.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from tests.trainer.helpers import run_cli


# ------------------------------------------------------------------------------------ validate and train refuse
@pytest.mark.slow
def test_validate_accepts_it_where_triton_runs_and_refuses_it_on_cpu_with_the_source(make_config):
    config = str(make_config(use_onebitllms=True))
    a100 = run_cli("validate", config, "--gpu", "a100")
    assert a100.returncode == 0, a100.stderr
    assert "use_onebitllms: every linear layer but lm_head becomes onebitllms' BitNetLinear" in a100.stdout
    for gpu, why in (("cpu", "use_onebitllms: cannot run on the CPU"),
                     ("v100", "use_onebitllms: triton's kernels need sm_75+ and Tesla V100")):
        result = run_cli("validate", config, "--gpu", gpu)
        assert result.returncode == 2 and result.stderr.startswith(f"error: {why}"), (gpu, result.stderr)
        assert "source: onebitllms 0.0.4" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_plan_decides_whether_triton_runs(make_config, tmp_path):
    import json

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"gpu": {"name": "NVIDIA A100", "compute_capability": "8.0", "count": 1},
                                "precision": "bf16", "attention": "sdpa", "features": {"liger": False}}))
    result = run_cli("validate", str(make_config(use_onebitllms=True)), "--plan", str(plan))
    assert result.returncode == 2 and "the plan switches triton kernels off for this GPU" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    ({"adapter": "lora", "lora_r": 4, "lora_target_linear": True}, "use_onebitllms: not with adapter: lora"),
    ({"adapter": "qlora", "load_in_4bit": True}, "use_onebitllms: not with adapter: qlora"),
])
def test_adapters_are_refused_with_it_as_in_axolotl(extra, message, make_config):
    result = run_cli("validate", str(make_config(use_onebitllms=True, **extra)), "--gpu", "a100")
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.slow
def test_train_on_cpu_stops_before_loading_anything(make_config, tmp_path):
    result = run_cli("train", str(make_config(use_onebitllms=True)))
    assert result.returncode == 2 and "use_onebitllms: cannot run on the CPU" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- the swap, with onebitllms' code
def installed() -> None:
    """onebitllms is installed (envtool's `bitnet` extra): skipped here without it, fails under CI."""
    import importlib.util

    from tests.support.oracle import missing

    if importlib.util.find_spec("onebitllms") is None:
        missing("onebitllms is not installed: envtool's `bitnet` extra (pip install '.[bitnet]'; .ci/setup installs "
                "every extra)")


@pytest.fixture
def onebitllms(monkeypatch):
    """The real onebitllms package, imported with a stand-in triton (its kernels are only decorated, never run)."""
    installed()
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int
    triton.language = language
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.autotune = lambda *_, **__: (lambda fn: fn)
    triton.Config = lambda *args, **kwargs: (args, kwargs)
    triton.cdiv = lambda a, b: -(-a // b)
    for name in [m for m in sys.modules if m == "onebitllms" or m.startswith("onebitllms.")]:
        monkeypatch.delitem(sys.modules, name)
    assert "triton" not in sys.modules  # the CPU build of torch has none
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        import onebitllms
    finally:  # only onebitllms saw the stand-in: transformers and torch must still find no triton
        del sys.modules["triton"], sys.modules["triton.language"]
    yield onebitllms
    for name in [m for m in sys.modules if m == "onebitllms" or m.startswith("onebitllms.")]:
        del sys.modules[name]


def _load(config):
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.model.load import load_model
    from trainer.runtime.hardware import adapt, gpu_from_name

    cfg, _ = load_config(config)
    return load_model(cfg, adapt(cfg, gpu_from_name("cpu")), AutoTokenizer.from_pretrained(cfg.base_model))


def test_loading_swaps_every_linear_but_lm_head_for_onebitllms_layers_keeping_the_weights(
        onebitllms, make_config, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    swapped = _load(make_config(use_onebitllms=True))
    linears = {n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    bitnet = {n for n, m in swapped.named_modules() if isinstance(m, onebitllms.BitNetLinear)}
    assert linears and bitnet == linears  # q/k/v/o and the MLP of every layer
    assert type(swapped.lm_head) is torch.nn.Linear
    assert not any(type(m) is torch.nn.Linear for n, m in swapped.named_modules() if n != "lm_head")
    assert torch.get_default_dtype() == torch.float32  # onebitllms leaves the model's dtype as the default
    # the same parameter names and values: checkpoints are ordinary ones, and load back into the swapped layers
    ours, theirs = swapped.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        swapped.model.layers[0].self_attn.q_proj.weight.mul_(0.5)
    swapped.save_pretrained(tmp_path / "saved")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert torch.equal(reloaded.model.layers[0].self_attn.q_proj.weight, ours["model.layers.0.self_attn.q_proj.weight"])
    again = _load(make_config("again.yml", use_onebitllms=True, base_model=str(tmp_path / "saved")))
    assert isinstance(again.model.layers[0].self_attn.q_proj, onebitllms.BitNetLinear)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, ours["model.layers.0.self_attn.q_proj.weight"])


def test_without_the_key_nothing_is_swapped(onebitllms, make_config):
    model = _load(make_config())
    assert not any(isinstance(m, onebitllms.BitNetLinear) for m in model.modules())


@pytest.mark.slow
def test_dpo_with_it_validates_and_does_not_reuse_a_plain_models_reference_log_probs(make_config, tmp_path):
    """Falcon-E's DPO example: the reference log-probs come from the swapped model, so they are cached apart."""
    from types import SimpleNamespace

    from trainer.config import load_config
    from trainer.objectives.reference import reference_key
    from trainer.runtime.hardware import adapt, gpu_from_name

    rows = tmp_path / "pairs.jsonl"
    turn = [{"role": "user", "content": "hi"}]  # chatml.ultra: chosen/rejected are conversations (validate reads the rows)
    rows.write_text(json.dumps({"prompt": "hi", "chosen": [*turn, {"role": "assistant", "content": "yes"}],
                                "rejected": [*turn, {"role": "assistant", "content": "no"}]}) + "\n")
    dpo = dict(rl="dpo", datasets=[{"path": str(rows), "type": "chatml.ultra"}])
    bitnet = make_config("bitnet.yml", use_onebitllms=True, **dpo)
    result = run_cli("validate", str(bitnet), "--gpu", "a100")
    assert result.returncode == 0 and "use_onebitllms: every linear layer" in result.stdout, result.stderr
    dpo_objective = SimpleNamespace(name="dpo", reference_names=("chosen", "rejected"))
    keys = []
    for config in (bitnet, make_config("plain.yml", **dpo)):
        cfg, _ = load_config(config)
        keys.append(reference_key(cfg, adapt(cfg, gpu_from_name("cpu")), dpo_objective))
    assert keys[0] != keys[1]


def test_loading_it_where_onebitllms_cannot_import_is_one_config_error(make_config):
    from trainer.errors import ConfigError

    installed()
    assert "triton" not in sys.modules
    with pytest.raises(ConfigError, match=r"use_onebitllms: onebitllms cannot be imported here \(No module named 'triton'\)"):
        _load(make_config(use_onebitllms=True))
