"""One rule for agreement between `envtool train CONFIG --dry-run` and `envtool resolve --gpu G`.

For every config the repository holds (the project's examples, the copies of Axolotl's own examples and the users'
corpus under tests/trainer/fixtures) x every target of the plan tables in the docs (the `envtool resolve --gpu ... --format
markdown` commands that print them, read from the docs, so a GPU added there is covered here), the plan a config gets
picks the torch release, the CUDA variant, the attention and its packing that `envtool resolve` picks for that target,
unless the config pins something; then the plan's reasons name the key (`attn_implementation: flash_attention_2 in
PATH`), or the model that needs it (`base_model ...`). `flash_attention: true` pins nothing: it asks for FlashAttention
kernels, whichever serves them best (FA3 on Hopper, torch's own varlen_attn, a flash-attn 2 wheel).

The pairs are compared through the functions behind the two commands (resolver.launch.plan_for_config,
resolver.pipeline.one_plan), in this process; one pair also through the real command line.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from resolver.errors import EnvtoolError
from resolver.launch import attention_key, plan_for_config, read_config
from resolver.pipeline import PlanOptions, one_plan
from trainer.config.load import load_config
from trainer.errors import ConfigError

from .conftest import run_envtool

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(REPO.glob("examples/**/*.yml")) + sorted((REPO / "tests" / "trainer" / "fixtures").rglob("*.y*ml"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
TABLE_COMMAND = re.compile(r"`envtool resolve --gpu\s+([^`]*?--format markdown)`")


def table_targets() -> list[PlanOptions]:
    """Every target of the docs' plan tables, with the options its command gives (--driver, --python, --platform)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    targets = []
    for page in (p for p in pages if p.is_file()):
        for command in TABLE_COMMAND.findall(page.read_text()):
            words = command.split()
            options = dict(zip(words[1::2], words[2::2]))  # (after the GPU list: --flag value pairs)
            for gpu in words[0].split(","):
                target = PlanOptions(gpu=gpu, driver=options.get("--driver"), python=options.get("--python", "3.11"),
                                     platform=options.get("--platform", "x86_64"))
                if target not in targets:
                    targets.append(target)
    return targets


def read(path: Path):
    """(cfg, notes) as the trainer's reader gives them; a config whose only problem is a local dataset file on its
    author's machine is read all the same (the attention decision reads no dataset); None where the reader refuses."""
    try:
        return load_config(path)
    except ConfigError as e:
        if e.config is not None and e.problems and all(kind == "file" for kind, _ in e.problems):
            return e.config, []
        return None


def family(plan) -> tuple:
    return plan.torch.version, plan.torch.variant, plan.attention, plan.packing


@pytest.mark.slow
def test_train_dry_run_plans_what_resolve_plans_unless_the_config_pins_it_and_then_names_the_key(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    targets = table_targets()
    assert {t.gpu for t in targets} >= {"t4", "a100", "h100", "cpu"} and any(t.driver for t in targets), targets
    resolved = {t: one_plan(t) for t in targets}
    pairs, agree, pinned, model, served, refused, unread = 0, 0, 0, 0, 0, 0, 0
    disagreements = []
    generic = 0  # flash_attention: true pairs (they must agree: nothing is pinned)
    for path in CONFIGS:
        got = read(path)
        if got is None:
            unread += 1
            continue
        cfg, notes = got
        key = attention_key(cfg)
        for target in targets:
            try:
                plan = plan_for_config(cfg, notes, path, target).plan
            except EnvtoolError:  # the dry-run refuses it here (validate does too: test_train_seam.py)
                refused += 1
                continue
            pairs += 1
            generic += cfg.asks_flash_kernels
            if family(plan) == family(resolved[target]):
                agree += 1
            elif key and not cfg.asks_flash_kernels and any(f"{key} in {path}" in r for r in plan.reasons):
                pinned += 1
            elif cfg.asks_flash_kernels and any(f"base_model {cfg.base_model}" in r for r in plan.reasons):
                model += 1
            elif any(f"trl.use_vllm: true in {path} needs (its Requires-Dist pins torch" in r for r in plan.reasons):
                served += 1  # GRPO's vLLM server: its wheel pins the torch the plan takes, and the plan says so
            else:
                disagreements.append(f"{path.relative_to(REPO)} --gpu {target.gpu} --driver {target.driver}: "
                                     f"{family(plan)} vs resolve's {family(resolved[target])} ({key or 'no key'})")
    print(f"\n{len(CONFIGS)} configs ({unread} refused by the reader) x {len(targets)} targets: {pairs} pairs planned "
          f"({refused} refused by the dry-run): {agree} agree, {pinned} differ by a pinned key the plan names, {model} "
          f"by the model's needs the plan names, {served} by vLLM's torch pin; {len(disagreements)} unexplained; "
          f"{generic} pairs of flash_attention: true")
    assert not disagreements, "\n".join(disagreements)
    assert pairs >= 500 and generic >= 100 and pinned > 0  # the corpus exercises all three ways


@pytest.mark.slow
def test_the_a100_example_on_an_h100_plans_what_resolve_plans(tmp_path):
    """Through the commands a user types: the A100 example (flash_attention: true) taken to an H100 gets the torch
    and FlashAttention-3 wheel `envtool resolve --gpu h100` plans, and says which key asked for it."""
    common = ["--gpu", "h100", "--python", "3.11", "--platform", "x86_64", "--json"]
    env = {**os.environ, **OFFLINE, "ENVTOOL_CACHE_DIR": str(tmp_path)}
    train = run_envtool("train", "examples/a100.yml", *common, "--dry-run", "--isolated", env=env)
    resolve = run_envtool("resolve", *common, env=env)
    assert train.returncode == resolve.returncode == 0, train.stderr + resolve.stderr
    plan, plain = json.loads(train.stdout)["plan"], json.loads(resolve.stdout)
    assert (plan["torch"], plan["attention"], plan["packing"], plan["flash_attn"]) == \
        (plain["torch"], plain["attention"], plain["packing"], plain["flash_attn"])
    assert plan["attention"] == "flash_attention_3" and plan["flash_attn"]["package"] == "flash-attn-3"
    assert any(r.startswith("flash_attention_3: flash_attention: true in examples/a100.yml asks for FlashAttention "
                            "kernels: served by the flash-attn-3") for r in plan["reasons"]), plan["reasons"]
    assert json.loads(train.stdout)["trainer"]["attention"] == "flash_attention_3"


def _cell(text: str, row: str) -> list[str]:
    """The first word of each `row` row of the plan tables a command printed (`│ attention │ sdpa ... │`)."""
    return re.findall(rf"│ {row} +│ (\S+)", text)


@pytest.mark.slow
def test_resolve_and_the_dry_run_name_the_attention_and_packing_the_trainer_runs(tmp_path):
    """`envtool resolve --gpu G` (its table, and the Markdown table the README prints) and `envtool train CONFIG --gpu G
    --dry-run` (its plan table and its `trainer:` lines) name the same attention and packing, packed or not. On an
    A100 the plan's backend is sdpa with packing varlen, which the trainer runs as torch's own varlen_attn: every
    one of them says varlen_attn (it said sdpa in resolve and varlen_attn in the dry run)."""
    gpus = ["t4", "v100", "a100", "h100"]
    env = {**os.environ, **OFFLINE, "ENVTOOL_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}
    common = ["--python", "3.11", "--platform", "x86_64"]
    resolved = run_envtool("resolve", "--gpu", ",".join(gpus), *common, env=env)
    table = run_envtool("resolve", "--gpu", ",".join(gpus), *common, "--format", "markdown", env=env)
    assert resolved.returncode == table.returncode == 0, resolved.stderr + table.stderr
    rows = [line.split(" | ") for line in table.stdout.splitlines()[2:]]
    expected = dict(zip(gpus, zip(_cell(resolved.stdout, "attention"), _cell(resolved.stdout, "packing"))))
    assert [(row[3], row[4]) for row in rows] == list(expected.values())
    assert expected["a100"] == ("varlen_attn", "varlen") and expected["t4"] == ("sdpa", "mask")
    example = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    example["datasets"][0]["path"] = str(REPO / example["datasets"][0]["path"])
    example.pop("attn_implementation")  # (a pin: the plan follows it, test_train_dry_run_plans_what_resolve_plans...)
    for packed in (True, False):
        config = tmp_path / f"packing-{packed}.yml"
        config.write_text(yaml.safe_dump({**example, "sample_packing": packed, "eval_sample_packing": packed}))
        for gpu in gpus:
            run = run_envtool("train", str(config), "--gpu", gpu, *common, "--dry-run", "--isolated", env=env)
            assert run.returncode == 0, run.stderr
            trainer = re.search(r"^trainer: attention (\S+),.*^trainer: packing (\w+)", run.stdout, re.M | re.S)
            said = {"plan table": (_cell(run.stdout, "attention")[0], _cell(run.stdout, "packing")[0]),
                    "trainer: lines": trainer.groups()}
            assert said == {"plan table": expected[gpu], "trainer: lines": expected[gpu]}, (gpu, packed)


def _model_dir(tmp_path: Path, config) -> Path:
    """A model directory holding the config.json transformers itself writes for `config` (no weights: the plan reads
    only the config)."""
    config.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.slow
def test_flash_attention_takes_the_flash_attn_2_wheel_only_for_a_model_that_needs_it(tmp_path, monkeypatch):
    """Gemma 2 soft-caps its attention logits: torch's varlen_attn cannot, flash-attn 2's kernel can, so on an A100
    `flash_attention: true` gets the wheel and the torch it needs, and the plan names the model and why; a Llama
    (nothing varlen_attn lacks) gets what `envtool resolve` plans."""
    from transformers import Gemma2Config, LlamaConfig

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    target = PlanOptions(gpu="a100", python="3.11", platform="x86_64")
    small = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=256)
    for name, config, needs in (("gemma2", Gemma2Config(head_dim=32, **small), "soft-caps its attention logits"),
                                ("llama", LlamaConfig(**small), None)):
        model = _model_dir(tmp_path / name, config)
        path = tmp_path / name / "config.yml"
        path.write_text(yaml.safe_dump({"base_model": str(model), "learning_rate": 2e-5, "flash_attention": True,
                                        "datasets": [{"path": "org/data", "type": "alpaca"}]}))
        cfg, notes = read_config(path)
        fitted = plan_for_config(cfg, notes, path, target)
        plan, reasons = fitted.plan, "\n".join(fitted.plan.reasons)
        if needs is None:
            assert family(plan) == family(one_plan(target)) and plan.attention == "sdpa", reasons
            assert fitted.trainer["attention"] == "varlen_attn"
            continue
        assert (plan.attention, plan.packing, plan.flash_attn.package) == ("flash_attention_2", "varlen", "flash-attn")
        assert f"base_model {model} needs what torch " in reasons and needs in reasons, reasons
        assert f"held back by the flash-attn wheel (flash_attention: true in {path}, for base_model {model})" \
            in reasons, reasons
        assert "newest build that carries" not in reasons and plan.pinned in (None, {})
        assert fitted.trainer["attention"] == "flash_attention_2"


@pytest.mark.parametrize("keys, gpu, torch, expected, says", [
    # flash_attention: true under a torch pin: the fastest FlashAttention that runs on the torch the pin allows
    ({"flash_attention": True}, "a100", "2.8", ("2.8.0", "flash_attention_2", "varlen"),
     ["held back by the pin: torch ", "flash_attention: true in {path} asks for FlashAttention kernels: served by "
                                      "the flash-attn 2.8.3.post1 wheel, the fastest that runs here on torch 2.8.0"]),
    ({"flash_attention": True}, "a100", "2.9", ("2.9.1", "sdpa", "mask"),
     ["held back by the pin: torch ", "flash_attention: true in {path} -> sdpa: flash-attn publishes no prebuilt "
                                      "wheel for torch 2.9"]),
    # the wheel asked for by name: torch held back by it, and the plan names the key, not a command-line option
    ({"attn_implementation": "flash_attention_2"}, "h100", None, ("2.8.0", "flash_attention_2", "varlen"),
     ["held back by the flash-attn wheel (attn_implementation: flash_attention_2 in {path}): torch "]),
])
def test_what_holds_torch_back_from_flash_attention_is_named(keys, gpu, torch, expected, says, tmp_path):
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump({"base_model": "org/model", "learning_rate": 2e-5, "datasets": [{"path": "org/data", "type": "alpaca"}],
                                    **keys}))
    cfg, notes = read_config(path)
    plan = plan_for_config(cfg, notes, path, PlanOptions(gpu=gpu, torch=torch, python="3.11", platform="x86_64")).plan
    reasons = "\n".join(plan.reasons)
    assert (plan.torch.version, plan.attention, plan.packing) == expected, reasons
    assert "newest build that carries" not in reasons and "--attention" not in reasons, reasons
    for text in says:
        assert text.format(path=path) in reasons, reasons
