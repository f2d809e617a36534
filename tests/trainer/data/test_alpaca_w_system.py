"""Axolotl's alpaca_w_system types: an alpaca prompt whose system text is the row's own. The prompts are compared
with Axolotl's own prompters (prompt_strategies/alpaca_w_system.py, from the axolotl package .ci/setup installs in
.ci-cache/axolotl-oracle) over rows drawn by hypothesis; one type trains through the trainer's command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.helpers import read_metrics, write_jsonl
from trainer.cli import main
from trainer.config import DatasetConfig
from trainer.data.formats import instruction

ROOT = Path(__file__).resolve().parents[3]
ORACLE = ROOT / ".ci-cache" / "axolotl-oracle"
# type -> (Axolotl's prompter class, its prompt style, the row's columns as (instruction, input, system))
TYPES = {
    "alpaca_w_system": ("SystemDataPrompter", "chat", ("instruction", "input", "system")),
    "alpaca_w_system.load_chat": ("SystemDataPrompter", "chat", ("instruction", "input", "system")),
    "alpaca_w_system.load_instruct": ("SystemDataPrompter", "instruct", ("instruction", "input", "system")),
    "alpaca_w_system.load_open_orca": ("OpenOrcaSystemDataPrompter", "instruct", ("question", None, "system_prompt")),
    "alpaca_w_system.load_open_orca_chatml": ("OpenOrcaSystemDataPrompter", "chatml",
                                              ("question", None, "system_prompt")),
}
AXOLOTL_PROMPTS = """
import json, sys
from axolotl.prompt_strategies import alpaca_w_system
cases = json.load(sys.stdin)
print(json.dumps([next(getattr(alpaca_w_system, cls)(style).build_prompt_w_system(system, ins, inp))
                  for cls, style, system, ins, inp in cases]))
"""


class Tok:
    eos_token = "</s>"


def rows():
    from hypothesis import HealthCheck, given, settings, strategies as st

    text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
    drawn = []

    @settings(max_examples=40, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(ins=text, inp=st.one_of(st.just(""), text), system=st.one_of(st.just(""), text),
           name=st.sampled_from(sorted(TYPES)))
    def draw(ins, inp, system, name):
        drawn.append((name, ins, inp, system))

    draw()
    return drawn


@pytest.mark.slow  # Axolotl's prompters in a subprocess (its package imports transformers: ~6 s of CPU)
def test_prompts_are_axolotls_prompters_for_every_row():
    cases = rows()
    ours, theirs_in = [], []
    for name, ins, inp, system in cases:
        cls, style, (f_ins, f_inp, f_sys) = TYPES[name]
        row = {f_ins: ins, f_sys: system, "output": "o", "response": "o", **({f_inp: inp} if f_inp else {})}
        text, [(start, _)], _ = instruction.render(row, DatasetConfig(path="d.jsonl", type=name), Tok())
        ours.append(text[:start])
        theirs_in.append((cls, style, system, ins, inp if f_inp else ""))
    out = subprocess.run([sys.executable, "-c", AXOLOTL_PROMPTS], input=json.dumps(theirs_in), capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ORACLE)}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ours == json.loads(out.stdout)


def test_an_open_orca_dataset_trains_and_a_row_without_its_system_column_is_named(make_config, tmp_path, capsys):
    data = write_jsonl(tmp_path / "orca.jsonl", [
        {"system_prompt": "You are terse." if i % 2 else "", "question": f"What is {i} + {i}?",
         "response": str(2 * i)} for i in range(16)])
    config = make_config(datasets=[{"path": str(data), "type": "alpaca_w_system.load_open_orca"}], max_steps=2)
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]

    broken = write_jsonl(tmp_path / "broken.jsonl", [{"instruction": "Hi", "output": "Hello"}] * 8)
    config = make_config("broken.yml", datasets=[{"path": str(broken), "type": "alpaca_w_system"}],
                         dataset_prepared_path=str(tmp_path / "prepared-broken"), output_dir=str(tmp_path / "b"))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "a row has no 'system' field (type alpaca_w_system)" in err and "Traceback" not in err
