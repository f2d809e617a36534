"""What output_dir/merged was made from: merge-lora writes merged/envtool-merge.json (the adapter's path and the
sha256 of its files); export and chat-check refuse a merged/ whose adapter has changed since (training continued
or ran again after merge-lora), instead of writing or checking a stale model with exit 0."""

from __future__ import annotations

import json
from pathlib import Path

MADE_FROM = "envtool-merge.json"  # in merged/: the adapter it was made from ({"adapter", "files": {name: sha256}})
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def adapter_fingerprint(final: Path) -> dict:
    # start-up: trainer.runtime.digest imported only when this runs
    from trainer.runtime.digest import sha256_file

    return {name: sha256_file(final / name) for name in ADAPTER_FILES if (final / name).is_file()}


def stale_merge(out: Path) -> str | None:
    """Why output_dir/merged no longer is output_dir/final's adapter merged (training continued, or ran again,
    after merge-lora), or None. Read from merged/envtool-merge.json; a merged/ without one (an older envtool) is
    stale when an adapter file is newer than its config.json."""
    merged, final = Path(out) / "merged", Path(out) / "final"
    if not (merged / "config.json").is_file() or not (final / "adapter_config.json").is_file():
        return None
    try:
        made_from = json.loads((merged / MADE_FROM).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        made_from = None
    if isinstance(made_from, dict):
        if made_from == adapter_fingerprint(final):
            return None
        why = "its adapter files changed since"
    else:
        newer = [n for n in ADAPTER_FILES if (final / n).is_file()
                 and (final / n).stat().st_mtime > (merged / "config.json").stat().st_mtime]
        if not newer:
            return None
        why = f"{newer[0]} is newer"
    return (f"{merged} was merged from an earlier {final} ({why}: training continued after merge-lora); merge again: "
            f"remove {merged} and run python -m trainer merge-lora CONFIG")
