"""gc_collect_steps, the feature added through the feature list (trainer/runtime/gc_collect.py and its entry in
trainer/config/features.py, which declares the key): `python -m trainer validate` names it and no longer lists the
key as ignored, a bad value is one line naming it, a resume may change it, and the loop's hook runs Python's real
garbage collector when Axolotl's GCCallback does (seen through gc.callbacks, not a stand-in)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from trainer import features
from trainer.cli import main
from trainer.config import load_config, resume
from trainer.hooks import Run
from trainer.runtime.gc_collect import CollectEvery


def _training(cfg, tmp_path, eval_every=None, save_every=None, total_steps=12):
    """What the loop passes each feature's hook (trainer.train.Training), before a model is loaded."""
    return SimpleNamespace(context=Run(cfg, output_dir=tmp_path), cfg=cfg, unwrapped=None, optimizer=None,
                           tokenizer=None, data=None, runtime=SimpleNamespace(precision="fp32", attention="sdpa"),
                           output_dir=tmp_path, main=True, sharded=False, tp=1, say=print, eval_every=eval_every,
                           save_every=save_every, total_steps=total_steps)


@pytest.fixture
def full_collections():
    """The steps at which Python's collector ran a full (generation 2) collection, as gc reports them (automatic
    collections off meanwhile: only what is asked for is seen; the objects alive before frozen, so that each
    collection scans only what the test makes, not all of torch)."""
    seen: list[int] = []
    step = [0]

    def callback(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(step[0])

    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    gc.callbacks.append(callback)
    yield seen, step
    gc.callbacks.remove(callback)
    gc.unfreeze()
    if enabled:
        gc.enable()


def _loop(hook, steps: int, step_box) -> None:
    """The loop's calls of a hook (trainer/train.py): start, then before_step / after_step each step."""
    hook.start({}, None)
    for done in range(steps):
        step_box[0] = done
        hook.before_step(done)
        step_box[0] = done + 1
        hook.after_step(done + 1)


def test_validate_names_gc_collect_steps_and_no_longer_ignores_it(make_config, capsys):
    path = make_config(gc_collect_steps=3)
    assert main(["validate", str(path), "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert ("  memory:     Python's garbage collected every 3 steps and before each evaluation and save "
            "(gc_collect_steps)") in out
    assert "gc_collect_steps" not in out.split("ignored", 1)[1] if "ignored" in out else True


def test_a_bad_value_is_one_line_naming_the_key(make_config, capsys):
    assert main(["validate", str(make_config(gc_collect_steps=-2)), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gc_collect_steps" in err[0] and "-1" in err[0], err


def test_a_resume_may_change_it():
    assert resume.CLASSES["gc_collect_steps"] == resume.MAY_CHANGE


def test_the_hook_collects_every_n_steps_and_before_evaluations_and_saves(make_config, tmp_path, full_collections):
    seen, step = full_collections
    cfg, _ = load_config(make_config(gc_collect_steps=4))
    made = [h for h in features.hooks(_training(cfg, tmp_path, eval_every=5, save_every=6)) if h is not None]
    assert [type(h) for h in made] == [CollectEvery]
    _loop(made[0], 12, step)
    # start; every 4th step; before the evaluation at 5 and again at the start of step 7 (Axolotl's next step
    # begin: global_step + 1); before the save at 6; step 10's evaluation (and the start of step 12); step 12
    assert made[0].collected == [0, 4, 5, 6, 6, 8, 10, 11, 12]
    assert seen == made[0].collected  # each one a full collection of Python's collector


def test_minus_one_collects_only_around_evaluations_and_saves(make_config, tmp_path, full_collections):
    seen, step = full_collections
    cfg, _ = load_config(make_config(gc_collect_steps=-1))
    (made,) = [h for h in features.hooks(_training(cfg, tmp_path, eval_every=5)) if h is not None]
    _loop(made, 12, step)
    assert made.collected == seen == [0, 5, 6, 10, 11]


def test_without_the_key_no_hook_and_no_line(make_config, capsys, tmp_path):
    path = make_config()
    assert main(["validate", str(path), "--gpu", "cpu"]) == 0
    assert "garbage" not in capsys.readouterr().out
    cfg, _ = load_config(path)
    assert not any(isinstance(h, CollectEvery) for h in features.hooks(_training(cfg, tmp_path)))
