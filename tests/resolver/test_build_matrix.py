"""`envtool matrix update` reading torch's CUDA builds from PyPI's neighbour: PyTorch's release build matrix at each
release tag (resolver/buildmatrix.py), served on 127.0.0.1.

What is captured and what is not (tests/support/captured/SOURCES.md, "pytorch/pytorch build files"):
- CAPTURED_TABLE, CAPTURED_SCRIPT, CAPTURED_MATRIX: excerpts of .ci/manywheel/build_env_setup.py (commit 00505f29),
  .ci/manywheel/build_cuda.sh (commit 00c7a380) and .github/scripts/generate_binary_build_matrix.py (commit
  00018c94) as the stored index of pytorch/pytorch holds them (read 2026-12-07), verbatim. They are the only
  versions of these files readable here: none is at a release tag (GitHub is not reachable, the pytorch/pytorch
  snapshot is over the fetch limit). The reading tests run on them.
- MATRIX, TABLE (and SCRIPT_BY_ARCH): NOT captures. Written in the shape of the files above with the values issue
  43 reports for v2.13.0 (CUDA 12.6, 12.9, 13.0, 13.2), so the rows-it-writes tests have a build matrix that lists
  12.9; they check the reading and the rows written from it, not torch's facts. Files captured at real tags
  (tests/resolver/data/upstream/capture.py --pytorch-git DIR TAG ...) are served by tests/support/upstream.py at
  /pytorch/<tag>/<path> beside these.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest
from packaging.version import Version

from resolver import buildmatrix, update
from resolver import matrix as matrix_module
from resolver.upstream import Client, UpstreamError
from tests.support.upstream import World, serve

from .conftest import run_envtool

REPO_MATRICES = Path(matrix_module.__file__).resolve().parents[1] / "matrices"
CAPTURED = Path(__file__).resolve().parents[1] / "support" / "captured" / "pytorch"
CAPTURED_TABLE = (CAPTURED / "build_env_setup.py@00505f29-excerpt.py").read_text()
CAPTURED_SCRIPT = (CAPTURED / "build_cuda.sh@00c7a380-excerpt.sh").read_text()
CAPTURED_MATRIX = (CAPTURED / "generate_binary_build_matrix.py@00018c94-excerpt.py").read_text()

MATRIX = '''#!/usr/bin/env python3
"""Generates a matrix to be utilized through github actions"""
import os
from typing import Optional

CUDA_ARCHES = ["12.6", "12.9", "13.0", "13.2"]
CUDA_STABLE = "13.0"
CUDA_ARCHES_FULL_VERSION = {
    "12.6": "12.6.3",
    "12.9": "12.9.1",
    "13.0": "13.0.2",
    "13.2": "13.2.1",
}
ROCM_ARCHES = ["7.1", "7.2"]
CUDA_AARCH64_ARCHES = ["12.6-aarch64", "12.9-aarch64", "13.0-aarch64", "13.2-aarch64"]
DEFAULT_TAG = os.getenv("RELEASE_VERSION_TAG", "main")
WHEEL_CONTAINER_IMAGES = {gpu_arch: f"manylinux2_28-builder:cuda{gpu_arch}" for gpu_arch in CUDA_ARCHES}
raise SystemExit("never run: read with ast")
'''

TABLE = '''TORCH_CUDA_ARCH_LIST_TABLE: dict[str, dict[str, set[int]]] = {
    "12.6": {
        "x86_64": {50, 60, 70, 75, 80, 86, 90},
        "aarch64": {80, 90},
    },
    "12.9": {
        "x86_64": {70, 75, 80, 86, 90, 100, 120},
        "aarch64": {80, 90, 100, 120},
    },
    "13.0": {
        "x86_64": {75, 80, 86, 90, 100, 120},
        "aarch64": {80, 90, 100, 110, 120},
    },
    "13.2": {
        "x86_64": {75, 80, 86, 90, 100, 120},
        "aarch64": {80, 90, 100, 110, 120},
    },
}

# Architectures we additionally emit PTX for (forward-compat for newer GPUs).
_PTX_ARCHES: set[int] = {120}
'''

SCRIPT = CAPTURED_SCRIPT  # the case block of build_cuda.sh at 00c7a380: 12.8, 12.9, 12.6 branches

SCRIPT_BY_ARCH = '''TORCH_CUDA_ARCH_LIST="7.0;7.5;8.0;8.6;9.0"
case ${CUDA_VERSION} in
    12.6) TORCH_CUDA_ARCH_LIST="5.0;6.0;${TORCH_CUDA_ARCH_LIST}" ;;
    12.8) TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST};10.0;12.0" ;;
    13.0)
        TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;9.0;10.0;$([[ "$ARCH" == "aarch64" ]] && echo "11.0;" || echo "")12.0+PTX"
        ;;
    *) echo "unknown cuda version $CUDA_VERSION"; exit 1 ;;
esac
'''


def publish(world: World, tag: str, files: dict[str, str]) -> None:
    for path, text in files.items():
        world.paths[f"/pytorch/{tag}/{path}"] = (200, text.encode(), {"Content-Type": "text/plain"})


def template(url: str) -> str:
    return f"{url}/pytorch/{{ref}}/{{path}}"


# ---------------------------------------------------------------------------- reading


def test_the_matrix_is_read_as_literals_without_running_it():
    values = buildmatrix.literals(MATRIX)
    assert values["CUDA_ARCHES"] == ["12.6", "12.9", "13.0", "13.2"] and values["CUDA_STABLE"] == "13.0"
    assert values["ROCM_ARCHES"] == ["7.1", "7.2"] and "WHEEL_CONTAINER_IMAGES" not in values
    assert buildmatrix.literals("def broken(:\n") == {}


def test_the_captured_matrix_is_read_as_literals_without_running_it():
    values = buildmatrix.literals(CAPTURED_MATRIX)
    assert values["CUDA_ARCHES"] == ["11.8", "12.6", "12.8"] and values["CUDA_STABLE"] == "12.6"
    assert values["CUDA_ARCHES_FULL_VERSION"]["12.8"] == "12.8.0" and values["ROCM_ARCHES"] == ["6.2.4", "6.3"]
    assert values["CUDA_AARCH64_ARCHES"] == ["12.8-aarch64"]


def test_the_arch_table_counts_ptx_capabilities_as_sass():
    table = buildmatrix.arch_table(CAPTURED_TABLE)  # 12.0 is in _PTX_ARCHES there: SASS and PTX
    assert table["12.6"]["x86_64"] == ["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]
    assert table["13.0"]["aarch64"] == ["8.0", "9.0", "10.0", "11.0", "12.0"]
    assert table["13.2"]["x86_64"] == ["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert "12.9" not in table  # this commit's table has no 12.9: a build matrix listing 12.9 with it gets no row
    assert buildmatrix.arch_table("TORCH_CUDA_ARCH_LIST_TABLE = compute()\n") == {}


def test_the_case_block_is_evaluated_per_cuda_version_and_machine():
    assert buildmatrix.arch_script(SCRIPT, "12.9") == ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert buildmatrix.arch_script(SCRIPT, "12.6") == ["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]
    assert buildmatrix.arch_script(SCRIPT, "13.0") is None  # only `*)` matches: the script refuses it
    assert buildmatrix.arch_script(SCRIPT_BY_ARCH, "12.8") == ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert buildmatrix.arch_script(SCRIPT_BY_ARCH, "12.6")[:3] == ["5.0", "6.0", "7.0"]
    assert buildmatrix.arch_script(SCRIPT_BY_ARCH, "13.0") == ["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert "11.0" in buildmatrix.arch_script(SCRIPT_BY_ARCH, "13.0", "aarch64")


def test_if_blocks_on_arch_nest_with_other_tests():
    script = ('case ${CUDA_VERSION} in\n    12.9)\n        if [[ "$ARCH" == "aarch64" ]]; then\n'
              '            if [[ "$PACKAGE_TYPE" == "libtorch" ]]; then\n                export X=1\n            fi\n'
              '            TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0;12.0"\n        else\n'
              '            TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;9.0;10.0;12.0+PTX"\n        fi\n        ;;\nesac\n')
    assert buildmatrix.arch_script(script, "12.9", "aarch64") == ["8.0", "9.0", "10.0", "12.0"]
    assert buildmatrix.arch_script(script, "12.9") == ["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]


@pytest.mark.parametrize("line", ['TORCH_CUDA_ARCH_LIST="$(python3 list.py)"', "TORCH_CUDA_ARCH_LIST=$LIST",
                                  'TORCH_CUDA_ARCH_LIST="`cat list`"',
                                  '[[ "$ARCH" == "aarch64" ]] && TORCH_CUDA_ARCH_LIST="8.0;9.0"'])
def test_a_construct_not_followed_gives_no_list_rather_than_a_guess(line):
    script = f"case ${{CUDA_VERSION}} in\n    12.9)\n        {line}\n        ;;\nesac\n"
    assert buildmatrix.arch_script(script, "12.9") is None


def test_the_source_url_is_overridable_and_must_name_ref_and_path(monkeypatch):
    monkeypatch.delenv(buildmatrix.SOURCE_ENV, raising=False)
    assert buildmatrix.source_url() == "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/{path}"
    monkeypatch.setenv(buildmatrix.SOURCE_ENV, "http://127.0.0.1:9/{ref}/{path}")
    assert buildmatrix.source_url() == "http://127.0.0.1:9/{ref}/{path}"
    assert buildmatrix.source_url("http://mirror/{ref}/{path}") == "http://mirror/{ref}/{path}"
    with pytest.raises(Exception, match="must contain {ref} and {path}") as e:
        buildmatrix.source_url("http://mirror/pytorch")
    assert e.value.exit_code == 2


def test_the_captured_matrix_and_script_give_builds_with_the_lists_they_state():
    """The captured generate_binary_build_matrix.py (11.8, 12.6, 12.8; 12.8-aarch64) with the captured build_cuda.sh
    case block, served as one tag: 12.6 and 12.8 get the script's lists, 11.8 none (no branch: its `*)` exits), and
    12.8's aarch64 list stays unread (that script never tests $ARCH)."""
    world = World()
    publish(world, "v0.0.0", {buildmatrix.MATRIX_PATH: CAPTURED_MATRIX, buildmatrix.ARCH_SCRIPT_PATH: CAPTURED_SCRIPT})
    with serve(world) as url:
        found = buildmatrix.read(Client(url), template(url), "0.0.0")
    by = {b.variant: b for b in found.cuda}
    assert list(by) == ["cu118", "cu126", "cu128"] and found.stable == "12.6" and found.rocm == ["6.2.4", "6.3"]
    assert by["cu118"].sass is None and by["cu126"].sass == ["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]
    assert by["cu128"].sass == ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"] and by["cu128"].full == "12.8.0"
    assert by["cu128"].aarch64 and by["cu128"].sass_aarch64 is None and not by["cu126"].aarch64


def test_the_table_is_read_first_and_the_script_where_the_tag_has_no_table():
    world = World()
    publish(world, "v2.13.0", {buildmatrix.MATRIX_PATH: MATRIX, buildmatrix.ARCH_TABLE_PATH: TABLE})
    publish(world, "v2.12.1", {buildmatrix.MATRIX_PATH: MATRIX.replace('"13.2"]', '"13.2", "12.8"]'),
                               buildmatrix.ARCH_SCRIPT_PATH: SCRIPT})
    with serve(world) as url:
        client = Client(url)
        new = buildmatrix.read(client, template(url), "2.13.0")
        old = buildmatrix.read(client, template(url), "2.12.1")
        assert buildmatrix.read(client, template(url), "2.99.0") is None
    cu129 = next(b for b in new.cuda if b.variant == "cu129")
    assert (cu129.full, cu129.aarch64, cu129.sass_aarch64) == ("12.9.1", True, ["8.0", "9.0", "10.0", "12.0"])
    assert cu129.arch_source == ".ci/manywheel/build_env_setup.py@v2.13.0 TORCH_CUDA_ARCH_LIST_TABLE"
    assert new.source == "pytorch/pytorch .github/scripts/generate_binary_build_matrix.py@v2.13.0"
    assert new.rocm == ["7.1", "7.2"] and new.stable == "13.0"
    by_variant = {b.variant: b for b in old.cuda}
    assert by_variant["cu129"].sass == ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert by_variant["cu129"].sass_aarch64 is None  # the script never tests $ARCH: aarch64 lists unread
    assert by_variant["cu130"].sass is None  # the script has no 13.0 branch


def test_a_matrix_without_cuda_arches_is_one_error_line():
    world = World()
    publish(world, "v2.13.0", {buildmatrix.MATRIX_PATH: "ROCM_ARCHES = ['7.1']\n"})
    with serve(world) as url, pytest.raises(UpstreamError, match="no CUDA_ARCHES list in it"):
        buildmatrix.read(Client(url), template(url), "2.13.0")


@pytest.mark.parametrize("text, expected", [
    ("CUDA_ARCHES = " + "1+" * 200_000 + "1\n", "no CUDA_ARCHES list in it"),  # RecursionError in ast.parse before
    ("CUDA_ARCHES = ['12.9', {'a': 1}]\n", "CUDA_ARCHES holds \"{'a': 1}\", not a list of versions"),
    ("CUDA_ARCHES = ['12.9']\nCUDA_AARCH64_ARCHES = 5\n", "CUDA_AARCH64_ARCHES holds '5', not a list"),
    ("CUDA_ARCHES = ['12.9']\nROCM_ARCHES = [None]\n", "ROCM_ARCHES holds 'None', not a list"),
    ("CUDA_ARCHES = ['12.9']\nCUDA_STABLE = 12.9\n", "CUDA_STABLE is not a string"),
], ids=["deep", "a dict in CUDA_ARCHES", "an int for a list", "None in ROCM_ARCHES", "a float for CUDA_STABLE"])
def test_a_hostile_build_matrix_file_is_one_error_line(text, expected):
    """The file comes from a server: nesting too deep for the parser and values of the wrong type are one line
    naming the URL (tracebacks before)."""
    world = World()
    publish(world, "v2.13.0", {buildmatrix.MATRIX_PATH: text})
    with serve(world) as url, pytest.raises(UpstreamError, match=re.escape(expected)) as raised:
        buildmatrix.read(Client(url), template(url), "2.13.0")
    assert str(raised.value).startswith(f"{url}/pytorch/v2.13.0/{buildmatrix.MATRIX_PATH}: ")


def test_an_arch_list_entry_that_is_no_capability_gives_no_list_rather_than_a_traceback():
    table = "TORCH_CUDA_ARCH_LIST_TABLE = {'12.9': {'x86_64': {'sm_90'}, 'aarch64': [90, '10.0+PTX']}}\n"
    assert buildmatrix.arch_table(table) == {"12.9": {"aarch64": ["9.0", "10.0"]}}
    script = 'case ${CUDA_VERSION} in\n  12.9) TORCH_CUDA_ARCH_LIST="8.0;sm_90" ;;\nesac\n'
    assert buildmatrix.arch_script(script, "12.9") is None


# ---------------------------------------------------------------------------- the rows it writes


def without_cu129(tmp_path: Path) -> Path:
    """A copy of the matrices without the cu129 builds of 2.11.0-2.13.0 (entered by hand from pytorch's issue threads,
    issue 43): the state the update met, for the tests of the rows it writes."""
    import tomlkit

    copy = tmp_path / "matrices"
    shutil.copytree(REPO_MATRICES, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    doc = tomlkit.parse((copy / "torch.toml").read_text())
    for release in doc["release"]:
        if release["version"] in ("2.11.0", "2.12.1", "2.13.0"):
            keep = [b for b in release["build"] if b["variant"] != "cu129"]
            release["build"].clear()
            release["build"].extend(keep)
    (copy / "torch.toml").write_text(tomlkit.dumps(doc))
    return copy


def builds_report(world: World, directory: Path = REPO_MATRICES) -> update.Report:
    data = update.read(directory)
    report = update.Report([], [], [], [])
    with serve(world) as url:
        update._torch_builds(data, Client(url), template(url), "2026-12-07", report, lambda what: None)
    return report


def test_a_cuda_build_the_matrix_lists_becomes_a_row_naming_file_tag_and_date(tmp_path):
    world = World()
    publish(world, "v2.13.0", {buildmatrix.MATRIX_PATH: MATRIX, buildmatrix.ARCH_TABLE_PATH: TABLE})
    report = builds_report(world, without_cu129(tmp_path))
    added = [a for a in report.additions if a.row == "torch 2.13.0 cu129"]
    assert len(added) == 1 and added[0].table == "release.build"
    fields = added[0].fields
    assert (fields["variant"], fields["cuda"], fields["status"]) == ("cu129", "12.9", "experimental")
    assert fields["sass"] == ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert fields["sass_aarch64"] == ["8.0", "9.0", "10.0", "12.0"]
    assert "generate_binary_build_matrix.py@v2.13.0" in fields["source"] and "on 2026-12-07" in fields["source"]
    assert "build_env_setup.py@v2.13.0 TORCH_CUDA_ARCH_LIST_TABLE" in fields["source"]
    # what the matrix does not list is reported, never removed; tags not served are reported, not guessed
    reviews = {(r.file, r.row): r.why for r in report.reviews}
    assert ("rocm.toml", "torch 2.13.0 rocm7.1") in reviews  # rocm.toml records 2.13.0's rocm7.2 only
    assert ("rocm.toml", "torch 2.13.0 rocm7.2") not in reviews
    assert "not readable at v2.12.1" in reviews[("torch.toml", "torch 2.12.1")]
    assert not any(a.row.startswith("torch 2.12.1") for a in report.additions)


def test_a_build_without_a_readable_arch_list_is_reported_and_not_written(tmp_path):
    world = World()
    publish(world, "v2.13.0", {buildmatrix.MATRIX_PATH: MATRIX, buildmatrix.ARCH_SCRIPT_PATH: SCRIPT})
    report = builds_report(world, without_cu129(tmp_path))
    assert not any(a.row == "torch 2.13.0 cu129" for a in report.additions)  # no aarch64 list in the script
    assert "no arch list for it is readable at v2.13.0" in {r.row: r.why for r in report.reviews}[
        "torch 2.13.0 cu129"]


def resolve_json(copy: Path, *args: str) -> dict:
    out = run_envtool("resolve", *args, "--json", ENVTOOL_MATRIX_DIR=str(copy))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["torch"]


ASKED = {  # issue 43's three cases: refused while torch.toml had no cu129 build after 2.8.0
    ("--gpu", "a100", "--torch", "2.13", "--cuda", "12.9"): ("2.13.0", "cu129"),
    ("--gpu", "a10g", "--torch", "2.12", "--cuda", "12.9"): ("2.12.1", "cu129"),
    # driver 570 < 12.9's 575.51.03: runs through CUDA 12 minor-version compatibility (cuda.toml), and no newer
    # torch has a CUDA 12 build for sm_120 here (2.14.1's cu126 has no 12.0; 2.15.0 is CUDA 13 only)
    ("--gpu", "rtxpro6000", "--driver", "570.172.08"): ("2.13.0", "cu129"),
}


def test_the_recorded_cu129_builds_plan_issue_43s_cases_and_name_their_sources():
    """The matrix as shipped: the three requests of issue 43 take the cu129 builds of 2.12.1/2.13.0, and each cu129
    row of 2.11-2.13 names where it was read and that its arch list was not read at the tag."""
    from resolver import hardware
    from resolver.solve import Request, solve

    m = matrix_module.load()
    for ask, (version, variant) in ASKED.items():
        args = dict(zip(ask[::2], ask[1::2]))
        p = solve(Request(gpu=hardware.lookup(args["--gpu"], m), driver=args.get("--driver"), python="3.11",
                          target=args["--gpu"], torch=args.get("--torch"), cuda=args.get("--cuda")), m)
        assert (p.torch.version, p.torch.variant, p.torch.cuda) == (version, variant, "12.9"), ask
    for release in m.torch:
        cu129 = [b for b in release.build if b.variant == "cu129"]
        if release.version in ("2.11.0", "2.12.1", "2.13.0"):
            (b,) = cu129
            assert "read through the issues corpus 2026-12-07" in b.source and "not readable here" in b.source
            assert b.sass_aarch64 is None and "7.0" not in b.sass  # PR #172598 dropped Volta from 12.9
        elif Version(release.version) >= Version("2.14"):
            assert not cu129  # none for 2.14+ (pytorch/pytorch#187834: no cu129 binaries with 2.14)


@pytest.mark.slow
def test_written_cu129_builds_are_planned_by_the_same_rules(tmp_path):
    """The rows update writes from the matrix are valid matrices, and plans take them without code changes: the
    requests refused before the rows plan after them (on a copy: the real tags were not readable here)."""
    copy = without_cu129(tmp_path)
    world = World()
    for tag in ("v2.12.1", "v2.13.0"):
        publish(world, tag, {buildmatrix.MATRIX_PATH: MATRIX, buildmatrix.ARCH_TABLE_PATH: TABLE})
    before = {ask: run_envtool("resolve", *ask, "--json", ENVTOOL_MATRIX_DIR=str(copy)) for ask in ASKED}
    report = builds_report(world, copy)
    report = update.Report([], [a for a in report.additions if a.file == "torch.toml"], [], [])
    assert sorted(a.row for a in report.additions) == ["torch 2.12.1 cu129", "torch 2.13.0 cu129"]
    update.write(copy, update.apply(copy, report, date="2026-12-07"))
    for ask, (version, variant) in ASKED.items():
        old = before[ask]
        if "--cuda" in ask:
            assert old.returncode == 2 and len(old.stderr.strip().splitlines()) == 1, old.stderr
        else:
            assert json.loads(old.stdout)["torch"]["version"] == "2.11.0"  # held at 2.11.0+cu128
        torch = resolve_json(copy, *ask)
        assert (torch["version"], torch["variant"], torch["cuda"]) == (version, variant, "12.9"), ask


@pytest.mark.slow
def test_a_bad_or_unreachable_source_is_one_line_and_writes_nothing(tmp_path):
    copy = tmp_path / "matrices"
    shutil.copytree(REPO_MATRICES, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with serve(World()) as url:
        base = ("matrix", "update", "--pypi-url", url, "--torch-index-url", f"{url}/whl/{{variant}}",
                "--matrix-dir", str(copy))
        bad = run_envtool(*base, "--pytorch-source-url", f"{url}/pytorch", XDG_CACHE_HOME=str(tmp_path))
        down = run_envtool(*base, "--pytorch-source-url", f"{closed}/{{ref}}/{{path}}",
                           XDG_CACHE_HOME=str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"envtool: error: the PyTorch source URL must contain {{ref}} and {{path}}: {url}/pytorch"]
    assert down.returncode == 1 and len(down.stderr.strip().splitlines()) == 1, down.stderr
    assert "cannot reach" in down.stderr and "Connection refused" in down.stderr
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
