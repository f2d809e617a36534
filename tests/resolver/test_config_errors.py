"""A config's mistakes as the commands a user types report them (issue 40, item 6): a value of the wrong type for a
key that takes a list or a name (`datasets: -1` with `rl: dpo` ended in "TypeError: 'int' object is not iterable"),
and a YAML syntax error (PyYAML's own wording only, before) -- one line naming the file, the key or the place, and
exit 2, from `python -m trainer validate`, `python -m trainer train`, `envtool train --dry-run` and `envtool fit`.

In this process, through each command's own entry point (the trainer's `main`, envtool's typer app), as
tests/resolver/test_train_seam.py does: the refusal comes before anything is built or loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
EXAMPLE["datasets"][0]["path"] = str(REPO / EXAMPLE["datasets"][0]["path"])
COMMANDS = ["validate", "train", "envtool train --dry-run", "envtool fit"]


@pytest.fixture
def run(monkeypatch, tmp_path, capsys):
    """run(command, config) -> (exit code, stderr lines) for one of COMMANDS."""
    from typer.testing import CliRunner

    from resolver.cli import app
    from trainer.cli import main

    for key, value in {"HF_HUB_OFFLINE": "1", "ENVTOOL_CACHE_DIR": str(tmp_path / "cache"),
                       "XDG_CACHE_HOME": str(tmp_path / "xdg")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ENVTOOL_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)

    def run_one(command: str, config: Path) -> tuple[int, list[str]]:
        if command.startswith("envtool "):
            words = command.split()[1:]
            result = CliRunner().invoke(app, [words[0], str(config), "--gpu", "a100", *words[1:],
                                              *(["--isolated"] if "--dry-run" in words else [])])
            assert "Traceback" not in result.output and result.exception is None or isinstance(
                result.exception, SystemExit), result.output
            return result.exit_code, result.stderr.strip().splitlines()
        capsys.readouterr()
        code = main([command, str(config)] + (["--gpu", "a100"] if command == "validate" else []))
        return code, capsys.readouterr().err.strip().splitlines()

    return run_one


def write(tmp_path: Path, **keys) -> Path:
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump({**EXAMPLE, **keys}))
    return path


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("keys, says", [
    ({"rl": "dpo", "datasets": -1}, "datasets: must be a list of dataset entries, each starting with `- ` (`- path: "
                                     "...`, then `type: ...` below it), not -1"),
    ({"datasets": "x"}, "datasets: must be a list of dataset entries, each starting with `- ` (`- path: ...`, then "
                        "`type: ...` below it), not 'x'"),
    ({"datasets": {"a": 1}}, "datasets: must be a list of dataset entries, each starting with `- ` (`- path: ...`), "
                             "but is one mapping (a)"),
    ({"rl": "dpo", "test_datasets": 3}, "test_datasets: must be a list of dataset entries"),
    ({"rl": 5}, "rl: got 5; input should be 'dpo'"),
], ids=["dpo-datasets-int", "datasets-str", "datasets-mapping", "test_datasets-int", "rl-int"])
def test_a_wrong_type_is_one_line_naming_the_key_and_value(run, tmp_path, command, keys, says):
    code, lines = run(command, write(tmp_path, **keys))
    assert code == 2 and len(lines) == 1 and says in lines[0], lines


WRONG = st.one_of(st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                  st.text(max_size=5), st.lists(st.integers(), max_size=2),
                  st.dictionaries(st.sampled_from("ab"), st.integers(), max_size=2))


def _keys() -> list[str]:
    from trainer.config.schema import Config

    return sorted(Config.model_fields)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(key=st.sampled_from(_keys()), value=WRONG, rl=st.sampled_from([None, "dpo"]))
def test_any_top_level_key_with_a_wrong_type_is_refused_in_lines_never_a_traceback(run, tmp_path, key, value, rl):
    """Wrong-typed values for every top-level key, with and without a preference method: validate accepts the
    config or refuses it in lines (exit 0 or 2), never exit 1 (the trainer's one line for a bug)."""
    keys = {key: value, **({"rl": rl} if rl and key != "rl" else {})}
    code, lines = run("validate", write(tmp_path, **keys))
    assert code in (0, 2), lines
    assert not any("run with --debug for the traceback" in line for line in lines), lines


BROKEN = {  # (the file's text, the line and column named, what it says)
    "tab indentation": ("base_model: x\ndatasets:\n\t- path: a.jsonl\n", 3, 1, "a tab: YAML indents with spaces only"),
    "unclosed quote": ('base_model: x\nchat_template: "chatml\nlearning_rate: 0.1\n', 2, 16,
                       "a quoted value opens here and is never closed"),
    "duplicate colon": ("base_model: x\nlearning_rate: 0.1: 2\n", 2, 19, "a ':' YAML cannot read here: quote a value "
                        "that holds ': '"),
    "unclosed list": ("base_model: x\nlora_target_modules: [q_proj, v_proj\nseed: 1\n", 2, 22,
                      "a [list] opens here and is not closed"),
    "missing colon": ("base_model: x\nlearning_rate\nseed: 1\n", 2, 1, "not `key: value`"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_yaml_syntax_error_is_one_line_naming_the_file_line_and_column(run, tmp_path, command, broken):
    text, line, column, says = BROKEN[broken]
    config = tmp_path / "broken.yml"
    config.write_text(text)
    code, lines = run(command, config)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].split("error: ", 1)[1].startswith(f"{config} line {line} column {column}: {says}"), lines
