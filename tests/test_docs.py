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


def test_every_environment_variable_the_code_reads_has_a_line_and_every_line_is_read(monkeypatch):
    """docs/reference/environment.md: the names come from the code; one the code reads without an entry, or an entry
    nothing reads, stops the generator naming it."""
    module = gen_docs()
    page = module.environment_page()
    assert "| `ENVTOOL_TORCH_INDEX_URL` |" in page and "resolver/" in page.split("`ENVTOOL_TORCH_INDEX_URL`", 1)[1]
    monkeypatch.delitem(module.ENVIRONMENT, "ENVTOOL_UV")
    with pytest.raises(SystemExit, match="no entry for ENVTOOL_UV"):
        module.environment_page()
    monkeypatch.setitem(module.ENVIRONMENT, "ENVTOOL_UV", ("you", "the uv binary"))
    monkeypatch.setitem(module.ENVIRONMENT, "ENVTOOL_GONE", ("you", "read by nothing"))
    with pytest.raises(SystemExit, match="nothing reads ENVTOOL_GONE"):
        module.environment_page()


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


# ---------------------------------------------------------------------------- the commands the docs give
# Every `envtool ...` and `python -m trainer ...` in a code block or an inline code span of README.md and docs/ is
# checked against the command tables of the two CLIs: the subcommand exists, every --option is one of its options,
# and a value given to an option that takes one of a set of names is one of them (argparse's choices; for envtool,
# the sets its code checks). Placeholders (CONFIG, <dir>, [--json], a|b) are not checked as values.
CLI_WORDS = re.compile(r"(?<![\w.-])(envtool|-m trainer)((?:[ \t]+[^\s|;&)#>]+)*)")
PLACEHOLDER = re.compile(r"[A-Z<>\[\]{}|$*]|\.\.\.")


# what may stand before a command on its line: nothing, a prompt, VAR=value, a shell operator, a wrapper, a path
COMMAND_START = re.compile(r"(?:.*(?:&&|\|\||[|;(`]|\$\(|\s--|\btime|\bexec|\bsudo|\brun|/))?[\s$]*(?:\w+=\S*\s+)*")


def _code(text: str):
    """The code of a Markdown page: each line of its fenced blocks (continuation lines joined), each inline span;
    not the blocks scripts/gen_docs.py fills with a command's output (`<!-- output: ... -->`)."""
    text = re.sub(r"<!-- output: .*?<!-- output:end -->", "", text, flags=re.S)
    fenced = re.compile(r"^ *```[^\n]*\n(.*?)^ *```", re.S | re.M)
    for block in fenced.findall(text):
        yield from block.replace("\\\n", " ").splitlines()
    yield from re.findall(r"`([^`\n]+)`", fenced.sub("", text))


def _documented_commands(path: Path):
    """(the CLI, its words) for each command written on the page, the words up to a shell operator, a comment or
    `--` (what follows is another program's). `envtool` counts where a command starts, not mid-sentence in an
    output line ("the envtool command that ...")."""
    for code in _code(path.read_text()):
        if re.match(r"\s*envtool: ", code):  # a message envtool printed (`envtool: error: ...`), not a command
            continue
        for match in CLI_WORDS.finditer(code):
            words = match.group(2).split()
            words = words[:words.index("--")] if "--" in words else words
            if match.group(1) == "-m trainer":
                yield "python -m trainer", words
            elif words and COMMAND_START.fullmatch(code[:match.start()]):
                yield "envtool", words


@functools.cache
def _cli_tables() -> dict[str, dict]:
    """{CLI: {subcommand words: {option: the names it takes, or None for any value}}}, read from the CLIs' parsers."""
    import typer.main

    from resolver import cli, lock
    from trainer.cli import build_parser

    tables: dict[str, dict] = {"envtool": {}, "python -m trainer": {}}
    checked = {("export", "--format"): set(lock.EXPORT_FORMATS), ("resolve", "--format"): set(cli.RESOLVE_FORMATS)}

    def walk(command, words: tuple):
        if hasattr(command, "commands"):  # a group (typer vendors its own click: no isinstance)
            for name, sub in command.commands.items():
                walk(sub, (*words, name))
            if words:  # `envtool matrix` alone prints its help
                tables["envtool"][words] = {"--help": None}
            return
        options = {}
        for param in command.params:
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("-"):
                    choices = getattr(param.type, "choices", None)
                    options[opt] = set(choices) if choices else checked.get((" ".join(words), opt))
        tables["envtool"][words] = {**options, "--help": None}

    walk(typer.main.get_command(cli.app), ())
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for name, sub in subparsers.choices.items():
        tables["python -m trainer"][(name,)] = {opt: set(a.choices) if a.choices else None
                                                for a in sub._actions for opt in a.option_strings}
    return tables


GLOBAL_OPTIONS = {"--debug", "--version", "--help", "-h"}


def _command_problem(cli: str, words: list[str]) -> str | None:
    """Why `cli words` is not a command of that CLI, None when it is (or names no subcommand: a placeholder)."""
    words = [w.strip("'\"") for w in words]
    while words and words[0] in GLOBAL_OPTIONS:
        words = words[1:]
    if not words or not re.fullmatch(r"[a-z][a-z0-9-]*", words[0]):
        return None  # `envtool` alone, `envtool COMMAND`, `envtool [OPTIONS]`: no subcommand named
    table = _cli_tables()[cli]
    found = next((key for n in (2, 1) if (key := tuple(words[:n])) in table), None)
    if found is None:
        return f"{cli} {' '.join(words[:2])}: no such subcommand (known: {', '.join(sorted(' '.join(k) for k in table))})"
    options, rest = table[found], words[len(found):]
    for i, word in enumerate(rest):
        name, _, value = word.lstrip("[").rstrip("]").partition("=")
        if not name.startswith("--") or PLACEHOLDER.search(name):
            continue
        if name not in options:
            return f"{cli} {' '.join(found)}: no option {name} (its options: {', '.join(sorted(options))})"
        value = value or (rest[i + 1] if i + 1 < len(rest) else "")
        if options[name] and value and not value.startswith("-") and not PLACEHOLDER.search(value) \
                and value not in options[name]:
            return f"{cli} {' '.join(found)} {name} {value}: {name} takes {', '.join(sorted(options[name]))}"
    return None


@pytest.mark.parametrize("path", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_the_docs_give_exist(path):
    """`envtool export --format gguf` was written in docs/guides/train.md: envtool's export writes requirements or
    pylock; the GGUF export is `python -m trainer export`. Every command a page gives is one the CLIs take."""
    problems = [p for cli, words in _documented_commands(path) if (p := _command_problem(cli, words))]
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(sorted(set(problems)))


def test_the_docs_check_catches_a_wrong_command():
    """The check on the mistake that was in the docs, and on a misspelt subcommand and option."""
    assert "--format takes pylock, requirements" in _command_problem("envtool", "export --format gguf".split())
    assert _command_problem("python -m trainer", "export config.yml --format gguf".split()) is None
    assert "no such subcommand" in _command_problem("envtool", ["exprot", "x"])
    assert "no option --dryrun" in _command_problem("envtool", ["train", "CONFIG", "--dryrun"])
    assert "no such subcommand" in _command_problem("python -m trainer", ["merge", "CONFIG"])
    assert _command_problem("envtool", ["matrix", "update", "--check"]) is None
    assert _command_problem("envtool", ["COMMAND", "--help"]) is None
