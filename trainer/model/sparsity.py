"""Sparse fine-tuning: Axolotl's LLMCompressorPlugin with an `llmcompressor:` recipe of ConstantPruningModifier.

What Axolotl does (src/axolotl/integrations/llm_compressor/plugin.py, with llmcompressor's
modifiers/pruning/constant/base.py): at train begin (after a checkpoint's weights are loaded) the session is
initialized; ConstantPruningModifier with `start: 0` takes, for the weight of every module its `targets` match,
the mask |w| > 1e-8 (llmcompressor's `_epsilon = 10e-9`), and after every optimizer step (Axolotl's on_step_end
fires optim_post_step) multiplies the weight by that mask. So a weight that is zero when training starts stays
zero; the others train as usual. The masks are not saved (not persistent buffers): a resumed run takes them again
from the resumed weights, which carry the same zeros. Here the same is done by `Pruning.after_step()`, which the
loop calls right after optimizer.step().

llmcompressor itself is not used: every release that has ConstantPruningModifier for this stack (0.14) pins
transformers<=5.17, below the tested transformers. So only that modifier is implemented, with `targets` and
`start: 0` (or below: from the first step; llmcompressor's Modifier.should_start never starts one whose start is
unset, and with any `end` set to -1 it never starts either, so those are refused, as are later starts and every
other modifier or option, each in one line naming it).
Targets are matched as llmcompressor matches them: "re:<regex>" by re.match, anything else by exact name or a
module class name (e.g. Linear); a name is tried as the module's name and also as its weight's name. The second is
for Axolotl's example, whose targets name weights ("re:.*q_proj.weight"): llmcompressor 0.14 matches module names
only (compressed-tensors' match_named_modules), so there they match nothing, and Axolotl's plugin builds its recipe
with Recipe.model_validate(dict), which in 0.14 yields no modifiers at all: with today's llmcompressor the example
keeps no zeros. Here it keeps them, as the example means. Checked against llmcompressor 0.14.0.1 itself (in a
separate environment, bench/llmcompressor_oracle.py): with targets it matches (module regexes, "Linear") its
session and this module give bit-identical weights after AdamW steps. The recipe is read as Recipe.from_dict
reads one: <name>_stage: {<name>_modifiers: {Modifier: options}}; other keys, which it skips, are refused here.

`save_compressed: true`: compressed-tensors (0.15+) no longer has sparse compressors, and llmcompressor then writes
a sparse-only model dense (get_model_compressor warns "Sparse compression is no longer supported"); the final
model here is written dense too, with its zeros, and a note says so.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from trainer.errors import ConfigError
from trainer.hooks import Hook

if TYPE_CHECKING:
    import torch

PLUGIN = "axolotl.integrations.llm_compressor.LLMCompressorPlugin"
PLUGINS = (PLUGIN, "axolotl.integrations.llm_compressor.plugin.LLMCompressorPlugin")  # the module path works too
EPSILON = 10e-9  # llmcompressor's ConstantPruningModifier._epsilon: |w| <= this counts as a zero
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


def _matches(target: str, name: str, module: torch.nn.Module) -> bool:
    names = (name, f"{name}.weight")
    if target.startswith("re:"):
        return any(re.match(target[3:], n) for n in names)
    return target in names or any(cls.__name__ == target for cls in type(module).__mro__)


class Pruning:
    """ConstantPruningModifier: the targeted weights' zero pattern, taken now, re-applied after every step."""

    def __init__(self, cfg, model: torch.nn.Module, say=print):
        import torch  # here, not at the top: config validation imports this module and needs no torch

        targets = [t for m in modifiers(cfg.llmcompressor.recipe) for t in m["targets"]]
        self.masks: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        seen = set()
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter) or id(weight) in seen:
                continue
            if any(_matches(t, name, module) for t in targets):
                seen.add(id(weight))
                with torch.no_grad():
                    self.masks.append((weight, weight.detach().abs() > EPSILON))
        if not self.masks:
            raise ConfigError(f"llmcompressor: the recipe's targets ({', '.join(targets)}) match no layer's weight")
        total = sum(m.numel() for _, m in self.masks)
        zeros = total - sum(int(m.sum()) for _, m in self.masks)
        say(f"llmcompressor: keeping the zeros of {len(self.masks)} weights ({zeros / total:.1%} of their "
            f"{total:,} values are zero)")

    def after_step(self) -> None:
        for weight, mask in self.masks:
            weight.data.mul_(mask)  # outside autograd, as under no_grad


class KeepZeros(Hook):
    """The loop's part: the masks are taken when training starts (after a resumed checkpoint's weights load, so
    from the zeros training continues from), and applied again after every optimizer step."""

    def __init__(self, cfg, model, say=print):
        self.cfg, self.model, self.say, self.pruning = cfg, model, say, None

    def start(self, state: dict, checkpoint) -> None:
        self.pruning = Pruning(self.cfg, self.model, self.say)

    def after_step(self, step: int) -> None:
        self.pruning.after_step()


def hook(cfg, model, say=print) -> Hook | None:
    return KeepZeros(cfg, model, say) if cfg.llmcompressor is not None else None
