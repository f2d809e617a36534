"""Every lr_scheduler Axolotl trains with: transformers' SchedulerType names (through get_scheduler, with
lr_scheduler_kwargs) and Axolotl's own one_cycle and rex, checked against their sources: transformers' enum and
Axolotl's RexLR from the axolotl package .ci/setup installs (.ci-cache/axolotl-oracle)."""

from __future__ import annotations

import importlib.util
import typing
from pathlib import Path

import pytest

from tests.trainer.helpers import read_metrics
from trainer.cli import main
from trainer.config import parse_config
from trainer.config.training import METRIC_SCHEDULES, OWN_SCHEDULES, TrainingKeys

ROOT = Path(__file__).resolve().parents[3]
AXOLOTL_SCHEDULERS = ROOT / ".ci-cache" / "axolotl-oracle" / "axolotl" / "utils" / "schedulers.py"
RATIOS = (None, 0.0, 0.1, 0.5)
BASE = {"base_model": "x", "datasets": [{"path": "x", "type": "alpaca"}], "learning_rate": 1e-3}


def axolotl_schedulers():
    """Axolotl's schedulers module, loaded on its own (it imports only torch)."""
    from tests.support.oracle import require

    require(AXOLOTL_SCHEDULERS)
    spec = importlib.util.spec_from_file_location("axolotl_schedulers", AXOLOTL_SCHEDULERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lrs_of(scheduler, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def one_param_optimizer(lr: float):
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_the_names_taken_are_transformers_schedules_and_axolotls_own():
    from transformers import SchedulerType

    taken = set(typing.get_args(TrainingKeys.model_fields["lr_scheduler"].annotation))
    assert taken == {s.value for s in SchedulerType} | set(OWN_SCHEDULES)


def test_rex_is_axolotls_rexlr_step_for_step():
    from hypothesis import given, settings, strategies as st

    from trainer.optim.schedule import make_scheduler

    rex = axolotl_schedulers().RexLR
    configs = {r: parse_config({**BASE, "lr_scheduler": "rex", "cosine_min_lr_ratio": r})[0] for r in RATIOS}

    @settings(max_examples=100, deadline=None, derandomize=True)
    @given(total=st.integers(1, 40), warmup_share=st.floats(0, 1), ratio=st.sampled_from(RATIOS))
    def check(total, warmup_share, ratio):
        warmup = int(total * warmup_share)
        cfg = configs[ratio]
        ours = one_param_optimizer(1e-3)
        theirs = one_param_optimizer(1e-3)
        # as Axolotl's SchedulerMixin builds it: min_lr from cosine_min_lr_ratio when set (rex runs as 'cosine')
        expected = lrs_of(rex(theirs, max_lr=1e-3, min_lr=1e-3 * (ratio or 0), total_steps=total,
                              num_warmup_steps=warmup), theirs, total)
        assert lrs_of(make_scheduler(cfg, ours, warmup, total), ours, total) == pytest.approx(expected, rel=1e-12)

    check()


def test_a_rex_run_logs_axolotls_rates_and_one_cycle_takes_its_kwargs(make_config, tmp_path):
    """Through the trainer's command: the learning rates logged per step are the schedule's."""
    config = make_config(lr_scheduler="rex", warmup_steps=2, max_steps=6, cosine_min_lr_ratio=0.1)
    assert main(["train", str(config)]) == 0
    theirs = one_param_optimizer(1e-3)
    expected = lrs_of(axolotl_schedulers().RexLR(theirs, max_lr=1e-3, min_lr=1e-4, total_steps=6, num_warmup_steps=2),
                      theirs, 6)
    assert [r["lr"] for r in read_metrics(tmp_path / "out") if "lr" in r] == pytest.approx(expected, rel=1e-9)

    out = tmp_path / "cycle"
    config = make_config("cycle.yml", lr_scheduler="one_cycle", lr_scheduler_kwargs={"div_factor": 10.0},
                         warmup_steps=2, max_steps=6, output_dir=str(out))
    assert main(["train", str(config)]) == 0
    lrs = [r["lr"] for r in read_metrics(out) if "lr" in r]
    # torch's OneCycleLR as Axolotl builds it: from learning_rate / div_factor up to learning_rate (its rise lasts
    # pct_start x steps - 1 steps), then a cosine down
    assert lrs[0] == pytest.approx(1e-4) and max(lrs) == pytest.approx(1e-3) and lrs[-1] < lrs[0]


@pytest.mark.parametrize("name", ["cosine_with_restarts", "polynomial", "inverse_sqrt", "warmup_stable_decay",
                                  "cosine_warmup_with_min_lr"])
def test_transformers_schedules_are_built_by_transformers(name):
    from transformers import get_scheduler

    from trainer.optim.schedule import make_scheduler

    kwargs = {"min_lr_rate": 0.1} if "min_lr" in name else {"num_decay_steps": 4} if name == "warmup_stable_decay" else {}
    cfg, _ = parse_config({**BASE, "lr_scheduler": name, "lr_scheduler_kwargs": kwargs or None})
    ours, theirs = one_param_optimizer(1e-3), one_param_optimizer(1e-3)
    expected = lrs_of(get_scheduler(name, theirs, num_warmup_steps=3, num_training_steps=12,
                                    scheduler_specific_kwargs=kwargs), theirs, 12)
    assert lrs_of(make_scheduler(cfg, ours, 3, 12), ours, 12) == pytest.approx(expected, rel=1e-12)


def test_refusals_are_one_line_naming_the_key(make_config, capsys):
    for name in METRIC_SCHEDULES:
        assert main(["validate", str(make_config(lr_scheduler=name))]) == 2
        err = capsys.readouterr().err
        assert f"lr_scheduler: {name} steps on evaluation metrics" in err
    assert main(["validate", str(make_config(lr_scheduler="cosine_with_min_lr",
                                             lr_scheduler_kwargs={"min_lr_rat": 0.1}))]) == 2
    err = capsys.readouterr().err
    assert "lr_scheduler_kwargs: " in err and "min_lr_rat" in err and "Traceback" not in err
    assert main(["validate", str(make_config(lr_scheduler="one_cycle", warmup_steps=1))]) == 2
    assert "one_cycle with exactly 1 warmup step" in capsys.readouterr().err
    assert main(["validate", str(make_config(lr_scheduler="rexx"))]) == 2
    assert "lr_scheduler: got 'rexx'" in capsys.readouterr().err


def test_kwargs_a_schedule_does_not_read_are_named():
    _, notes = parse_config({**BASE, "lr_scheduler": "rex", "lr_scheduler_kwargs": {"num_cycles": 2}})
    assert any(n.startswith("lr_scheduler_kwargs: not read") for n in notes)


def test_the_schedules_built_without_transformers_are_get_schedulers_step_for_step():
    """linear, cosine (with cosine_min_lr_ratio: cosine_with_min_lr), constant and constant_with_warmup are built
    from transformers' formulas without importing it (start-up time): the rates and the state a checkpoint keeps
    are get_scheduler's, exactly."""
    from hypothesis import given, settings, strategies as st
    from transformers import get_scheduler

    from trainer.optim.schedule import make_scheduler, warmup_schedule

    @settings(max_examples=80, deadline=None, derandomize=True)
    @given(name=st.sampled_from(["linear", "cosine", "constant", "constant_with_warmup"]), total=st.integers(1, 40),
           warmup_share=st.floats(0, 1.2), ratio=st.sampled_from(RATIOS), cycles=st.sampled_from([None, 0.5, 1.5]))
    def check(name, total, warmup_share, ratio, cycles):
        warmup = int(total * warmup_share)
        kwargs = {"num_cycles": cycles} if cycles is not None and name == "cosine" and not ratio else {}
        cfg, _ = parse_config({**BASE, "lr_scheduler": name, "cosine_min_lr_ratio": ratio,
                               "lr_scheduler_kwargs": kwargs or None})
        ours, theirs = one_param_optimizer(1e-3), one_param_optimizer(1e-3)
        schedule = "constant_with_warmup" if name == "constant" else name
        extra = {"min_lr_rate": ratio} if name == "cosine" and ratio is not None else {}
        built = make_scheduler(cfg, ours, warmup, total)
        assert warmup_schedule("cosine_with_min_lr" if extra else schedule, one_param_optimizer(1e-3), warmup, total,
                               {**extra, **kwargs}) is not None  # (built here, not by get_scheduler)
        expected = get_scheduler("cosine_with_min_lr" if extra else schedule, theirs, num_warmup_steps=warmup,
                                 num_training_steps=total, scheduler_specific_kwargs={**extra, **kwargs})
        assert lrs_of(built, ours, total + 3) == lrs_of(expected, theirs, total + 3)
        assert built.state_dict() == expected.state_dict()

    check()
