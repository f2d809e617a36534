"""`envtool resolve` answered without typer (resolver/quick.py) says exactly what the typer app says: the same output,
the same error lines, the same exit codes, over the inputs a script gives it and the ones it hands to typer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resolver import quick

PY = ["--python", "3.11", "--platform", "x86_64"]
# parsed by quick.py
QUICK = [
    ["resolve", "--gpu", "t4", "--json", *PY],
    ["resolve", "--gpu=a100", "--format", "github", *PY],
    ["resolve", "--gpu", "t4,v100", "--json", "--explain", *PY],
    ["resolve", "--gpu", "v100", "--torch", "2.8", "--json", *PY],
    ["resolve", "--gpu", "a100", "--no-flash-attn", "--format=markdown", *PY],
    ["resolve", "--gpu", "h100", "--driver", "550.54.14", "--cuda", "12", "--json", *PY],
    ["resolve", "--gpu", "a100", "--attention", "sdpa", "--json", *PY],
    ["resolve", "--gpu", "a101", *PY],  # unknown GPU: one line, exit 2
    ["resolve", "--gpu", "", "--json"],  # an empty value: one line, exit 2
    ["resolve", "--gpu", "t4", "--python", " ", "--json"],
    ["resolve", "--gpu", "t4", "--format", "yaml"],
    ["resolve", "--gpu", "t4", "--torch", "1.0", "--json", *PY],  # unsatisfiable
]
# handed to typer: its usage errors and help
TYPER = [
    ["resolve", "--gpu"],
    ["resolve", "--json=1"],
    ["resolve", "--gpu", "t4", "--gpu", "a100", "--json", *PY],
    ["resolve", "--help"],
    ["resolve", "--bogus"],
    ["resolve", "extra"],
    ["--debug", "resolve", "--gpu", "t4", "--json", *PY],
]

RUN_ALL = """
import contextlib, io, json, sys
from {module} import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["envtool", *argv]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_all(module: str, cases: list[list[str]]) -> list:
    out = subprocess.run([sys.executable, "-c", RUN_ALL.format(module=module), json.dumps(cases)],
                         capture_output=True, text=True, timeout=300, env={"COLUMNS": "120", **_env()})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("ENVTOOL_")}


def test_quick_parses_what_it_should_and_hands_the_rest_to_typer():
    assert all(quick.parse_resolve(argv) is not None for argv in QUICK)
    assert all(quick.parse_resolve(argv) is None for argv in TYPER)


def test_the_quick_path_and_the_typer_app_answer_alike():
    cases = QUICK + TYPER
    fast, typer_app = run_all("resolver.entry", cases), run_all("resolver.cli", cases)
    for argv, a, b in zip(cases, fast, typer_app):
        assert a == b, argv
    codes = {tuple(argv): code for argv, (code, _, _) in zip(cases, fast)}
    assert codes[tuple(QUICK[0])] == 0 and codes[tuple(QUICK[7])] == 2 and codes[tuple(TYPER[0])] == 2
    assert json.loads(fast[0][1])["gpu"]["name"] == "Tesla T4"


def test_quick_knows_resolves_options_as_typer_declares_them():
    """Every option of the typer `resolve` command is parsed here, with the same kind (flag or value): a new option
    added there and not here would still work (typer answers), but slowly; one here and not there would be a lie."""
    import typer.main

    from resolver.cli import app

    command = typer.main.get_command(app).commands["resolve"]
    declared = {opt: p.is_flag for p in command.params for opt in p.opts}
    here = {**{o: False for o in quick.VALUE_OPTIONS}, **{o: True for o in quick.FLAG_OPTIONS}}
    assert here == {o: flag for o, flag in declared.items() if o != "--help"}


@pytest.mark.parametrize("argv", [["resolve", "--gpu", "t4", "--json"]])
def test_resolve_needs_neither_typer_nor_the_toml_parser(argv, tmp_path):
    """`envtool resolve` starts in a few times `python -c pass` (bench/bench_resolve_startup.py): no typer, and the
    matrices read back from the cache, not parsed (the first run writes it)."""
    script = ("import sys; sys.argv = ['envtool', *sys.argv[1:]]\nfrom resolver.entry import main\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "slow = {'typer', 'click', 'tomllib', 'dataclasses', 'hashlib', 'inspect', 'trainer.config'}\n"
              "print(sorted(m for m in sys.modules if m in slow or m.split('.')[0] in slow), file=sys.stderr)")
    env = {**_env(), "XDG_CACHE_HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env)
    assert again.stderr.strip().splitlines()[-1] == "[]", again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)
