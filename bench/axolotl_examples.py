"""How many of Axolotl's own example configs `python -m trainer validate --gpu GPU` takes unchanged.

Reads the configs straight out of a git directory of axolotl-ai-cloud/axolotl (for example the bare one
`fetch github:axolotl-ai-cloud/axolotl` leaves under /work/.mirror), at a given commit (default HEAD).
Counted: every examples/**/*.y(a)ml except examples/archived/, vision/audio configs (those with
processor_type or image_* keys) and files that are not training configs (no base_model: cloud launcher
files). Each config is validated in its own directory (relative paths stay relative) by the real CLI, in
this process, with no network: validate loads no tokenizer or model (HF_HUB_OFFLINE=1 makes sure).

Prints the pass ratio, the refusals grouped by the key they name, and any config that failed with
something other than a one-line refusal (a bug). Usage:

    python bench/axolotl_examples.py /work/.mirror/axolotl-ai-cloud+axolotl/repo [--gpu a100] [--ref HEAD] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import yaml  # noqa: E402

VISION_KEYS = ("processor_type", "image_size", "image_resize_algorithm")


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def example_configs(git_dir: str, ref: str) -> tuple[dict[str, str], dict[str, str]]:
    """(path -> text of the counted configs, path -> why the others were left out)."""
    kept, skipped = {}, {}
    for path in git(git_dir, "ls-tree", "-r", "--name-only", ref, "examples").splitlines():
        if not re.search(r"\.ya?ml$", path):
            continue
        if path.startswith("examples/archived/"):
            skipped[path] = "archived"
            continue
        text = git(git_dir, "show", f"{ref}:{path}")
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError:
            raw = None
        if not isinstance(raw, dict) or "base_model" not in raw:
            skipped[path] = "not a training config (no base_model)"
        elif any(k in raw for k in VISION_KEYS):
            skipped[path] = "vision/audio model"
        else:
            kept[path] = text
    return kept, skipped


def validate(path: Path, gpu: str) -> tuple[int, str]:
    """Run the real `validate` in this process: (exit code, stderr)."""
    from trainer.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(["validate", str(path), "--gpu", gpu])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, err.getvalue().strip()


def refused_keys(message: str) -> list[str]:
    """The config keys a refusal names (the CLI prints one line per problem: `error: KEY: why`)."""
    keys = []
    for line in message.splitlines():
        part = line.removeprefix("error: ")
        m = re.match(r"([\w.\[\]]+): ", part) or re.match(r"([\w.\[\]]+) ", part)
        keys.append(re.sub(r"\.\d+(\.|$)", r".*\1", m.group(1)) if m else part[:60])
    return keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("git_dir")
    ap.add_argument("--gpu", default="a100")
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every refusal")
    args = ap.parse_args(argv)

    commit = git(args.git_dir, "rev-parse", args.ref).strip()
    configs, skipped = example_configs(args.git_dir, args.ref)
    passed, refusals, crashes = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for rel, text in sorted(configs.items()):
            path = Path(tmp) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            code, err = validate(path, args.gpu)
            if code == 0:
                passed.append(rel)
            elif "(run with --debug for the traceback)" in err or code not in (1, 2):
                crashes[rel] = err
            else:
                refusals[rel] = err if err else f"exit {code}"

    by_key: dict[str, list[str]] = defaultdict(list)
    for rel, message in refusals.items():
        for key in refused_keys(message):
            by_key[key].append(rel)
    total = len(configs)
    print(f"axolotl {commit[:12]}: {len(passed)}/{total} example configs validate for --gpu {args.gpu} "
          f"({100 * len(passed) / max(total, 1):.1f}%); left out: "
          + ", ".join(f"{n} {why}" for why, n in Counter(skipped.values()).most_common()))
    if by_key:
        print("refusals by key (a config may name several):")
        for key, rels in sorted(by_key.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            print(f"  {len(rels):4d}  {key}: e.g. {rels[0]}")
    alone = Counter(keys[0] for keys in (sorted(set(refused_keys(m))) for m in refusals.values()) if len(keys) == 1)
    if alone:
        print("configs refused for one key only: " + ", ".join(f"{k} ({n})" for k, n in alone.most_common()))
    if args.verbose:
        for rel, message in sorted(refusals.items()):
            print(f"  {rel}: {message}")
    for rel, message in sorted(crashes.items()):
        print(f"CRASH {rel}: {message}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
