"""Axolotl's MoE FSDP2 recipes (GLM-4.7-Flash and Qwen3.5 MoE qlora_fsdp): experts quantized on load with LoRA on
them, FSDP2 over 2 processes (torchrun, gloo on 127.0.0.1). The quantized expert storage is kept whole on each rank
(trainer/parallel/distributed.py keep_quantized_experts_whole) and the rest sharded; the losses are the one-process
run's with the same global batch, and the adapter saved from the sharded run is the one-process run's adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import alpaca_rows, run_cli, torchrun_train, train_losses, write_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FSDP2 = {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                            "fsdp_transformer_layer_cls_to_wrap": "MixtralDecoderLayer",
                                            "fsdp_state_dict_type": "FULL_STATE_DICT",
                                            "fsdp_reshard_after_forward": True}}


def config(tmp_path: Path, model: Path, name: str, **keys) -> Path:
    cfg = {"base_model": str(model), "datasets": [{"path": str(write_jsonl(tmp_path / "rows.jsonl", alpaca_rows(40))),
                                                   "type": "alpaca"}],
           "dataset_prepared_path": str(tmp_path / f"prepared-{name}"), "output_dir": str(tmp_path / name),
           "adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True, "lora_r": 8, "lora_alpha": 16,
           "lora_target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
           "lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "sequence_len": 128,
           "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4, "learning_rate": 5e-3,
           "lr_scheduler": "constant", "val_set_size": 0, "seed": 1, "attn_implementation": "sdpa", **keys}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_quantized_experts_with_expert_lora_under_fsdp2_train_as_one_process(tmp_path, tiny_mixtral):
    import torch
    from safetensors.torch import load_file

    one = run_cli("train", str(config(tmp_path, tiny_mixtral, "one", micro_batch_size=4)))
    assert one.returncode == 0, one.stderr[-3000:]
    sharded = torchrun_train(config(tmp_path, tiny_mixtral, "fsdp", **FSDP2), timeout=420)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "sharding: FSDP" in sharded.stderr
    assert "FSDP: the 4 quantized expert tensors are kept whole on each rank" in sharded.stderr
    want, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert sorted(got) == [1, 2, 3, 4] and want[4] < want[1]
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (want, got)
    adapters = [load_file(str(tmp_path / run / "final" / "adapter_model.safetensors")) for run in ("one", "fsdp")]
    assert set(adapters[0]) == set(adapters[1]) and sum(".experts." in k for k in adapters[1]) == 8
    for key, value in adapters[0].items():
        assert torch.allclose(value, adapters[1][key], rtol=1e-3, atol=1e-6), key
