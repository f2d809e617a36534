"""PyTorch's own release build matrix, read at a release tag: which CUDA and ROCm variants a torch release
builds, and the compute capabilities (SASS) each CUDA build carries. What `envtool matrix update` reads torch's
builds from, so a variant upstream adds (cu129 revived for 2.12.1 and 2.13.0) is a row without anyone typing it.

Files read, at tag v{version} of pytorch/pytorch (raw files; the URL template is overridable with
--pytorch-source-url / $ENVTOOL_PYTORCH_SOURCE_URL, `{ref}` and `{path}` filled in):
1. `.github/scripts/generate_binary_build_matrix.py`: CUDA_ARCHES (the Linux x86_64 CUDA builds),
   CUDA_ARCHES_FULL_VERSION, CUDA_STABLE, CUDA_AARCH64_ARCHES ("12.9-aarch64": an aarch64 (sbsa) build too),
   ROCM_ARCHES. Read with `ast` (literal assignments only; the file is never run).
2. The arch list of each CUDA build, where the release's build scripts set TORCH_CUDA_ARCH_LIST:
   `.ci/manywheel/build_env_setup.py` (TORCH_CUDA_ARCH_LIST_TABLE: {cuda: {machine: {cc_int}}}, from 2.13),
   else `.ci/manywheel/build_cuda.sh` (the `case ${CUDA_VERSION} in` block, evaluated for x86_64 and for
   aarch64). A CUDA version neither file states, or a shell construct this reader does not follow, gives no
   arch list: the build is reported for review, never written with a guessed one.
A "+PTX" suffix marks a capability compiled as SASS and PTX: it counts as SASS (PTX alone never does).

Imported only by the `matrix` commands (requests stays off `envtool resolve`'s path).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from typing import NamedTuple

from .errors import BadInput
from .upstream import Client, UpstreamError

SOURCE_ENV = "ENVTOOL_PYTORCH_SOURCE_URL"
DEFAULT_SOURCE_URL = "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/{path}"
MATRIX_PATH = ".github/scripts/generate_binary_build_matrix.py"
ARCH_TABLE_PATH = ".ci/manywheel/build_env_setup.py"
ARCH_SCRIPT_PATH = ".ci/manywheel/build_cuda.sh"
MACHINES = ("x86_64", "aarch64")


def source_url(option: str | None = None) -> str:
    template = option or os.environ.get(SOURCE_ENV) or DEFAULT_SOURCE_URL
    if "{ref}" not in template or "{path}" not in template:
        raise BadInput(f"the PyTorch source URL must contain {{ref}} and {{path}}: {template}")
    return template


def tag_of(version: str) -> str:
    return f"v{version}"


class CudaBuild(NamedTuple):
    cuda: str  # "12.9"
    full: str | None  # "12.9.1" (CUDA_ARCHES_FULL_VERSION)
    variant: str  # "cu129"
    sass: list[str] | None  # x86_64; None: no arch list readable at the tag
    sass_aarch64: list[str] | None  # None: no aarch64 build, or none readable (aarch64 says which)
    aarch64: bool  # CUDA_AARCH64_ARCHES lists it
    arch_source: str  # the file the arch lists were read from ("" where none)


class BuildMatrix(NamedTuple):
    tag: str
    cuda: list[CudaBuild]
    rocm: list[str]  # ROCM_ARCHES: "7.1" -> variant "rocm7.1"
    stable: str | None  # CUDA_STABLE
    source: str  # "pytorch/pytorch .github/scripts/generate_binary_build_matrix.py@v2.13.0"


def literals(text: str) -> dict[str, object]:
    """The module-level NAME = <literal> (and NAME: T = <literal>) assignments of a Python file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the file comes from a server: any text
        return {}
    out: dict[str, object] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) and node.value is not None else None
        if not isinstance(target, ast.Name):
            continue
        try:
            out[target.id] = ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return out


def _cc(value: int | str) -> str:
    """50 -> "5.0", 120 -> "12.0", "12.0+PTX" -> "12.0"; ValueError for what is no compute capability."""
    cc = f"{value // 10}.{value % 10}" if isinstance(value, int) and not isinstance(value, bool) else \
        str(value).removesuffix("+PTX").strip()
    if not re.fullmatch(r"\d{1,2}\.\d", cc):
        raise ValueError(f"not a compute capability: {str(value)[:40]!r}")
    return cc


def _sorted(ccs) -> list[str]:
    return sorted({_cc(c) for c in ccs}, key=lambda c: tuple(int(x) for x in c.split(".")))


def _sorted_or_none(ccs) -> list[str] | None:
    """The capabilities sorted; None where one is not a capability (no list rather than a guess)."""
    try:
        return _sorted(ccs)
    except ValueError:
        return None


def arch_table(text: str) -> dict[str, dict[str, list[str]]]:
    """TORCH_CUDA_ARCH_LIST_TABLE of build_env_setup.py: {cuda: {machine: ["5.0", ...]}}."""
    table = literals(text).get("TORCH_CUDA_ARCH_LIST_TABLE")
    if not isinstance(table, dict):
        return {}
    out: dict[str, dict[str, list[str]]] = {}
    for cuda, machines in table.items():
        if isinstance(machines, dict):
            lists = {str(m): _sorted_or_none(ccs) for m, ccs in machines.items() if isinstance(ccs, (set, list, tuple))}
            out[str(cuda)] = {m: ccs for m, ccs in lists.items() if ccs is not None}
    return out


_CASE = re.compile(r"^\s*case\s+\"?\$\{?CUDA_VERSION\}?\"?\s+in\s*$")
_LABEL = re.compile(r"^\s*\(?([\w.*|?\[\]-]+)\)\s*(.*)$")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?TORCH_CUDA_ARCH_LIST=(.*?)\s*(;;)?\s*$")
_ARCH_IF = re.compile(r"^\s*if\s+\[\[\s*\"?\$\{?ARCH\}?\"?\s*(==|!=)\s*\"?(\w+)\"?\s*\]\];\s*then\s*$")
_ARCH_SUBST = re.compile(r"\$\(\[\[\s*\"?\$\{?ARCH\}?\"?\s*(==|!=)\s*\"?(\w+)\"?\s*\]\]\s*&&\s*echo\s+\"([^\"]*)\""
                         r"\s*\|\|\s*echo\s+\"([^\"]*)\"\)")


def _expand(value: str, current: str | None, machine: str) -> str | None:
    value = _ARCH_SUBST.sub(lambda m: m.group(3) if (machine == m.group(2)) == (m.group(1) == "==") else m.group(4),
                            value)
    value = value[1:-1] if value[:1] in "\"'" and value[-1:] == value[:1] else value
    if '"' in value or "'" in value or " " in value:
        return None
    if re.search(r"\$\{?TORCH_CUDA_ARCH_LIST\}?", value):
        if current is None:
            return None
        value = re.sub(r"\$\{?TORCH_CUDA_ARCH_LIST\}?", current, value)
    return None if "$" in value or "`" in value else value


def arch_script(text: str, cuda: str, machine: str = "x86_64") -> list[str] | None:
    """TORCH_CUDA_ARCH_LIST as build_cuda.sh sets it for `cuda` on `machine`: the assignments before the
    `case ${CUDA_VERSION} in` block and in its first branch whose pattern matches; `if [[ "$ARCH" == ... ]]`
    blocks and `$([[ "$ARCH" == ... ]] && echo A || echo B)` are followed. None: no branch for `cuda`, or a
    construct not followed here."""
    current: str | None = None
    stack: list[bool | None] = []  # the open if blocks: their ARCH condition, None for any other test
    state = "before"  # before the case -> "labels" (looking for a branch) -> "branch" -> "done"
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not stripped:
            continue
        m = _ARCH_IF.match(stripped)
        if m or re.match(r"^\s*if\s.*;\s*then\s*$", stripped):
            stack.append((machine == m.group(2)) == (m.group(1) == "==") if m else None)
            continue
        if stripped.strip() == "else" and stack:
            stack[-1] = None if stack[-1] is None else not stack[-1]
            continue
        if stripped.strip() == "fi" and stack:
            stack.pop()
            continue
        live = all(c is not False for c in stack)
        if state == "before" and _CASE.match(stripped):
            state = "labels"
            continue
        if state == "labels":
            if stripped.strip() == "esac":
                return None
            label = _LABEL.match(stripped)
            if label and any(fnmatch.fnmatchcase(cuda, p) for p in label.group(1).split("|")):
                state, stripped = "branch", label.group(2)
                if not stripped:
                    continue
            else:
                continue
        if state in ("before", "branch"):
            if state == "branch" and re.search(r"\bexit\b", stripped):
                return None  # the branch refuses this version ("unknown cuda version")
            a = _ASSIGN.match(stripped)
            if not a and "TORCH_CUDA_ARCH_LIST=" in stripped and state == "branch":
                return None  # set some other way (`[[ ... ]] && TORCH_CUDA_ARCH_LIST=...`): not followed
            if a and live:
                current = _expand(a.group(1), current, machine)
                if current is None and state == "branch":
                    return None
            if state == "branch" and (stripped.strip().endswith(";;") or (a and a.group(2))):
                state = "done"
                break
            if state == "branch" and stripped.strip() == "esac":
                break
    if state != "done" or not current:
        return None
    return _sorted_or_none(c for c in current.split(";") if c.strip())


def _get(client: Client, template: str, ref: str, path: str) -> str | None:
    """The file's text at `ref`, None where the server says it is not there (404)."""
    r = client.get(template.format(ref=ref, path=path), ok=(200, 404))
    return r.text if r.status_code == 200 else None


def _arch_lists(client: Client, template: str, ref: str, versions: list[str]) -> tuple[dict, str]:
    """{cuda: {machine: [cc...] | None}} and the file read, for the CUDA versions of the matrix."""
    text = _get(client, template, ref, ARCH_TABLE_PATH)
    table = arch_table(text) if text else {}
    if table:
        return ({v: {m: table.get(v, {}).get(m) for m in MACHINES} for v in versions},
                f"{ARCH_TABLE_PATH}@{ref} TORCH_CUDA_ARCH_LIST_TABLE")
    text = _get(client, template, ref, ARCH_SCRIPT_PATH)
    if not text:
        return {v: dict.fromkeys(MACHINES) for v in versions}, ""
    # a script that never tests $ARCH sets the x86_64 list only: aarch64 wheels were built by another script
    # then (.ci/aarch64_linux/), so their lists stay unread
    machines = MACHINES if re.search(r"\$\{?ARCH\}?\b", text) else ("x86_64",)
    return ({v: {m: arch_script(text, v, m) if m in machines else None for m in MACHINES} for v in versions},
            f"{ARCH_SCRIPT_PATH}@{ref} TORCH_CUDA_ARCH_LIST")


def _strings(values: dict, url: str, name: str, pattern: str) -> None:
    """values[name], where present, is a list of strings matching `pattern`; else UpstreamError naming it."""
    items = values.get(name) or []
    bad = [a for a in items if not isinstance(a, str) or not re.fullmatch(pattern, a)] \
        if isinstance(items, (list, tuple)) else [items]
    if bad:
        raise UpstreamError(f"{url}: {name} holds {str(bad[0])[:40]!r}, not a list of versions")


def read(client: Client, template: str, version: str) -> BuildMatrix | None:
    """The build matrix of torch `version` at its release tag; None where the tag has no such file."""
    ref = tag_of(version)
    text = _get(client, template, ref, MATRIX_PATH)
    if text is None:
        return None
    values = literals(text)
    url = template.format(ref=ref, path=MATRIX_PATH)
    arches = values.get("CUDA_ARCHES")
    if not isinstance(arches, list):
        raise UpstreamError(f"{url}: no CUDA_ARCHES list in it")
    _strings(values, url, "CUDA_ARCHES", r"\d+\.\d+")
    _strings(values, url, "CUDA_AARCH64_ARCHES", r"\d+\.\d+(-aarch64)?")
    _strings(values, url, "ROCM_ARCHES", r"[\w.]+")
    if not isinstance(values.get("CUDA_STABLE", ""), str):
        raise UpstreamError(f"{url}: CUDA_STABLE is not a string")
    full = values.get("CUDA_ARCHES_FULL_VERSION") if isinstance(values.get("CUDA_ARCHES_FULL_VERSION"), dict) else {}
    aarch64 = {str(a).removesuffix("-aarch64") for a in values.get("CUDA_AARCH64_ARCHES") or []}
    lists, arch_source = _arch_lists(client, template, ref, [str(a) for a in arches])
    builds = []
    for cuda in map(str, arches):
        sass = lists[cuda]["x86_64"]
        arm = lists[cuda]["aarch64"] if cuda in aarch64 else None
        builds.append(CudaBuild(cuda, full.get(cuda), "cu" + cuda.replace(".", ""), sass, arm, cuda in aarch64,
                                arch_source))
    stable = values.get("CUDA_STABLE")
    return BuildMatrix(ref, builds, [str(r) for r in values.get("ROCM_ARCHES") or []],
                       stable or None, f"pytorch/pytorch {MATRIX_PATH}@{ref}")
