"""Users' own Axolotl configs (tests/trainer/fixtures/user_configs/, each with its source): accepted as Axolotl accepts
them, and ten of them really train.

- The corpus figure: `python -m trainer validate` on every config, for its author's GPU (else an A100) and for a T4,
  the same call bench/user_configs.py makes. At least 95% validate or are refused only for a hardware limit of that
  GPU or a local file the config names that is not on this machine (the authors' data and models); none crashes.
- Ten configs of different kinds (QLoRA/LoRA, 4- and 8-bit, alpaca, completion, sharegpt, chat_template, Axolotl's
  older instruction types, a format of the user's own, NEFTune, DPO over an alpaca-typed dataset, SimPO) train for
  two steps on CPU through `python -m trainer train`. What is swapped: the model (the tiny local llama), the data
  (a local file with rows in the columns the dataset's type reads, written from the config as read), the output
  folders, and the run's size (2 steps, micro-batches of at most 2 rows of at most 512 tokens, no accumulation).
  Every other key stays as its author wrote it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import read_metrics, write_jsonl

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "trainer" / "fixtures" / "user_configs"
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_users_configs_are_accepted_as_axolotl_accepts_them(capsys):
    from user_configs import ACCEPTED, results

    configs = sorted(CORPUS.glob("*.y*ml"))
    assert len(configs) >= 40
    for which in ("author", "t4"):
        found = results(configs, which)
        crashed = {p.name: r[2] for p, r in found.items() if r[3] == "crash"}
        assert not crashed, crashed
        refused = {p.name: r[2] for p, r in found.items() if r[3] not in ACCEPTED}
        assert len(configs) - len(refused) >= 0.95 * len(configs), refused


TRAINED = [
    "HieuBui99__finetuning__axolotl__config.yaml",  # alpaca, QLoRA, an empty fsdp block
    "TanametTpk__util-llm-script__llama-1b-lora-v2.yaml",  # chat_template from/value, LoRA, packing
    "TanametTpk__util-llm-script__llama3-qlora.yml",  # type: sharegpt with conversation: llama3, QLoRA
    "TanametTpk__util-llm-script__qlora_dpo.yml",  # rl: dpo over an alpaca-typed dataset (rows used as they are)
    "Kyushik__axolotl-finetuning__2_rlhf__train_config.yaml",  # rl: simpo, chatml.intel
    "adi-kmt__llm-finetuning__math-reasoning__qlora.yml",  # alpaca_chat.load_qa
    "adi-kmt__llm-finetuning__sql-coder__qlora.yml",  # context_qa.load_v2
    "chats-bug__jsr-config__qlora.yml",  # completion, packing
    "muellerzr__fine-tuning-llms__axolotl_config.yaml",  # oasst
    "kallewoof__qlora__axolotl-mistral-7b.yml",  # completion + a format of the user's own, 8-bit LoRA, NEFTune
]

_WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def _text(i: int, n: int = 3) -> str:
    return " ".join(_WORDS[(i + k) % len(_WORDS)] for k in range(n))


def _row(ds, rl: str | None, i: int) -> dict:
    """A row with the columns a dataset entry (as the trainer read it) takes: its own field names, the columns
    Axolotl's named types read, and a conversation in its message field with its role and content names."""
    row = {k: _text(i + j) for j, k in enumerate((
        "instruction", "output", "question", "answer", "context", "article", "INSTRUCTION", "RESPONSE",
        "text", "prompt", "chosen", "rejected", "system"))}
    fmt = ds.user_defined
    for name in ((fmt.field_instruction, fmt.field_output) if fmt else (ds.field_instruction, ds.field_output, ds.field,
                                                                        ds.field_prompt, ds.field_chosen,
                                                                        ds.field_rejected)):
        row[name] = _text(i + 3)
    if fmt:
        row.pop(fmt.field_system, None)  # the format's system_prompt is used
    roles = ds.roles or {"user": ["user"], "assistant": ["assistant"]}
    row[ds.field_messages] = [{ds.role_key: roles[role][0], ds.content_key: _text(i + k)}
                              for k, role in enumerate(("user", "assistant", "user", "assistant"))]
    return row


def _swap(name: str, tmp_path: Path, model: Path) -> Path:
    """The user's config with the model, data, outputs and run size swapped (see the module's docstring)."""
    from trainer.config import parse_config

    raw = yaml.safe_load((CORPUS / name).read_text())
    cfg, _ = parse_config(dict(raw))  # (the migrated entries: the columns the data must have)
    for group in ("datasets", "test_datasets"):
        for i, (entry, ds) in enumerate(zip(raw.get(group) or [], getattr(cfg, group) or [])):
            path = write_jsonl(tmp_path / f"{group}-{i}.jsonl", [_row(ds, cfg.rl, k) for k in range(48)])
            for key in ("name", "data_files", "split", "revision"):
                entry.pop(key, None)
            entry.update(path=str(path), ds_type="json")
    raw.update(base_model=str(model), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"), max_steps=2, gradient_accumulation_steps=1,
               micro_batch_size=min(raw.get("micro_batch_size") or 1, 2),
               sequence_len=min(raw.get("sequence_len") or 512, 512))
    for key in ("base_model_config", "tokenizer_config", "hub_model_id", "wandb_project", "resume_from_checkpoint",
                "lora_model_dir"):
        raw.pop(key, None)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_a_users_config_trains_on_cpu_with_the_tiny_model(name, tmp_path, tiny_llama, capsys):
    from trainer.cli import main

    config = _swap(name, tmp_path, tiny_llama)
    assert main(["train", str(config)]) == 0, capsys.readouterr().err[-3000:]
    steps = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert [m["step"] for m in steps][-1] == 2
    assert all(m["loss"] == m["loss"] and m["loss"] > 0 for m in steps)  # finite, positive
    assert any((tmp_path / "out" / "final").glob("*.safetensors"))  # the final model or adapter is written
