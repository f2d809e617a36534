"""Expert parallelism (`expert_parallel_size`, Axolotl's ExpertParallelPlugin): each MoE layer's experts split over
the ranks by transformers' own expert parallelism (DistributedConfig ep_size, the model's ep_plan), tokens sent to
their experts' rank with torch.distributed all-to-all (gloo has it), the rest of the model FSDP2-sharded.

The sizes and refusals are checked without torch processes; the runs are the user's: `envtool train CONFIG --gpu cpu
--nproc 2` on a tiny Qwen3-MoE (transformers' Qwen3MoeConfig, 4 experts, 2 per token) against the same global batch
on one process (2 ranks x accumulation 2 = 1 process x accumulation 4): the same losses to float rounding, the saved
model whole (every expert) and loadable by one process, and a resumed run taking the uninterrupted run's steps. The
routing exchange itself is compared with the unsplit experts' forward and backward on two gloo ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import REPO, alpaca_rows, read_metrics, run_group, torchrun, train_losses, write_jsonl
from tests.trainer.parallel.test_fsdp_deepspeed import FSDP2
from trainer.config import parse_config
from trainer.config.parallel import Mesh, mesh_for
from trainer.errors import ConfigError

BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
PLUGIN = "axolotl.integrations.expert_parallel.ExpertParallelPlugin"
ENVTOOL = Path(sys.executable).parent / "envtool"


def cfg(**keys):
    return parse_config({**BASE, **keys})


# --- the sizes (Axolotl's rule: expert_parallel_size x dp_shard_size = world) -------------------------------------

@pytest.mark.parametrize("keys, world, fsdp, expected", [
    ({"expert_parallel_size": 2}, 2, False, Mesh(1, 2, ep=2)),  # EP alone: every rank a data rank
    ({"expert_parallel_size": 4}, 4, False, Mesh(1, 4, ep=4)),  # examples/expert_parallel/*_ep_fft_4gpu
    ({"expert_parallel_size": 2, "dp_shard_size": 2}, 4, True, Mesh(1, 4, ep=2)),  # *_ep_fsdp_fft_4gpu
    ({"expert_parallel_size": 2}, 4, True, Mesh(1, 4, ep=2)),  # FSDP takes the ranks EP leaves
    ({"expert_parallel_size": 2, "context_parallel_size": 2}, 4, False, Mesh(1, 2, cp=2, ep=2)),  # EP x CP
])
def test_sizes_fill_the_world_as_axolotl_does(keys, world, fsdp, expected):
    assert mesh_for(cfg(**keys, **(FSDP2 if fsdp else {}))[0], world, fsdp) == expected


@pytest.mark.parametrize("keys, world, message", [
    ({"expert_parallel_size": 2}, 4, "expert_parallel_size 2 = 2 processes, but this run has 4"),
    ({"expert_parallel_size": 2, "dp_shard_size": 2, **FSDP2}, 2,
     "dp_shard_size 2 x expert_parallel_size 2 = 4 processes, but this run has 2"),
    ({"expert_parallel_size": 4, **FSDP2}, 6, "expert_parallel_size 4 needs a multiple of 4 processes, but this run has 6"),
    ({"expert_parallel_size": 2, "context_parallel_size": 2}, 2,
     "context_parallel_size 2 x expert_parallel_size 2 = 4 processes, but this run has 2"),
])
def test_sizes_that_do_not_fit_the_world_are_one_clear_line(keys, world, message):
    with pytest.raises(ConfigError, match=message) as err:
        mesh_for(cfg(**keys)[0], world, fsdp="fsdp_version" in keys)
    assert "\n" not in str(err.value)


def test_the_plugin_is_accepted_and_the_note_says_how_tokens_move():
    config, notes = cfg(expert_parallel_size=2, plugins=[PLUGIN], expert_parallel_backend="deep_ep")
    assert config.expert_parallel_size == 2
    note = next(n for n in notes if n.startswith("expert_parallel_size: 2:"))
    assert "torch.distributed all-to-all" in note and "exactly 2 processes" in note
    assert any("expert_parallel_backend" in n for n in notes)  # DeepEP's kernels are not used, said once


@pytest.mark.parametrize("keys, message", [
    ({"deepspeed": "ds.json"}, "expert_parallel_size: 2 with deepspeed (ZeRO shards"),
    ({"tensor_parallel_size": 2}, "expert_parallel_size: 2 with tensor_parallel_size: 2 (EP x TP"),
    ({"adapter": "lora", "lora_target_parameters": ["mlp.experts.gate_up_proj"]},
     "expert_parallel_size: 2 with lora_target_parameters"),
    ({"adapter": "qlora", "load_in_4bit": True}, "expert_parallel_size: 2 with load_in_4bit"),
    ({"rl": "dpo", "datasets": [{"path": "d.jsonl", "type": "chatml.intel"}]}, "expert_parallel_size: 2 with rl: dpo"),
    ({"expert_parallel_token_capacity": 1024}, "expert_parallel_token_capacity"),
])
def test_what_ep_does_not_compose_with_is_one_line_naming_both_keys(keys, message):
    with pytest.raises(ConfigError) as err:
        cfg(expert_parallel_size=2, **keys)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model_config, message", [
    ({"model_type": "llama", "hidden_size": 8}, "expert_parallel_size: 2: model_type llama is not a mixture-of-experts"),
    ({"model_type": "qwen3_moe", "num_experts": 6}, "expert_parallel_size: 4 does not divide the model's 6 experts"),
    ({"model_type": "mixtral", "num_local_experts": 3}, "expert_parallel_size: 2 does not divide the model's 3 experts"),
])
def test_a_local_model_ep_cannot_split_is_refused_by_validate(tmp_path, model_config, message):
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    ep = int(message.split(":")[1].split()[0])
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, "base_model": str(tmp_path), "expert_parallel_size": ep})


def test_the_lora_example_keeps_its_adapter_and_a_size_of_one_means_none():
    config, _ = cfg(expert_parallel_size=2, adapter="lora", lora_target_modules=["q_proj", "v_proj"])
    assert config.adapter == "lora"
    assert mesh_for(cfg(expert_parallel_size=1)[0], 2, False) == Mesh(2, 1)


# --- the routing exchange, two gloo ranks, against the unsplit experts --------------------------------------------

def _exchange_script(tmp_path: Path) -> Path:
    script = tmp_path / "exchange.py"
    script.write_text(r'''
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import Qwen3MoeConfig
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
torch.manual_seed(0)
x = torch.randn(world, 6, 16, dtype=torch.float64)  # rank r's tokens: x[r]
whole = Qwen3MoeSparseMoeBlock(config).double()
with torch.no_grad():  # a block built alone is not initialised (the model's _init_weights does that)
    for p in whole.parameters():
        p.normal_(0, 0.5)
split = Qwen3MoeSparseMoeBlock(config).double()
split.load_state_dict(whole.state_dict())
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
tp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep_", "tp"))["tp"]
apply_expert_parallelism(split, mesh, tp, {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
                                           "experts": "ep_dispatch_experts"})
assert split.experts.gate_up_proj.to_local().shape[0] == 4 // world  # each rank holds its share of the experts
# the reference: the unsplit block on every rank's tokens (the global batch), loss = mean over ranks of sum(out)
xs = x.clone().requires_grad_(True)
out = whole(xs.reshape(-1, 16).view(world, 6, 16))
(out.sum() / world).backward()
# expert parallel: rank r's tokens only, the loss its share, gradients summed over ranks (as FSDP/DDP reduce them)
mine = x[rank:rank + 1].clone().requires_grad_(True)
got = split(mine)
(got.sum() / world).backward()
assert torch.allclose(got, out[rank:rank + 1], atol=1e-12), (got - out[rank:rank + 1]).abs().max()
assert torch.allclose(mine.grad, xs.grad[rank:rank + 1], atol=1e-12)  # the tokens' gradients come back
for name in ("gate_up_proj", "down_proj"):
    local = getattr(split.experts, name).grad
    local = local.to_local() if isinstance(local, DTensor) else local
    share = 4 // world
    assert torch.allclose(local, getattr(whole.experts, name).grad[rank * share:(rank + 1) * share], atol=1e-12), name
router = split.gate.weight.grad.clone()
dist.all_reduce(router)
assert torch.allclose(router, whole.gate.weight.grad, atol=1e-12)  # the router stays replicated, gradients summed
print(f"rank {rank}: exchange equals the unsplit experts", flush=True)
dist.destroy_process_group()
''')
    return script


@pytest.mark.distributed
@pytest.mark.slow
def test_the_all_to_all_exchange_equals_the_unsplit_experts(tmp_path):
    """Forward, the tokens' gradients, each rank's experts' gradients and the router's: the 2-rank exchange (gloo
    all-to-all) against one process running all 4 experts on both ranks' tokens, in float64."""
    result = torchrun(str(_exchange_script(tmp_path)), nproc=2, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("exchange equals the unsplit experts") == 2


# --- the user's runs: envtool train --gpu cpu --nproc 2 -----------------------------------------------------------

def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "ENVTOOL_GPU")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               ENVTOOL_CACHE_DIR=str(tmp_path / "cache"))
    return env


def _config(tmp_path: Path, model: Path, name: str, **keys) -> Path:
    data = tmp_path / "rows.jsonl"
    if not data.exists():
        write_jsonl(data, alpaca_rows(48, seed=3))
    config = {**dict(base_model=str(model), datasets=[{"path": str(data), "type": "alpaca"}],
                     dataset_prepared_path=str(tmp_path / "prepared"), output_dir=str(tmp_path / name),
                     sequence_len=128, sample_packing=True, micro_batch_size=1, max_steps=4, learning_rate=1e-3,
                     lr_scheduler="cosine", warmup_steps=1, seed=1, attn_implementation="sdpa", val_set_size=0.2,
                     eval_steps=2, save_steps=2, max_grad_norm=1.0, ddp_timeout=60), **keys}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(tmp_path: Path, path: Path, nproc: int) -> subprocess.CompletedProcess:
    cmd = [str(ENVTOOL), "train", str(path), "--gpu", "cpu", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    result = run_group(cmd, _env(tmp_path), tmp_path, 400)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _same_losses(out: Path, reference: Path) -> float:
    losses, expected = train_losses(out), train_losses(reference)
    print(f"losses 1 process: {expected}\nlosses parallel: {losses}")
    assert losses.keys() == expected.keys() == {1, 2, 3, 4}
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), step
    evals = lambda o: [r["eval_loss"] for r in read_metrics(o) if "eval_loss" in r]  # noqa: E731
    assert evals(out) == pytest.approx(evals(reference), rel=1e-5) and len(evals(out)) == 2
    norms = lambda o: [r["grad_norm"] for r in read_metrics(o) if r.get("grad_norm") is not None]  # noqa: E731
    assert norms(out) == pytest.approx(norms(reference), rel=1e-5) and len(norms(out)) == 4  # clipped alike (> 1)
    return max(abs(losses[s] - expected[s]) for s in expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_envtool_trains_a_moe_expert_parallel_on_two_processes_as_one_process_does(tmp_path, tiny_qwen3_moe):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    one = _config(tmp_path, tiny_qwen3_moe, "one", gradient_accumulation_steps=4)
    ep = _config(tmp_path, tiny_qwen3_moe, "ep", gradient_accumulation_steps=2, expert_parallel_size=2,
                 plugins=[PLUGIN])
    _train(tmp_path, one, 1)
    result = _train(tmp_path, ep, 2)
    assert "expert parallel: the experts of 2 MoE layers split over 2 ranks (2 processes)" in result.stderr
    assert "tokens move with" in result.stderr or "torch.distributed all-to-all" in result.stderr
    print(f"max |loss difference| 1 process vs 2 (expert parallel): {_same_losses(tmp_path / 'ep', tmp_path / 'one'):.2e}")

    # the saved model is whole (every expert of every layer) and loads in one process, as the 1-process run's does
    final = tmp_path / "ep" / "final"
    assert "distributed_config" not in json.loads((final / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and type(experts.gate_up_proj).__name__ == "Parameter"
    mine, theirs = load_file(final / "model.safetensors"), load_file(tmp_path / "one" / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) < 1e-6

    # resumed from checkpoint-2 on two processes: the uninterrupted run's steps 3 and 4
    resumed = tmp_path / "ep-resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "ep" / "checkpoint-2", resumed / "checkpoint-2")
    again = _config(tmp_path, tiny_qwen3_moe, "ep-resumed", gradient_accumulation_steps=2, expert_parallel_size=2,
                    plugins=[PLUGIN], auto_resume_from_checkpoints=True)
    assert "resumed from" in _train(tmp_path, again, 2).stderr
    full, after = train_losses(tmp_path / "ep"), train_losses(resumed)
    assert sorted(after) == [3, 4] and all(after[s] == pytest.approx(full[s], rel=1e-6) for s in after)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_with_context_parallel_on_four_processes_matches_one_process(tmp_path, tiny_qwen3_moe):
    """Axolotl's EP x CP: 2 expert-parallel ranks x 2 context-parallel ranks (each sequence split over a CP pair, the
    tokens of every slice sent to their experts' rank); 2 data ranks x accumulation 2 = 1 process x accumulation 4."""
    _train(tmp_path, _config(tmp_path, tiny_qwen3_moe, "one", gradient_accumulation_steps=4), 1)
    result = _train(tmp_path, _config(tmp_path, tiny_qwen3_moe, "epcp", gradient_accumulation_steps=2,
                                      expert_parallel_size=2, context_parallel_size=2), 4)
    assert ("parallelism: 2-way expert parallel, each expert held by 2 ranks x 2-way context parallel; other weights "
            "FSDP over all 4 processes") in result.stderr
    print(f"max |loss difference| (EP 2 x CP 2): {_same_losses(tmp_path / 'epcp', tmp_path / 'one'):.2e}")


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_with_dp_shard_on_four_processes_matches_one_process(tmp_path, tiny_qwen3_moe):
    """Axolotl's ep_fsdp example's layout: expert_parallel_size 2 x dp_shard_size 2 under fsdp_version 2, every
    expert held by 2 ranks that FSDP2-shard it; 4 data ranks x accumulation 1 = 1 process x accumulation 4."""
    _train(tmp_path, _config(tmp_path, tiny_qwen3_moe, "one", gradient_accumulation_steps=4), 1)
    result = _train(tmp_path, _config(tmp_path, tiny_qwen3_moe, "epfsdp", gradient_accumulation_steps=1,
                                      expert_parallel_size=2, dp_shard_size=2, **FSDP2), 4)
    assert ("parallelism: 2-way expert parallel, each expert held by 2 ranks; other weights FSDP over all 4 "
            "processes") in result.stderr
    print(f"max |loss difference| (EP 2 x dp_shard 2): {_same_losses(tmp_path / 'epfsdp', tmp_path / 'one'):.2e}")


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_on_attention_with_expert_parallel_matches_one_process(tmp_path, tiny_mixtral):
    """Axolotl's ep_lora example's shape (LoRA on q/k/v/o, the experts frozen and split): peft's weights, added after
    transformers' FSDP2 wrapped the loaded ones, averaged over the ranks; the adapter saved whole."""
    from safetensors.torch import load_file

    lora = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                learning_rate=5e-3)
    _train(tmp_path, _config(tmp_path, tiny_mixtral, "one", gradient_accumulation_steps=4, **lora), 1)
    result = _train(tmp_path, _config(tmp_path, tiny_mixtral, "ep", gradient_accumulation_steps=2,
                                      expert_parallel_size=2, **lora), 2)
    assert "expert parallel: the experts of 2 MoE layers split over 2 ranks (2 processes)" in result.stderr
    print(f"max |loss difference| (LoRA): {_same_losses(tmp_path / 'ep', tmp_path / 'one'):.2e}")
    mine = load_file(tmp_path / "ep" / "final" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and max((mine[k] - theirs[k]).abs().max().item() for k in mine) < 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dense_model_with_expert_parallel_stops_in_one_line_before_training(tmp_path, tiny_llama):
    result = run_group([str(ENVTOOL), "train", str(_config(tmp_path, tiny_llama, "dense", expert_parallel_size=2)),
                        "--gpu", "cpu", "--nproc", "2"], _env(tmp_path), tmp_path, 300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "expert_parallel_size: 2: model_type llama is not a mixture-of-experts model" in errors[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "dense" / "final").exists()


@pytest.mark.slow
def test_a_checkpoints_unfused_experts_resume_as_from_pretrained_fuses_them(tiny_mixtral, tiny_qwen3_moe):
    """save_pretrained writes MoE experts unfused (experts.0.w1 / experts.0.gate_proj ...); a resume sets them on a
    loaded model itself, fused by transformers' own conversions: the same tensors from_pretrained makes (before, a
    MoE full fine-tune's checkpoint did not resume, on one process or several)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.model.experts import as_loaded

    for path in (tiny_mixtral, tiny_qwen3_moe):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        saved = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        assert any(".experts.0." in k for k in saved)  # the checkpoint's own layout
        fused = as_loaded(model, saved)
        own = model.state_dict()
        assert fused.keys() <= own.keys() and {k for k in own if "experts" in k} <= fused.keys()
        assert all(torch.equal(fused[k], own[k]) for k in fused), path
        assert as_loaded(model, fused) is fused  # already the model's names: unchanged


def test_the_memory_estimate_shards_what_expert_parallelism_shards():
    """Axolotl's ep_fft example on 4 GPUs: transformers' FSDP2 over every rank and the experts split over them, so
    the estimate divides weights and states by 4 (estimated as full replicas, a 30B MoE would be refused as not
    fitting on four 80 GB GPUs)."""
    from trainer.fit.memory import _sharding

    sharding = _sharding(cfg(expert_parallel_size=4)[0], 4)
    assert (sharding.fsdp, sharding.shard) == ("full", 4)
    assert _sharding(cfg()[0], 4).shard == 1  # plain DDP: replicas
