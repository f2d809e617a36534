"""Vision-language SFT (trainer/objectives/vision.py) on a tiny LLaVA built locally: the prepared rows, a batch as
the processor collates it (images in, only the assistant's tokens trained), freeze_mm_modules and LoRA on the
language tower in process; one slow test trains, merges and exports through the commands a user types."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import REPO, image_chat_rows, train_losses, write_jsonl
from trainer.config import load_config
from trainer.errors import DataError

LANGUAGE_LORA = r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"  # Axolotl's form


def vision_config(tmp_path: Path, model: Path, rows: list[dict] | None = None, **overrides) -> Path:
    rows = rows if rows is not None else image_chat_rows(tmp_path / "images", 6)
    data = write_jsonl(tmp_path / "images" / "chat.jsonl", rows)
    cfg = {"base_model": str(model), "processor_type": "AutoProcessor", "chat_template": "qwen2_vl",
           "skip_prepare_dataset": True, "remove_unused_columns": False, "sample_packing": False,
           "datasets": [{"path": str(data), "type": "chat_template"}], "sequence_len": 128,
           "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4, "learning_rate": 1e-2,
           "optimizer": "adamw_torch", "lr_scheduler": "constant", "attn_implementation": "sdpa",
           "output_dir": str(tmp_path / "out"), "dataset_prepared_path": str(tmp_path / "prepared"), "seed": 1,
           **overrides}
    path = tmp_path / "vlm.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def objective(cfg):
    from trainer.data.prepare import load_tokenizer
    from trainer.objectives import objective_class

    cls = objective_class(cfg)
    assert cls.__name__ == "VisionSFT"
    return cls, load_tokenizer(cfg)


def test_rows_are_checked_measured_and_collated_with_their_images(tiny_llava, tmp_path):
    rows = image_chat_rows(tmp_path / "images", 6)
    rows.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "long " * 200}]},
                              {"role": "assistant", "content": "too long"}]})
    cfg, _ = load_config(vision_config(tmp_path, tiny_llava, rows))
    cls, tokenizer = objective(cfg)
    prepared = cls.prepare_data(cfg, tokenizer, log=lambda *_: None)
    assert len(prepared.train) == 6 and prepared.stats["dropped_too_long"] == 1  # never truncated through images
    obj = cls.from_config(cfg, None, None)
    batch = obj.collate([obj.rows(prepared.train)[[0]], obj.rows(prepared.train)[[1]]])
    assert batch["pixel_values"].shape == (2, 3, 28, 28)  # two images, at the vision tower's size
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ((batch["input_ids"] == image_id).sum(dim=1) == 4).all()  # 2x2 patches each
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        trained = tokenizer.decode(ids[labels != -100])
        assert re.fullmatch(r"It is (red|green|blue)\.<\|im_end\|>", trained), trained  # the assistant's turn only
    assert int(batch["num_tokens"]) == int(batch["attention_mask"].sum())

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_llava)
    loss, metrics = obj.loss(model, batch, {"target_tokens": obj.step_stats(model, batch)[0]})
    loss.backward()
    assert loss.item() == pytest.approx(metrics[0].item() / obj.step_stats(model, batch)[0], rel=1e-5)
    tower = model.model.vision_tower.embeddings.patch_embedding.weight.grad
    assert tower is not None and tower.abs().sum() > 0  # the image reached the loss


def test_gemma3_trains_its_model_turns_with_images_attended_both_ways(tiny_gemma3_vision, tmp_path):
    """Gemma 3's markers (matrices/vision.toml gemma3: <start_of_turn>model ... <end_of_turn>), one BOS though its
    template writes it, and the processor's token_type_ids passed on (the model attends within an image both ways)."""
    cfg, _ = load_config(vision_config(tmp_path, tiny_gemma3_vision, chat_template="gemma3"))
    cls, tokenizer = objective(cfg)
    prepared = cls.prepare_data(cfg, tokenizer, log=lambda *_: None)
    obj = cls.from_config(cfg, None, None)
    batch = obj.collate([obj.rows(prepared.train)[[0]], obj.rows(prepared.train)[[1]]])
    assert batch["token_type_ids"].sum(dim=1).tolist() == [4, 4]  # the image's soft tokens
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        assert (ids == tokenizer.bos_token_id).sum() == 1
        assert re.fullmatch(r"It is (red|green|blue)\.<end_of_turn>", tokenizer.decode(ids[labels != -100]))
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_gemma3_vision).train()
    loss, _ = obj.loss(model, batch, {"target_tokens": obj.step_stats(model, batch)[0]})
    loss.backward()
    assert 0 < loss.item() < 20 and model.model.vision_tower.embeddings.patch_embedding.weight.grad.abs().sum() > 0


def test_a_url_or_a_missing_image_stops_preparation_naming_the_row(tiny_llava, tmp_path):
    rows = image_chat_rows(tmp_path / "images", 3)
    rows[2]["messages"][0]["content"][0] = {"type": "image", "url": "http://example.com/a.png"}
    cfg, _ = load_config(vision_config(tmp_path, tiny_llava, rows))
    cls, tokenizer = objective(cfg)
    with pytest.raises(DataError, match=r"chat.jsonl row 3 turn 0: image url http://example.com/a.png cannot be "
                                        r"fetched \(training reads no network\)"):
        cls.prepare_data(cfg, tokenizer, log=lambda *_: None)


def test_freeze_mm_modules_and_lora_leave_only_the_language_tower_trained(tiny_llava, tmp_path):
    from transformers import AutoModelForImageTextToText

    from trainer.model.load import add_lora
    from trainer.model.vision import freeze

    model = AutoModelForImageTextToText.from_pretrained(tiny_llava)
    frozen = freeze(model)
    towers = [n for n, _ in model.named_parameters() if ".vision_tower." in n or ".multi_modal_projector." in n]
    assert frozen == len(towers) > 0
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(towers)
    cfg, _ = load_config(vision_config(tmp_path, tiny_llava, adapter="lora", lora_target_modules=LANGUAGE_LORA))
    peft = add_lora(cfg, AutoModelForImageTextToText.from_pretrained(tiny_llava))
    trained = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trained and all(".language_model.layers." in n and ".lora_" in n for n in trained)
    assert {n.split(".language_model.layers.")[1].split(".lora_")[0] for n in trained} >= {
        "0.self_attn.q_proj", "1.mlp.down_proj"}


@pytest.mark.slow  # trains in a subprocess through `envtool train` (~30 s), then merges and exports
def test_envtool_trains_merges_and_refuses_gguf_for_a_vision_language_model(tiny_llava, tmp_path, capsys,
                                                                            monkeypatch):
    import os
    import subprocess
    import sys

    config = vision_config(tmp_path, tiny_llava, adapter="lora", lora_r=8, lora_target_modules=LANGUAGE_LORA,
                           freeze_mm_modules=True, max_steps=5, logging_steps=1, val_set_size=0.25)
    env = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "resolver", "train", str(config), "--gpu", "cpu"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vision-language: training the turns of assistant" in out.stdout + out.stderr
    losses = train_losses(tmp_path / "out")
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(v == v and v < 20 for v in losses.values())
    assert losses[5] < losses[1]
    final = tmp_path / "out" / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "processor_config.json").is_file()

    from trainer.cli import main  # merge and export in this process (the same commands, without a second start-up)

    monkeypatch.chdir(tmp_path)
    # `evaluate` scores the saved adapter as the run's last evaluation did (the same rows, images and masking)
    capsys.readouterr()
    assert main(["evaluate", str(config), "--json"]) == 0
    last = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert json.loads(capsys.readouterr().out)["eval_loss"] == pytest.approx(
        [r["eval_loss"] for r in last if "eval_loss" in r][-1], rel=1e-5)
    assert main(["merge-lora", str(config)]) == 0
    # the merged model is the base with the adapter applied: the same logits as base + adapter, and it loads with
    # its processor as a user would load it
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tmp_path / "out" / "merged")
    from PIL import Image

    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}],
        tokenize=False, add_generation_prompt=True)
    batch = processor(text=[text], images=[Image.new("RGB", (30, 28), (220, 20, 20))], return_tensors="pt")
    with torch.no_grad():
        one = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "merged")(**batch).logits
        base = AutoModelForImageTextToText.from_pretrained(tiny_llava)
        two = PeftModel.from_pretrained(base, str(final))(**batch).logits
    assert torch.allclose(one, two, atol=1e-4)
    assert json.loads((tmp_path / "out" / "merged" / "config.json").read_text())["model_type"] == "llava"

    capsys.readouterr()
    assert main(["export", str(config), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "export: model_type 'llava' is not exported to GGUF here" in err and len(err.strip().splitlines()) == 1
