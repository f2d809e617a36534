"""`envtool matrix update` and `envtool matrix verify`, run as a user runs them, against a server on 127.0.0.1
that answers with captured real PyPI metadata (tests/resolver/data/upstream, see capture.py there).

The tests work on a copy of the repository's matrices, so corrections to the data rows do not break them:
each starts by bringing its copy up to date with the captured upstream, then changes what it tests.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest
import tomlkit

from resolver import matrix as matrix_module
from resolver.errors import MatrixError
from tests.support.pypi import make_wheel
from tests.support.upstream import World, serve

from .conftest import run_envtool

REPO_MATRICES = Path(matrix_module.__file__).resolve().parents[1] / "matrices"
DATA_UPSTREAM = Path(__file__).parent / "data" / "upstream"


def envtool(*args, **env):
    env.setdefault("XDG_CACHE_HOME", env.pop("cache"))
    return run_envtool(*args, **env)


FA3_FILES = {variant: [f"flash_attn_3-3.0.0-cp39-abi3-{tag}.whl"
                       for tag in ("manylinux_2_28_x86_64", "manylinux_2_34_aarch64")]
             for variant in ("cu126", "cu128", "cu129", "cu130")}


def pytorch_index_page(project: str, files: dict[str, list[str]]) -> bytes:
    """A download.pytorch.org project page, as pytorch/test-infra s3_management/manage_v2.py
    to_simple_package_html writes it: links to /whl/<folder>/<file> with #sha256= and PEP 658 attributes (the
    root page whl/<project>/ links every folder's files; a folder's page, its own)."""
    links = "".join(f'    <a href="/whl/{folder}/{f.replace("+", "%2B")}#sha256={"0" * 64}" data-dist-info-metadata='
                    f'"sha256={"1" * 64}" data-core-metadata="sha256={"1" * 64}">{f}</a><br/>\n'
                    for folder, names in files.items() for f in names)
    return (f"<!DOCTYPE html>\n<html>\n  <body>\n    <h1>Links for {project}</h1>\n{links}  </body>\n</html>\n"
            f"<!--TIMESTAMP 1771000000-->").encode()


def publish_fa3(world: World, files: dict[str, list[str]] = FA3_FILES) -> None:
    world.paths["/whl/flash-attn-3/"] = (200, pytorch_index_page("flash-attn-3", files), {"Content-Type": "text/html"})
    for folder, names in files.items():
        world.paths[f"/whl/{folder}/flash-attn-3/"] = (200, pytorch_index_page("flash-attn-3", {folder: names}),
                                                       {"Content-Type": "text/html"})


@pytest.fixture
def world():
    """The captured upstream, and the PyTorch index's flash-attn-3 pages as the matrix records them."""
    w = World()
    publish_fa3(w)
    return w


@pytest.fixture
def copy(tmp_path):
    """A copy of the repository's matrices whose torch rows start at 2.6 (older rows carry Python-dependent
    pins the schema cannot state yet; they are reported for review, which these tests are not about)."""
    target = tmp_path / "matrices"
    target.mkdir()
    for name in matrix_module.FILES:
        shutil.copy2(REPO_MATRICES / f"{name}.toml", target / f"{name}.toml")
    doc = tomlkit.parse((target / "torch.toml").read_text())
    releases = doc["release"]
    for i in reversed(range(len(releases))):
        if tuple(int(x) for x in releases[i]["version"].split(".")[:2]) < (2, 6):
            del releases[i]
    (target / "torch.toml").write_text(tomlkit.dumps(doc))
    return target


def trim_flash_attn(world: World, directory: Path) -> None:
    """Serve flash-attn and xformers with the releases the matrix records and no others: their new releases
    need a human (wheel matrix, arch list), so with them upstream never reads as current."""
    from packaging.version import Version

    m = matrix_module._load(directory)
    world.drop_releases("flash-attn", str(max(Version(r.version) for r in m.flash_attn_releases if r.impl == "fa2")))
    recorded = {Version(x.version) for x in m.xformers}
    releases = world.pypi["xformers"]["releases"]
    world.pypi["xformers"]["releases"] = {v: f for v, f in releases.items()
                                          if Version(v) in recorded or Version(v).is_prerelease}


def update(url, directory, *args, tmp):
    """`envtool matrix update` on PyPI and the PyTorch index only: torch's release build matrices (read at each
    release tag) are tested in test_build_matrix.py, where the stand-in serves them."""
    return envtool("matrix", "update", "--pypi-url", url, "--torch-index-url", f"{url}/whl/{{variant}}",
                   "--no-builds", "--matrix-dir", str(directory), *args, cache=str(tmp / "cache"))


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def make_current(url, directory, tmp):
    out = update(url, directory, tmp=tmp)
    assert out.returncode == 0, out.stderr
    return out


# ---------------------------------------------------------------------------- update


@pytest.mark.slow
def test_check_is_clean_when_the_matrices_match_upstream(world, copy, tmp_path):
    trim_flash_attn(world, copy)
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        before = snapshot(copy)
        out = update(url, copy, "--check", tmp=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "are current with" in out.stdout and "---" not in out.stdout
        data = json.loads(update(url, copy, "--check", "--json", tmp=tmp_path).stdout)
    assert data["stale"] is False and data["written"] is False
    assert data["changes"] == data["added"] == data["needs_review"] == [] and data["diff"] == ""
    assert snapshot(copy) == before
    # what was read: the JSON API, the PEP 691 page and PEP 658 files, never a torch or xformers wheel; the
    # training stack's wheels (no PEP 658 here; transformers' runtime version table) only by range requests
    paths = [p for _, p, _ in world.requests]
    assert "/pypi/torch/json" in paths and "/simple/torch/" in paths
    assert any(p.endswith(".whl.metadata") for p in paths)
    assert not any(p.endswith(".whl") and p.rsplit("/", 1)[-1].startswith(("torch-", "xformers-")) for p in paths)
    assert all(r for _, p, r in world.requests if p.endswith(".whl"))


def regress(copy: Path, world: World) -> tuple[str, str, str, str]:
    """Make the copy what it was before upstream's newest torch patch and transformers release."""
    torch_doc = tomlkit.parse((copy / "torch.toml").read_text())
    torch_releases = world.pypi["torch"]["releases"]
    row = next(r for r in reversed(torch_doc["release"])
               if re.sub(r"\.(\d+)$", lambda m: f".{int(m.group(1)) - 1}", r["version"]) in torch_releases
               and not r["version"].endswith(".0"))
    newest_torch = str(row["version"])
    older_torch = re.sub(r"\.(\d+)$", lambda m: f".{int(m.group(1)) - 1}", newest_torch)
    text = (copy / "torch.toml").read_text()
    (copy / "torch.toml").write_text(text.replace(f'version = "{newest_torch}"', f'version = "{older_torch}"'))
    packages = (copy / "packages.toml").read_text()
    newest_tf = tomlkit.parse(packages)["stack"][0]["packages"]["transformers"]
    from packaging.version import Version

    older_tf = str(max((Version(v) for v in world.pypi["transformers"]["releases"]
                        if Version(v) < Version(newest_tf) and not Version(v).is_prerelease)))
    (copy / "packages.toml").write_text(packages.replace(f'transformers = "{newest_tf}"',
                                                         f'transformers = "{older_tf}"', 1))
    matrix_module._load(copy)
    return older_torch, newest_torch, older_tf, str(newest_tf)


@pytest.mark.slow
def test_check_names_newer_torch_and_transformers_releases_and_writes_nothing(world, copy, tmp_path):
    trim_flash_attn(world, copy)
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        old_torch, new_torch, old_tf, new_tf = regress(copy, world)
        before = snapshot(copy)
        out = update(url, copy, "--check", tmp=tmp_path)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"version {old_torch} -> {new_torch}" in out.stdout
        assert f"packages.transformers {old_tf} -> {new_tf}" in out.stdout
        assert f'+version = "{new_torch}"' in out.stdout and "matrices are stale" in out.stdout
        data = json.loads(update(url, copy, "--check", "--json", tmp=tmp_path).stdout)
    assert snapshot(copy) == before
    assert data["stale"] is True and data["written"] is False
    found = {(c["file"], c["field"], c["old"], c["new"]) for c in data["changes"]}
    assert ("torch.toml", "version", old_torch, new_torch) in found
    assert ("packages.toml", "packages.transformers", old_tf, new_tf) in found
    # meta.toml's version is today's date already (make_current wrote it)
    assert {"torch.toml", "packages.toml"} <= set(data["files"]) <= {"torch.toml", "packages.toml", "meta.toml"}
    assert set(data) == {"stale", "written", "pypi_url", "matrix_dir", "changes", "added", "needs_review",
                         "held_back", "files", "diff"}


@pytest.mark.slow
def test_update_writes_valid_files_keeping_comments(world, copy, tmp_path):
    trim_flash_attn(world, copy)
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        old_torch, new_torch, old_tf, new_tf = regress(copy, world)
        before = {n: (copy / n).read_text() for n in ("torch.toml", "packages.toml")}
        out = update(url, copy, tmp=tmp_path)
        assert out.returncode == 0, out.stderr
        assert re.search(r"^wrote (meta.toml, )?packages.toml, torch.toml in ", out.stdout, flags=re.M), out.stdout
        again = update(url, copy, "--check", tmp=tmp_path)
    assert again.returncode == 0, again.stdout
    m = matrix_module._load(copy)  # the schema check passes
    assert new_torch in [r.version for r in m.torch] and m.stacks[0].packages["transformers"] == new_tf
    for name, old in before.items():
        new = (copy / name).read_text()
        assert [line for line in old.splitlines() if line.startswith("#")] == \
            [line for line in new.splitlines() if line.startswith("#")]
        changed = [line for line in new.splitlines() if line not in old.splitlines()]
        assert all(re.match(r'(version|packages|source) = ', line) for line in changed), changed
    row = next(r for r in m.torch if r.version == new_torch)
    assert "version updated by envtool matrix update from PyPI metadata on" in row.source
    assert re.fullmatch(r"\d{4}\.\d{2}\.\d{2}", m.version)
    assert not [p for p in copy.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.slow
def test_a_new_torch_minor_becomes_a_row_without_builds(world, copy, tmp_path):
    trim_flash_attn(world, copy)
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        doc = tomlkit.parse((copy / "torch.toml").read_text())
        newest = doc["release"][-1]
        version, python, triton = str(newest["version"]), str(newest["python"]), newest.get("triton")
        del doc["release"][-1]
        (copy / "torch.toml").write_text(tomlkit.dumps(doc))
        old = (copy / "torch.toml").read_text()
        out = update(url, copy, tmp=tmp_path)
        assert out.returncode == 0, out.stderr
        assert f"torch.toml: new row torch {version}" in out.stdout
        check = update(url, copy, "--check", "--json", tmp=tmp_path)
    new = (copy / "torch.toml").read_text()
    assert new.startswith(old.rstrip("\n") + "\n")  # appended; everything before it kept byte for byte
    row = next(r for r in matrix_module._load(copy).torch if r.version == version)
    assert row.python == python and row.triton == triton and row.build == [] and row.cxx11abi is True
    assert "added by envtool matrix update from PyPI metadata on" in row.source
    assert "builds not yet checked" in row.source
    # still stale: a human must add its CUDA builds
    assert check.returncode == 1
    review = json.loads(check.stdout)["needs_review"]
    assert [r["row"] for r in review] == [f"torch {version}"] and "[[release.build]]" in review[0]["why"]


@pytest.mark.slow
def test_new_xformers_and_flash_attn_releases_need_review_and_are_not_written(world, copy, tmp_path):
    (copy / "xformers.toml").write_text('[[release]]\nversion = "0.0.29"\ntorch = "==2.5.1"\nmin_cc = "7.5"\n'
                                        'source = "test"\n')
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        before = snapshot(copy)
        out = update(url, copy, "--check", "--json", tmp=tmp_path)
    assert out.returncode == 1
    review = {(r["file"], r["row"]): r["why"] for r in json.loads(out.stdout)["needs_review"]}
    assert "0.0.29.post1 pins the same torch==2.5.1" in review["xformers.toml", "xformers 0.0.29"]
    assert "Requires-Dist torch==2.6.0" in review["xformers.toml", "xformers 0.0.29.post2"]
    assert "Requires-Dist torch>=2.10" in review["xformers.toml", "xformers 0.0.35"]
    assert not [r for r in review if r[1].startswith("xformers 0.0.34.dev")]  # pre-releases are not releases
    from packaging.version import Version

    recorded = max(Version(r.version) for r in matrix_module._load(copy).flash_attn_releases if r.impl == "fa2")
    reviewed = {Version(v) for v in matrix_module._load(copy).flash_attn_reviewed}  # looked at, not recorded
    upstream = {f"flash-attn {v}" for v in world.pypi["flash-attn"]["releases"]
                if Version(v) > recorded and not Version(v).is_prerelease and Version(v) not in reviewed}
    assert {r[1] for r in review if r[0] == "flash_attn.toml"} == upstream
    assert snapshot(copy) == before


TORCH_251 = '''index_url = "https://download.pytorch.org/whl/{variant}"

[[release]]
version = "2.5.1"
python = ">=3.9,<3.14"
triton = "3.1.0"
cxx11abi = false
source = "test"

[[release.build]]
variant = "cu124"
cuda = "12.4"
status = "stable"
sass = ["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]
source = "test"
'''


@pytest.mark.slow
def test_a_triton_pin_for_some_pythons_only_is_written_or_reported(world, copy, tmp_path):
    """torch 2.5.1's wheel requires triton only where python_version < "3.13" (its real METADATA): a schema with
    `triton_python` gets the marker written; one without reports that its `triton` cannot say so."""
    trim_flash_attn(world, copy)
    has_field = "triton_python" in matrix_module.TorchRelease._fields
    # a wrong marker to be corrected where the schema records it
    (copy / "torch.toml").write_text(TORCH_251.replace('cxx11abi = false\n', 'cxx11abi = false\ntriton_python = "<3.12"\n'
                                                       'triton_platforms = ["x86_64"]\n') if has_field else TORCH_251)
    matrix_module._load(copy)
    with serve(world) as url:
        out = update(url, copy, "--check", "--json", tmp=tmp_path)
        data = json.loads(out.stdout)
        if has_field:
            assert [(c["field"], c["old"], c["new"]) for c in data["changes"] if c["row"] == "torch 2.5.1"] == \
                [("triton_python", "<3.12", "<3.13")]
            assert update(url, copy, tmp=tmp_path).returncode == 0
            assert matrix_module._load(copy).torch[0].triton_python == "<3.13"
        else:
            (why,) = [r["why"] for r in data["needs_review"] if r["row"] == "torch 2.5.1"]
            assert "only for Python <3.13" in why and "(not 3.13)" in why
            assert not [c for c in data["changes"] if c["row"] == "torch 2.5.1"]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["500 on a metadata page", "404 on a project", "unreachable"])
def test_upstream_failure_is_one_line_and_touches_nothing(world, copy, tmp_path, failure):
    trim_flash_attn(world, copy)
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        regress(copy, world)
        before = snapshot(copy)
        if failure == "500 on a metadata page":
            world.fail["/simple/xformers/"] = 500
            expect = f"{url}/simple/xformers/: HTTP 500"
        elif failure == "404 on a project":
            world.fail["/pypi/transformers/json"] = 404
            expect = f"{url}/pypi/transformers/json: HTTP 404"
        else:
            with socket.socket() as s:  # a port nothing listens on
                s.bind(("127.0.0.1", 0))
                url = f"http://127.0.0.1:{s.getsockname()[1]}"
            expect = f"cannot reach {url}/pypi/torch/json"
        out = update(url, copy, tmp=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("envtool: error: ") and expect in lines[0], out.stderr
    assert out.stdout == ""
    assert snapshot(copy) == before


def test_regenerated_files_failing_the_schema_replace_nothing(copy):
    from resolver.update import write

    before = snapshot(copy)
    torch = (copy / "torch.toml").read_text()
    meta = (copy / "meta.toml").read_text()
    texts = {"meta.toml": (meta, meta.replace('version = "', 'version = "9')),
             "torch.toml": (torch, torch.replace('python = ">=', 'python = "~=', 1))}
    with pytest.raises(MatrixError, match=r"fail the schema check, nothing written: .*torch.toml"):
        write(copy, texts)
    assert snapshot(copy) == before


def test_metadata_is_read_from_the_wheel_with_range_requests_when_the_index_has_no_pep658(tmp_path):
    """The fallback for indexes without PEP 658 files: the zip's central directory, then the one member."""
    import os

    from resolver.upstream import Client

    wheel = make_wheel(tmp_path, "bigpkg", "1.0", tag="cp311-cp311-manylinux_2_28_x86_64",
                       requires=["triton==3.1.0; python_version < \"3.13\""],
                       files={"bigpkg/blob.bin": os.urandom(3 * 1024 * 1024).hex()})
    world = World()
    world.paths["/files/" + wheel.name] = (200, wheel.read_bytes(), {"Content-Type": "application/zip",
                                                                     "Accept-Ranges": "bytes"})
    with serve(world) as url:
        text = Client(url).metadata_from_wheel(f"{url}/files/{wheel.name}")
    assert "Name: bigpkg" in text and 'Requires-Dist: triton==3.1.0; python_version < "3.13"' in text
    ranges = [r for _, p, r in world.requests if p.endswith(".whl")]
    assert ranges and all(ranges)  # only range requests, never the whole file
    fetched = sum(int(b) - int(a or 0) for a, b in (re.fullmatch(r"bytes=(\d*)-(\d+)", r).groups() for r in ranges))
    assert fetched < wheel.stat().st_size / 2


def test_an_index_without_pep691_is_read_through_the_wheels(world, tmp_path):
    """A mirror with the JSON API but no PEP 691 pages: METADATA comes from the wheel, by range requests."""
    from resolver.upstream import Client, linux_wheel, requirement

    captured = (DATA_UPSTREAM / "metadata" / "torch-2.5.1-cp39-cp39-manylinux1_x86_64.whl.metadata").read_text()
    (triton,) = [line.removeprefix("Requires-Dist: ") for line in captured.splitlines()
                 if line.startswith("Requires-Dist: triton")]
    # a stand-in wheel with the real wheel's name and triton requirement
    wheel = make_wheel(tmp_path, "torch", "2.5.1", tag="cp39-cp39-manylinux1_x86_64", requires=[triton])
    del world.simple["torch"]
    doc = world.pypi["torch"]
    doc["releases"] = {"2.5.1": [dict(f, url="/files/" + wheel.name) for f in doc["releases"]["2.5.1"]
                                 if f["filename"] == wheel.name]}
    world.paths["/files/" + wheel.name] = (200, wheel.read_bytes(), {"Content-Type": "application/zip",
                                                                     "Accept-Ranges": "bytes"})
    with serve(world) as url:
        client = Client(url)
        release = client.project("torch").final()[0]
        pin = requirement(client.metadata("torch", linux_wheel(release)), "triton")
    assert pin.version == "3.1.0" and 'python_version < "3.13"' in pin.marker
    assert ("GET", "/simple/torch/", None) in world.requests
    assert all(r for _, p, r in world.requests if p.startswith("/files/"))


def test_resolve_does_not_import_the_matrix_commands_libraries():
    import subprocess
    import sys

    script = ("import sys, runpy; sys.argv = ['envtool', 'resolve', '--gpu', 't4', '--json']\n"
              "try:\n    runpy.run_module('resolver', run_name='__main__')\nexcept SystemExit:\n    pass\n"
              "print(sorted({'requests', 'tomlkit', 'rich', 'urllib3'} & set(sys.modules)), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


# ---------------------------------------------------------------------------- verify

SYNTHETIC_TORCH = '''index_url = "https://download.pytorch.org/whl/{variant}"

[[release]]
version = "2.15.0"
python = ">=3.11,<3.13"
triton = "3.9.0"
cxx11abi = true
source = "test"

[[release.build]]
variant = "cu130"
cuda = "13.0"
status = "stable"
sass = ["7.5", "8.0", "9.0"]
source = "test"

[[release.build]]
variant = "cu132"
cuda = "13.2"
status = "stable"
sass = ["7.5", "8.0", "9.0"]
source = "test"
'''

SYNTHETIC_FLASH_ATTN = '''wheel_url = "https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/{filename}"

[[impl]]
name = "fa2"
attention = "flash_attention_2"
package = "flash-attn"
source = "test"

[[release]]
version = "2.9.0"
impl = "fa2"
filename = "flash_attn-{version}+cu{cuda}torch{torch}cxx11abi{abi}-cp{py}-cp{py}-linux_{platform}.whl"
torch = ["2.15"]
cuda = { "13" = "13" }
python = ["3.11", "3.12"]
cxx11abi = [true, false]
platforms = ["x86_64"]
source = "test"
'''

SYNTHETIC_XFORMERS = '''[[release]]
version = "0.0.35"
torch = ">=2.10"
min_cc = "7.5"
source = "test"
'''

# What a plan can name with that matrix, written out by hand.
FLASH_ATTN_FILES = ["flash_attn-2.9.0+cu13torch2.15cxx11abiTRUE-cp311-cp311-linux_x86_64.whl",
                    "flash_attn-2.9.0+cu13torch2.15cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"]
TORCH_FILES = {variant: [f"torch-2.15.0+{variant}-cp{py}-cp{py}-manylinux_2_28_{machine}.whl"
                         for py in ("311", "312") for machine in ("x86_64", "aarch64")]
               for variant in ("cpu", "cu130", "cu132")}


@pytest.fixture
def synthetic(copy):
    torch = SYNTHETIC_TORCH
    if "sass_aarch64" in matrix_module.TorchBuild._fields:  # a schema that records aarch64 builds apart
        torch = torch.replace('sass = ["7.5", "8.0", "9.0"]\n', 'sass = ["7.5", "8.0", "9.0"]\nsass_aarch64 = ["9.0"]\n')
    (copy / "torch.toml").write_text(torch)
    (copy / "flash_attn.toml").write_text(SYNTHETIC_FLASH_ATTN)
    (copy / "xformers.toml").write_text(SYNTHETIC_XFORMERS)
    matrix_module._load(copy)
    return copy


def publish(world: World, *, skip: str = "") -> None:
    """download.pytorch.org-style index pages, and GitHub-style release assets (302 to the storage host)."""
    for variant, files in TORCH_FILES.items():
        links = "".join(f'<a href="/whl/{variant}/{f.replace("+", "%2B")}#sha256={"0" * 64}">{f}</a><br/>\n'
                        for f in files if f != skip)
        page = f"<!DOCTYPE html>\n<html>\n<body>\n<h1>Links for torch</h1>\n{links}</body>\n</html>\n"
        world.paths[f"/whl/{variant}/torch/"] = (200, page.encode(), {"Content-Type": "text/html"})
    for f in FLASH_ATTN_FILES:
        if f != skip:
            world.paths[f"/gh/v2.9.0/{f}"] = (302, b"", {"Location": f"/objects/{f}"})
            world.paths[f"/objects/{f}"] = (200, b"PK\x05\x06" + b"\0" * 18, {"Content-Type": "application/octet-stream"})


def verify(url, directory, tmp, *args):
    return envtool("matrix", "verify", "--matrix-dir", str(directory), "--pypi-url", url,
                   "--torch-index-url", f"{url}/whl/{{variant}}", "--flash-attn-url",
                   f"{url}/gh/v{{version}}/{{filename}}", *args, cache=str(tmp / "cache"))


def test_verify_passes_when_every_wheel_exists(world, synthetic, tmp_path):
    publish(world)
    with serve(world) as url:
        out = verify(url, synthetic, tmp_path)
        data = json.loads(verify(url, synthetic, tmp_path, "--json").stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("all ") and "wheels a plan can name exist" in out.stdout
    assert data["ok"] is True and data["missing"] == []
    assert data["by_kind"]["torch index"] == 12 and data["by_kind"]["flash-attn wheel"] == 2
    heads = {p for method, p, _ in world.requests if method == "HEAD"}
    assert heads >= {f"/gh/v2.9.0/{f}" for f in FLASH_ATTN_FILES}  # and the redirect was followed
    assert {f"/objects/{f}" for f in FLASH_ATTN_FILES} <= heads


def test_verify_falls_back_to_get_where_storage_refuses_head(world, synthetic, tmp_path):
    """Release assets redirect to storage URLs signed for GET only, which answer HEAD with 403."""
    publish(world)
    for f in FLASH_ATTN_FILES:
        world.head_fail[f"/objects/{f}"] = 403
    with serve(world) as url:
        out = verify(url, synthetic, tmp_path)
    assert out.returncode == 0, out.stdout
    gets = {p for method, p, _ in world.requests if method == "GET"}
    assert {f"/objects/{f}" for f in FLASH_ATTN_FILES} <= gets


@pytest.mark.parametrize("skip", [FLASH_ATTN_FILES[1], TORCH_FILES["cu132"][1]])
def test_verify_names_a_missing_wheel(world, synthetic, tmp_path, skip):
    publish(world, skip=skip)
    with serve(world) as url:
        out = verify(url, synthetic, tmp_path)
        data = json.loads(verify(url, synthetic, tmp_path, "--json").stdout)
    assert out.returncode == 1
    assert out.stdout.startswith("1 of ") and "missing" in out.stdout
    (missing,) = data["missing"]
    if skip.startswith("flash_attn"):
        assert missing["url"] == f"{url}/gh/v2.9.0/{skip}" and missing["why"] == "HTTP 404"
        assert missing["url"] in out.stdout
    else:
        assert missing["url"] == f"{url}/whl/cu132/torch/" and missing["what"] == "torch 2.15.0+cu132 cp311 aarch64"
        assert missing["why"] == "not listed on the index page"


def test_verify_checks_pinned_pypi_versions(world, synthetic, tmp_path):
    """A plan pins triton from torch's row and xformers by torch: a version without a wheel for one of the
    Pythons a plan names it with is named (here: the real files, minus one)."""
    publish(world)
    world.pypi["triton"]["releases"]["3.9.0"] = [f for f in world.pypi["triton"]["releases"]["3.9.0"]
                                                 if "cp312-abi3" not in f["filename"] or "aarch64" not in f["filename"]]
    world.pypi["xformers"]["releases"]["0.0.35"] = [f for f in world.pypi["xformers"]["releases"]["0.0.35"]
                                                    if not f["filename"].endswith("x86_64.whl")]
    with serve(world) as url:
        out = verify(url, synthetic, tmp_path, "--json")
    assert out.returncode == 1
    assert [m["what"] for m in json.loads(out.stdout)["missing"]] == [
        "xformers 0.0.35 cp311 x86_64 (with torch 2.15.0)", "xformers 0.0.35 cp312 x86_64 (with torch 2.15.0)",
        "triton 3.9.0 cp312 aarch64 (pinned by torch 2.15.0)"]


# ---------------------------------------------------------------------------- flash-attn-3 on the PyTorch index


@pytest.mark.slow
def test_update_reads_where_the_pytorch_index_holds_flash_attn_3(world, copy, tmp_path):
    """The root page links every variant folder: a new folder (cu132) and a platform gone are written into the
    row (with where they were read), a newer release is left for review."""
    trim_flash_attn(world, copy)
    files = {v: list(names) for v, names in FA3_FILES.items()}
    files["cu132"] = ["flash_attn_3-3.0.0-cp39-abi3-manylinux_2_28_x86_64.whl"]
    del files["cu129"]
    files["cu130"].append("flash_attn_3-3.0.1-cp310-abi3-manylinux_2_28_x86_64.whl")
    files["cu126"].append("flash_attn_3-3.0.0+20260301.cu126.x86-cp39-abi3-manylinux_2_28_x86_64.whl")  # a test build
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        assert update(url, copy, "--check", tmp=tmp_path).returncode == 0  # as recorded: current
        publish_fa3(world, files)
        data = json.loads(update(url, copy, "--check", "--json", tmp=tmp_path).stdout)
        fa3 = [(c["row"], c["field"], c["old"], c["new"]) for c in data["changes"] if c["file"] == "flash_attn.toml"]
        assert fa3 == [("flash-attn-3 3.0.0", "variants", ["cu126", "cu128", "cu129", "cu130"],
                        ["cu126", "cu128", "cu130", "cu132"])]
        review = {r["row"]: r["why"] for r in data["needs_review"] if r["file"] == "flash_attn.toml"}
        assert list(review) == ["flash-attn-3 3.0.1"] and "folders cu130" in review["flash-attn-3 3.0.1"]
        assert update(url, copy, tmp=tmp_path).returncode == 0
    row = next(r for r in matrix_module._load(copy).flash_attn_releases if r.impl == "fa3")
    assert row.variants == ["cu126", "cu128", "cu130", "cu132"]
    assert "variants updated by envtool matrix update from the PyTorch index on" in row.source


def test_update_adds_a_new_kernels_release_and_reviews_a_stack_without_a_kernels_requirement(world, copy, tmp_path):
    trim_flash_attn(world, copy)
    packages = (copy / "packages.toml").read_text()
    (copy / "packages.toml").write_text(packages.replace('[[kernels_release]]\nversion = "0.17.2"',
                                                         '[[kernels_release]]\nversion = "0.17.1"'))
    doc = tomlkit.parse((copy / "packages.toml").read_text())
    rows = doc["kernels_requirement"]
    del rows[[r["transformers"] for r in rows].index("5.20.2")]
    (copy / "packages.toml").write_text(tomlkit.dumps(doc))
    with serve(world) as url:
        out = update(url, copy, "--check", "--json", tmp=tmp_path)
    data = json.loads(out.stdout)
    assert [a["row"] for a in data["added"] if a["file"] == "packages.toml"] == ["kernels 0.17.2"]
    review = {r["row"]: r["why"] for r in data["needs_review"] if r["file"] == "packages.toml"}
    assert "no [[kernels_requirement]] row" in review["transformers 5.20.2"]


SYNTHETIC_FA3 = SYNTHETIC_FLASH_ATTN + '''
[[impl]]
name = "fa3"
attention = "flash_attention_3"
package = "flash-attn-3"
min_cuda = "12.3"
source = "test"

[[release]]
version = "3.0.0"
impl = "fa3"
index = "torch"
filename = "flash_attn_3-{version}-cp39-abi3-{platform_tag}.whl"
min_torch = "2.9"
min_python = "3.9"
variants = ["cu130"]
cxx11abi = [true, false]
platforms = ["x86_64", "aarch64"]
platform_tags = { x86_64 = "manylinux_2_28_x86_64", aarch64 = "manylinux_2_34_aarch64" }
source = "test"
'''


@pytest.mark.parametrize("published", ["both", "x86_64 only"])
def test_verify_reads_the_flash_attn_3_folder_page_of_each_variant(world, synthetic, tmp_path, published):
    (synthetic / "flash_attn.toml").write_text(SYNTHETIC_FA3)
    matrix_module._load(synthetic)
    publish(world)
    files = FA3_FILES["cu130"] if published == "both" else FA3_FILES["cu130"][:1]
    publish_fa3(world, {"cu130": files})
    with serve(world) as url:
        out = verify(url, synthetic, tmp_path, "--json")
    assert out.stdout, out.stderr
    data = json.loads(out.stdout)
    assert data["by_kind"]["flash-attn index"] == 4  # cp311, cp312 (the synthetic torch's Pythons) x 2 platforms
    assert f"/whl/cu130/flash-attn-3/" in {p for _, p, _ in world.requests}
    if published == "both":
        assert out.returncode == 0 and data["missing"] == [], data["missing"]
    else:
        assert out.returncode == 1
        assert {(m["what"], m["url"], m["why"]) for m in data["missing"]} == {
            (f"flash-attn-3 3.0.0 for torch 2.15.0+cu130 cp3{n} aarch64 (on {url}/whl/cu130)",
             f"{url}/whl/cu130/flash-attn-3/", "not listed on the index page") for n in ("11", "12")}


# ---------------------------------------------------------------------------- the stack installs together


def without_hold(copy: Path, peft: str = "0.21.2") -> None:
    """The copy's newest stack row as it stood before issue 43: no hold on transformers, peft at `peft`."""
    doc = tomlkit.parse((copy / "packages.toml").read_text())
    row = doc["stack"][0]
    row["packages"]["peft"] = peft
    for key in ("hold", "hold_source"):
        row.pop(key, None)
    (copy / "packages.toml").write_text(tomlkit.dumps(doc))


def before_peft_0_22(world) -> None:
    """PyPI as captured on 2026-11-28, before peft 0.22.0 (captured 2026-12-07) was uploaded."""
    del world.pypi["peft"]["releases"]["0.22.0"]
    for name in [n for n in world.wheels if n.startswith("peft-0.22.0-")]:
        del world.wheels[name]


@pytest.mark.slow
def test_transformers_5_24_is_held_back_while_pypi_has_no_peft_it_accepts(world, copy, tmp_path):
    """transformers 5.24.0 (2026-11-21, captured) checks peft >= 0.22.0 when it loads an adapter (its
    dependency_versions_table.py; no Requires-Dist), and PyPI's newest peft was 0.21.2 (until 2026-12): the
    update keeps the stack at 5.23.0 and says what held it, instead of writing a set that breaks LoRA loading."""
    trim_flash_attn(world, copy)
    before_peft_0_22(world)
    without_hold(copy)
    assert "5.24.0" in world.pypi["transformers"]["releases"]
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        data = json.loads(update(url, copy, "--check", "--json", tmp=tmp_path).stdout)
        text = update(url, copy, "--check", tmp=tmp_path).stdout
    stack = tomlkit.parse((copy / "packages.toml").read_text())["stack"][0]["packages"]
    assert (stack["transformers"], stack["peft"]) == ("5.23.0", "0.21.2")
    assert data["stale"] is False and data["changes"] == []
    (held,) = [h["why"] for h in data["held_back"] if h["why"].startswith("transformers 5.24.0")]
    assert "held back at 5.23.0: requires peft>=0.22.0" in held and "dependency_versions_table.py" in held
    assert "PyPI has no peft release that fits it" in held
    assert f"held back: packages.toml: [[stack]] python>=3.11: {held}" in text


@pytest.mark.slow
def test_the_stack_moves_to_a_release_once_what_it_requires_is_on_pypi(world, copy, tmp_path):
    """The same rule lets a release through once its requirement exists: with peft 0.22.0 on the index (captured
    2026-12-07) and no hold on the row, the update moves transformers and peft together to 5.24.0 and 0.22.0."""
    trim_flash_attn(world, copy)
    without_hold(copy)
    with serve(world) as url:
        data = json.loads(update(url, copy, "--check", "--json", tmp=tmp_path).stdout)
    found = {(c["field"], c["new"]) for c in data["changes"] if c["row"] == "[[stack]] python>=3.11"}
    assert {("packages.transformers", "5.24.0"), ("packages.peft", "0.22.0")} <= found
    assert not [h for h in data["held_back"] if h["why"].startswith("transformers 5.24.0")]


@pytest.mark.slow
def test_the_train_extra_is_bounded_by_what_the_stack_installs_together(world):
    """pyproject's `train` extra admits the newest stack row's versions and no release the update holds back
    (captured metadata of today's releases): `pip install envtool[train]` never pairs transformers 5.24.0 with
    peft 0.21.2 again."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from resolver.update import co_installable
    from resolver.upstream import Client

    extra = {Requirement(r).name: Requirement(r).specifier
             for r in tomllib.loads((REPO_MATRICES.parent / "pyproject.toml").read_text())
             ["project"]["optional-dependencies"]["train"]}
    newest = tomllib.loads((REPO_MATRICES / "packages.toml").read_text())["stack"][0]
    with serve(world) as url:
        chosen, held = co_installable(Client(url), dict(newest["packages"]), "3.11", holds=newest.get("hold"),
                                      hold_source=newest.get("hold_source"))
    for name, version in chosen.items():
        if name in extra:
            assert extra[name].contains(version), f"the train extra's {name}{extra[name]} excludes {version}"
    assert held
    for line in held:
        name, version = line.split()[:2]
        if name in extra:
            assert not extra[name].contains(Version(version)), f"the train extra admits {line}"


@pytest.mark.slow
def test_vllm_and_flash_attn_4_rows_follow_pypi(world, copy, tmp_path):
    """A vLLM release with pins no row has yet becomes a [[package]] row read from its wheel's METADATA (torch pin,
    transformers range, Requires-Python, CUDA 13 kernels); flash-attn-4's PyPI row follows its newest release, and a
    final one ends its beta (attention.toml auto_when_final: plans then pick it where it ranks first)."""
    trim_flash_attn(world, copy)
    with serve(world) as url:
        make_current(url, copy, tmp_path)
        doc = tomlkit.parse((copy / "packages.toml").read_text())
        rows = doc["package"]
        del rows[next(i for i, r in enumerate(rows) if r["name"] == "vllm" and r["version"] == "0.34.0")]
        (copy / "packages.toml").write_text(tomlkit.dumps(doc))
        text = (copy / "flash_attn.toml").read_text()
        (copy / "flash_attn.toml").write_text(text.replace('version = "4.0.0b40"', 'version = "4.0.0b39"')
                                              .replace('cuda = { "12" = "", "13" = "cu13" }', 'cuda = { "12" = "" }'))
        check = update(url, copy, "--check", "--json", tmp=tmp_path)
        assert check.returncode == 1, check.stdout + check.stderr
        data = json.loads(check.stdout)
        added = {a["row"]: a["fields"] for a in data["added"]}
        assert set(added) == {"vllm 0.34.0"}, added
        fields = added["vllm 0.34.0"]
        assert (fields["torch"], fields["requires"], fields["cuda"], fields["python"]) == (
            "==2.14.0", {"transformers": "<5.23.0,>=5.16.1"}, "13", "<3.15,>=3.11")
        assert [(c["row"], c["field"], c["old"], c["new"]) for c in data["changes"]] == [
            ("flash-attn-4 4.0.0b39", "version", "4.0.0b39", "4.0.0b40"),
            ("flash-attn-4 4.0.0b39", "cuda", {"12": ""}, {"12": "", "13": "cu13"})]  # its Provides-Extra: cu13
        assert update(url, copy, tmp=tmp_path).returncode == 0
        m = matrix_module._load(copy)
        row = next(p for p in m.packages if p.name == "vllm" and p.version == "0.34.0")
        assert "added by envtool matrix update from PyPI metadata on" in row.source and row.not_on["cpu"]
        assert m.newest_flash_attn("fa4").version == "4.0.0b40" and not m.is_auto(m.backend("flash_attention_4"))
        assert m.newest_flash_attn("fa4").cuda == {"12": "", "13": "cu13"} and m.newest_flash_attn("fa4").min_torch is None
        assert re.search(r'^cuda = \{.*"cu13" ?\}$', (copy / "flash_attn.toml").read_text(), flags=re.M)  # inline

        final = world.pypi["flash-attn-4"]["releases"]["4.0.0b40"]
        world.pypi["flash-attn-4"]["releases"]["4.0.0"] = [{**f, "filename": f["filename"].replace("4.0.0b40", "4.0.0")}
                                                           for f in final]
        assert update(url, copy, tmp=tmp_path).returncode == 0
    m = matrix_module._load(copy)
    assert m.newest_flash_attn("fa4").version == "4.0.0" and m.is_auto(m.backend("flash_attention_4"))
