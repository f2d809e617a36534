"""Issue 34 item 6: the matrix's pairings follow the packages' own metadata, read from captured files (fast tier:
no server, no subprocess but one `envtool resolve`).

- xformers: each row's torch range is its wheel's `Requires-Dist: torch…`; a row admitting a torch other than the
  one its compiled part was built with must link only torch's stable C ABI (captured symbols of the wheel's _C.so).
- Hub kernels: a Hub-kernel plan's transformers, kernels and the rest of its stack install together by each
  release's own Requires-Dist and transformers' runtime version table.
- CUDA toolkits without a driver floor say so ("unverified"), never a guessed number.
"""

from __future__ import annotations

import json
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from resolver import hardware
from resolver.errors import Unsatisfiable
from resolver.solve import Request, solve
from resolver.update import RUNTIME_TABLES
from resolver.upstream import requirements

from .conftest import run_envtool

UPSTREAM = Path(__file__).parent / "data" / "upstream"
CAPTURED = Path(__file__).parents[1] / "support" / "captured"
HUB = "kernels-community/vllm-flash-attn3"


def xformers_metadata(version: str):
    (path,) = sorted(UPSTREAM.glob(f"metadata/xformers-{version}-*.whl.metadata"))
    return Parser().parsestr(path.read_text())


def torch_requirement(metadata) -> SpecifierSet:
    (req,) = [r for r in requirements(metadata, "3.11") if r.name == "torch"]
    return req.specifier


def test_every_xformers_row_pins_the_torch_its_wheel_requires(m):
    for x in m.xformers:
        wheel = torch_requirement(xformers_metadata(x.version))
        assert SpecifierSet(x.torch) == wheel, f"xformers.toml {x.version}: torch{x.torch}, its METADATA: torch{wheel}"


def test_no_xformers_plan_pairs_a_torch_its_wheel_rejects(m):
    """Every torch release an xformers plan can take, through the solver: the xformers it pins accepts it."""
    planned = 0
    for release in m.torch:
        try:
            p = solve(Request(gpu=hardware.lookup("h100", m), driver="570.86.10", python="3.11", target="h100",
                              torch=release.version, attention="xformers"), m)
        except Unsatisfiable:  # a torch no xformers release fits is refused, which is not a pairing
            continue
        planned += 1
        wheel = torch_requirement(xformers_metadata(p.packages["xformers"]))
        assert wheel.contains(p.torch.version), (p.torch.version, p.packages["xformers"], str(wheel))
    assert planned >= 5


def test_xformers_beside_a_later_torch_only_where_its_binary_uses_torchs_stable_abi(m):
    """A row whose range admits a torch release other than the one its _C.so was built with (xformers 0.0.35:
    built with 2.10.0+cu128, torch>=2.10) must link no libtorch C++ symbol, and a CUDA 12 runtime row says cuda 12."""
    widened = 0
    for x in m.xformers:
        admitted = [r.version for r in m.torch if SpecifierSet(x.torch).contains(r.version)]
        if len(admitted) <= 1:
            continue
        widened += 1
        build = CAPTURED / f"xformers-{x.version}-py39-none-manylinux_2_28_x86_64.whl.cpp_lib.json"
        symbols = CAPTURED / f"xformers-{x.version}-py39-none-manylinux_2_28_x86_64.whl._C.so.symbols.txt"
        assert build.exists() and symbols.exists(), f"xformers {x.version} admits torch {admitted}: capture its _C.so"
        built = json.loads(build.read_text())["version"]
        assert Version(built["torch"]).base_version in admitted
        lines = [s for s in symbols.read_text().splitlines() if not s.startswith("#")]
        needed, undefined = [s for s in lines if ".so" in s], [s for s in lines if ".so" not in s]
        libtorch_cxx = [s for s in undefined if s.startswith("_Z") and any(k in s for k in ("3c10", "2at", "5torch"))]
        assert not libtorch_cxx, f"xformers {x.version} calls libtorch's C++ ABI: {libtorch_cxx[:3]}"
        assert any(s.startswith("aoti_torch_") for s in undefined)
        cudart = {s for s in needed if s.startswith("libcudart.so.")}
        assert cudart == {f"libcudart.so.{x.cuda}"} and built["cuda"] // 100 == int(x.cuda)
    assert widened >= 1  # 0.0.35 is such a row today


# ------------------------------------------------------------------------------------------------ Hub kernels


def wheel_members(name: str, version: str) -> dict[str, str]:
    (path,) = sorted(UPSTREAM.glob(f"wheels/{name}-{version}-*.whl.json"))
    return json.loads(path.read_text())


def needs(name: str, version: str, python: str, names: set[str]) -> list[tuple[Requirement, str]]:
    """What this release requires of the other packages (no extras, Linux x86_64), with where it says so."""
    if name == "kernels" and not sorted(UPSTREAM.glob(f"wheels/{name}-{version}-*.whl.json")):
        info = json.loads((CAPTURED / "pypi.org-pypi-kernels-json-info.json").read_text())
        assert info["version"] == version, "the captured kernels info is another release's"
        text = "".join(f"Requires-Dist: {r}\n" for r in info["requires_dist"])
        return [(r, "JSON API") for r in requirements(Parser().parsestr(text), python)
                if canonicalize_name(r.name) in names]
    if name == "deepspeed":  # an sdist: its requirements are not readable without building it
        return []
    members = wheel_members(name, version)
    (metadata,) = [v for k, v in members.items() if k.endswith(".dist-info/METADATA")]
    out = [(r, "METADATA") for r in requirements(Parser().parsestr(metadata), python)
           if canonicalize_name(r.name) in names]
    for key, text in members.items():
        if name in RUNTIME_TABLES and key.endswith("dependency_versions_table.py"):
            import ast
            table = next(ast.literal_eval(n.value) for n in ast.walk(ast.parse(text))
                         if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict))
            out += [(Requirement(s), key) for s in table.values() if canonicalize_name(Requirement(s).name) in names]
    return out


def plan(m, python, **pins):
    return solve(Request(gpu=hardware.lookup("h100", m), driver="580.65.06", python=python, target="h100", **pins), m)


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.13"])
def test_a_hub_kernel_plans_packages_install_together_by_their_own_metadata(m, python):
    p = plan(m, python, attention=HUB)
    stack = {k: v for k, v in p.packages.items() if k not in ("torch", "triton")}
    assert "kernels" in stack and "transformers" in stack
    names = {canonicalize_name(n) for n in stack}
    pinned = {canonicalize_name(n): Version(v) for n, v in stack.items()}
    for name, version in stack.items():
        for req, where in needs(name, version, python, names):
            other = pinned[canonicalize_name(req.name)]
            assert req.specifier.contains(other, prereleases=True), \
                f"Python {python}: {name} {version} requires {req} ({where}), the plan pins {req.name} {other}"


def test_kernels_requirement_rows_are_the_captured_transformers_metadata(m):
    for row in m.kernels_requirements:
        metadata = Parser().parsestr(next(v for k, v in wheel_members("transformers", row.transformers).items()
                                          if k.endswith("METADATA")))
        specs = {str(Requirement(r).specifier) for r in metadata.get_all("Requires-Dist")
                 if Requirement(r).name == "kernels"
                 and any(f'extra == "{e}"' in r for e in ("kernels", "hub-kernels"))}
        assert specs == {str(SpecifierSet(row.kernels))}, (row.transformers, specs, row.kernels)


def test_hub_kernels_through_the_command_on_python_3_12():
    out = run_envtool("resolve", "--gpu", "h100", "--driver", "580.65.06", "--python", "3.12",
                      "--attention", HUB, "--json")
    assert out.returncode == 0, out.stderr
    packages = json.loads(out.stdout)["packages"]
    assert (packages["transformers"], packages["kernels"]) == ("5.23.0", "0.18.3")


# ------------------------------------------------------------------------------------------------ CUDA floors


def test_a_toolkit_without_a_driver_floor_says_it_is_unverified(m):
    for t in m.toolkits:
        if t.min_driver is None:
            assert "unverified" in t.source, f"cuda.toml [[toolkit]] {t.version}: no min_driver and no 'unverified'"


def _kernels_step(data, versions):
    from types import SimpleNamespace

    from resolver import update

    project = SimpleNamespace(final=lambda: [SimpleNamespace(version=Version(v), requires_python=">=3.10")
                                             for v in versions])
    report = update.Report([], [], [])
    update._kernels(data["packages"], SimpleNamespace(project=lambda name: project), "2026-12-07", report)
    return report


def test_matrix_update_asks_to_drop_hub_kernels_once_a_kernels_release_fits_the_stacks_own_transformers():
    """`envtool matrix update`'s kernels step, in process on the repository's packages.toml given back the
    hub_kernels override issue 34 wrote (transformers 5.22.2): with PyPI's kernels releases as captured on
    2026-11-28 (newest 0.17.2) nothing to review; with 0.18.3 published the override is no longer needed and the
    update says so (it was then dropped, issue 43)."""
    from resolver import update

    data = update.read(Path(update.__file__).resolve().parents[1] / "matrices")
    data["packages"]["stack"][0]["hub_kernels"] = {"transformers": "5.22.2"}
    data["packages"]["kernels_release"] = [r for r in data["packages"]["kernels_release"]
                                           if not r["version"].startswith(("0.18.", "0.19."))]
    captured = json.loads((CAPTURED / "pypi.org-pypi-kernels-json-info.json").read_text())["versions_newest_5"]

    def reviews(versions):
        return [r for r in _kernels_step(data, versions).reviews if "hub_kernels" in str(r)]

    assert reviews(captured) == []
    (drop,) = reviews([*captured, "0.18.3", "0.19.1"])
    assert "transformers 5.22.2" in str(drop) and "5.23.0" in str(drop) and "drop it" in str(drop)


def test_matrix_update_adds_the_newest_kernels_inside_each_transformers_range_not_only_pypis_newest():
    """PyPI's newest kernels (0.19.1) is outside transformers 5.23.0's kernels>=0.18.2,<0.19: a row for it alone
    would leave the stack's Hub-kernel plans on no release (or an older transformers). The update adds 0.18.3 too,
    naming the range, and nothing for ranges whose newest release is recorded."""
    from resolver import update

    data = update.read(Path(update.__file__).resolve().parents[1] / "matrices")
    data["packages"]["kernels_release"] = [r for r in data["packages"]["kernels_release"]
                                           if not r["version"].startswith(("0.18.", "0.19."))]
    added = {a.row: a.fields["source"] for a in _kernels_step(data, ["0.17.2", "0.18.2", "0.18.3", "0.19.1"]).additions}
    assert sorted(added) == ["kernels 0.18.3", "kernels 0.19.1"]
    assert "inside transformers 5.23.0's range kernels<0.19,>=0.18.2" in added["kernels 0.18.3"]
    assert "on 2026-12-07" in added["kernels 0.18.3"] and "Requires-Python >=3.10" in added["kernels 0.18.3"]
    full = update.read(Path(update.__file__).resolve().parents[1] / "matrices")  # as written: all recorded
    assert _kernels_step(full, ["0.17.2", "0.18.3", "0.19.1"]).additions == []


def test_every_stack_row_installs_together_by_its_releases_own_metadata(m):
    """The same oracle for each [[stack]] row as written (what `envtool matrix update` leaves or proposes), on
    the lowest Python it admits: no pin that another pin's Requires-Dist or runtime table rejects."""
    for s in m.stacks:
        python = s.python.split(",")[0].lstrip(">=")
        names = {canonicalize_name(n) for n in s.packages}
        pinned = {canonicalize_name(n): Version(v) for n, v in s.packages.items()}
        for name, version in s.packages.items():
            for req, where in needs(name, version, python, names):
                other = pinned[canonicalize_name(req.name)]
                assert req.specifier.contains(other, prereleases=True), \
                    f"[[stack]] python{s.python}: {name} {version} requires {req} ({where}), the row pins {other}"
