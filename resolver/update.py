"""`envtool matrix update`: regenerate the matrix fields that upstream package metadata states, and write them.

What is regenerated (everything else in matrices/ is hand-checked and kept as it is):
- torch.toml: each [[release]]'s `version` (the newest patch of its minor on PyPI), `python` (the CPython
  tags of its Linux x86_64 wheels, within Requires-Python) and `triton` (its Requires-Dist triton); torch
  minors newer than the newest row become new rows with no CUDA builds (their source says so; a human adds
  the [[release.build]] rows from torch's build scripts);
- xformers.toml: each [[release]]'s `torch` (its wheel's Requires-Dist torch), and where the schema has them
  `python` and `platforms` (its Linux wheels' tags);
- packages.toml [[triton_release]] (where the schema has it): `python` and `platforms` from triton's wheels,
  and a row for a triton a torch row newly pins;
- packages.toml: each [[stack]] row's package versions: the newest release whose Requires-Python admits the
  row's lowest Python;
- packages.toml [[package]] rows of vllm (GRPO's generation server): one row per distinct (Requires-Dist torch,
  transformers, Requires-Python, CUDA major of its kernels) among the releases from packages.toml `vllm_floor` on,
  the newest release of each, read from its Linux wheel's METADATA;
- flash_attn.toml release rows on PyPI (`index = "pypi"`, flash-attn-4): `version` (the newest release, pre-releases
  included while there is no final one), `min_python` (its Requires-Python), `min_torch` (its Requires-Dist torch
  floor, none where it pins no version) and `cuda` (a major per `Provides-Extra: cuNN`).
What needs a human is reported as "needs review" and not written: new xformers releases and post-releases
(their arch list),
new flash-attn releases (their wheel matrix comes from the publish workflow), rows PyPI does not know.

Files are edited with tomlkit, which keeps comments, order and formatting; the new set is checked with the
matrix loader in a temporary directory before any file is replaced (each by temp file + rename).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import difflib
import io
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple
from urllib.parse import unquote, urlsplit

import tomlkit
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from . import matrix as matrix_module
from .errors import MatrixError
from .upstream import (MACHINES, Client, Release, Unreachable, UpstreamError, admits_python, any_wheel,
                       linux_machines, linux_wheel, python_range, requirement, requirements)
from .upstream import pypi_url as resolve_pypi_url

UPDATED_RE = re.compile(r"; (?:[\w, ]+ )?updated by envtool matrix update from (?:PyPI metadata|the PyTorch index) "
                        r"on \d{4}-\d{2}-\d{2}"
                        r"(?: \([^)]*\))?")
ADDED_MARK = "builds not yet checked"


class Change(NamedTuple):
    file: str  # "torch.toml"
    table: str  # "release"
    index: int  # the row's position in its array of tables
    row: str  # how a human names the row: "torch 2.14.1"
    field: str  # "version", or "packages.transformers"
    old: object
    new: object
    why: str
    origin: str = "PyPI metadata"  # where the new value was read: "PyPI metadata" | "the PyTorch index"


class Addition(NamedTuple):
    file: str
    table: str  # "release", or "release.build": a [[release.build]] of the existing row `index`
    row: str
    fields: dict
    why: str
    index: int = -1  # the parent row of a nested table


class Review(NamedTuple):
    file: str
    row: str
    why: str


class Report(NamedTuple):
    changes: list[Change]
    additions: list[Addition]
    reviews: list[Review]
    held: list[Review] = []  # newer releases a stack row cannot take yet, and why (not stale: nothing to do)

    @property
    def stale(self) -> bool:
        return bool(self.changes or self.additions or self.reviews)

    @property
    def files(self) -> list[str]:
        return sorted({c.file for c in self.changes} | {a.file for a in self.additions})


def today() -> str:
    return datetime.date.today().isoformat()


def _minor(v: Version) -> tuple[int, int]:
    return v.release[0], v.release[1] if len(v.release) > 1 else 0


def _same_spec(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    return SpecifierSet(a) == SpecifierSet(b)


def _lowest_python(spec: str) -> str:
    """The lowest 3.X a matrix range admits (ranges are written with >= lower bounds)."""
    for minor in range(0, 40):
        if matrix_module.in_range(f"3.{minor}", spec):
            return f"3.{minor}"
    return "3.0"


# ---------------------------------------------------------------------------- regeneration


def regenerate(data: dict[str, dict], client: Client, *, date: str, torch_index: str | None = None,
               pytorch_source: str | None = None, step: Callable[[str], None] = lambda what: None) -> Report:
    """Compare the matrices (tomllib data per file stem) with upstream; nothing is written here. torch_index:
    the PyTorch index template ({variant}) whose pages say where index-hosted wheels (flash-attn-3) are;
    pytorch_source: the raw-file URL template ({ref}, {path}) of pytorch/pytorch whose release build matrix
    says which CUDA builds each torch row has (None: not read)."""
    report = Report([], [], [], [])
    step("torch")
    _torch(data["torch"], client, date, report, step)
    if pytorch_source:  # unreachable: one error line, nothing written (--no-builds reads PyPI without it)
        _torch_builds(data, client, pytorch_source, date, report, step)
    step("xformers")
    _xformers(data["xformers"], client, report, step)
    if "triton_release" in data["packages"]:
        step("triton")
        _triton_releases(data, client, date, report)
    step("flash-attn")
    _flash_attn(data["flash_attn"], client, report)
    _flash_attn_pypi(data["flash_attn"], client, report)
    if torch_index:
        step("flash-attn-3 on the PyTorch index")
        try:
            _flash_attn_index(data["flash_attn"], client, torch_index, report)
        except Unreachable as e:  # no flag leaves this index out: PyPI's facts are still read and written,
            # these rows stay as recorded, and --check counts them as needing review
            report.reviews.append(Review("flash_attn.toml", "flash-attn-3", f"the PyTorch index was not read "
                                         f"({e}); its rows are kept unchecked"))
    _stacks(data["packages"], client, report, step)
    if "kernels_release" in data["packages"]:
        step("kernels")
        _kernels(data["packages"], client, date, report)
    if "vllm_floor" in data["packages"]:
        step("vllm")
        _vllm(data["packages"], client, date, report)
    return report


def _default(cls: type, field: str):
    return cls._field_defaults.get(field)


class TorchFacts(NamedTuple):
    python: str | None
    triton: str | None
    triton_python: str | None  # the marker's python_version bound ("<3.13"); None: every Python
    triton_platforms: list[str]  # the machines the triton requirement applies on
    why: str  # the requirement as read, with the wheel it was read from


def _torch(data: dict, client: Client, date: str, report: Report, step) -> None:
    project = client.project("torch")
    by_minor: dict[tuple[int, int], Release] = {}
    for r in project.final():
        if linux_wheel(r) is not None:
            by_minor[_minor(r.version)] = r  # oldest first, so the newest patch wins
    rows = data.get("release", [])
    cls = matrix_module.TorchRelease
    for i, row in enumerate(rows):
        current = Version(row["version"])
        newest = by_minor.get(_minor(current))
        name = f"torch {row['version']}"
        if newest is None:
            report.reviews.append(Review("torch.toml", name, f"PyPI has no torch {_minor(current)[0]}."
                                         f"{_minor(current)[1]}.x release with Linux x86_64 wheels"))
            continue

        def change(field, new, why):
            report.changes.append(Change("torch.toml", "release", i, name, field, row.get(field), new, why))

        if newest.version > current:
            change("version", str(newest.version), f"newest patch of {current.major}.{current.minor} on PyPI")
        step(f"torch {newest.version} metadata")
        facts = _torch_facts(client, newest, step)
        if facts.python and not _same_spec(facts.python, row.get("python")):
            change("python", facts.python, f"CPython tags of torch {newest.version}'s Linux x86_64 wheels")
        if facts.triton != row.get("triton"):
            change("triton", facts.triton, facts.why)
        if facts.triton_python != row.get("triton_python", _default(cls, "triton_python")):
            change("triton_python", facts.triton_python, facts.why)
        if facts.triton:
            if facts.triton_platforms != list(row.get("triton_platforms", _default(cls, "triton_platforms"))):
                change("triton_platforms", facts.triton_platforms, facts.why)
        if not row.get("build"):
            report.reviews.append(Review("torch.toml", name, "no [[release.build]] rows: GPU plans cannot use it "
                                         "until its CUDA builds (variant, cuda, sass) are added from torch's build "
                                         "scripts"))
    newest_row = max((Version(r["version"]) for r in rows), default=Version("0"))
    present = {_minor(Version(r["version"])) for r in rows}
    oldest_row = min((Version(r["version"]) for r in rows), default=Version("0"))
    for minor, release in sorted(by_minor.items()):
        if minor in present or release.version < oldest_row:
            continue
        if release.version < newest_row:
            report.reviews.append(Review("torch.toml", f"torch {release.version}",
                                         "a torch minor between the matrix's rows is missing; add it by hand "
                                         "if it was not left out on purpose"))
            continue
        step(f"torch {release.version} metadata")
        facts = _torch_facts(client, release, step)
        wheel = linux_wheel(release)
        abi = any(re.match(r"manylinux_2_(2[89]|[3-9]\d)_", p) for p in wheel.platforms)
        fields = {"version": str(release.version), "python": facts.python, "triton": facts.triton,
                  "cxx11abi": abi}
        if facts.triton and facts.triton_python:
            fields["triton_python"] = facts.triton_python
        if facts.triton and facts.triton_platforms != list(_default(cls, "triton_platforms") or []):
            fields["triton_platforms"] = facts.triton_platforms
        fields["source"] = (f"added by envtool matrix update from PyPI metadata on {date}; {ADDED_MARK} "
                            f"(python: wheel tags; {facts.why}; cxx11abi: "
                            f"{'manylinux_2_28' if abi else 'pre-2_28 manylinux'} wheels)")
        if facts.triton is None:
            del fields["triton"]
        report.additions.append(Addition("torch.toml", "release", f"torch {release.version}", fields,
                                         "a torch minor newer than the matrix's rows is on PyPI"))


def _torch_builds(data: dict, client: Client, template: str, date: str, report: Report, step) -> None:
    """Each torch row's CUDA builds against PyTorch's release build matrix at its tag (resolver.buildmatrix):
    a CUDA build the matrix lists and the row lacks becomes a [[release.build]] row when its arch list is
    readable at the tag (else it is reported, never written with a guessed list); a recorded build the matrix
    does not list, an arch list that differs and a ROCm variant rocm.toml lacks are reported for review."""
    # start-up: resolver.buildmatrix imported only when this runs
    from . import buildmatrix

    rocm = {(str(b["torch"]), str(b["variant"])) for b in data.get("rocm", {}).get("build", [])}
    for i, row in enumerate(data["torch"].get("release", [])):
        version = str(row["version"])
        step(f"torch {version} build matrix")
        found = buildmatrix.read(client, template, version)
        name = f"torch {version}"
        if found is None:
            report.reviews.append(Review("torch.toml", name, f"{buildmatrix.MATRIX_PATH} is not readable at "
                                         f"{buildmatrix.tag_of(version)}: its CUDA builds stay as recorded"))
            continue
        recorded = {b["variant"]: b for b in row.get("build", [])}
        for build in found.cuda:
            _torch_build(report, i, name, row, recorded.get(build.variant), build, found, date)
        for variant in sorted(set(recorded) - {b.variant for b in found.cuda}):
            report.reviews.append(Review("torch.toml", f"{name} {variant}", f"recorded, but {found.source} lists "
                                         f"no CUDA {recorded[variant]['cuda']}"))
        for r in found.rocm:
            if (version, f"rocm{r}") not in rocm:
                report.reviews.append(Review("rocm.toml", f"{name} rocm{r}", f"{found.source} lists ROCm {r}; "
                                             "add a [[build]] row with its gfx targets (PYTORCH_ROCM_ARCH at the tag)"))


def _torch_build(report: Report, i: int, name: str, row: dict, recorded: dict | None, build, found,
                 date: str) -> None:
    where = f"{name} {build.variant}"
    if recorded is not None:
        if build.sass is not None and build.sass != list(recorded.get("sass", [])):
            report.reviews.append(Review("torch.toml", where, f"sass {list(recorded.get('sass', []))} recorded; "
                                         f"{build.arch_source} says {build.sass}"))
        return
    if build.sass is None or (build.aarch64 and build.sass_aarch64 is None):
        report.reviews.append(Review("torch.toml", where, f"{found.source} lists CUDA {build.cuda}, but no arch "
                                     f"list for it is readable at {found.tag}: add it by hand once read"))
        return
    status = "stable" if build.cuda == found.stable else "experimental"
    fields = {"variant": build.variant, "cuda": build.cuda, "status": status, "sass": build.sass}
    if build.sass_aarch64 is not None:
        fields["sass_aarch64"] = build.sass_aarch64
    fields["source"] = (f"added by envtool matrix update from the PyTorch release build matrix on {date}: "
                        f"{found.source} (CUDA_ARCHES; {'CUDA_STABLE' if status == 'stable' else 'not CUDA_STABLE'}"
                        f"{'; CUDA_AARCH64_ARCHES' if build.aarch64 else ''}); sass: {build.arch_source}")
    report.additions.append(Addition("torch.toml", "release.build", where, fields,
                                     f"{found.source} lists CUDA {build.cuda} ({build.full or '?'})", i))


def _torch_facts(client: Client, release: Release, step) -> TorchFacts:
    python = python_range(release)
    wheel = linux_wheel(release)
    pin = requirement(client.metadata("torch", wheel), "triton")
    if pin is None:
        return TorchFacts(python, None, None, list(MACHINES), f"{wheel.filename} has no Requires-Dist triton")
    marker = f"; {pin.marker}" if pin.marker else ""
    why = f"Requires-Dist triton{pin.specifier}{marker} of {wheel.filename}"
    bound = re.search(r"python_version\s*(<=?)\s*[\"'](3\.\d+)[\"']", pin.marker)
    machine = re.search(r"platform_machine\s*==\s*[\"'](\w+)[\"']", pin.marker)
    if machine:
        platforms = [machine.group(1)]
    else:  # no machine in the marker: ask the aarch64 wheel itself
        platforms = ["x86_64"]
        arm = linux_wheel(release, "aarch64")
        if arm is not None:
            step(f"torch {release.version} aarch64 metadata")
            if requirement(client.metadata("torch", arm), "triton") is not None:
                platforms.append("aarch64")
    return TorchFacts(python, pin.version or None, f"{bound.group(1)}{bound.group(2)}" if bound else None,
                      platforms, why)


def _triton_releases(data: dict, client: Client, date: str, report: Report) -> None:
    """packages.toml [[triton_release]]: where triton's own wheels exist (Python range, machines), for every
    triton a torch row pins; a pin without a row (a new torch release, a changed pin) gets one."""
    project = client.project("triton")
    rows = data["packages"]["triton_release"]
    for i, row in enumerate(rows):
        name = f"triton {row['version']}"
        release = project.releases.get(Version(row["version"]))
        if release is None or not release.files:
            report.reviews.append(Review("packages.toml", name, "no wheels on PyPI"))
            continue
        python = python_range(release) or python_range(release, "aarch64")
        machines = linux_machines(release)
        if python and not _same_spec(python, row.get("python")):
            report.changes.append(Change("packages.toml", "triton_release", i, name, "python", row.get("python"),
                                         python, f"the Python tags of triton {row['version']}'s Linux wheels"))
        if machines and machines != list(row.get("platforms", [])):
            report.changes.append(Change("packages.toml", "triton_release", i, name, "platforms",
                                         row.get("platforms"), machines, f"triton {row['version']}'s Linux wheels"))
    changed = {c.index: c.new for c in report.changes if c.file == "torch.toml" and c.field == "triton"}
    pinned = {changed.get(j, r.get("triton")) for j, r in enumerate(data["torch"].get("release", []))}
    pinned |= {a.fields.get("triton") for a in report.additions if a.file == "torch.toml"}
    pinned = {str(v) for v in pinned if v}
    recorded = {str(r["version"]) for r in rows}
    for version in sorted(pinned - recorded, key=Version):
        release = project.releases.get(Version(version))
        if release is None or not release.files:
            report.reviews.append(Review("packages.toml", f"triton {version}", "pinned by torch but not on PyPI "
                                         "with wheels"))
            continue
        report.additions.append(Addition("packages.toml", "triton_release", f"triton {version}", {
            "version": version, "python": python_range(release) or python_range(release, "aarch64"),
            "platforms": linux_machines(release),
            "source": f"added by envtool matrix update from PyPI metadata on {date} (triton {version}'s wheel tags)"},
            "a torch row pins it"))


def _xformers(data: dict, client: Client, report: Report, step) -> None:
    project = client.project("xformers")
    rows = data.get("release", [])
    known = {Version(r["version"]) for r in rows}
    if not rows:
        return
    oldest = min(known)
    candidates = [r for r in project.final() if r.version >= oldest and linux_wheel(r) is not None]
    pins: dict[Version, str | None] = {}
    for release in candidates:
        step(f"xformers {release.version} metadata")
        pin = requirement(client.metadata("xformers", linux_wheel(release)), "torch")
        pins[release.version] = pin.specifier if pin and pin.specifier else None
    cls = matrix_module.Xformers
    for i, row in enumerate(rows):
        current = Version(row["version"])
        name = f"xformers {row['version']}"
        if current not in pins:
            report.reviews.append(Review("xformers.toml", name, "not on PyPI with Linux x86_64 wheels"))
            continue

        def change(field, new, why):
            report.changes.append(Change("xformers.toml", "release", i, name, field, row.get(field), new, why))

        pin = pins[current]
        if pin and not _same_spec(pin, row["torch"]):
            change("torch", pin, f"Requires-Dist torch{pin} of {linux_wheel(project.releases[current]).filename}")
        same = [v for v, p in pins.items() if v > current and p and _same_spec(p, pin or row["torch"])
                and v not in known]
        if same:  # a post-release for the same torch: its arch list and CUDA build are facts of its own tag
            report.reviews.append(Review("xformers.toml", name, f"xformers {max(same)} pins the same "
                                         f"torch{pin or row['torch']}: move the row to it after checking its "
                                         "wheels_build.yml arch list (min_cc) at that tag"))
        release = project.releases[current]
        python = python_range(release)
        if python and not _same_spec(python, row.get("python")):
            change("python", python, f"the Python tags of xformers {current}'s Linux x86_64 wheels")
        machines = linux_machines(release)
        if machines and machines != list(row.get("platforms", _default(cls, "platforms"))):
            change("platforms", machines, f"the Linux wheels of xformers {current}")
    claimed = {max([v for v, p in pins.items() if p and _same_spec(p, r["torch"])], default=None) for r in rows}
    newest_row = max(known)
    for v, pin in sorted(pins.items()):
        if v > newest_row and v not in claimed:
            report.reviews.append(Review("xformers.toml", f"xformers {v}",
                                         f"new release (Requires-Dist torch{pin or ' (none)'}): add a row with "
                                         "min_cc from its .github/workflows/wheels_build.yml arch list"))


def _flash_attn(data: dict, client: Client, report: Report) -> None:
    recorded = {Version(r["version"]) for r in data.get("release", []) if r.get("impl") == "fa2"}
    reviewed = {Version(v) for v in data.get("reviewed", [])}  # looked at, deliberately not recorded
    if not recorded:
        return
    for release in client.project("flash-attn").final():
        if release.version > max(recorded) and release.version not in reviewed:
            report.reviews.append(Review("flash_attn.toml", f"flash-attn {release.version}",
                                         "new release on PyPI: its prebuilt wheels (torch, CUDA, Python, ABI, "
                                         "platforms) come from .github/workflows/publish.yml at its tag and its "
                                         "GitHub release assets; `envtool matrix verify` checks the URLs once added"))


def _flash_attn_pypi(data: dict, client: Client, report: Report) -> None:
    """Release rows on PyPI (`index = "pypi"`: flash-attn-4, one py3-none-any wheel): the row follows the project's
    newest release -- its final releases once it has one (which ends the backend's beta: attention.toml
    `auto_when_final`), else its newest pre-release -- with its Requires-Python."""
    packages = {i["name"]: i["package"] for i in data.get("impl", [])}
    for i, row in enumerate(data.get("release", [])):
        if row.get("index") != "pypi":
            continue
        package = packages[row["impl"]]
        project = client.project(package)
        wheels = sorted((r for r in project.releases.values() if r.files and not r.yanked), key=lambda r: r.version)
        newest = project.final()[-1] if project.final() else (wheels[-1] if wheels else None)
        name = f"{package} {row['version']}"
        if newest is None:
            report.reviews.append(Review("flash_attn.toml", name, "PyPI lists no wheel of it"))
            continue
        if newest.version > Version(row["version"]):
            kind = "final release" if not newest.version.is_prerelease else "release (pre-releases only so far)"
            report.changes.append(Change("flash_attn.toml", "release", i, name, "version", row["version"],
                                         str(newest.version), f"{package}'s newest {kind} on PyPI"))
        floor = _lowest_python(newest.requires_python) if newest.requires_python else None
        if floor and floor != row.get("min_python"):
            report.changes.append(Change("flash_attn.toml", "release", i, name, "min_python", row.get("min_python"),
                                         floor, f"{package} {newest.version}'s Requires-Python "
                                                f"{newest.requires_python}"))
        _pypi_wheel_floors(client, package, newest, i, row, report)


def _pypi_wheel_floors(client: Client, package: str, release: Release, i: int, row: dict, report: Report) -> None:
    """A PyPI release row's torch floor and CUDA extras, from its wheel's METADATA: `min_torch` from a
    `Requires-Dist torch>=X.Y` (none where it pins no version), and `cuda` keeps the recorded majors and adds one
    per `Provides-Extra: cuNN` (flash-attn-4[cu13])."""
    wheel = any_wheel(release)
    if wheel is None:
        return
    message = client.metadata(package, wheel)
    name = f"{package} {row['version']}"
    torch = requirement(message, "torch")
    lower = re.search(r">=\s*(\d+\.\d+)", torch.specifier) if torch else None
    min_torch = lower.group(1) if lower else None
    if min_torch != row.get("min_torch"):
        report.changes.append(Change("flash_attn.toml", "release", i, name, "min_torch", row.get("min_torch"),
                                     min_torch, f"{package} {release.version}'s Requires-Dist torch"
                                                f"{torch.specifier if torch else ' (none)'}"))
    cuda = dict(row.get("cuda", {}))
    for extra in message.get_all("Provides-Extra") or []:
        m = re.fullmatch(r"cu(\d\d)", extra)
        if m:
            cuda[m.group(1)] = extra
    if cuda != dict(row.get("cuda", {})):
        report.changes.append(Change("flash_attn.toml", "release", i, name, "cuda", row.get("cuda"), cuda,
                                     f"{package} {release.version}'s Provides-Extra (its CUDA builds)"))


def _flash_attn_index(data: dict, client: Client, torch_index: str, report: Report) -> None:
    """Release rows on the PyTorch index (`index = "torch"`): the index's own project page, across all variant
    folders (download.pytorch.org/whl/flash-attn-3/ links /whl/<variant>/<file>), says which folders and
    platforms hold each recorded version (written), and which newer versions exist (for review: their build,
    hopper/setup.py at the tag, decides the torch and Python floors)."""
    rows = [(i, r) for i, r in enumerate(data.get("release", [])) if r.get("index") == "torch"]
    packages = {i["name"]: i["package"] for i in data.get("impl", [])}
    root = torch_index.split("{variant}")[0].rstrip("/")
    for package in sorted({packages[r["impl"]] for _, r in rows}):
        page = f"{root}/{canonicalize_name(package)}/"
        answer = client.get(page, ok=(200, 404))
        if answer.status_code == 404:
            report.reviews.append(Review("flash_attn.toml", package, f"{page}: no such page on the PyTorch index"))
            continue
        held: dict[Version, dict[str, set[str]]] = {}  # version -> variant folder -> machines
        for href in re.findall(r'href="([^"#]+)', answer.text):
            parts = unquote(urlsplit(href).path).rstrip("/").split("/")
            try:
                _, version, _, tags = parse_wheel_filename(parts[-1])
            except (InvalidWheelFilename, IndexError):
                continue
            if version.local or len(parts) < 2 or not re.fullmatch(r"cu\d+", parts[-2]):
                continue  # test builds carry a local version; only the CUDA folders are plans' variants
            machines = {m for m in MACHINES for tag in tags if tag.platform.endswith(m)}
            held.setdefault(version, {}).setdefault(parts[-2], set()).update(machines)
        mine = [(i, r) for i, r in rows if packages[r["impl"]] == package]
        for i, row in mine:
            name = f"{package} {row['version']}"
            folders = held.get(Version(row["version"]))
            if not folders:
                report.reviews.append(Review("flash_attn.toml", name, f"{page} lists no wheel of it"))
                continue
            variants = sorted(folders, key=lambda v: int(v[2:]))
            why = f"the variant folders {page} links {name} from"
            if variants != list(row.get("variants", [])):
                report.changes.append(Change("flash_attn.toml", "release", i, name, "variants",
                                             row.get("variants"), variants, why, "the PyTorch index"))
            machines = [m for m in MACHINES if any(m in ms for ms in folders.values())]
            if machines != list(row.get("platforms", [])):
                report.changes.append(Change("flash_attn.toml", "release", i, name, "platforms",
                                             row.get("platforms"), machines, f"the platform tags of {name}'s wheels "
                                             f"on {page}", "the PyTorch index"))
        newest = max(Version(r["version"]) for _, r in mine)
        for version in sorted(v for v in held if v > newest and not v.is_prerelease):
            report.reviews.append(Review("flash_attn.toml", f"{package} {version}",
                                         f"new release on the PyTorch index (folders {', '.join(sorted(held[version]))}): "
                                         "its torch and Python floors come from hopper/setup.py at its tag "
                                         "(TORCH_TARGET_VERSION, the abi3 tag); add a row once checked"))


def _kernels(data: dict, client: Client, date: str, report: Report) -> None:
    """`kernels` (Hub kernels load through it): a release newer than the recorded ones is a fact of PyPI and
    becomes a row (plans pin it where it fits transformers' range); a stack whose transformers has no
    [[kernels_requirement]] row needs a human to read its Requires-Dist."""
    recorded = {Version(r["version"]) for r in data.get("kernels_release", [])}
    final = client.project("kernels").final()
    added: set[Version] = set()

    def add(release: Release, what: str) -> None:
        added.add(release.version)
        report.additions.append(Addition("packages.toml", "kernels_release", f"kernels {release.version}", {
            "version": str(release.version),
            "source": f"added by envtool matrix update from PyPI metadata on {date} ({what}; Requires-Python "
                      f"{release.requires_python or 'any'})"},
            "a kernels release newer than the recorded ones is on PyPI"))

    if final and recorded and final[-1].version > max(recorded):
        add(final[-1], "the newest kernels release")
    # a transformers' range the newest release falls outside of (transformers 5.23.0: kernels>=0.18.2,<0.19 while
    # PyPI's newest is 0.19.1) still gets its own newest release, or plans with that transformers keep an old one
    for r in data.get("kernels_requirement", []):
        spec = SpecifierSet(r["kernels"])
        inside = [rel for rel in final if spec.contains(rel.version)]
        if inside and inside[-1].version not in added and \
                all(inside[-1].version > v for v in recorded if spec.contains(v)):
            add(inside[-1], f"the newest kernels release inside transformers {r['transformers']}'s range "
                            f"kernels{spec}")
    required = {r["transformers"] for r in data.get("kernels_requirement", [])}
    ranges = {r["transformers"]: SpecifierSet(r["kernels"]) for r in data.get("kernels_requirement", [])}
    releases = {Version(r["version"]) for r in data.get("kernels_release", [])} | {r.version for r in final}
    for s in data.get("stack", []):
        own, hub = s["packages"].get("transformers"), s.get("hub_kernels", {}).get("transformers")
        if hub and own in ranges and any(ranges[own].contains(v) for v in releases):
            report.reviews.append(Review("packages.toml", f"[[stack]] python{s['python']}",
                                         f"hub_kernels (transformers {hub}) is no longer needed: a kernels release "
                                         f"fits transformers {own}'s range kernels{ranges[own]}; drop it"))
    used = {s["packages"].get("transformers") for s in data.get("stack", [])} | \
        {s.get("hub_kernels", {}).get("transformers") for s in data.get("stack", [])}
    for version in sorted(used - required - {None}, key=Version):
        report.reviews.append(Review("packages.toml", f"transformers {version}",
                                     "no [[kernels_requirement]] row: Hub kernel plans with this stack are refused "
                                     "until its Requires-Dist kernels (extra 'kernels') is recorded"))


VLLM_NOT_ON = {"cpu": "vLLM's PyPI wheels are CUDA builds; GRPO's trainer only talks to a vLLM server over HTTP "
                      "(trl.vllm_server_host), which runs on a CUDA machine of its own",
               "rocm": "vLLM's PyPI wheels are CUDA builds (its ROCm builds are not on PyPI)",
               "xpu": "vLLM's PyPI wheels are CUDA builds", "mps": "vLLM's PyPI wheels are CUDA builds"}


class VllmFacts(NamedTuple):
    torch: str  # its Requires-Dist torch specifier ("==2.13.0")
    transformers: str  # its Requires-Dist transformers specifier
    python: str  # Requires-Python
    cuda: str | None  # the CUDA major its kernels are built for (cu13 extras / -cu13 packages it requires)
    evidence: str  # the requirements that say so


def vllm_facts(client: Client, release: Release) -> VllmFacts | None:
    """What a vLLM release's Linux x86_64 wheel METADATA says decides whether it installs beside a plan."""
    # start-up: packaging imported only when this runs
    from packaging.requirements import InvalidRequirement, Requirement

    wheel = linux_wheel(release)
    if wheel is None:
        return None
    message = client.metadata("vllm", wheel)
    found = {}
    cuda = set()
    evidence = []
    for line in message.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and "extra" in str(req.marker):
            continue
        found.setdefault(canonicalize_name(req.name), str(req.specifier))
        for tag in [*req.extras, req.name]:
            m = re.search(r"(?:^|-)cu(\d\d)\d?$", tag)
            if m:
                cuda.add(m.group(1))
                evidence.append(str(req))
    if "torch" not in found:
        return None
    major = next(iter(cuda)) if len(cuda) == 1 else None
    return VllmFacts(found["torch"], found.get("transformers", ""), message.get("Requires-Python") or "",
                     major, ", ".join(evidence[:3]))


def _vllm(data: dict, client: Client, date: str, report: Report) -> None:
    """vLLM for GRPO configs with trl.use_vllm: the newest release of each distinct (torch pin, transformers range,
    Requires-Python, CUDA major) from `vllm_floor` on becomes a [[package]] row (plans take the
    first, newest first, that admits their torch, stack and Python: trainer/features.py `pin`)."""
    rows = [r for r in data.get("package", []) if r["name"] == "vllm"]
    recorded = {Version(r["version"]) for r in rows}
    floor = Version(data["vllm_floor"])
    groups: dict[tuple, tuple[Release, VllmFacts]] = {}
    for release in client.project("vllm").final():
        if release.version < floor:
            continue
        facts = vllm_facts(client, release)
        if facts is not None:
            groups[facts[:4]] = (release, facts)  # oldest first: the newest of each group stays
    for release, facts in sorted(groups.values(), key=lambda g: g[0].version, reverse=True):
        if release.version in recorded:
            continue
        fields = {"name": "vllm", "version": str(release.version), "python": facts.python, "torch": facts.torch}
        if facts.transformers:
            fields["requires"] = {"transformers": facts.transformers}
        if facts.cuda:
            fields["cuda"] = facts.cuda
        fields.update(backends=["cuda"], not_on=dict(VLLM_NOT_ON), source=(
            f"added by envtool matrix update from PyPI metadata on {date} (vllm {release.version}'s "
            f"{linux_wheel(release).filename} METADATA: Requires-Dist torch{facts.torch}"
            f"{', transformers' + facts.transformers if facts.transformers else ''}, Requires-Python {facts.python}; "
            f"CUDA {facts.cuda or 'unverified'}{' from ' + facts.evidence if facts.cuda else ''}; the newest "
            f"release with these pins)"))
        report.additions.append(Addition("packages.toml", "package", f"vllm {release.version}", fields,
                                         "the newest vLLM release with its torch pin, transformers range, "
                                         "Requires-Python and CUDA major"))


# Packages whose wheel declares, beside Requires-Dist, the versions of other packages it checks at run time
# (transformers' dependency_versions_table.py: `peft` is no Requires-Dist of transformers 5.24.0, yet its PEFT
# integration refuses peft < 0.22.0 when an adapter loads). These count as requirements like Requires-Dist.
RUNTIME_TABLES = {"transformers": r"transformers/dependency_versions_table\.py"}


class _Need(NamedTuple):
    requirement: object  # packaging Requirement
    origin: str  # "Requires-Dist" | the runtime table's file name


def _needs(client: Client, name: str, release: Release, python: str, names: set[str]) -> list[_Need]:
    """What `release` of `name` requires of the other stack packages: its Requires-Dist (no extras, Linux, the
    row's Python) and its runtime version table where RUNTIME_TABLES names one. An sdist-only release
    (deepspeed) states none that can be read without building it."""
    # start-up: packaging imported only when this runs
    from packaging.requirements import Requirement

    wheel = any_wheel(release)
    if wheel is None:
        return []
    out = [_Need(r, "Requires-Dist") for r in requirements(client.metadata(name, wheel), python)
           if canonicalize_name(r.name) in names]
    pattern = RUNTIME_TABLES.get(name)
    if pattern:
        entry = client.simple_files(name).get(wheel.filename)
        url = entry["url"] if entry else wheel.url
        for spec in _runtime_table(client.wheel_member(url, pattern), f"{url}: {pattern.replace(chr(92), '')}"):
            req = Requirement(spec)
            if canonicalize_name(req.name) in names:
                out.append(_Need(req, f"its {pattern.replace(chr(92), '')}, checked at run time"))
    return out


def _runtime_table(text: str | None, where: str) -> list[str]:
    """The requirement strings of a runtime version table (the first dict literal assigned in the file), read
    without running it; UpstreamError naming `where` when it is not one (the file comes from an index)."""
    # start-up: packaging imported only when this runs
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        tree = ast.parse(text or "")
        table = next((ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                      and isinstance(n.value, ast.Dict)), {})
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise UpstreamError(f"{where}: not a readable version table ({type(e).__name__})") from None
    specs = list(table.values()) if isinstance(table, dict) else [table]
    for spec in specs:
        try:
            Requirement(spec if isinstance(spec, str) else "")
        except InvalidRequirement:
            raise UpstreamError(f"{where}: {str(spec)[:80]!r} is not a requirement") from None
    return specs


def _admits(need: _Need, version: Version) -> bool:
    return need.requirement.specifier.contains(version, prereleases=True)


MAX_TRIES = 20_000  # releases tried by co_installable's backtracking (the real stack settles in a few dozen)


def _apply_holds(candidates: dict[str, list[Release]], holds: dict[str, str], why: str | None
                 ) -> dict[str, tuple[Version, str]]:
    """Drop the candidates past each package's hold (a [[stack]] row's `hold`); key -> (the newest release held
    back, the line saying why) for each package a hold held back."""
    capped = {}
    for name, spec in holds.items():
        key, hold = canonicalize_name(name), SpecifierSet(spec)
        past = [r for r in candidates.get(key, []) if not hold.contains(r.version, prereleases=True)]
        if past:
            capped[key] = (past[0].version, f"the row's hold {name}{hold} ({why or 'no reason recorded'})")
            candidates[key] = [r for r in candidates[key] if hold.contains(r.version, prereleases=True)]
    return capped


def co_installable(client: Client, pins: dict[str, str], python: str, step=lambda what: None,
                   holds: dict[str, str] | None = None, hold_source: str | None = None
                   ) -> tuple[dict[str, Version] | None, list[str]]:
    """The newest versions of the stack's packages (each at least its pin, Requires-Python admitting `python`)
    that install together: every chosen release's requirements (_needs) admit every other chosen one. Packages
    are settled in the row's order, newest first, backtracking where a later one has no fitting release.
    Returns (the set, or None where even the pins conflict; one line per newer release held back, naming what
    held it)."""
    names = {canonicalize_name(n): n for n in pins}
    keys = list(names)
    candidates: dict[str, list[Release]] = {}
    newest_fitting: dict[str, list[Release]] = {}
    for key in keys:
        step(names[key])
        fitting = [r for r in client.project(names[key]).final() if admits_python(r, python)]
        newest_fitting[key] = fitting
        floor = Version(pins[names[key]])
        candidates[key] = [r for r in reversed(fitting) if r.version >= floor] or \
            [r for r in client.project(names[key]).releases.values() if r.version == floor]
    capped = _apply_holds(candidates, holds or {}, hold_source)
    cache: dict[tuple[str, Version], list[_Need]] = {}

    def needs(key: str, release: Release) -> list[_Need]:
        if (key, release.version) not in cache:
            cache[(key, release.version)] = _needs(client, names[key], release, python, set(keys))
        return cache[(key, release.version)]

    def conflict(key: str, release: Release, chosen: dict[str, Release]) -> str | None:
        for need in needs(key, release):
            other = chosen.get(canonicalize_name(need.requirement.name))
            if other is not None and not _admits(need, other.version):
                return f"requires {need.requirement} ({need.origin})"
        for other_key, other in chosen.items():
            for need in needs(other_key, other):
                if canonicalize_name(need.requirement.name) == key and not _admits(need, release.version):
                    return f"{names[other_key]} {other.version} requires {need.requirement} ({need.origin})"
        return None

    tries = [0]

    def search(i: int, chosen: dict[str, Release]) -> dict[str, Release] | None:
        if i == len(keys):
            return chosen
        for release in candidates[keys[i]]:
            tries[0] += 1
            if tries[0] > MAX_TRIES:  # an index can list releases that never settle: bounded, never a spin
                raise UpstreamError(f"{client.base_url}: {', '.join(pins)} do not settle on releases that install "
                                    f"together within {MAX_TRIES} tries")
            if conflict(keys[i], release, chosen) is None:
                found = search(i + 1, {**chosen, keys[i]: release})
                if found is not None:
                    return found
        return None

    found = search(0, {})
    if found is None:
        return None, [f"the recorded versions ({', '.join(f'{n} {v}' for n, v in pins.items())}) do not install "
                      f"together"]
    held = []
    for key in keys:
        if key in capped and not [r for r in candidates[key] if r.version > found[key].version]:
            held.append(f"{names[key]} {capped[key][0]} held back at {found[key].version}: {capped[key][1]}")
            continue
        newer = [r for r in candidates[key] if r.version > found[key].version]
        if not newer:
            continue
        top = newer[0]
        why = conflict(key, top, {k: r for k, r in found.items() if k != key})
        if why and why.startswith("requires "):
            need = next(n for n in needs(key, top) if why == f"requires {n.requirement} ({n.origin})")
            other = canonicalize_name(need.requirement.name)
            exists = [r for r in newest_fitting.get(other, []) if _admits(need, r.version)]
            why += (f", and {names[other]} {found[other].version} is the newest that installs with the rest"
                    if exists else f", and PyPI has no {names[other]} release that fits it for Python {python} "
                    f"(newest: {newest_fitting[other][-1].version if newest_fitting.get(other) else 'none'})")
        held.append(f"{names[key]} {top.version} held back at {found[key].version}: "
                    f"{why or 'a release it needs conflicts with another package of the stack'}")
    return {names[k]: r.version for k, r in found.items()}, held


def _stacks(data: dict, client: Client, report: Report, step) -> None:
    """Each [[stack]] row moves to the newest set of releases that install together (co_installable), never
    to a package's newest release on its own; what held a package back is reported beside the changes."""
    rows = data.get("stack", [])
    for i, row in enumerate(rows):
        python = _lowest_python(row["python"])
        where = f"[[stack]] torch{row['torch']} python{row['python']}"
        unfit = [n for n in row["packages"] if not any(admits_python(r, python) for r in client.project(n).final())]
        for name in unfit:
            report.reviews.append(Review("packages.toml", f"{where}: {name}", f"no release of {name} admits "
                                         f"Python {python}"))
        if unfit:
            continue
        chosen, held = co_installable(client, dict(row["packages"]), python, step, holds=row.get("hold"),
                                      hold_source=row.get("hold_source"))
        if chosen is None:
            report.reviews.append(Review("packages.toml", where, held[0]))
            continue
        report.held.extend(Review("packages.toml", f"[[stack]] python{row['python']}", h) for h in held)
        for name, pinned in row["packages"].items():
            if chosen[name] > Version(pinned):
                newest = next(r for r in client.project(name).final() if r.version == chosen[name])
                report.changes.append(Change("packages.toml", "stack", i, f"[[stack]] python{row['python']}",
                                             f"packages.{name}", pinned, str(chosen[name]),
                                             f"newest {name} whose Requires-Python "
                                             f"({newest.requires_python or 'any'}) admits Python {python} and "
                                             f"that installs with the rest of the row (each release's "
                                             f"Requires-Dist and runtime version table)"))
            if i == 0:
                project = client.project(name)
                overall = project.final()[-1]
                fitting = [r for r in project.final() if admits_python(r, python)]
                if fitting and overall.version > fitting[-1].version:
                    report.reviews.append(Review(
                        "packages.toml", f"{name} {overall.version}",
                        f"needs Python {overall.requires_python}: no [[stack]] row for it yet (the newest row "
                        f"is for Python {row['python']})"))


# ---------------------------------------------------------------------------- applying


def apply(directory: Path, report: Report, *, date: str) -> dict[str, tuple[str, str]]:
    """file name -> (old text, new text) for every file the report changes (meta.toml's version bumped)."""
    texts: dict[str, tuple[str, str]] = {}
    docs: dict[str, tomlkit.TOMLDocument] = {}
    for name in report.files:
        old = (directory / name).read_text()
        texts[name] = (old, old)
        docs[name] = tomlkit.parse(old)
    touched: dict[tuple[str, str, int], list[str]] = {}
    origins = {(c.file, c.table, c.index): c.origin for c in report.changes}
    for c in report.changes:
        row = docs[c.file][c.table][c.index]
        parent, key = (row[c.field.split(".", 1)[0]], c.field.split(".", 1)[1]) if "." in c.field else (row, c.field)
        if c.new is None:
            parent.pop(key, None)
        elif isinstance(c.new, dict):  # written as the hand-made rows are: cuda = { "12" = "", "13" = "cu13" }
            inline = tomlkit.inline_table()
            inline.update(c.new)
            parent[key] = inline
        else:
            parent[key] = c.new
        touched.setdefault((c.file, c.table, c.index), []).append(c.field.split(".")[-1])
    for (file, table, index), fields in touched.items():
        row = docs[file][table][index]
        if "source" in row:
            kept = UPDATED_RE.sub("", str(row["source"]))
            row["source"] = (f"{kept}; {', '.join(dict.fromkeys(fields))} updated by envtool matrix update "
                             f"from {origins[(file, table, index)]} on {date}")
    for a in report.additions:
        table = tomlkit.table()
        for key, value in a.fields.items():
            if isinstance(value, dict):  # written as the hand-made rows are: not_on = { cpu = "..." }
                inline = tomlkit.inline_table()
                inline.update(value)
                value = inline
            table[key] = value
        table.trivia.indent = "\n"
        if a.table == "release.build":  # after the row's last build, which ends with a blank line already
            table.trivia.indent = ""
            table.add(tomlkit.nl())
            parent = docs[a.file]["release"][a.index]
            if "build" not in parent:
                parent["build"] = tomlkit.aot()
            parent["build"].append(table)
        else:
            docs[a.file][a.table].append(table)
    for name, doc in docs.items():
        texts[name] = (texts[name][0], tomlkit.dumps(doc))
    if texts:
        meta_old = (directory / "meta.toml").read_text()
        meta = tomlkit.parse(meta_old)
        meta["version"] = date.replace("-", ".")
        texts["meta.toml"] = (meta_old, tomlkit.dumps(meta))
    return {n: t for n, t in texts.items() if t[0] != t[1]}


def unified_diff(texts: dict[str, tuple[str, str]]) -> str:
    out = []
    for name, (old, new) in sorted(texts.items()):
        out.extend(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=f"a/matrices/{name}", tofile=f"b/matrices/{name}"))
    return "".join(out)


def write(directory: Path, texts: dict[str, tuple[str, str]]) -> None:
    """Check the new set with the matrix loader on a temporary copy, then replace each file atomically."""
    with tempfile.TemporaryDirectory(prefix="envtool-matrix-") as tmp:
        for name in matrix_module.FILES:
            shutil.copy2(directory / f"{name}.toml", Path(tmp) / f"{name}.toml")
        for name, (_, new) in texts.items():
            (Path(tmp) / name).write_text(new)
        try:
            matrix_module._load(Path(tmp))
        except MatrixError as e:
            raise MatrixError(f"the regenerated matrices fail the schema check, nothing written: "
                              f"{str(e).replace(tmp, str(directory))}") from None
    # all or nothing: every file checked unchanged and every new text written beside it before the first rename
    for name, (old, _) in texts.items():
        if (directory / name).read_text() != old:
            raise MatrixError(f"{directory / name} changed while envtool matrix update ran; nothing written")
    staged: list[tuple[str, Path]] = []
    try:
        for name, (_, new) in texts.items():
            fd, tmp_path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
            staged.append((tmp_path, directory / name))
            with os.fdopen(fd, "w") as f:
                f.write(new)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp_path, (directory / name).stat().st_mode & 0o777)
        for tmp_path, target in staged:
            os.replace(tmp_path, target)
    finally:
        for tmp_path, _ in staged:
            Path(tmp_path).unlink(missing_ok=True)


def read(directory: Path) -> dict[str, dict]:
    """The matrices as tomllib data (after the loader has checked them)."""
    matrix_module._load(directory)
    data = {name: matrix_module._read(directory / f"{name}.toml") for name in matrix_module.FILES}
    if (directory / "rocm.toml").exists():  # read, never written: its ROCm rows are checked against torch's matrix
        data["rocm"] = matrix_module._read(directory / "rocm.toml")
    return data


def as_json(report: Report, *, texts: dict[str, tuple[str, str]], written: bool, pypi_url: str,
            directory: Path) -> dict:
    return {
        "stale": report.stale,
        "written": written,
        "pypi_url": pypi_url,
        "matrix_dir": str(directory),
        "changes": [{"file": c.file, "row": c.row, "field": c.field, "old": c.old, "new": c.new, "why": c.why}
                    for c in report.changes],
        "added": [{"file": a.file, "row": a.row, "fields": a.fields, "why": a.why} for a in report.additions],
        "needs_review": [{"file": r.file, "row": r.row, "why": r.why} for r in report.reviews],
        "held_back": [{"file": r.file, "row": r.row, "why": r.why} for r in report.held],
        "files": sorted(texts),
        "diff": unified_diff(texts),
    }


def command(*, check: bool, json_out: bool, pypi_url: str | None, matrix_dir,
            torch_index_url: str | None = None, pytorch_source_url: str | None = None,
            builds: bool = True) -> int:
    """`envtool matrix update [--check]`; returns the exit code. builds=False: torch's release build matrices
    are not read (PyPI and the PyTorch index only)."""
    # start-up: resolver.buildmatrix imported only when this runs
    from .buildmatrix import source_url

    # start-up: resolver.progress, resolver.solve imported only when this runs
    from .progress import progress
    from .solve import TORCH_INDEX_ENV

    directory = Path(matrix_dir) if matrix_dir else matrix_module.matrix_dir()
    data = read(directory)
    base = resolve_pypi_url(pypi_url)
    torch_index = torch_index_url or os.environ.get(TORCH_INDEX_ENV) or data["torch"].get("index_url")
    date = today()
    with progress(f"reading {base}", None) as advance:
        client = Client(base, on_request=lambda url: advance(1))
        report = regenerate(data, client, date=date, torch_index=torch_index,
                            pytorch_source=source_url(pytorch_source_url) if builds else None)
    from .credentials import redact  # a mirror's credentials (in --pypi-url, the torch index) are never written

    texts = {name: (old, redact(new)) for name, (old, new) in apply(directory, report, date=date).items()}
    written = False
    if texts and not check:
        write(directory, texts)
        written = True
    if json_out:
        print(redact(json.dumps(as_json(report, texts=texts, written=written, pypi_url=base, directory=directory),
                                indent=2)))
        return 1 if check and report.stale else 0

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        _print_report(report, texts, written=written, check=check, base=base, directory=directory)
    print(redact(shown.getvalue()), end="")
    return 1 if check and report.stale else 0


def _print_report(report: Report, texts, *, written: bool, check: bool, base: str, directory: Path) -> None:
    for c in report.changes:
        print(f"{c.file}: {c.row}: {c.field} {c.old} -> {c.new} ({c.why})")
    for a in report.additions:
        print(f"{a.file}: new row {a.row} ({a.why})")
    for r in report.reviews:
        print(f"needs review: {r.file}: {r.row}: {r.why}")
    for r in report.held:
        print(f"held back: {r.file}: {r.row}: {r.why}")
    diff = unified_diff(texts)
    if diff:
        if sys.stdout.isatty():
            # start-up: rich imported only when this runs
            from rich.console import Console
            from rich.syntax import Syntax

            Console().print(Syntax(diff, "diff", theme="ansi_dark", background_color="default"))
        else:
            print(diff, end="")
    counts = (f"{len(report.changes)} field(s) to change, {len(report.additions)} new row(s), "
              f"{len(report.reviews)} item(s) need review")
    if not report.stale:
        print(f"matrices in {directory} are current with {base}")
    elif check:
        print(f"matrices are stale: {counts}" + ("; run `envtool matrix update` to write the changes" if texts
                                                  else ""))
    elif written:
        print(f"wrote {', '.join(sorted(texts))} in {directory} ({counts})")
    else:
        print(f"nothing to write: {counts}")
