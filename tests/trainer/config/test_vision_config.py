"""Vision-language keys (trainer/config/vision.py) as `validate` reads them: Axolotl's multimodal example is accepted
with the objective named, and what this trainer cannot do with images is one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import load_config
from trainer.errors import ConfigError

EXAMPLE = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "qwen2_5-vl__lora-7b.yaml"


def config(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw.update(changes)
    path = tmp_path / "vlm.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_axolotls_qwen2_5_vl_example_trains_as_vision_language_sft(tmp_path):
    from trainer import objectives

    cfg, notes = load_config(config(tmp_path))
    assert objectives.objective_class(cfg).__name__ == "VisionSFT"
    assert objectives.describe(cfg).startswith("vision-language SFT: AutoProcessor from Qwen/Qwen2.5-VL-7B-Instruct")
    assert any("rows are not truncated to sequence_len" in n for n in notes)


@pytest.mark.parametrize("changes, says", [
    ({"sample_packing": True}, "sample_packing: packing rows with images is not supported"),
    ({"processor_type": "AutoTokenizer"}, "processor_type: 'AutoTokenizer' is not a transformers processor class"),
    ({"rl": "dpo"}, "processor_type: vision-language training with dpo is not supported here"),
    ({"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}, "datasets.0.type: alpaca with processor_type is not "
                                                             "supported"),
    ({"image_size": 0}, "image_size: 0: Input should be greater than 0"),
    ({"image_resize_algorithm": "nearest"}, "image_resize_algorithm"),
])
def test_what_images_cannot_do_here_is_one_line(changes, says, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(config(tmp_path, **changes))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_image_keys_without_a_processor_say_they_do_nothing(tmp_path):
    path = tmp_path / "text.yml"
    path.write_text(yaml.safe_dump({"base_model": "NousResearch/Llama-3.2-1B", "learning_rate": 1e-4,
                                    "datasets": [{"path": "tatsu-lab/alpaca", "type": "alpaca"}], "image_size": 448,
                                    "freeze_mm_modules": True}))
    cfg, notes = load_config(path)
    assert "image_size: no effect without processor_type (only vision-language training reads it)" in notes
    assert cfg.freeze_mm_modules  # honoured on its own: a multimodal model trained on text (Gemma 4)
