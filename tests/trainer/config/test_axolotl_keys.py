"""matrices/axolotl_keys.toml: every key Axolotl's schema declared since v0.4.0 has this trainer's decision, and
scripts/axolotl_keys.py regenerates the history from a git directory of Axolotl (here a small one built in the
test, with Axolotl's three layouts: v0.4.0's README, v0_4_1's module, schemas/ with plugin args)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TABLE = ROOT / "matrices" / "axolotl_keys.toml"
DECISIONS = {"honoured", "inert", "migrated", "refused"}
sys.path.insert(0, str(ROOT / "scripts"))
from axolotl_keys import effective  # noqa: E402  (the table's rules, one copy)


@pytest.fixture(scope="module")
def table() -> dict:
    return tomllib.loads(TABLE.read_text())


def test_every_historical_key_has_a_decision(table):
    rows = {r["name"]: r for r in table["key"]}
    undecided = sorted(n for n in rows if not effective(rows, n).get("decision"))
    assert not undecided, f"{len(undecided)} keys of Axolotl's history have no decision: {undecided[:20]}"


def test_decisions_say_why(table):
    for row in table["key"]:
        if "decision" not in row:
            continue
        assert row["decision"] in DECISIONS, row
        if row["decision"] in ("inert", "refused"):
            assert len(row.get("reason", "")) > 20, f"{row['name']}: {row['decision']} without a reason"
        if row["decision"] == "migrated":
            assert row.get("to"), f"{row['name']}: migrated to nothing"


def test_the_table_names_its_source_and_covers_every_release(table):
    header = TABLE.read_text().split("\n[[key]]", 1)[0]
    assert "source: https://github.com/axolotl-ai-cloud/axolotl, tags v0.4.0.." in header
    assert table["releases"][0] == "v0.4.0" and table["releases"][-1] == "main"
    assert len(table["main"]) == 40
    names = {r["name"] for r in table["key"]}
    # keys users' configs carry from every era: v0.4.0's README, the v0_4_1 module, today's schemas, a plugin's args
    assert {"max_packed_sequence_len", "datasets[].conversation", "sequence_parallel_degree",
            "liger_rms_norm", "datasets[].type.no_input_format", "model_config"} <= names


# --- the script, on a small Axolotl-like repository with its three layouts ---------------------------------

README_040 = '''\
# Axolotl

<summary>All yaml options (click me)</summary>

```yaml
base_model: ./llama-7b-hf
# Optional tokenizer configuration override
tokenizer_config:
load_in_4bit: # bool
datasets:
  - path: vicgalle/alpaca-gpt4
    type: alpaca # format
    conversation:  # Optional[str] fastchat conversation type
  - path: repo
    type:
      system_prompt: ""
      format: "{instruction}"
max_packed_sequence_len: 2048
# gradient_checkpointing_kwargs:
```
'''

CONFIG_040 = '''\
def validate_config(cfg):
    if cfg.load_4bit:
        raise ValueError("deprecated")
    cfg.world_size = 1
    if cfg.world_size > 1:
        pass
'''

V041 = '''\
from typing import Optional, List, Union, Dict, Any
from pydantic import BaseModel, Field


class UserDefinedPrompterType(BaseModel):
    system_prompt: Optional[str] = None
    format: Optional[str] = None


class SFTDataset(BaseModel):
    path: Optional[str] = None
    type: Optional[Union[str, UserDefinedPrompterType]] = None
    conversation: Optional[str] = None


class RemappedParameters(BaseModel):
    overrides_of_model_config: Optional[Dict[str, Any]] = Field(default=None, alias="model_config")


class AxolotlInputConfig(RemappedParameters, BaseModel):
    base_model: str
    datasets: Optional[List[SFTDataset]] = None
    sample_packing: Optional[bool] = Field(default=False)
    max_packed_sequence_len: Optional[int] = None


class AxolotlConfigWCapabilities(AxolotlInputConfig):
    capabilities: Optional[Dict[str, Any]] = None
'''

SCHEMAS_CONFIG = '''\
from pydantic import BaseModel, Field
from axolotl.utils.schemas.datasets import SFTDataset


class AxolotlInputConfig(BaseModel):
    base_model: str
    datasets: list[SFTDataset] | None = None
    sample_packing: bool | None = Field(default=False)
    sequence_parallel_degree: int | None = Field(default=None, deprecated="Use `context_parallel_size` instead.")
'''

SCHEMAS_DATASETS = '''\
from pydantic import BaseModel


class SFTDataset(BaseModel):
    path: str | None = None
    type: str | None = None
'''

LIGER_ARGS = '''\
from pydantic import BaseModel


class LigerArgs(BaseModel):
    liger_rms_norm: bool | None = None
'''


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def commit_tree(repo: Path, tag: str, files: dict[str, str]) -> None:
    for old in [p for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts]:
        old.unlink()
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", tag)
    git(repo, "tag", tag)


@pytest.fixture(scope="module")
def axolotl_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("axolotl")
    git(repo, "init", "-q")
    commit_tree(repo, "v0.3.0", {"README.md": "old", "src/axolotl/utils/config.py": ""})  # before v0.4.0: not read
    commit_tree(repo, "v0.4.0", {"README.md": README_040, "src/axolotl/utils/config.py": CONFIG_040})
    commit_tree(repo, "v0.5.0", {"src/axolotl/utils/config/models/input/v0_4_1/__init__.py": V041})
    commit_tree(repo, "v0.8.0", {"src/axolotl/utils/schemas/config.py": SCHEMAS_CONFIG,
                                 "src/axolotl/utils/schemas/datasets.py": SCHEMAS_DATASETS,
                                 "src/axolotl/integrations/liger/args.py": LIGER_ARGS})
    return repo


def regenerate(repo: Path, out: Path) -> dict[str, dict]:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "axolotl_keys.py"), str(repo / ".git"),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "undecided" in done.stdout
    return {r["name"]: r for r in tomllib.loads(out.read_text())["key"]}


def test_script_reads_every_layout(axolotl_repo, tmp_path):
    rows = regenerate(axolotl_repo, tmp_path / "keys.toml")
    assert rows["base_model"]["releases"] == "v0.4.0..main"
    assert rows["max_packed_sequence_len"]["releases"] == "v0.4.0..v0.5.0"  # dropped in v0.8.0
    assert rows["load_4bit"]["releases"] == "v0.4.0"  # read by v0.4.0's utils/config.py
    assert "world_size" not in rows  # set by Axolotl itself there, not a user's key
    assert rows["gradient_checkpointing_kwargs"]["schema"] == "README"  # a commented key of the README block
    assert rows["datasets[].type.format"]["releases"] == "v0.4.0..v0.5.0"
    assert rows["datasets[].conversation"]["type"] == "str"
    assert rows["model_config"]["schema"] == "RemappedParameters"  # the alias is the key users write ...
    assert rows["overrides_of_model_config"]["alias_of"] == "model_config"  # ... and the field name is accepted too
    assert rows["capabilities"]["releases"] == "v0.5.0"
    assert rows["sequence_parallel_degree"]["deprecated"] is True  # a flag: Axolotl's own text is not kept
    assert rows["sequence_parallel_degree"]["replaced_by"] == "context_parallel_size"
    assert rows["sample_packing"]["default"] is False
    assert rows["liger_rms_norm"]["schema"] == "plugin liger: LigerArgs"
    assert rows["datasets[].type"]["type"] == "str"  # the newest release's type


def test_script_keeps_decisions_and_flags_new_keys(axolotl_repo, tmp_path):
    out = tmp_path / "keys.toml"
    out.write_text('[[key]]\nname = "capabilities"\ndecision = "inert"\nreason = "set by Axolotl itself from the GPU"\n'
                   '[[key]]\nname = "max_packed_sequence_len"\ndecision = "migrated"\nto = "sample_packing"\n'
                   '[[key]]\nname = "eta_min"\ndecision = "inert"\nreason = "not an Axolotl key; users write it"\n')
    rows = regenerate(axolotl_repo, out)
    assert rows["capabilities"]["decision"] == "inert" and rows["capabilities"]["reason"].startswith("set by")
    assert rows["max_packed_sequence_len"]["to"] == "sample_packing"  # kept, over the trainer's present refusal
    assert rows["max_packed_sequence_len"]["releases"] == "v0.4.0..v0.5.0"  # the history is rewritten
    assert rows["eta_min"]["schema"] == "none" and rows["eta_min"]["releases"] == ""  # a decided non-Axolotl key stays
    assert rows["base_model"]["decision"] == "honoured"  # a key new to the table takes the trainer's present decision
    assert "decision" not in rows["load_4bit"]  # the trainer does not know it today: undecided, for someone to decide


def test_every_key_called_honoured_is_read_by_the_trainer_or_the_resolver():
    """issue 44 item 8: the keys table called chunked_cross_entropy honoured while nothing read it. A top-level key whose
    decision is `honoured` must be read somewhere in trainer/ or resolver/ beyond its declaration (as `.key` or
    "key"), else it is inert (the run is the same: say why) or refused."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    rows = tomllib.loads((root / "matrices" / "axolotl_keys.toml").read_text())["key"]
    honoured = [r["name"] for r in rows if r.get("decision") == "honoured" and re.fullmatch(r"\w+", r["name"])]
    sources = [p.read_text() for d in ("trainer", "resolver") for p in (root / d).rglob("*.py")]
    unread = [k for k in honoured if not any(re.search(rf"\.{k}\b|[\"']{k}[\"']", text) for text in sources)]
    assert len(honoured) > 150 and unread == [], unread
