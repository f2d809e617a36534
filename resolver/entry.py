"""The `envtool` command's entry point: `envtool resolve` with plain options answered without typer
(resolver/quick.py), everything else by the typer app (resolver/cli.py)."""

from __future__ import annotations

import sys


def main() -> None:
    # start-up: trainer.errors imported only when this runs (no torch, no pydantic)
    from trainer.errors import no_home

    why = no_home()
    if why:
        print(f"envtool: error: {why}", file=sys.stderr)
        sys.exit(2)
    from .quick import parse_resolve, run_resolve  # start-up: no typer on resolve's path

    given = parse_resolve(sys.argv[1:])
    if given is not None:
        sys.exit(run_resolve(given))
    from .cli import main as typer_main  # start-up: typer only where its parser is needed

    typer_main()


if __name__ == "__main__":
    main()
