"""The documentation as a reader meets it: the generated reference pages and plan tables are what the code and the
matrices say today, the README stays a README, and every page and link in it leads somewhere.

(`mkdocs build --strict` in .ci/run checks the site's own links and nav; these tests need no mkdocs.)"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


@functools.cache
def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def generated() -> dict[Path, str]:
    return gen_docs().pages()


def test_generated_pages_are_not_stale():
    """Regenerate every reference page and plan table and compare: a changed --help, matrix row, config field or
    plan field fails here until `python scripts/gen_docs.py` is run and its output committed."""
    stale = [str(path.relative_to(ROOT)) for path, text in generated().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale generated docs: {stale}; run `python scripts/gen_docs.py` and commit what it writes"


def test_reference_pages_say_what_the_code_says():
    """Spot checks that the generator reads the real sources, not a copy: a command, a refused key, a plan field."""
    pages = {path.name: text for path, text in generated().items()}
    assert "## `envtool train`" in pages["cli.md"] and "--dry-run" in pages["cli.md"]
    assert "## `python -m trainer merge-lora`" in pages["trainer-cli.md"]
    from trainer.config import keys

    refused = next(name for name, row in sorted(keys.rows().items()) if row.get("decision") == "refused")
    assert f"| `{refused}` |" in pages["config-keys.md"].split("## Refused", 1)[1]
    from resolver.plan import Plan

    assert all(f"`{field}`" in pages["plan-json.md"] for field in Plan._fields)
    assert "| 2 | `BadInput` |" in pages["exit-codes.md"] and "| 138 |" in pages["exit-codes.md"]


def test_generator_refuses_an_undocumented_plan_field(monkeypatch):
    module = gen_docs()
    monkeypatch.delitem(module.PLAN_FIELDS, "packing")
    with pytest.raises(SystemExit, match=r"\['packing'\]"):
        module.plan_json_page()


def test_readme_is_a_readme():
    assert len(README.read_bytes()) <= 15 * 1024, "README.md is over 15 KB: move the detail into docs/"


def nav_pages(nav) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out.extend(nav_pages(value) if isinstance(value, list) else [value])
    return out


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk


@pytest.mark.parametrize("path", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(path):
    """A link to a file of this repository (README -> docs/, docs -> docs) names a file that exists."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{path.relative_to(ROOT)}: link to {target}"
