"""Vision-language fine-tuning's keys (Axolotl's ModelInputConfig.processor_type/processor_kwargs, MultiModalConfig,
freeze_mm_modules), with their rules.

With `processor_type` the model is loaded as an image-text-to-text model and its processor beside the tokenizer;
the datasets are conversations whose turns hold text and image parts (trainer/data/formats/vision.py), rendered and
collated by the processor per batch (trainer/objectives/vision.py), unpacked. `freeze_mm_modules` freezes the vision
(and audio) towers and projectors by name (trainer/model/vision.py), with or without processor_type, as Axolotl does.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainer.config.diffusion import enabled as diffusion_enabled
from trainer.errors import ConfigError


class RoleBoundary(BaseModel):
    """One `role_boundaries:` entry (Axolotl's RoleBoundarySpec): the markers of one role's turn."""

    model_config = ConfigDict(extra="forbid")
    role: str
    start: str
    end: str | None = None  # "eos_token": the tokenizer's EOS; None: the end of the sequence
    include_start: bool = False
    include_end: bool = True


class VisionKeys(BaseModel):
    processor_type: str | None = None  # AutoProcessor, or a transformers processor class by name
    processor_kwargs: dict[str, Any] | None = None  # extra from_pretrained arguments of the processor
    freeze_mm_modules: bool = False  # vision/audio towers and projectors frozen (matrices/vision.toml [freeze])
    # int: padded square; [w, h]: resized; unset: the processor's size {width, height} where it has one
    image_size: int | tuple[int, int] | None = None
    image_resize_algorithm: Literal["bilinear", "bicubic", "lanczos"] | None = None  # default bilinear
    role_boundaries: list[RoleBoundary] | None = None  # replaces the chat template's row of matrices/vision.toml


VISION_ONLY = ("processor_kwargs", "image_size", "image_resize_algorithm", "role_boundaries")


def check(cfg) -> list[str]:
    """What a vision-language config may not ask for here; returns notes, raises ConfigError naming every problem."""
    notes = [f"{key}: no effect without processor_type (only vision-language training reads it)"
             for key in VISION_ONLY if getattr(cfg, key) not in (None, [], {}) and not cfg.processor_type]
    sizes = cfg.image_size if isinstance(cfg.image_size, tuple) else (cfg.image_size,)
    if any(n is not None and n < 1 for n in sizes):
        raise ConfigError(f"image_size: {cfg.image_size}: Input should be greater than 0 (pixels)")
    if not cfg.processor_type:
        return notes
    problems = []
    check_processor_class(cfg.processor_type)
    if cfg.sample_packing:
        problems.append("sample_packing: packing rows with images is not supported (Axolotl 0.19's multimodal "
                        "collator refuses packing too); set sample_packing: false")
    if cfg.objective != "sft":
        problems.append(f"processor_type: vision-language training with {cfg.objective} is not supported here "
                        "(only supervised fine-tuning on chat_template conversations)")

    for key, on in (("use_eaft", cfg.use_eaft), ("plugins: diffusion", diffusion_enabled(cfg))):
        if on:
            problems.append(f"{key} with processor_type is not supported (vision-language rows train with plain "
                            "cross-entropy)")
    for name, entries in (("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets or [])):
        for i, ds in enumerate(entries):
            for key in ("message_field_training", "message_field_training_detail", "split_thinking"):
                if getattr(ds, key):
                    problems.append(f"{name}.{i}.{key} with processor_type is not supported (the vision-language rows "
                                    "train the turns of roles_to_train)")
            if ds.type != "chat_template":
                problems.append(f"{name}.{i}.type: {ds.type} with processor_type is not supported; vision-language "
                                "data is type: chat_template (turns whose content lists text and image parts)")
    if cfg.streamed:
        problems.append("pretraining_dataset / streaming with processor_type is not supported (image rows are "
                        "prepared before training)")
    if problems:
        raise ConfigError("; ".join(problems))
    notes.append("vision-language: rows are not truncated to sequence_len (an image's tokens cannot be cut); "
                 "longer rows are dropped")
    return notes


def check_processor_class(name: str) -> None:
    """processor_type names a transformers processor class (AutoProcessor, Qwen2_5_VLProcessor, ...): judged where
    transformers is installed (the resolver may read a config without it; the trainer's start checks again)."""
    if importlib.util.find_spec("transformers") is None:
        return
    # heavy: transformers loads only when this runs
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        cls = None
    from transformers import ProcessorMixin

    if not (isinstance(cls, type) and (cls is transformers.AutoProcessor or issubclass(cls, ProcessorMixin))):
        raise ConfigError(f"processor_type: {name!r} is not a transformers processor class (e.g. AutoProcessor, "
                          "Qwen2_5_VLProcessor, LlavaProcessor)")
