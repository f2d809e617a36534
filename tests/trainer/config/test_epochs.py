"""num_epochs as Axolotl reads it: a float (a fraction of an epoch is that share of its steps), and 0 or -1 beside
max_steps, which alone decides the length then; without max_steps such a run trains nothing and is refused."""

from __future__ import annotations

import math

from tests.trainer.helpers import alpaca_rows, read_metrics, write_jsonl
from trainer.cli import main


def steps_trained(out) -> list[int]:
    return [r["step"] for r in read_metrics(out) if "loss" in r]


def test_a_fraction_of_an_epoch_is_that_share_of_its_steps(make_config, tmp_path):
    small = [{"path": str(write_jsonl(tmp_path / "small.jsonl", alpaca_rows(12))), "type": "alpaca"}]
    one = make_config("one.yml", max_steps=None, num_epochs=1, output_dir=str(tmp_path / "one"), datasets=small)
    assert main(["train", str(one)]) == 0
    per_epoch = len(steps_trained(tmp_path / "one"))
    assert per_epoch >= 2

    half = make_config("half.yml", max_steps=None, num_epochs=1.5, output_dir=str(tmp_path / "half"), datasets=small)
    assert main(["train", str(half)]) == 0
    assert len(steps_trained(tmp_path / "half")) == math.ceil(1.5 * per_epoch)  # no packing: rounded up, as Axolotl


def test_no_epochs_beside_max_steps_trains_the_steps_and_alone_is_refused(make_config, tmp_path, capsys):
    steps = make_config("steps.yml", num_epochs=-1, max_steps=3, output_dir=str(tmp_path / "steps"))
    assert main(["train", str(steps)]) == 0
    assert steps_trained(tmp_path / "steps") == [1, 2, 3]

    capsys.readouterr()
    for epochs in (0, -1):
        assert main(["validate", str(make_config("none.yml", num_epochs=epochs, max_steps=None))]) == 2
        err = capsys.readouterr().err
        assert f"num_epochs: {epochs} trains nothing without max_steps" in err and "Traceback" not in err
