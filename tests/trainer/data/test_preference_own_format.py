"""A preference format of your own (`type:` a mapping with rl:): Axolotl's user_defined.default of
prompt_strategies/dpo and /kto. Each row's prompt and completions are compared with Axolotl's own transform
(loaded from the axolotl package .ci/setup installs) over rows drawn by hypothesis; DPO and KTO train with one
through the trainer's command; the mapping is checked where the config is read."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.trainer.helpers import read_metrics
from tests.trainer.pref_helpers import write_jsonl
from trainer.cli import main
from trainer.config import parse_config
from trainer.data.formats.preference_prompts import label_of, render

ROOT = Path(__file__).resolve().parents[3]
STRATEGIES = ROOT / ".ci-cache" / "axolotl-oracle" / "axolotl" / "prompt_strategies"
BASE = {"base_model": "x", "learning_rate": 1e-3}
DPO_FORMAT = {"field_prompt": "question", "field_system": "sys", "field_chosen": "good", "field_rejected": "bad",
              "prompt_format": "<|system|>{system}<|user|>{prompt}<|assistant|>", "chosen_format": "{chosen}</s>",
              "rejected_format": "{rejected}</s>"}
KTO_FORMAT = {"field_prompt": "q", "field_completion": "a", "field_label": "ok", "prompt_format": "Q: {prompt}\nA: ",
              "completion_format": "{completion}"}


def axolotl_transform(kind: str, fmt: dict):
    from tests.support.oracle import require

    require(STRATEGIES / kind / "user_defined.py")
    spec = importlib.util.spec_from_file_location(f"axolotl_{kind}_user_defined", STRATEGIES / kind / "user_defined.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # it imports nothing
    return module.default({"datasets": [{"type": fmt}]})


def test_rows_render_as_axolotls_transform():
    from hypothesis import HealthCheck, given, settings, strategies as st

    dpo_cfg, _ = parse_config({**BASE, "rl": "dpo", "datasets": [{"path": "p.jsonl", "type": DPO_FORMAT}]})
    kto_cfg, _ = parse_config({**BASE, "rl": "kto", "datasets": [{"path": "p.jsonl", "type": KTO_FORMAT}]})
    dpo, kto = axolotl_transform("dpo", DPO_FORMAT), axolotl_transform("kto", KTO_FORMAT)
    text = st.text(max_size=10)

    @settings(max_examples=60, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(q=text, sys=st.one_of(st.none(), text), good=text, bad=text, label=st.booleans())
    def check(q, sys, good, bad, label):
        row = {"question": q, "good": good, "bad": bad, **({"sys": sys} if sys is not None else {})}
        theirs = dpo(dict(row))
        assert render(row, dpo_cfg.datasets[0], None, kto=False)[:2] == (theirs["prompt"],
                                                                           [theirs["chosen"], theirs["rejected"]])
        row = {"q": q, "a": good, "ok": label}
        theirs = kto(dict(row))
        ds = kto_cfg.datasets[0]
        assert render(row, ds, None, kto=True)[:2] == (theirs["prompt"], [theirs["completion"]])
        assert label_of(row, ds) == theirs["label"]

    check()


def test_dpo_and_kto_train_with_a_format_of_your_own(make_config, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"question": f"Say {i}.", "sys": "Be brief." if i % 2 else None,
                                                    "good": f"{i}", "bad": f"no {i} at all"} for i in range(16)])
    config = make_config(rl="dpo", datasets=[{"path": str(pairs), "type": DPO_FORMAT}], max_steps=2, sequence_len=64)
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]

    rows = write_jsonl(tmp_path / "kto.jsonl", [{"q": f"Say {i}.", "a": f"{i}", "ok": i % 3 != 0} for i in range(16)])
    config = make_config("kto.yml", rl="kto", datasets=[{"path": str(rows), "type": KTO_FORMAT}], max_steps=2,
                         sequence_len=64, output_dir=str(tmp_path / "kto"), dataset_prepared_path=str(tmp_path / "p2"))
    assert main(["train", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "kto") if "loss" in r] == [1, 2]


@pytest.mark.parametrize("entry,rl,message", [
    ({"field_prompt": "q", "prompt_format": "{prompt} {answer}"}, "dpo", "prompt_format: unknown placeholder(s) answer"),
    ({"field_prompt": "q", "field_chosen": "c"}, None, "a preference format of your own (field_chosen, field_prompt) "
                                                       "needs rl:"),
])
def test_a_wrong_mapping_is_one_line_naming_the_key(entry, rl, message, make_config, capsys):
    config = make_config(datasets=[{"path": "p.jsonl", "type": entry}], **({"rl": rl} if rl else {}))
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
