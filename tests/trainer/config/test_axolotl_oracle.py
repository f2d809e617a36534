"""Axolotl's own validation as the oracle: wherever Axolotl accepts a config, envtool's reader accepts it too, or
refuses it for a reason of a documented class.

The oracle is Axolotl's `validate_config` (scripts/axolotl_oracle.py, in the environment .ci/setup builds under
.ci-cache/axolotl-oracle: the `axolotl` wheel from PyPI, --no-deps, over the .venv's own torch/transformers/pydantic),
run once per session in one subprocess over every config, batched. envtool's side is trainer.setup.start (what
`python -m trainer validate` calls) for an H100, in this process.

The configs: every user config of tests/trainer/fixtures/user_configs, every example of
tests/trainer/fixtures/axolotl_examples, and GENERATED configs: a small valid base plus 1-4 keys drawn (hypothesis) from
AxolotlInputConfig's own fields with values of each field's type (bools, literals/enums, small ints and floats, short
strings), and from matrices/axolotl_keys.toml's rows.

A refusal by envtool of a config Axolotl accepts is allowed only where its kinds are hardware (a limit of the GPU) or
file (a local file the config names that is not on this machine), or where every config problem it names matches
a row of DIFFERENCES below: a cause, its reason class, and why. Everything else fails the test with the config and
both verdicts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from tests.support import oracle
import yaml

ROOT = Path(__file__).resolve().parents[3]
ORACLE = ROOT / ".ci-cache" / "axolotl-oracle"
FIXTURES = ROOT / "tests" / "trainer" / "fixtures"
N_GENERATED = int(os.environ.get("ORACLE_N", 2000))

# The one table of known differences: (regex over one problem line of envtool's refusal, reason class, why), by
# cause. Besides these, a problem naming a key that matrices/axolotl_keys.toml refuses is a "design limit" (the row's
# reason says what ignoring it would change), and the kinds hardware and file are the GPU's and this machine's.
DIFFERENCES: list[tuple[str, str, str]] = [
    (r"quantize_moe_experts with lora_target_parameters on the expert tensors is not supported", "upstream limit",
     "peft 0.22 wraps a quantized (parametrized) expert tensor wrongly: a nested wrapper trains nothing and the "
     "delta stays on the tensor after each forward (added again every step); Axolotl patches peft for it "
     "(monkeypatch/moe_quant.py), envtool refuses rather than train another adapter than the config asks for"),
    (r"not implemented|not supported|does not implement|this trainer does not carry|this trainer has one loop"
     r"|implemented here only with|ignoring it would", "design limit",
     "a feature envtool does not have, refused in one line naming the key rather than trained without it"),
    (r"Input should be (greater|less) than", "stricter range",
     "a count, size or weight of 0 (or a smoothing >= 0.5) that Axolotl's schema lets through unchecked: "
     "transformers or TRL refuse it when training starts (logging/save/eval steps, processes) or it trains "
     "nothing (max_steps 0, lora_alpha 0); envtool says so before anything slow"),
    (r"(^|: )got .*; input should be|Input should be a valid (list|boolean)", "stricter choice",
     "a name Axolotl's schema takes as any string (wandb_mode, lr_scheduler, adapter, gradient_checkpointing "
     "modes, lora_target_parameters) or any int (fsdp_version) where only some work; envtool lists the ones it takes"),
    (r"only with |needs |conflicts with|set both|not both|go together|must be at most|must be a whole number"
     r"|applies to SFT|is not an rl method|is not an? \w+ dataset type|must be a plain directory name"
     r"|is not a transformers (config|processor) class|set it to true or remove it|shrinks the embedding", "inconsistent keys",
     "a key whose companion key is missing or contradicts it, or a value that names nothing: Axolotl ignores one "
     "of them without a word, envtool says which (no silent difference in what is trained)"),
    (r"is not a key; did you mean '\w+'\? \(the config does not set", "silent difference",
     "a key Axolotl's schema drops (a near miss or transformers' name of one of its keys: lr_scheduler_type for "
     "lr_scheduler) while the config leaves the key it means unset: Axolotl trains with that key's default; envtool "
     "names the key instead (no silent difference in what is trained)"),
    (r"with rl: \w+ use a transform 'module\.function'", "fails later in Axolotl",
     "a dataset type without a function under rl: grpo (chat_template, chatml, ...): Axolotl's schema takes it, its RL "
     "loader then applies the DPO transform of that name (utils/data/rl.py _load_split -> load_dpo), which reads "
     "chosen/rejected columns a GRPO prompt dataset does not have (KeyError while preprocessing)"),
    (r"unknown placeholder\(s\)", "fails later in Axolotl",
     "a prompt format of one's own naming a placeholder the format is not filled with ({output} in format): "
     "Axolotl's schema takes any string, its prompter's str.format then fails with KeyError while preprocessing"),
]


def _oracle(kind: str, payload=None):
    env = {**os.environ, "PYTHONPATH": str(ORACLE), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "axolotl_oracle.py"), kind], env=env,
                         input=json.dumps(payload) if payload is not None else "", capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _generated(fields: dict, n: int) -> list[dict]:
    """n configs: a valid base plus 1-4 keys of Axolotl's schema, drawn by hypothesis (derandomized: the same
    configs every run)."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    rows = tomllib.loads((ROOT / "matrices" / "axolotl_keys.toml").read_text())
    table = {r["name"] for r in rows.get("key", []) if re.fullmatch(r"\w+", r["name"]) and r["name"] in fields}
    names = sorted(k for k, v in fields.items() if v["kind"] != "other" and k not in BASE) + sorted(table - set(BASE))

    def values(name: str):
        f = fields.get(name, {"kind": "other"})
        return {"bool": st.booleans(), "int": st.integers(min_value=0, max_value=4096),
                "float": st.floats(min_value=0, max_value=1, allow_nan=False),
                "str": st.sampled_from(["", "auto", "none", "default", "linear", "cosine"]),
                "choice": st.sampled_from(f.get("choices") or [None]),
                }.get(f["kind"], st.sampled_from([True, False, 1, "auto"]))

    extra = st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: values(k) for k in keys}))
    drawn: list[dict] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(extra)
    def draw(keys):
        drawn.append({**BASE, **keys})

    draw()
    return drawn


BASE = {"base_model": "NousResearch/Llama-3.2-1B", "datasets": [{"path": "tatsu-lab/alpaca", "type": "alpaca"}],
        "sequence_len": 512, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "num_epochs": 1,
        "learning_rate": 2e-4, "optimizer": "adamw_torch", "output_dir": "./out"}


def _envtool(path: Path) -> tuple[str, list[str]]:
    """('ok' | 'refused' | 'crash', the problem lines with their kinds) for `validate --gpu h100` of `path`."""
    from trainer.errors import TrainerError
    from trainer.setup import start

    try:
        start(path, "h100")
    except TrainerError as err:
        return "refused", [f"{k}: {p}" for k, p in (err.problems or [("config", str(err))])]
    except Exception as err:  # noqa: BLE001
        return "crash", [f"{type(err).__name__}: {err}"]
    return "ok", []


def _explained(problem: str) -> str | None:
    from trainer.config import keys

    kind, _, line = problem.partition(": ")
    if kind in ("hardware", "file"):
        return kind
    key = line.split(":", 1)[0].strip()
    if re.fullmatch(r"\w+", key) and keys.decision(key).get("decision") == "refused":
        return "design limit"
    return next((cls for rx, cls, _ in DIFFERENCES if re.search(rx, line)), None)


@pytest.mark.slow
def test_where_axolotl_accepts_a_config_envtool_does_or_says_why(tmp_path, monkeypatch):
    oracle.require(ORACLE / "axolotl", ORACLE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    configs: list[tuple[str, dict, Path]] = []
    for group in ("user_configs", "axolotl_examples"):
        for p in sorted((FIXTURES / group).rglob("*.y*ml")):
            raw = yaml.safe_load(p.read_text())
            if isinstance(raw, dict):
                configs.append((f"{group}/{p.relative_to(FIXTURES / group)}", raw, p))
    fields = _oracle("schema")
    for i, raw in enumerate(_generated(fields, N_GENERATED)):
        p = tmp_path / f"gen{i}.yml"
        p.write_text(yaml.safe_dump(raw))
        configs.append((f"generated/{i}", raw, p))
    verdicts = _oracle("verdicts", [raw for _, raw, _ in configs])
    counts, causes, unexplained = Counter(), Counter(), []
    for (name, raw, path), axo in zip(configs, verdicts):
        group = name.split("/")[0]
        if not axo["ok"]:
            counts[f"{group}: axolotl refuses"] += 1
            continue
        verdict, problems = _envtool(path)
        if verdict == "ok":
            counts[f"{group}: agree"] += 1
            continue
        why = [_explained(p) for p in problems]
        if verdict == "refused" and all(why):
            counts[f"{group}: explained"] += 1
            causes.update(set(why))
            continue
        counts[f"{group}: DISAGREE"] += 1
        unexplained.append((name, [p for p, w in zip(problems, why) if not w][:3],
                            {k: v for k, v in raw.items() if k not in BASE} if group == "generated" else None))
    print(json.dumps({"counts": dict(sorted(counts.items())), "causes": dict(causes)}, indent=1))
    for u in unexplained:
        print("UNEXPLAINED", u)
    assert sum(1 for n, _, _ in configs if n.startswith("generated/")) >= N_GENERATED
    assert not unexplained, f"{len(unexplained)} configs Axolotl accepts are refused for no documented reason"
