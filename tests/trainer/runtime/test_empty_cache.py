"""torch_empty_cache_steps, the feature added through trainer/features.py (its module, one FEATURES entry): validate
names it, the loop's hooks include it, and it empties the cache on every Nth step."""

from __future__ import annotations

from types import SimpleNamespace

from trainer import features
from trainer.cli import main
from trainer.config import load_config
from trainer.hooks import Run
from trainer.runtime.empty_cache import EmptyCacheEvery


def _run(cfg, tmp_path):
    """What the loop passes each feature's hook (trainer.train.Training), before a model is loaded."""
    return SimpleNamespace(context=Run(cfg, output_dir=tmp_path), cfg=cfg, unwrapped=None, optimizer=None, tokenizer=None, data=None,
                           runtime=SimpleNamespace(precision="fp32", attention="sdpa"), output_dir=tmp_path,
                           main=True, sharded=False, tp=1, say=print)


def test_validate_names_torch_empty_cache_steps_and_the_loop_gets_its_hook(make_config, capsys, tmp_path):
    path = make_config(torch_empty_cache_steps=3)
    assert main(["validate", str(path), "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "  memory:     the accelerator's cache emptied every 3 steps (torch_empty_cache_steps)" in out
    assert "ignored" not in out or "torch_empty_cache_steps" not in out.split("ignored", 1)[1]  # honoured

    cfg, _ = load_config(path)
    made = [h for h in features.hooks(_run(cfg, tmp_path)) if h is not None]
    assert [type(h) for h in made] == [EmptyCacheEvery]
    for step in range(1, 10):
        made[0].after_step(step)
    assert made[0].emptied == 3  # steps 3, 6, 9


def test_without_the_key_validate_says_nothing_and_no_hook(make_config, capsys, tmp_path):
    path = make_config()
    assert main(["validate", str(path), "--gpu", "cpu"]) == 0
    assert "memory:" not in capsys.readouterr().out
    cfg, _ = load_config(path)
    assert [h for h in features.hooks(_run(cfg, tmp_path)) if h is not None] == []
