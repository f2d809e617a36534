"""Optimizers by the names Axolotl's configs use: each built by the library matrices/optimizers.toml names
(through transformers' mapping), and each one's state checkpoints and resumes exactly."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from tests.trainer.helpers import train_losses, train_then_resume
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError
from trainer.optim import optimizers

BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}


def test_the_table_names_the_library_transformers_builds():
    from transformers import Trainer

    checked = 0
    for name, row in optimizers.table().items():
        if "unsupported" in row or "built_by" in row or importlib.util.find_spec(row["library"]) is None:
            continue
        args = SimpleNamespace(optim=row.get("transformers_name", name), learning_rate=1e-3, adam_beta1=0.9,
                               adam_beta2=0.999, adam_epsilon=1e-8, optim_args=None, weight_decay=0.0)
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(args, None)
        assert cls.__module__.split(".")[0] == row["library"], (name, cls)
        checked += 1
    assert checked >= 20


def test_torchs_adamw_is_built_as_transformers_builds_it():
    """adamw_torch and adamw_torch_fused (and their aliases) are built without importing transformers' Trainer
    (start-up time): the class and keyword arguments are its get_optimizer_cls_and_kwargs's; optim_args, and every
    other optimizer, still go through it."""
    from hypothesis import given, settings, strategies as st
    from transformers import Trainer

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(name=st.sampled_from(sorted(optimizers.table())), lr=st.floats(1e-6, 1.0), b1=st.floats(0, 0.99),
           b2=st.floats(0.9, 0.9999), eps=st.floats(1e-10, 1e-6), optim_args=st.sampled_from([None, "", "foo=1"]))
    def check(name, lr, b1, b2, eps, optim_args):
        row = optimizers.table()[name]
        args = SimpleNamespace(optim=row.get("transformers_name", name), learning_rate=lr, adam_beta1=b1,
                               adam_beta2=b2, adam_epsilon=eps, optim_args=optim_args, weight_decay=0.0)
        ours = optimizers.torch_adamw(args)
        if ours is None:
            assert args.optim not in optimizers.ADAMW_TORCH or optim_args
            return
        assert ours == Trainer.get_optimizer_cls_and_kwargs(args, None)

    check()
    assert optimizers.torch_adamw(SimpleNamespace(optim="adamw_torch", learning_rate=1e-3, adam_beta1=0.9,
                                                  adam_beta2=0.999, adam_epsilon=1e-8, optim_args=None)) is not None


def test_axolotl_optimizer_names_are_accepted_and_unknown_ones_refused():
    for name in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch_8bit",
                 "adamw_torch_4bit", "adamw_torch", "adamw_torch_fused", "adafactor", "lion_8bit", "sgd"):
        assert parse_config({**BASE, "optimizer": name})[0].optimizer == name
    with pytest.raises(ConfigError, match=r"optimizer: optimi_adamw is not supported \(Axolotl's optimi"):
        parse_config({**BASE, "optimizer": "optimi_adamw"})


def test_a_missing_library_is_named(make_config, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert main(["train", str(make_config(optimizer="adamw_torch_8bit"))]) == 2
    assert "optimizer: adamw_torch_8bit needs the torchao package, which is not installed" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["paged_adamw_8bit", "adamw_bnb_8bit", "paged_adamw_32bit", "lion_8bit",
                                  "adafactor", "adamw_torch_fused", "sgd"])
def test_full_fine_tune_resumes_exactly(make_config, tmp_path, name):
    """Full fine-tune (Axolotl's full-finetune examples use paged 8-bit AdamW): a run resumed from its
    checkpoint takes exactly the steps of the uninterrupted run."""
    common = dict(optimizer=name, max_steps=4, save_steps=2, learning_rate=1e-3, weight_decay=0.01,
                  lr_scheduler="cosine", warmup_steps=1)
    full, _ = train_then_resume(main, make_config, tmp_path, **common)
    a = train_losses(full)
    assert a[4] != a[1]  # the optimizer moved the weights
    if "8bit" in name:  # the state really is 8-bit for big matrices, 32-bit for the embeddings
        state = torch.load(full / "checkpoint-4" / "optimizer.pt", weights_only=False)["state"]
        quant = [s.get("__bnb_optimizer_quant_state__", s) for s in state.values()]  # bitsandbytes 0.50 nests it
        dtypes = {str(s["state1"].dtype) for s in quant if "state1" in s}
        assert dtypes == {"torch.uint8", "torch.float32"}, dtypes
