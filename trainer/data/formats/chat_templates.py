"""Chat templates by name: trainer/templates/<name>.jinja, each listed with its source in SOURCES.toml.

`chat_template:` may be
- tokenizer_default: the tokenizer's own template (the default);
- jinja: the template in chat_template_jinja (the text itself, or a path to a .jinja file);
- a name from trainer/templates/ (llama3, chatml, phi_3, gemma3, mistral_v7_tekken, qwen_25, qwen3, ...);
- tokenizer_default_fallback_<name>: the tokenizer's template, or <name> when it has none.
A dataset may override the top-level choice with its own chat_template / chat_template_jinja.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

from trainer.errors import ConfigError

TEMPLATE_DIR = Path(__file__).parents[2] / "templates"
FALLBACK = "tokenizer_default_fallback_"


@lru_cache(maxsize=1)
def sources() -> dict[str, dict]:
    with open(TEMPLATE_DIR / "SOURCES.toml", "rb") as f:
        return {row["name"]: row for row in tomllib.load(f)["template"]}


def names() -> list[str]:
    return sorted(sources())


def check(choice: str, jinja: str | None) -> None:
    """Validate a chat_template choice without a tokenizer (validate runs offline)."""
    if choice in ("tokenizer_default",):
        return
    if choice == "jinja":
        if not jinja:
            raise ConfigError("chat_template: jinja needs chat_template_jinja (the template text or a .jinja file)")
        return
    name = choice.removeprefix(FALLBACK)
    if name not in sources():
        import difflib

        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"chat_template: unknown template '{choice}'{hint} (known: tokenizer_default, jinja, "
                          f"{', '.join(names())})")


def template_text(name: str) -> str:
    return (TEMPLATE_DIR / sources()[name]["file"]).read_text()


def resolve(choice: str, jinja: str | None, tokenizer) -> str | None:
    """The template text for a choice (None: the tokenizer has none and none was asked for)."""
    check(choice, jinja)
    if choice == "tokenizer_default":
        return tokenizer.chat_template
    if choice == "jinja":
        path = Path(jinja).expanduser()
        if "\n" not in jinja and "{" not in jinja and path.suffix == ".jinja":
            if not path.is_file():
                raise ConfigError(f"chat_template_jinja: file not found: {jinja}")
            return path.read_text()
        return jinja
    if choice.startswith(FALLBACK) and tokenizer.chat_template:
        return tokenizer.chat_template
    return template_text(choice.removeprefix(FALLBACK))
