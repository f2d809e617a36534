"""Chat roles in the data -> the roles a chat template knows (shared by the SFT, preference and mistral-common
renderers)."""

from __future__ import annotations

from trainer.config import DatasetConfig

# Axolotl's mapping when a dataset sets no `roles` (ShareGPT's human/gpt), from its chat_template strategy.
DEFAULT_ROLES = {"user": ["human", "user"], "assistant": ["gpt", "assistant"], "system": ["system"], "tool": ["tool"]}


def role_alias(ds: DatasetConfig) -> dict[str, str]:
    """Data role name -> template role: the dataset's `roles`, else Axolotl's default (human -> user, gpt -> assistant)."""
    return {name: role for role, names in (ds.roles or DEFAULT_ROLES).items() for name in names}
