"""`envtool matrix verify`: does every wheel a plan can name exist upstream?

What a plan can name, enumerated from the matrix the way the solver uses it:
- torch: for every [[release]] and each of its builds (and the CPU build), the index page
  `{torch index}/torch/` (index_url with {variant}) must list a wheel of that version and variant for every
  Python of the release's range, on each platform (x86_64, aarch64);
- flash-attn: every wheel the solver names for some GPU, Python, platform and `--flash-attn` pin (found by
  running the solver's own candidate evaluation): a wheel taken by its URL (flash-attn 2's release assets) with
  a HEAD request (redirects followed), a wheel on a package index (flash-attn-3 on the PyTorch index of each
  torch variant) by reading that index's project page, as uv does;
- PyPI: every package version a plan pins: the training stack rows, xformers, and triton (a Linux wheel for
  every Python and platform a plan names it with).
URLs come from the matrix, $ENVTOOL_TORCH_INDEX_URL, $ENVTOOL_FLASH_ATTN_URL and --pypi-url/$ENVTOOL_PYPI_URL.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple
from urllib.parse import unquote

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from . import matrix as matrix_module
from .errors import EnvtoolError
from .matrix import Matrix, in_range, pythons
from .plan import PYPI_SIMPLE
from .upstream import Client, UpstreamError, parse_project
from .upstream import pypi_url as resolve_pypi_url

PLATFORMS = ("x86_64", "aarch64")


class Check(NamedTuple):
    kind: str  # "torch index" | "flash-attn wheel" | "flash-attn index" | "pypi"
    what: str  # what a plan names: "torch 2.8.0+cu128 cp311 x86_64"
    url: str  # what is fetched: the index page, the wheel URL, the project's JSON
    match: tuple = ()  # listing/pypi: (name, version, local, python, machine); head: ()


class Missing(NamedTuple):
    check: Check
    why: str


def checks(m: Matrix, *, torch_index: str, pypi: str) -> list[Check]:
    out: list[Check] = []
    # torch: the index pages
    for r in m.torch:
        builds = [("cpu", PLATFORMS)] + [(b.variant, build_platforms(b)) for b in r.build]
        for variant, platforms in builds:
            page = torch_index.format(variant=variant).rstrip("/") + "/torch/"
            for py in pythons(r.python):
                for machine in platforms:
                    out.append(Check("torch index", f"torch {r.version}+{variant} cp{py.replace('.', '')} {machine}",
                                     page, ("torch", r.version, variant, py, machine)))
    # flash-attn: what the solver names
    for (url, match), what in flash_attn_wheels(m).items():
        if match and url.startswith(PYPI_SIMPLE):  # on PyPI (flash-attn-4): its JSON project page, at --pypi-url
            out.append(Check("pypi", what, f"{pypi}/pypi/{canonicalize_name(match[0])}/json", match))
            continue
        out.append(Check("flash-attn index" if match else "flash-attn wheel", what, url, match))
    # PyPI: pinned versions
    pinned: dict[tuple[str, str], str] = {}
    for s in m.stacks:
        for name, version in s.packages.items():
            pinned.setdefault((name, version), f"{name} {version} ([[stack]] torch{s.torch} python{s.python})")
        for name, version in s.hub_kernels.items():
            pinned.setdefault((name, version), f"{name} {version} ([[stack]] torch{s.torch} python{s.python} "
                                               f"hub_kernels, --attention <org>/<kernel>)")
    for x in m.xformers:
        pinned.setdefault(("xformers", x.version), f"xformers {x.version} (--attention xformers)")
    for k in m.kernels_releases:
        pinned.setdefault(("kernels", k.version), f"kernels {k.version} (Hub kernels, --attention <org>/<kernel>)")
    xformers: dict[tuple[str, str, str], str] = {}
    for r in m.torch:  # the release `--attention xformers` picks for this torch, on each Python and platform
        for py in pythons(r.python):
            for machine in PLATFORMS:
                fits = [x for x in m.xformers if in_range(r.version, x.torch)
                        and machine in x.platforms and (x.python is None or in_range(py, x.python))]
                if fits:
                    x = max(fits, key=lambda x: Version(x.version))
                    xformers.setdefault((x.version, py, machine), f"torch {r.version}")
    for (name, version), what in pinned.items():
        out.append(Check("pypi", what, f"{pypi}/pypi/{canonicalize_name(name)}/json", (name, version, None, None, None)))
    triton: dict[tuple[str, str, str], str] = {}
    for r in m.torch:
        if r.triton and r.build:
            for py in pythons(r.python):
                for machine in PLATFORMS:
                    if names_triton(m, r, py, machine):
                        triton.setdefault((r.triton, py, machine), f"torch {r.version}")
    for (version, py, machine), by in xformers.items():
        out.append(Check("pypi", f"xformers {version} cp{py.replace('.', '')} {machine} (with {by})",
                         f"{pypi}/pypi/xformers/json", ("xformers", version, None, py, machine)))
    for (version, py, machine), by in triton.items():
        out.append(Check("pypi", f"triton {version} cp{py.replace('.', '')} {machine} (pinned by {by})",
                         f"{pypi}/pypi/triton/json", ("triton", version, None, py, machine)))
    return out


def build_platforms(build) -> tuple[str, ...]:
    """The platforms a CUDA build is planned for: aarch64 only for builds with an aarch64 arch list."""
    return ("x86_64",) + (("aarch64",) if build.sass_aarch64 is not None else ())


def names_triton(m: Matrix, r, py: str, machine: str) -> bool:
    """Whether a plan for torch release `r` on this Python and machine names its triton pin: where the
    requirement's marker applies and triton has a wheel."""
    if machine not in r.triton_platforms:
        return False
    if r.triton_python and not in_range(py, r.triton_python):
        return False
    wheels = m.triton_release(r.triton)
    return wheels is None or (machine in wheels.platforms and in_range(py, wheels.python))


def flash_attn_urls(m: Matrix) -> dict[str, str]:
    """The wheel URLs of flash_attn_wheels (what a plan names as `wheel_url`)."""
    return {url: what for (url, match), what in flash_attn_wheels(m).items() if not match}


def flash_attn_wheels(m: Matrix) -> dict[tuple[str, tuple], str]:
    """Every flash-attn wheel a plan can name, as (URL to fetch, listing match) -> what: the solver's own search,
    for a GPU each implementation runs on, every Python a torch release covers, each platform, and each release
    pinned with --flash-attn. A wheel taken by its URL: (its URL, ()); a wheel on an index: (the project page,
    (name, version, None, python, machine)), the wheel uv would take from it."""
    # start-up: resolver.hardware, resolver.solve imported only when this runs
    from .hardware import from_cc
    from .solve import Request, evaluate

    all_pythons = sorted({py for r in m.torch for py in pythons(r.python)}, key=Version)
    urls: dict[tuple[str, tuple], str] = {}
    for impl in m.flash_attn_impls:
        min_cc = m.backend(impl.attention).min_cc  # the oldest GPU it runs on (attention.toml)
        try:
            gpu = from_cc(min_cc, m, name=f"sm_{min_cc.replace('.', '')}", memory_gb=None, source="verify")
        except EnvtoolError:
            continue
        for rel in m.flash_attn_releases:
            if rel.impl != impl.name:
                continue
            for py in all_pythons:
                for machine in PLATFORMS:
                    req = Request(gpu=gpu, driver=None, python=py, platform=machine, flash_attn=rel.version)
                    survivors, _ = evaluate(req, m)
                    for c in survivors:
                        fa = c.flash_attn
                        if fa is None:
                            continue
                        what = f"{fa.package} {fa.version} for {c.label} cp{py.replace('.', '')} {machine}"
                        if fa.index_url:
                            page = f"{fa.index_url.rstrip('/')}/{canonicalize_name(fa.package)}/"
                            key = (page, (fa.package, fa.version, None, py, machine))
                            urls.setdefault(key, what + f" (on {fa.index_url})")
                        else:
                            urls.setdefault((fa.wheel_url, ()), what)
    return urls


def listing(text: str) -> list[str]:
    """The file names a PEP 503 page links to."""
    names = []
    for href, label in re.findall(r"<a\s[^>]*href=\"([^\"]*)\"[^>]*>([^<]*)</a>", text, flags=re.I):
        label = html.unescape(label).strip()
        name = label if label.endswith(".whl") else unquote(html.unescape(href).split("#")[0].rsplit("/", 1)[-1])
        names.append(name)
    return names


def wheel_matches(filename: str, name: str, version: str, local: str | None, python: str | None,
                  machine: str | None) -> bool:
    try:
        dist, v, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return False
    if dist != canonicalize_name(name) or v.public != Version(version).public:
        return False
    if local is not None and v.local != local and not (local == "cpu" and v.local is None):
        return False
    if python is not None:
        minor = int(python.split(".")[1])

        def runs(t) -> bool:  # cpXY-cpXY, py3-none, or cpXY-abi3 / pyXY-none for Python >= X.Y
            if t.interpreter in (f"cp3{minor}", "py3"):
                return True
            m = re.fullmatch(r"(cp|py)3(\d+)", t.interpreter)  # py39: pure-Python code for 3.9 and later
            return bool(m and (t.abi == "abi3" or m.group(1) == "py") and int(m.group(2)) <= minor)

        if not any(runs(t) for t in tags):
            return False
    if machine is not None:
        if not any(t.platform == "any" or (t.platform.startswith(("manylinux", "linux")) and t.platform.endswith(machine))
                   for t in tags):  # (a pure-Python wheel, flash-attn-4's, installs on every machine)
            return False
    return True


def run(all_checks: list[Check], client: Client, *, jobs: int = 8,
        advance: Callable[[int], None] = lambda n: None) -> list[Missing]:
    """Fetch every page and project once and HEAD every wheel URL, `jobs` at a time; what is missing."""
    pages = sorted({c.url for c in all_checks if c.kind in ("torch index", "flash-attn index")})
    projects = sorted({c.url for c in all_checks if c.kind == "pypi"})
    heads = sorted({c.url for c in all_checks if c.kind == "flash-attn wheel"})
    fetched: dict[str, object] = {}

    def get_page(url: str):
        r = client.get(url, ok=tuple(range(200, 600)))
        return ("page", r.status_code, listing(r.text) if r.status_code == 200 else [])

    def get_project(url: str):
        r = client.get(url, ok=tuple(range(200, 600)))
        if r.status_code != 200:
            return ("project", r.status_code, {})
        data = r.json()
        parse_project(data, url)  # every value of the type it should have, else one line naming it
        return ("project", 200, data["releases"])

    def head(url: str):
        return ("head",) + client.exists(url)

    work = [(get_page, u) for u in pages] + [(get_project, u) for u in projects] + [(head, u) for u in heads]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(fn, url): url for fn, url in work}
        errors = []
        for future, url in futures.items():
            try:
                fetched[url] = future.result()
            except UpstreamError as e:
                errors.append(e)
            advance(1)
        if errors:
            raise UpstreamError(f"{errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))

    missing = []
    for c in all_checks:
        result = fetched[c.url]
        if c.kind == "flash-attn wheel":
            _, found, said = result
            if not found:
                missing.append(Missing(c, said))
        elif c.kind in ("torch index", "flash-attn index"):
            _, status, names = result
            if status != 200:
                missing.append(Missing(c, f"index page: HTTP {status}"))
            elif not any(wheel_matches(n, *c.match) for n in names):
                missing.append(Missing(c, "not listed on the index page"))
        else:
            _, status, releases = result
            name, version, _, py, machine = c.match
            files = _release_files(releases, version)
            if status != 200:
                missing.append(Missing(c, f"HTTP {status}"))
            elif files is None:
                missing.append(Missing(c, f"{name} {version} is not on the index"))
            elif not files or all(f.get("yanked") for f in files):
                missing.append(Missing(c, f"{name} {version} has no (unyanked) files"))
            elif py and not any(wheel_matches(f.get("filename", ""), name, version, None, py, machine)
                                for f in files if not f.get("yanked")):
                missing.append(Missing(c, f"no {name} {version} wheel for cp{py.replace('.', '')} Linux {machine}"))
    return missing


def _release_files(releases: dict, version: str) -> list | None:
    for text, files in releases.items():
        try:
            if Version(text) == Version(version):
                return files or []
        except Exception:
            continue
    return None


def summary(all_checks: list[Check], missing: list[Missing]) -> dict:
    kinds: dict[str, int] = {}
    for c in all_checks:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return {
        "ok": not missing,
        "checked": len(all_checks),
        "by_kind": kinds,
        "urls": len({c.url for c in all_checks}),
        "missing": [{"kind": x.check.kind, "what": x.check.what, "url": x.check.url, "why": x.why} for x in missing],
    }


def torch_index_template(option: str | None, m: Matrix) -> str:
    # start-up: resolver.solve imported only when this runs
    from .solve import TORCH_INDEX_ENV

    return option or os.environ.get(TORCH_INDEX_ENV) or m.torch_index_url


def command(*, json_out: bool, pypi_url: str | None, torch_index_url: str | None, flash_attn_url: str | None,
            jobs: int, matrix_dir) -> int:
    """`envtool matrix verify`; returns the exit code (1: something a plan names is missing)."""
    # start-up: resolver.progress, resolver.solve imported only when this runs
    from .progress import progress
    from .solve import FLASH_ATTN_URL_ENV, TORCH_INDEX_ENV

    if flash_attn_url:  # the solver reads the templates from the environment
        os.environ[FLASH_ATTN_URL_ENV] = flash_attn_url
    if torch_index_url:  # (flash-attn-3 is on the torch index: the solver names it there)
        os.environ[TORCH_INDEX_ENV] = torch_index_url
    m = matrix_module._load(matrix_dir) if matrix_dir else matrix_module.load()
    pypi = resolve_pypi_url(pypi_url)
    todo = checks(m, torch_index=torch_index_template(torch_index_url, m), pypi=pypi)
    fetches = len({c.url for c in todo})
    with progress("checking wheel URLs", fetches) as advance:
        client = Client(pypi)
        missing = run(todo, client, jobs=jobs, advance=advance)
    result = summary(todo, missing)
    from .credentials import redact  # a mirror's credentials in $ENVTOOL_TORCH_INDEX_URL are never printed

    if json_out:
        print(redact(json.dumps(result, indent=2)))
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in result["by_kind"].items())
        if missing:
            print(f"{len(missing)} of {len(todo)} wheels a plan can name are missing ({kinds}; "
                  f"{fetches} URLs fetched):")
            for x in missing:
                print(redact(f"  {x.check.what}: {x.check.url} ({x.why})"))
        else:
            print(f"all {len(todo)} wheels a plan can name exist ({kinds}; {fetches} URLs fetched)")
    sys.stdout.flush()
    return 1 if missing else 0
