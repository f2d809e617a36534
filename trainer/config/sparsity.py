"""Sparse fine-tuning's `llmcompressor:` block (Axolotl's LLMCompressorPlugin) and its rules; the masks themselves
are trainer/model/sparsity.py."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from trainer.errors import ConfigError

PLUGIN = "axolotl.integrations.llm_compressor.LLMCompressorPlugin"
PLUGINS = (PLUGIN, "axolotl.integrations.llm_compressor.plugin.LLMCompressorPlugin")  # the module path works too
MODIFIER = "ConstantPruningModifier"


class SparsityConfig(BaseModel):
    """Axolotl's CompressionArgs (integrations/llm_compressor/args.py)."""

    model_config = ConfigDict(extra="forbid")
    recipe: Any = None
    save_compressed: bool = False


def enabled(cfg) -> bool:
    return any(p in PLUGINS for p in cfg.plugins or [])


def modifiers(recipe) -> list[dict]:
    """The ConstantPruningModifier argument dicts of a recipe {<name>_stage: {<group>_modifiers: {Name: args}}}, the
    form llmcompressor's Recipe.from_dict reads (it skips any other key silently: here that is an error)."""
    if not isinstance(recipe, dict) or not recipe:
        raise ConfigError("llmcompressor.recipe: give the recipe inline as a mapping "
                          "(<name>_stage: {<name>_modifiers: {ConstantPruningModifier: {targets: [...], start: 0}}}); "
                          "recipe files and strings are not supported")
    groups = []
    for key, value in recipe.items():
        if not key.endswith("_stage") or not isinstance(value, dict) or not value:
            raise ConfigError(f"llmcompressor.recipe.{key}: expected a <name>_stage mapping of <name>_modifiers "
                              "groups (llmcompressor reads nothing else)")
        for group, mods in value.items():
            if isinstance(mods, list) and all(isinstance(m, dict) and len(m) == 1 for m in mods):
                mods = {name: args for m in mods for name, args in m.items()}  # a list of {Name: options}
            if not group.endswith("_modifiers") or not isinstance(mods, dict):
                raise ConfigError(f"llmcompressor.recipe.{key}.{group}: expected a <name>_modifiers mapping of "
                                  "modifier name to its options")
            groups.append((f"{key}.{group}", mods))
    found = []
    for where, group in groups:
        for name, args in group.items():
            if name != MODIFIER:
                raise ConfigError(f"llmcompressor.recipe.{where}.{name}: only {MODIFIER} is supported (keeping a "
                                  "sparse model's zeros while fine-tuning); pruning/quantizing modifiers are not")
            if args is not None and not isinstance(args, dict):
                raise ConfigError(f"llmcompressor.recipe.{where}.{name}: expected a mapping of its options")
            args = dict(args or {})
            unknown = sorted(set(args) - {"targets", "start", "end"})
            if unknown:
                raise ConfigError(f"llmcompressor.recipe.{where}.{name}: {', '.join(unknown)} not supported "
                                  "(targets and start: 0 are)")
            start = args.get("start")
            if start is None or isinstance(start, bool) or not isinstance(start, (int, float)) or start > 0:
                raise ConfigError(f"llmcompressor.recipe.{where}.{name}.start: set start: 0 (keep the zeros from "
                                  "the first step; llmcompressor never starts a modifier without a start, and later "
                                  "starts are not supported)")
            if "end" in args:
                raise ConfigError(f"llmcompressor.recipe.{where}.{name}.end: not supported (leave it out: the zeros "
                                  "are kept to the end of training; llmcompressor's end: -1 would never start it)")
            targets = args.get("targets")
            targets = [targets] if isinstance(targets, str) else targets
            if not targets or not all(isinstance(t, str) for t in targets):
                raise ConfigError(f"llmcompressor.recipe.{where}.{name}.targets: a list of layer names, "
                                  "\"re:<regex>\" patterns or class names is required")
            for target in targets:
                if target.startswith("re:"):
                    try:
                        re.compile(target[3:])
                    except re.error as err:
                        raise ConfigError(f"llmcompressor.recipe.{where}.{name}.targets: bad regex {target!r}: "
                                          f"{err}") from None
            found.append({"targets": list(targets)})
    if not found:
        raise ConfigError(f"llmcompressor.recipe: no {MODIFIER} in the recipe")
    return found


def check(cfg) -> list[str]:
    """Config-level rules; returns notes."""
    if cfg.llmcompressor is not None and not enabled(cfg):
        raise ConfigError(f"llmcompressor: needs plugins: [{PLUGIN}]")
    if not enabled(cfg):
        return []
    if cfg.llmcompressor is None or cfg.llmcompressor.recipe is None:
        raise ConfigError(f"plugins: {PLUGIN} needs an llmcompressor: block with a recipe")
    modifiers(cfg.llmcompressor.recipe)
    if cfg.adapter:
        raise ConfigError(f"adapter: {cfg.adapter} with the llmcompressor plugin: the base weights are frozen and "
                          "the LoRA update is dense, so a merged model would lose the zeros; train the full model")
    if cfg.deepspeed or cfg.fsdp or cfg.fsdp_config or cfg.fsdp_version or (cfg.tensor_parallel_size or 1) > 1:
        raise ConfigError("llmcompressor: sparse fine-tuning runs with whole weights in each process (one process "
                          "or DDP), not with DeepSpeed, FSDP or tensor parallelism")
    notes = []
    if cfg.llmcompressor.save_compressed:
        notes.append("llmcompressor.save_compressed: the final model is written dense, zeros included (compressed-"
                     "tensors has no sparse formats any more; llmcompressor also writes a sparse-only model dense)")
    return notes


class SparsityKeys(BaseModel):
    # with plugins: [axolotl.integrations.llm_compressor.LLMCompressorPlugin] (trainer/model/sparsity.py)
    llmcompressor: SparsityConfig | None = None
