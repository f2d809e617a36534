"""Chat templates by name: trainer/templates/<name>.jinja, each listed with its source in SOURCES.toml.

`chat_template:` may be
- tokenizer_default: the tokenizer's own template (the default);
- jinja: the template in chat_template_jinja (the text itself, or a path to a .jinja file);
- a name from trainer/templates/ (llama3, chatml, phi_3, gemma3, mistral_v7_tekken, qwen_25, qwen3, ...);
- tokenizer_default_fallback_<name>: the tokenizer's template, or <name> when it has none.
A dataset may override the top-level choice with its own chat_template / chat_template_jinja.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config.datasets import FALLBACK, TEMPLATE_DIR, check_chat_template, template_names, template_sources
from trainer.errors import ConfigError

# the catalog and the check of a choice live with the config (read without a tokenizer, in the resolver too)
check = check_chat_template
sources, names = template_sources, template_names


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
