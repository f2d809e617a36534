"""`envtool resolve` without typer: the command scripts and CI call most, answered in a fraction of typer's start-up.

Importing typer (and click, inspect, typing's machinery) and building its parser cost more than the whole answer,
so `envtool resolve` with plain options is parsed here and runs the same body as the typer command (`show_plans`,
which cli.resolve also calls), with the same one-line errors and exit codes (`error_lines`). Anything this parser
does not take as written (--help, --debug, --version, an option it does not know, a flag given a value, an option
given twice or without a value) goes to the typer app, so its answer, help and usage errors stay typer's: the two
paths agree on every input (tests/resolver/test_quick_cli.py). The options are cli.py's (PLAN_OPTIONS and
resolve's own); the test checks that every name here is one of them, with the same kind (flag or value).
"""

from __future__ import annotations

import json
import sys

# resolve's options, as cli.resolve declares them: the flag, the keyword it fills, and whether it takes a value
VALUE_OPTIONS = {"--gpu": "gpu", "--driver": "driver", "--python": "python", "--torch": "torch", "--cuda": "cuda",
                 "--flash-attn": "flash_attn", "--attention": "attention", "--platform": "platform",
                 "--format": "fmt"}
FLAG_OPTIONS = {"--no-flash-attn": "no_flash_attn", "--json": "json_out", "--explain": "explain"}
RESOLVE_FORMATS = ("table", "json", "github", "markdown")  # `envtool resolve --format`


def parse_resolve(argv: list[str]) -> dict | None:
    """resolve's keyword arguments from `argv` (without the program name), or None when typer should parse it."""
    if argv[:1] != ["resolve"]:
        return None
    given: dict = {}
    words = iter(argv[1:])
    for word in words:
        flag, eq, value = word.partition("=")
        if flag in FLAG_OPTIONS and not eq:
            name, value = FLAG_OPTIONS[flag], True
        elif flag in VALUE_OPTIONS:
            name = VALUE_OPTIONS[flag]
            if not eq:
                value = next(words, None)
                if value is None or value.startswith("-"):
                    return None  # a missing value: typer's usage error
        else:
            return None
        if name in given:
            return None  # given twice: typer's rule (the last) applies there
        given[name] = value
    return given


def plan_options(values: dict):
    """The PlanOptions a plan-making command's options build, checked: one clear line for an empty value."""
    # start-up: resolver.hardware, resolver.pipeline imported only when this runs
    from .errors import BadInput
    from .hardware import check_target_text
    from .pipeline import PlanOptions

    check_target_text(values.get("gpu"))  # `--gpu ''` or `--gpu None` is an error, not a CPU plan
    for name, value in values.items():  # `--python ''` (a script's empty variable) is an error, not the default
        if name != "gpu" and isinstance(value, str) and not value.strip():
            raise BadInput(f"--{name.replace('_', '-')} is empty: give a value, or leave the option out for the default")
    return PlanOptions(**values)


def show_plans(opts, fmt: str, json_out: bool, explain: bool) -> None:
    """resolve's body: the plans for `opts`, printed as a table, JSON, a GitHub matrix or markdown."""
    # start-up: resolver.pipeline, resolver.ci imported only when this runs
    from .errors import BadInput
    from .pipeline import make_plans

    fmt = "json" if json_out else fmt
    if fmt not in RESOLVE_FORMATS:
        raise BadInput(f"--format {fmt!r}: choose table, json, github or markdown")
    plans = make_plans(opts)
    if fmt == "json":
        data = [p.to_dict(explain) for p in plans]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    elif fmt == "github":
        from .ci import github_matrix  # start-up

        print(github_matrix(plans))
    elif fmt == "markdown":
        from .markdown import plans_markdown  # start-up
        from .matrix import load  # start-up

        print(plans_markdown(plans, load()))
    else:
        from .render import plan_table  # start-up

        for plan in plans:
            plan_table(plan, explain)


def error_lines(e: Exception) -> list[str]:
    """An EnvtoolError as the lines the CLI prints: one per problem, cut to a readable size, no credential."""
    # start-up: trainer.errors, resolver.credentials imported only when this runs
    from trainer.errors import readable  # one line, cut to a readable size

    from .credentials import redact  # no index credential in an error line

    return [readable(redact(f"envtool: error: {line}")) for line in getattr(e, "lines", None) or [str(e)]]


def run_resolve(given: dict) -> int:
    """`envtool resolve` with options parsed by `parse_resolve`: the exit code."""
    from .errors import EnvtoolError  # start-up

    fmt, json_out, explain = given.pop("fmt", "table"), given.pop("json_out", False), given.pop("explain", False)
    try:
        show_plans(plan_options({"gpu": "auto", **given}), fmt, json_out, explain)
    except EnvtoolError as e:
        for line in error_lines(e):
            print(line, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("envtool: interrupted", file=sys.stderr)
        return 130
    return 0
