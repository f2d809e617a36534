"""Regenerate matrices/axolotl_keys.toml: every config key Axolotl declared since v0.4.0, and what this trainer does with it.

Reads a git directory of axolotl-ai-cloud/axolotl (the bare one `fetch github:axolotl-ai-cloud/axolotl` leaves under
/work/.mirror) without importing or copying Axolotl's code: at each release tag from v0.4.0 on, and at the branch
head given by --ref, the config schema is parsed with Python's ast:

- v0.5.0 .. v0.7.x: src/axolotl/utils/config/models/input/v0_4_1/*.py; v0.8.0 on: src/axolotl/utils/schemas/*.py.
  The fields of the root model (AxolotlConfigWCapabilities, else AxolotlInputConfig) and of every class it inherits
  from, a field's `alias` being the key users write (both spellings are accepted by populate_by_name); fields whose
  type is another model of the schema are walked into: `datasets[].type.format`, `trl.beta`.
- the plugins' own keys, src/axolotl/integrations/*/args.py (merged into the config when the plugin is listed):
  every pydantic model there that no other model of the file nests.
- v0.4.0 had no schema: its README's "All yaml options" block (the documented keys, commented ones included) and
  the keys src/axolotl/utils/config.py reads from cfg without setting them.

The decision columns (decision, reason, to) are kept from the existing table for every key already in it; a key
new to the table takes the trainer's present behaviour where the trainer knows it (trainer.config's fields and its
key lists), else it is left undecided, and tests/trainer/config/test_axolotl_keys.py fails until someone decides.

    python scripts/axolotl_keys.py /work/.mirror/axolotl-ai-cloud+axolotl/repo [--ref HEAD] [--out matrices/axolotl_keys.toml]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "matrices" / "axolotl_keys.toml"
FIRST = (0, 4, 0)
V041 = "src/axolotl/utils/config/models/input/v0_4_1/"
SCHEMAS = "src/axolotl/utils/schemas/"
ROOT_MODELS = ("AxolotlConfigWCapabilities", "AxolotlInputConfig")
MODEL_BASES = {"BaseModel"}  # a class is a pydantic model when it reaches one of these through its bases
DECISIONS = ("honoured", "inert", "migrated", "refused")


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def version(tag: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", tag.split(".post")[0])[:3])


def release_tags(git_dir: str) -> list[str]:
    tags = [t for t in git(git_dir, "tag", "--list", "v*").split() if re.fullmatch(r"v\d+\.\d+\.\d+(\.post\d+)?", t)]
    return sorted((t for t in tags if version(t) >= FIRST), key=lambda t: (version(t), t))


# --- one release's schema ----------------------------------------------------------------------------------

def _unwrap(node: ast.expr) -> ast.expr:
    """Optional[X] -> X, Annotated[X, ...] -> X, X | None -> X."""
    while True:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name | ast.Attribute):
            name = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if name == "Optional":
                node = node.slice
                continue
            if name == "Annotated" and isinstance(node.slice, ast.Tuple):
                node = node.slice.elts[0]
                continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            parts = _union_parts(node)
            rest = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
            if len(rest) < len(parts):
                node = rest[0] if len(rest) == 1 else _join(rest)
                continue
        return node


def _union_parts(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_parts(node.left) + _union_parts(node.right)
    return [node]


def _join(parts: list[ast.expr]) -> ast.expr:
    node = parts[0]
    for p in parts[1:]:
        node = ast.BinOp(left=node, op=ast.BitOr(), right=p)
    return node


def type_text(annotation: ast.expr) -> str:
    text = ast.unparse(_unwrap(annotation))
    text = re.sub(r"\bOptional\[([^\[\]]+)\]", r"\1", text)
    text = re.sub(r"\bList\[", "list[", re.sub(r"\bDict\[", "dict[", text))
    return re.sub(r"\s+", " ", text)


def _names(node: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _is_listy(annotation: ast.expr) -> bool:
    return bool({"list", "List", "conlist", "Sequence"} & _names(annotation))


def _field_call(value: ast.expr | None) -> dict[str, ast.expr]:
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) == "Field":
        return {kw.arg: kw.value for kw in value.keywords if kw.arg}
    return {}


def _default(value: ast.expr | None, call: dict[str, ast.expr]):
    """The field's default when it is a plain bool, number or string (None: unset, or not a literal)."""
    node = call.get("default", None if call else value)
    try:
        literal = ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None
    return literal if isinstance(literal, bool | int | float | str) else None


class Schema:
    """The pydantic models of one release's files, by class name."""

    def __init__(self) -> None:
        self.classes: dict[str, ast.ClassDef] = {}
        self.where: dict[str, str] = {}

    def add(self, path: str, text: str) -> list[str]:
        names = []
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                self.where[node.name] = path
                names.append(node.name)
        return names

    def bases(self, name: str) -> list[str]:
        node = self.classes.get(name)
        return [] if node is None else [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]

    def is_model(self, name: str, seen: frozenset = frozenset()) -> bool:
        if name in MODEL_BASES:
            return True
        if name not in self.classes or name in seen:
            return False
        return any(self.is_model(b, seen | {name}) for b in self.bases(name))

    def fields(self, name: str) -> dict[str, tuple[ast.AnnAssign, str]]:
        """field name -> (its declaration, the class declaring it), bases first so subclasses override."""
        out: dict[str, tuple[ast.AnnAssign, str]] = {}
        for base in reversed(self.bases(name)):
            if base in self.classes:
                out.update(self.fields(base))
        for stmt in self.classes[name].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                key = stmt.target.id
                if key.startswith("_") or "ClassVar" in _names(stmt.annotation) or key == "model_config" and not _field_call(stmt.value):
                    continue
                out[key] = (stmt, name)
        return out

    def keys(self, root: str, prefix: str = "", seen: frozenset = frozenset()) -> dict[str, dict]:
        rows: dict[str, dict] = {}
        for field, (stmt, owner) in self.fields(root).items():
            call = _field_call(stmt.value)
            alias = call.get("alias")
            names = [field]
            if isinstance(alias, ast.Constant) and isinstance(alias.value, str):
                names = [alias.value, field]
            deprecated = call.get("deprecated")
            default = _default(stmt.value, call)
            for i, key in enumerate(names):
                row = {"type": type_text(stmt.annotation), "schema": owner}
                if i:
                    row["alias_of"] = prefix + names[0]
                if isinstance(deprecated, ast.Constant) and deprecated.value:
                    row["deprecated"] = True  # (the message itself is Axolotl's text: only what it names is kept)
                    named = re.findall(r"`([^`]+)`", deprecated.value) if isinstance(deprecated.value, str) else []
                    named = [n for n in named if n.split(":")[0].strip() != key]
                    if named:
                        row["replaced_by"] = named[0]
                if default is not None:
                    row["default"] = default
                rows[prefix + key] = row
            nested = sorted(n for n in _names(stmt.annotation)
                            if n in self.classes and self.is_model(n) and n not in seen)
            sub = prefix + names[0] + ("[]." if _is_listy(stmt.annotation) else ".")
            for model in nested:
                for key, row in self.keys(model, sub, seen | {root, model}).items():
                    rows.setdefault(key, row)
        return rows


def schema_keys(git_dir: str, ref: str) -> tuple[dict[str, dict], str]:
    """(key -> {type, schema[, alias_of, deprecated]}, what was read) for one release."""
    files = git(git_dir, "ls-tree", "-r", "--name-only", ref, "src/axolotl").splitlines()
    core = [f for f in files if f.endswith(".py") and (f.startswith(SCHEMAS) or f.startswith(V041))]
    if not core:
        return readme_keys(git_dir, ref), "README 'All yaml options' + utils/config.py"
    schema = Schema()
    for path in core:
        schema.add(path, git(git_dir, "show", f"{ref}:{path}"))
    root = next(r for r in ROOT_MODELS if r in schema.classes)
    rows = schema.keys(root)
    for path in sorted(f for f in files if re.fullmatch(r"src/axolotl/integrations/[^/]+/args\.py", f)):
        plugin = path.split("/")[3]
        local = Schema()
        local.classes, local.where = dict(schema.classes), dict(schema.where)
        names = local.add(path, git(git_dir, "show", f"{ref}:{path}"))
        models = [n for n in names if local.is_model(n)]
        nested = {m for n in models for stmt, _ in local.fields(n).values() for m in _names(stmt.annotation) if m in models}
        for model in (m for m in models if m not in nested):
            for key, row in local.keys(model).items():
                rows.setdefault(key, {**row, "schema": f"plugin {plugin}: {row['schema']}"})
    return rows, (V041 if core[0].startswith(V041) else SCHEMAS) + " + integrations/*/args.py"


def readme_keys(git_dir: str, ref: str) -> dict[str, dict]:
    """v0.4.0: the README's documented keys and the user keys utils/config.py reads."""
    readme = git(git_dir, "show", f"{ref}:README.md")
    block = readme.split("All yaml options", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    rows: dict[str, dict] = {}

    def note(key: str, value, comment: str = "") -> None:
        m = re.search(r"(Optional\[[\w\[\], ]+\]|\bbool(ean)?\b|\bint\b|\bfloat\b|\bstr\b)", comment)
        kind = m.group(1).replace("boolean", "bool") if m else (
            type(value).__name__ if value is not None and not isinstance(value, dict | list) else "")
        rows.setdefault(key, {"type": kind, "schema": "README"})

    data = yaml.safe_load(block) or {}
    comments = {}
    for line in block.splitlines():
        m = re.match(r"^(#\s?)?([a-z_][a-z0-9_]*):\s*(\S[^#]*)?(#.*)?$", line)
        if m and (not m.group(1) or not m.group(3)):
            comments[m.group(2)] = m.group(4) or ""
    for key in list(data) + [k for k in comments if k not in data]:
        note(key, data.get(key), comments.get(key, ""))
    for entry in data.get("datasets") or []:
        for key, value in entry.items():
            if key == "type" and isinstance(value, dict):
                for sub, v in value.items():
                    rows.setdefault(f"datasets[].type.{sub}", {"type": type(v).__name__ if v is not None else "",
                                                               "schema": "README"})
                value = "str"
            for line in block.splitlines():
                m = re.match(rf"^\s+-?\s*{key}:[^#]*(#.*)?$", line)
                if m:
                    break
            comment = (m.group(1) or "") if m else ""
            kind = re.search(r"Optional\[(\w+)\]", comment)
            rows.setdefault(f"datasets[].{key}", {"type": kind.group(1) if kind else "str", "schema": "README"})
    code = ast.parse(git(git_dir, "show", f"{ref}:src/axolotl/utils/config.py"))
    read, written = set(), set()
    for node in ast.walk(code):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
            (written if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    for key in sorted(read - written - set(rows)):
        rows[key] = {"type": "", "schema": "utils/config.py"}
    return rows


# --- the table -----------------------------------------------------------------------------------------------

def ranges(present: list[bool], labels: list[str]) -> str:
    out, start = [], None
    for i, here in enumerate(present + [False]):
        if here and start is None:
            start = i
        elif not here and start is not None:
            out.append(labels[start] if start == i - 1 else f"{labels[start]}..{labels[i - 1]}")
            start = None
    return ", ".join(out)


def trainer_decision(key: str) -> dict[str, str]:
    """What the trainer does with a key today, where its config module says (else {})."""
    sys.path.insert(0, str(ROOT))
    try:
        import trainer.config as tc
        from trainer.config.parallel import FSDP_KEYS
    except Exception:  # noqa: BLE001  (a checkout mid-change: no decisions offered)
        return {}
    head, _, rest = key.partition(".")
    if rest:  # a key inside a block: the trainer's model of the block (or its known keys) says
        if head == "fsdp_config":
            return {"decision": "honoured"} if rest.removeprefix("fsdp_") in FSDP_KEYS else {}
        if head == "special_tokens":
            return {"decision": "honoured"}
        model = ({"datasets[]": tc.DatasetConfig, "pretraining_dataset[]": tc.PretrainingDatasetConfig}.get(head)
                 or _model_of(tc.Config.model_fields.get(head)))
        for part in rest.split("."):
            if model is None or part not in model.model_fields:
                return {}
            inner = _model_of(model.model_fields[part])
            model = inner if inner is not None else None
        return {"decision": "honoured"}
    if key in tc.Config.model_fields or key == "model_config":
        return {"decision": "honoured"}
    from trainer.config.keys import LEGACY_DTYPE_KEYS

    if key in LEGACY_DTYPE_KEYS:
        target, value = LEGACY_DTYPE_KEYS[key]
        return {"decision": "migrated", "to": f"{target}: {str(value).lower()}"}
    return {}


def _model_of(field):
    """The pydantic model a field holds (through Optional/list), else None."""
    import typing

    from pydantic import BaseModel

    stack = [getattr(field, "annotation", None)]
    while stack:
        ann = stack.pop()
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return ann
        stack += list(typing.get_args(ann))
    return None


def effective(rows: dict[str, dict], name: str) -> dict:
    """A key's decision by the table's rules (its header); the rules live in trainer/config/keys.py, which the
    trainer reads the table with."""
    sys.path.insert(0, str(ROOT))
    from trainer.config.keys import effective as rules

    return rules(rows, name)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return toml_str(str(value))


def toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


HEADER = """\
# Axolotl's config keys, release by release, and what this trainer does with each.
#
# Generated by scripts/axolotl_keys.py from a git directory of axolotl-ai-cloud/axolotl; the history columns are
# rewritten on every run, the decision columns (decision, reason, to) are kept for the keys already here.
# source: https://github.com/axolotl-ai-cloud/axolotl, {source}
# read: {read}
#
# Columns of each [[key]]:
#   name      the key as a user writes it: top level `lora_r`, a dataset entry's `datasets[].conversation`,
#             a block's `trl.beta`, a user-defined prompt format's `datasets[].type.format`
#   releases  the releases whose schema declared it (ranges of consecutive releases in the order of `releases`
#             below; "main" is the branch head named in the source line); empty, with schema "none": a key no
#             release declared that users' configs carry, listed for the decision this trainer takes on it
#   type      its type in the newest release that declared it (Optional unwrapped), as Axolotl wrote it
#   schema    where that release declared it: the pydantic class (a plugin's: "plugin NAME: Class"), or, for
#             keys only v0.4.0 knew, "README" (its "All yaml options" block) / "utils/config.py" (read by it)
#   alias_of  the key is the field name behind an alias (Axolotl accepts both spellings)
#   deprecated  true where the newest release declaring the key marks it deprecated
#   replaced_by what that deprecation names instead (a key, or key: value), where it names one
#   default   Axolotl's default for it in that release, where it is a plain value: a refused key given this value
#             (or an empty one) asks for nothing and is accepted as ignored
#   decision  honoured (the trainer acts on it) | inert (accepted and named in the "ignored:" note; reason says
#             why the run is the same) | migrated (rewritten to `to`, with a note) | refused (exit 2; reason
#             says why ignoring it would change what the user asked for, and what to write instead);
#             empty: undecided (tests/trainer/config/test_axolotl_keys.py fails)
#   reason    why (inert, refused; optional for honoured and migrated)
#   to        migrated: what the key becomes
#
# A key without a decision of its own takes one by these rules: a key of a `test_datasets[]` or
# `pretraining_dataset[]` entry the decision of the same key of a `datasets[]` entry; a key inside a block
# (`vllm.port`) its block's decision where that is inert or refused (the block is ignored or refused whole).
"""


def build(git_dir: str, ref: str, old: dict[str, dict]) -> tuple[str, dict[str, dict]]:
    tags = release_tags(git_dir)
    head = git(git_dir, "rev-parse", ref).strip()
    labels = tags + ["main"]
    per_release, reads = [], set()
    for tag in tags + [head]:
        keys, read = schema_keys(git_dir, tag)
        per_release.append(keys)
        reads.add(read)
    history = {k for keys in per_release for k in keys}
    extras = {k for k, row in old.items() if k not in history and row.get("decision")}
    names = sorted(history | extras, key=lambda k: (k in extras, "." in k or "[]" in k, k))
    table = {}
    for name in names:
        if name in extras:  # a key users write that no release declared: kept for its decision
            row = {"name": name, "releases": "", "type": "", "schema": "none"}
            row.update({k: v for k, v in old[name].items() if k in ("decision", "reason", "to")})
            table[name] = row
            continue
        present = [name in keys for keys in per_release]
        newest = next(keys[name] for keys in reversed(per_release) if name in keys)
        row = {"name": name, "releases": ranges(present, labels), "type": newest["type"], "schema": newest["schema"]}
        for extra in ("alias_of", "deprecated", "replaced_by", "default"):
            if extra in newest:
                row[extra] = newest[extra]
        decided = {k: v for k, v in old.get(name, {}).items() if k in ("decision", "reason", "to")}
        row.update(decided or trainer_decision(name))
        table[name] = row
    date = git(git_dir, "log", "-1", "--format=%cs", head).strip()
    source = f"tags {tags[0]}..{tags[-1]} and main at {head} ({date})"
    lines = [HEADER.format(source=source, read="; ".join(sorted(reads))).rstrip("\n"), "",
             "releases = [" + ", ".join(toml_str(t) for t in labels) + "]", f"main = {toml_str(head)}", ""]
    for row in table.values():
        lines.append("[[key]]")
        for col in ("name", "releases", "type", "schema", "alias_of", "deprecated", "replaced_by", "default", "decision",
                    "reason", "to"):
            if col in row:
                lines.append(f"{col} = {toml_value(row[col])}")
        lines.append("")
    return "\n".join(lines), table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("git_dir", help="git directory of axolotl-ai-cloud/axolotl")
    ap.add_argument("--ref", default="HEAD", help="the branch head read after the last release (default HEAD)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    out = Path(args.out)
    old = {}
    if out.exists():
        old = {row["name"]: row for row in tomllib.loads(out.read_text()).get("key", [])}
    text, table = build(args.git_dir, args.ref, old)
    tomllib.loads(text)  # what is written parses
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, out)
    decided = {n: effective(table, n).get("decision") for n in table}
    counts = {d: sum(v == d for v in decided.values()) for d in DECISIONS}
    undecided = sorted(n for n, v in decided.items() if not v)
    print(f"{out}: {len(table)} keys; " + ", ".join(f"{n} {d}" for d, n in counts.items())
          + f", {len(undecided)} undecided" + (f" ({', '.join(undecided[:10])}, ...)" if undecided else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
