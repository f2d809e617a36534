"""Context parallelism (trainer/parallel/context_parallel.py): context_parallel_size 2 splits every sequence over two
processes (torchrun, gloo on 127.0.0.1, hard timeouts), with packing, long-tailed lengths, gradient
accumulation, an evaluation and a checkpoint mid-run.

The oracle is the same config trained in ONE process (no context parallelism): both processes of the CP group
read the same micro-batches, so the run must take the same steps -- the same losses, evaluation losses and
trained weights, up to the order of floating-point sums (rel 1e-5) -- and resume exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer.helpers import alpaca_rows, read_metrics, run_cli, torchrun_train, train_losses, write_jsonl
from trainer.config import parse_config
from trainer.config.parallel import Mesh, mesh_for
from trainer.errors import ConfigError

DS_CONFIGS = Path(__file__).parents[1] / "fixtures" / "deepspeed_configs"  # Axolotl's zero3.json, verbatim
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                            "fsdp_state_dict_type": "FULL_STATE_DICT",
                                            "fsdp_reshard_after_forward": True}}
BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}


def common(tmp: Path, tiny_llama: Path) -> dict:
    data = tmp / "long_tail.jsonl"
    if not data.exists():
        write_jsonl(data, alpaca_rows(60, seed=5, long_every=4))  # 1 in 4 rows ~3x longer: uneven packs
    return dict(base_model=str(tiny_llama), datasets=[{"path": str(data), "type": "alpaca"}],
                dataset_prepared_path=str(tmp / "prepared"), sequence_len=300, sample_packing=True,
                val_set_size=0.2, micro_batch_size=1, gradient_accumulation_steps=2, max_steps=4, eval_steps=2,
                save_steps=2, learning_rate=1e-3, lr_scheduler="cosine", warmup_steps=1, seed=1,
                attn_implementation="sdpa", ddp_timeout=60)


def write(tmp: Path, tiny_llama: Path, name: str, **overrides) -> tuple[Path, Path]:
    import yaml

    out = tmp / name
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump({**common(tmp, tiny_llama), "output_dir": str(out), **overrides}))
    return path, out


def evals(out: Path) -> list[float]:
    return [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def assert_trains_as(out: Path, reference: Path) -> None:
    losses, expected = train_losses(out), train_losses(reference)
    assert losses.keys() == expected.keys() == {1, 2, 3, 4}
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), step
    assert evals(out) == pytest.approx(evals(reference), rel=1e-5) and len(evals(out)) == 2
    tokens = lambda o: [r["eval_tokens"] for r in read_metrics(o) if "eval_tokens" in r]  # noqa: E731
    assert tokens(out) == tokens(reference)  # every validation token counted once, not once per CP rank
    mine, theirs = weights(out), weights(reference)
    assert mine.keys() == theirs.keys()
    moved = 0
    for name, tensor in theirs.items():
        assert mine[name].float().allclose(tensor.float(), rtol=1e-4, atol=1e-6), name
        moved += 1
    assert moved


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_llama):
    """The oracle: the same config in one process, no context parallelism."""
    tmp = tmp_path_factory.mktemp("cp1")
    path, out = write(tmp, tiny_llama, "single")
    result = run_cli("train", str(path), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp, out


@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallel_two_processes_trains_as_one_process_and_resumes_exactly(one_process, tiny_llama):
    tmp, reference = one_process
    path, out = write(tmp, tiny_llama, "cp2", context_parallel_size=2)
    result = torchrun_train(path, nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "parallelism: 2-way context parallel x data parallel over 1 process(es) (2 processes)" in result.stderr
    assert_trains_as(out, reference)
    assert (out / "checkpoint-2").is_dir()

    # resume from the mid-run checkpoint: the later steps, the same losses
    resumed_path, resumed = write(tmp, tiny_llama, "cp2_resumed", context_parallel_size=2,
                                  auto_resume_from_checkpoints=True)
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    result = torchrun_train(resumed_path, nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    a, b = train_losses(out), train_losses(resumed)
    assert sorted(b) == [3, 4] and [b[s] for s in (3, 4)] == [a[s] for s in (3, 4)]  # bit for bit
    assert evals(resumed)[-1] == evals(out)[-1]
    assert weights(resumed).keys() == weights(out).keys()
    assert all(weights(resumed)[k].equal(v) for k, v in weights(out).items())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
def test_context_parallel_under_fsdp2_and_zero3_trains_as_one_process(backend, one_process, tiny_llama, monkeypatch):
    """ZeRO-3 also with gradient checkpointing (as the ALST examples) and attention in blocks of a few queries
    (each block checkpointed inside the checkpointed layer)."""
    tmp, reference = one_process
    extra = FSDP2 if backend == "fsdp2" else {"deepspeed": str(DS_CONFIGS / "zero3.json"),
                                              "gradient_checkpointing": True}
    if backend == "zero3":
        monkeypatch.setenv("ENVTOOL_CP_MASK_ELEMENTS", "4000")  # ~300 keys: blocks of ~13 queries
    path, out = write(tmp, tiny_llama, f"cp2_{backend}", context_parallel_size=2, **extra)
    result = torchrun_train(path, nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"sharding: {'FSDP' if backend == 'fsdp2' else 'DEEPSPEED'}" in result.stderr
    if backend == "fsdp2":  # the CP ranks shard the model between them
        assert "mesh dim0=2, placements Shard(dim=0)" in result.stderr
    assert_trains_as(out, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_data_ranks_of_two_context_parallel_ranks_train_as_ddp(tmp_path, tiny_llama):
    """4 processes, 2 data ranks x CP 2, against plain DDP over 2 processes: each CP group reads its data rank's
    batches, and every step's tokens and losses count once."""
    path, ddp = write(tmp_path, tiny_llama, "ddp")
    result = torchrun_train(path, nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    path, out = write(tmp_path, tiny_llama, "dp2_cp2", context_parallel_size=2)
    result = torchrun_train(path, nproc=4, timeout=500)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2-way context parallel x data parallel over 2 process(es) (4 processes)" in result.stderr
    assert_trains_as(out, ddp)
    counts = lambda o: [(r.get("tokens"), r.get("target_tokens")) for r in read_metrics(o) if "loss" in r]  # noqa: E731
    assert counts(out) == counts(ddp)


@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallel_with_tensor_parallel_under_fsdp2_trains_as_one_process(one_process, tiny_llama):
    """The qwen3 fsdp-tp-cp example's composition, one data rank: 2-way CP x 2-way TP (the tiny llama's tp_plan)
    with FSDP2 over the CP ranks, 4 processes."""
    tmp, reference = one_process
    path, out = write(tmp, tiny_llama, "cp2_tp2", context_parallel_size=2, tensor_parallel_size=2, **FSDP2)
    result = torchrun_train(path, nproc=4, timeout=500)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2-way context parallel x 2-way tensor parallel x no data parallelism (4 processes)" in result.stderr
    assert_trains_as(out, reference)


@pytest.mark.parametrize("limit", [1 << 26, 120, 1])  # one block; blocks of a few queries; one query each
def test_blocked_attention_is_the_dense_block_causal_attention(limit):
    """One rank's share: its local queries (the second half of a packed row) against every key, computed in
    query blocks each against only the keys it can see, equals SDPA with the collator's dense block-causal mask
    (trainer.batch.attention.block_causal_mask), values and gradients, with GQA and a sliding window."""
    import types

    import torch

    from trainer.batch.attention import block_causal_mask
    from trainer.parallel.context_parallel import attend, plan_blocks

    torch.manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 9, 3, 7], 4, 2, 8
    total = sum(lengths)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    q = torch.randn(1, heads, total, dim, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, requires_grad=True)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    for window in (None, 4):
        mask = block_causal_mask(segments, "sdpa")
        if window:
            index = torch.arange(total)
            mask = mask & (index[None, :] > index[:, None] - window)
        rep = lambda t: t.repeat_interleave(heads // kv_heads, dim=1)  # noqa: E731
        dense = torch.nn.functional.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=0.3)
        first = total // 2
        local = dense[:, :, first:].transpose(1, 2)
        starts = torch.arange(total)[None] - positions
        blocks = plan_blocks(starts[:, first:], first, limit=limit)
        assert len(blocks) == (1 if limit > total * total else -(-(total - first) // max(1, limit // total)))
        mine = attend(module, q[:, :, first:], k, v, torch.arange(first, total), starts, blocks, scaling=0.3,
                      window=window)
        assert mine.shape == local.shape and torch.allclose(mine, local, atol=1e-6)
        weights = torch.randn_like(local)
        expected = torch.autograd.grad((local * weights).sum(), (q, k, v))
        got = torch.autograd.grad((mine * weights).sum(), (q, k, v))
        for e, g in zip(expected, got):
            assert torch.allclose(e, g, atol=1e-5)


# --- sizes and bad input: one line, exit code 2 -----------------------------------------------------------

def cfg(**keys):
    return parse_config({**BASE, **keys})[0]


@pytest.mark.parametrize("keys, world, fsdp, expected", [
    ({"context_parallel_size": 2}, 2, False, Mesh(1, 1, 1, 2)),
    ({"context_parallel_size": 2}, 4, False, Mesh(2, 1, 1, 2)),  # 2 DDP replicas of a 2-rank CP group
    ({"context_parallel_size": 2}, 4, True, Mesh(1, 2, 1, 2)),  # FSDP over the 2 data ranks x 2 CP ranks
    ({"dp_shard_size": 2, "context_parallel_size": 2, "tensor_parallel_size": 2}, 8, True, Mesh(1, 2, 2, 2)),
])
def test_context_parallel_sizes_fill_the_world_as_axolotl_does(keys, world, fsdp, expected):
    mesh = mesh_for(cfg(**keys, **(FSDP2 if fsdp else {})), world, fsdp)
    assert mesh == expected and mesh.world == world
    assert [mesh.data_rank(r) for r in range(world)] == [r // (mesh.cp * mesh.tp) for r in range(world)]


def test_context_parallel_size_that_does_not_divide_the_world_is_one_line():
    with pytest.raises(ConfigError, match="context_parallel_size 3 needs a multiple of 3 processes, but this run has 2"):
        mesh_for(cfg(context_parallel_size=3), 2, False)
    with pytest.raises(ConfigError, match="context_parallel_size 2 needs a multiple of 2 processes, but this run has 3"):
        mesh_for(cfg(context_parallel_size=2, **FSDP2), 3, True)


@pytest.mark.slow
def test_context_parallel_bad_configs_are_one_line_exit_2(tmp_path, tiny_llama):
    with pytest.raises(ConfigError, match="needs micro_batch_size: 1"):
        cfg(context_parallel_size=2, sample_packing=True, micro_batch_size=2)
    with pytest.raises(ConfigError, match="context_parallel_size: 2 with rl: dpo"):
        cfg(context_parallel_size=2, rl="dpo", datasets=[{"path": "d.jsonl", "type": "chatml.intel"}])
    with pytest.raises(ConfigError, match="context_parallel_size: 2 with do_causal_lm_eval"):
        cfg(context_parallel_size=2, do_causal_lm_eval=True, eval_causal_lm_metrics=["perplexity"])
    assert cfg(sequence_parallel_degree=2, micro_batch_size=1).context_parallel_size == 2  # Axolotl's older name
    path, _ = write(tmp_path, tiny_llama, "bad", context_parallel_size=2, micro_batch_size=2)
    result = run_cli("validate", str(path))
    assert result.returncode == 2 and "needs micro_batch_size: 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_ring_attention_options_are_accepted_as_speed_options():
    config, notes = parse_config({**BASE, "context_parallel_size": 2, "heads_k_stride": 1,
                                  "ring_attn_func": "batch_zigzag"})
    assert config.context_parallel_size == 2
    assert any(n.startswith("ignored: ") and "heads_k_stride" in n for n in notes)
    assert any(n.startswith("ignored: ") and "ring_attn_func (ring-flash-attn's communication pattern" in n for n in notes)


def test_models_with_mamba_layers_softcaps_or_sinks_are_refused_when_loaded():
    """Real transformers configs of hybrid Mamba models (the nemotron-h example's model type among them)."""
    from transformers import AutoConfig, LlamaConfig

    from trainer.parallel.context_parallel import check_model, recurrent_reason

    class Loaded:
        def __init__(self, config, modules=()):
            self.config, self._modules = config, list(modules)

        def modules(self):
            return iter(self._modules)

    for kind in ("nemotron_h", "falcon_h1", "jamba", "granitemoehybrid", "qwen3_next"):
        with pytest.raises(ConfigError, match=f"context_parallel_size: 2: model_type {kind} has .*cannot be split"):
            check_model(Loaded(AutoConfig.for_model(kind)), 2)
    assert recurrent_reason(LlamaConfig()) is None
    check_model(Loaded(LlamaConfig()), 2)
    # what the SDPA kernels cannot do: soft-capped logits (gemma2), attention sinks (gpt-oss)
    with pytest.raises(ConfigError, match="model_type gemma2 soft-caps its attention logits"):
        check_model(Loaded(AutoConfig.for_model("gemma2")), 2)
    import types

    import torch

    with pytest.raises(ConfigError, match="model_type gpt_oss has attention sinks"):
        check_model(Loaded(AutoConfig.for_model("gpt_oss"), [types.SimpleNamespace(sinks=torch.zeros(2))]), 2)
    assert recurrent_reason(AutoConfig.for_model("gemma3_text")) is None  # sliding + full attention layers


@pytest.mark.distributed
@pytest.mark.slow
def test_mamba_model_with_context_parallel_is_refused_by_validate_and_at_load_exit_2(tmp_path, tiny_llama):
    from transformers import AutoTokenizer, JambaConfig, JambaForCausalLM

    model_dir = tmp_path / "tiny-jamba"
    config = JambaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=4,
                         mamba_expand=2, mamba_dt_rank=4)
    JambaForCausalLM(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(model_dir)
    path, _ = write(tmp_path, tiny_llama, "jamba", base_model=str(model_dir), context_parallel_size=2)
    result = run_cli("validate", str(path))  # a local model: validate reads its config.json
    assert result.returncode == 2 and "model_type jamba has Mamba/SSM" in result.stderr
    assert "Traceback" not in result.stderr
    (model_dir / "config.json").rename(model_dir / "config.json.hidden")  # what validate cannot see ...
    path, _ = write(tmp_path, tiny_llama, "jamba", base_model=str(model_dir), context_parallel_size=2)
    assert run_cli("validate", str(path)).returncode == 0
    (model_dir / "config.json.hidden").rename(model_dir / "config.json")  # ... the load still refuses
    result = torchrun_train(path, nproc=2, timeout=240)
    assert "exitcode  : 2" in result.stderr
    line = next(x for x in result.stderr.splitlines() if "context_parallel_size: 2: model_type jamba" in x)
    assert "Mamba/SSM" in line and "cannot be split" in line
    assert "Traceback" not in result.stderr.split("exitcode")[0]
