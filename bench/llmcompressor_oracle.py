"""Cross-check trainer/model/sparsity.py against llmcompressor's own ConstantPruningModifier (a one-off, not CI).

llmcompressor 0.14 pins transformers<=5.17, so it cannot live in the project's environment. Run this in a
throwaway venv that sees the project's packages and adds llmcompressor without its dependencies:

    python3 -m venv /tmp/lc && echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > /tmp/lc/lib/python3.11/site-packages/shared.pth
    /tmp/lc/bin/python -m pip install --no-deps llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /tmp/lc/bin/python bench/llmcompressor_oracle.py

A tiny llama is made 2:4 sparse (plus one value per weight at 5e-9, below llmcompressor's 1e-8 threshold), then
trained 4 AdamW steps twice: driven through an llmcompressor session as Axolotl's plugin drives it (batch_start,
optimizer step, optim_pre_step, optim_post_step, batch_end), and with trainer.model.sparsity.Pruning.after_step().
Exit 0 when, for every recipe llmcompressor applies, both give bit-identical weights. It also prints what
llmcompressor does with Axolotl's example recipe (result on 2026-11-22: Recipe.model_validate gives 0 modifiers,
and through Recipe.from_dict its "re:.*q_proj.weight" targets match no module: no zeros kept).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import yaml
from llmcompressor import active_session, create_session
from llmcompressor.core import callbacks
from llmcompressor.recipe import Recipe

from trainer.config import parse_config
from trainer.config.sparsity import PLUGIN
from trainer.model.sparsity import Pruning
from trainer.model.tiny import build_model, build_tokenizer

EXAMPLE = Path(__file__).parents[1] / "tests/trainer/fixtures/axolotl_examples/llama-3__sparse-finetuning.yaml"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sparse_model(tokenizer):
    model = build_model(tokenizer, "llama", seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-2] in PROJ:
                groups = p.view(p.shape[0], -1, 4)
                groups.scatter_(-1, groups.abs().argsort(-1)[..., :2], 0.0)
                p[tuple((p != 0).nonzero()[0])] = 5e-9
    return model


def train(base, tokenizer, block: dict, ours: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if ours:
        cfg, _ = parse_config({"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}],
                               "plugins": [PLUGIN], "llmcompressor": block})
        pruning = Pruning(cfg, model, lambda *_: None)
    else:
        create_session()
        active_session().initialize(model=model, optimizer=opt, start=0.0, recipe=Recipe.from_dict(block["recipe"]))
    for step in range(4):
        ids = torch.randint(3, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(step))
        if not ours:
            callbacks.batch_start()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if ours:
            pruning.after_step()
        else:
            callbacks.optim_pre_step()
            callbacks.optim_post_step()
            callbacks.batch_end()
    if not ours:
        active_session().finalize()
        active_session().reset()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> int:
    tokenizer = build_tokenizer()
    base = sparse_model(tokenizer)
    start = base.state_dict()
    example = yaml.safe_load(EXAMPLE.read_text())["llmcompressor"]
    print(f"Axolotl's Recipe.model_validate(example recipe): {len(Recipe.model_validate(example['recipe']).modifiers)} "
          "modifiers")
    kept = train(base, tokenizer, example, ours=False)
    lost = any(not torch.equal(kept[n] != 0, start[n].abs() > 1e-8) for n in kept if n.split(".")[-2] in PROJ)
    print(f"llmcompressor with the example's targets through Recipe.from_dict: zeros {'lost' if lost else 'kept'}")
    ok = True
    for label, targets in {"module regexes": [f"re:.*{p}$" for p in PROJ], "class name Linear": ["Linear"]}.items():
        block = {"recipe": {"finetuning_stage": {"finetuning_modifiers": {"ConstantPruningModifier": {
            "targets": targets, "start": 0}}}}}
        theirs, mine = train(base, tokenizer, block, ours=False), train(base, tokenizer, block, ours=True)
        same = all(torch.equal(theirs[n], mine[n]) for n in theirs)
        moved = any(not torch.equal(theirs[n], start[n]) for n in theirs)
        print(f"{label}: trainer.model.sparsity == llmcompressor bit for bit: {same}")
        ok = ok and same and moved
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
