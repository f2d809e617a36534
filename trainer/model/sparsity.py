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
from typing import TYPE_CHECKING

from trainer.config.sparsity import modifiers  # the recipe, as the config checked it
from trainer.errors import ConfigError
from trainer.hooks import Hook

if TYPE_CHECKING:
    import torch

EPSILON = 10e-9  # llmcompressor's ConstantPruningModifier._epsilon: |w| <= this counts as a zero


def _matches(target: str, name: str, module: torch.nn.Module) -> bool:
    names = (name, f"{name}.weight")
    if target.startswith("re:"):
        return any(re.match(target[3:], n) for n in names)
    return target in names or any(cls.__name__ == target for cls in type(module).__mro__)


class Pruning:
    """ConstantPruningModifier: the targeted weights' zero pattern, taken now, re-applied after every step."""

    def __init__(self, cfg, model: torch.nn.Module, say=print):
        # heavy: torch loads only when this runs
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
