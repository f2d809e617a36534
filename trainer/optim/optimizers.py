"""Optimizers by name: matrices/optimizers.toml says which names exist and which library implements each;
transformers' Trainer.get_optimizer_cls_and_kwargs builds them (the mapping the HF Trainer and Axolotl use),
so adamw_bnb_8bit is bitsandbytes' AdamW with 8-bit state, paged_adamw_32bit its paged 32-bit one,
adamw_torch_8bit torchao's AdamW8bit, and so on. torch's AdamW (adamw_torch, adamw_torch_fused) is built to that
mapping here, without importing the Trainer (`torch_adamw`).

Weight decay skips biases and norm weights (parameters with fewer than 2 dimensions). 8-bit bitsandbytes
optimizers keep embeddings' state in 32 bits, as the HF Trainer does (8-bit embedding state is unstable).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

from trainer import facts
from trainer.config.training import check_optimizer as check
from trainer.config.training import optimizer_table as table  # noqa: F401 (the names, by library)
from trainer.errors import ConfigError, HardwareError


def hardware_notes(name: str, gpu) -> list[str]:
    """Raise HardwareError if the optimizer's library feature cannot run on this GPU; return notes."""
    row = check(name)
    notes = []
    if row.get("feature"):
        feat = facts.feature(row["feature"])
        if gpu.cc is None:
            if not feat.get("cpu"):
                raise HardwareError(f"optimizer: {name} needs a CUDA GPU ({feat['reason']})")
            notes.append(f"optimizer: {name} runs on CPU through {feat['package']}'s CPU backend ({feat['reason']})")
        else:
            floor = tuple(int(x) for x in feat["min_cc"].split("."))
            if gpu.cc < floor:
                raise HardwareError(
                    f"optimizer: {name} needs sm_{floor[0]}{floor[1]}+ for {feat['package']} {feat['reason']}; "
                    f"{gpu.describe()} is below (source: {feat['source']}); use adamw_torch")
    return notes


def make_optimizer(cfg, model):
    """Build the config's optimizer over the trainable parameters (two groups: with and without decay)."""
    import torch  # heavy: torch loads only when training

    row = check(cfg.optimizer)
    # torch's Muon + AdamW split as Axolotl's muon does it (optimizers.toml's name for trainer/optim/muon.py)
    if row.get("built_by") == "trainer.muon":
        from trainer.optim.muon import build

        return build(cfg, model)
    if importlib.util.find_spec(row["library"]) is None:
        raise ConfigError(f"optimizer: {cfg.optimizer} needs the {row['library']} package, which is not installed "
                          f"(pip install {row['library']}, or pick adamw_torch)")
    groups = param_groups(cfg, [(n, p) for n, p in model.named_parameters() if p.requires_grad])
    optim_args = cfg.optim_args
    if isinstance(optim_args, dict):
        optim_args = ",".join(f"{k}={v}" for k, v in optim_args.items())
    args = SimpleNamespace(optim=row.get("transformers_name", row["name"]), learning_rate=cfg.learning_rate,
                           adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_epsilon,
                           optim_args=optim_args or None, weight_decay=cfg.weight_decay)
    try:
        cls, kwargs = torch_adamw(args) or _transformers_optimizer(args, model)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"optimizer: {cfg.optimizer}: {str(err).splitlines()[0]}") from None
    if cfg.loraplus_lr_ratio is not None:  # LoRA+: peft's own groups (Axolotl's create_optimizer)
        from peft.optimizers import create_loraplus_optimizer  # heavy: peft loads only here

        embedding_lr = 1e-6 if cfg.loraplus_lr_embedding is None else cfg.loraplus_lr_embedding
        optimizer = create_loraplus_optimizer(model, cls, loraplus_lr_ratio=cfg.loraplus_lr_ratio,
                                              loraplus_lr_embedding=embedding_lr, **kwargs)
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]  # (no empty group: below)
    else:
        optimizer = cls(groups, **kwargs)
    if "bitsandbytes" in cls.__module__ and kwargs.get("optim_bits") == 8:
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def param_groups(cfg, named: list) -> list[dict]:
    """The trainable parameters' groups: with and without weight decay (1-d: biases, norms); with embedding_lr /
    embedding_lr_scale / lr_groups, as Axolotl's create_optimizer_grouped_parameters: the embeddings (embed_tokens,
    lm_head, a saved module's weight) apart without decay at learning_rate x embedding_lr_scale, else at embedding_lr,
    and each lr_group's decayed parameters (a name containing one of its modules) at its lr. No empty group: DeepSpeed
    ZeRO-3 drops empty groups, leaving the schedule one group short (LoRA has no 1-d parameters)."""
    lr = cfg.learning_rate
    if not (cfg.embedding_lr or cfg.embedding_lr_scale or cfg.lr_groups):
        groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]
    embedding = lr * cfg.embedding_lr_scale if cfg.embedding_lr_scale else cfg.embedding_lr or lr
    owner = {m: g for g in cfg.lr_groups or [] for m in g.modules}
    decay, embeddings, rest, by_group = [], [], [], {g.name: [] for g in cfg.lr_groups or []}
    for name, p in named:
        if name.endswith("modules_to_save.default.weight") or "embed_tokens" in name or "lm_head" in name:
            embeddings.append(p)
        elif p.ndim < 2:
            rest.append(p)
        else:
            found = next((m for m in owner if m in name), None)
            (by_group[owner[found].name] if found else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "lr": lr},
              {"params": embeddings, "weight_decay": 0.0, "lr": embedding},
              {"params": rest, "weight_decay": 0.0, "lr": lr}]
    groups += [{"params": by_group[g.name], "weight_decay": cfg.weight_decay, "lr": g.lr} for g in cfg.lr_groups or []]
    return [g for g in groups if g["params"]]


ADAMW_TORCH = ("adamw_torch", "adamw_torch_fused")  # transformers' names for torch's AdamW (_get_adamw_torch)


def torch_adamw(args) -> tuple | None:
    """(torch.optim.AdamW, kwargs) as transformers' Trainer.get_optimizer_cls_and_kwargs gives them for adamw_torch
    and adamw_torch_fused with no optim_args (the test checks the two agree); None for any other optimizer. Built
    here because importing transformers' Trainer imports peft and bitsandbytes: about 1.5 s of every run's start."""
    if args.optim not in ADAMW_TORCH or args.optim_args:
        return None
    from torch.optim import AdamW  # heavy: torch loads only when training

    kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if args.optim == "adamw_torch_fused":
        kwargs["fused"] = True
    return AdamW, kwargs


def _transformers_optimizer(args, model) -> tuple:
    from transformers import Trainer  # heavy: imports peft and bitsandbytes (the optimizers torch_adamw does not build)

    return Trainer.get_optimizer_cls_and_kwargs(args, model)
