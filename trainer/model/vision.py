"""freeze_mm_modules: the vision and audio towers and their projectors frozen (Axolotl's utils/freeze.py), so only
the language tower trains. (A vision-language config loads with AutoModelForImageTextToText:
trainer/model/reward_model.py auto_class.)"""

from __future__ import annotations

from trainer.data.formats.vision import freeze_components


def freeze(model) -> int:
    """requires_grad off for every parameter with a component named in matrices/vision.toml [freeze] (e.g.
    model.vision_tower.*, model.multi_modal_projector.*); returns how many were frozen."""
    names = set(freeze_components())
    frozen = 0
    for name, param in model.named_parameters():
        if param.requires_grad and names & set(name.split(".")):
            param.requires_grad = False
            frozen += 1
    return frozen

