"""The fit estimate knows the vision tower: a vision-language model's parameters are counted whole (tower and
projector with the language tower, against the model transformers loads), frozen by freeze_mm_modules in a full
fine-tune exactly as the trainer freezes them, and the estimate says what it does not count (image tokens)."""

from __future__ import annotations

from trainer.config import parse_config
from trainer.fit import memory, memory_model
from trainer.runtime.hardware import Runtime, adapt, gpu_from_name


def test_the_vision_tower_is_counted_and_frozen_as_the_trainer_freezes_it(tiny_llava):
    from transformers import AutoModelForImageTextToText

    from trainer.model.vision import freeze

    model = AutoModelForImageTextToText.from_pretrained(tiny_llava)
    shape = memory_model.model_shape(str(tiny_llava))
    assert shape.counted == "meta" and shape.params == sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for n, p in model.named_parameters() if ".vision_tower." in n or "multi_modal_projector" in n)
    assert shape.vision_params == tower > 0 and shape.expert_params == 0  # (its patch convolution is no MoE expert)
    assert any("activations of image tokens are not counted (unverified" in n for n in shape.notes)

    raw = {"base_model": str(tiny_llava), "processor_type": "AutoProcessor", "chat_template": "qwen2_vl",
           "datasets": [{"path": "chat.jsonl", "type": "chat_template"}], "sequence_len": 128,
           "micro_batch_size": 2, "attn_implementation": "sdpa", "learning_rate": 1e-4}
    rt = adapt(parse_config(raw)[0], gpu_from_name("cpu"))
    rt = Runtime(gpu=rt.gpu, attention=rt.attention, precision="fp32", tf32=False)
    for frozen in (False, True):
        cfg, _ = parse_config({**raw, "freeze_mm_modules": frozen})
        setup = memory.setup_from(cfg, rt, 1)
        assert not setup.chunked_loss  # vision-language SFT computes the loss over the full logits
        if frozen:
            freeze(model)
        assert memory.static_terms(shape, setup).trained == sum(p.numel() for p in model.parameters()
                                                                 if p.requires_grad)
