"""`envtool matrix update` against a hostile index (issue 44 item 5): a server on 127.0.0.1 whose every answer is a
small handler doing one hostile thing — a lying Content-Range, a drip of one byte at a time, JSON of the wrong
shape or nested 200,000 deep, a METADATA that unpacks to 1.5 GB from a zip of 1.5 MB. Each run must end, within a
bound, in exit 1 and one line naming the URL and what was wrong; no traceback, nothing written to matrices/."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import struct
import threading
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resolver import matrix as matrix_module
from resolver import upstream
from resolver.upstream import Client, UpstreamError, parse_project, parse_simple

from .conftest import run_envtool

REPO_MATRICES = Path(matrix_module.__file__).resolve().parents[1] / "matrices"
WHEEL = "torch-2.9.1-cp312-cp312-manylinux_2_28_x86_64.whl"
MEMBER = "torch-2.9.1.dist-info/METADATA"


# ---------------------------------------------------------------------------- the hostile server


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict  # path -> handler(request) doing one hostile (or honest) thing
    stop: threading.Event

    def log_message(self, *args):
        pass

    def do_GET(self):
        route = self.routes.get(self.path.split("?", 1)[0])
        try:
            if route is None:
                send(self, 404, b"not here")
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on us: what it should do


@contextlib.contextmanager
def hostile(routes: dict):
    """Serve `routes` on a free port of 127.0.0.1; yields the base URL. Every handler stops when the test ends."""
    stop = threading.Event()
    handler = type("Handler", (_Handler,), {"routes": routes, "stop": stop})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def send(request, status: int, body: bytes, headers: dict | None = None) -> None:
    request.send_response(status)
    for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
        request.send_header(key, value)
    request.end_headers()
    request.wfile.write(body)


def answer(body: bytes | str, content_type: str = "application/json"):
    return lambda r: send(r, 200, body.encode() if isinstance(body, str) else body, {"Content-Type": content_type})


def drip(r) -> None:
    """Headers at once, then one byte every 0.3 s of a 100-byte body (at most 30 s): never a read timeout."""
    r.send_response(200)
    r.send_header("Content-Type", "application/json")
    r.send_header("Content-Length", "100")
    r.end_headers()
    r.wfile.flush()
    for _ in range(100):
        if r.stop.wait(0.3):
            return
        r.wfile.write(b" ")
        r.wfile.flush()


def lying_tail(r) -> None:
    """A 206 for the last block that says the file is 100 bytes and sends byte 0 of it."""
    send(r, 206, b"P", {"Content-Range": "bytes 0-0/100", "Accept-Ranges": "bytes"})


def ranges(data: bytes, lie_about_blocks: bool = False):
    """Serve `data` with range requests (as a CDN does); lie_about_blocks: any range but the tail comes back as
    another range than asked."""

    def serve(r) -> None:
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", r.headers.get("Range") or "")
        if not m:
            return send(r, 200, data, {"Content-Type": "application/zip"})
        first, last = m.groups()
        start, end = (len(data) - int(last), len(data) - 1) if first == "" else (int(first), int(last))
        start = max(0, start)
        if lie_about_blocks and first != "":
            start, end = start + 1, min(end + 1, len(data) - 1)
        send(r, 206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"})

    return serve


def project(files: list | str | None = None, **fields) -> str:
    """A PyPI JSON API page for torch with one release (2.9.1) of one Linux wheel, served from /files/."""
    files = [{"filename": WHEEL, "url": f"/files/{WHEEL}", "requires_python": ">=3.10", "yanked": False}] \
        if files is None else files
    return json.dumps({"info": {"name": "torch"}, "releases": {"2.9.1": files}, **fields})


def zip_member(name: str, *, size: int, declared: int | None = None) -> bytes:
    """A zip whose one member `name` unpacks to `size` zero bytes (its headers say `declared`): deflate blocks
    of 1 MiB of zeros, each closed by a full flush so one compressed block serves for all (1.5 GB from 1.5 MB
    without compressing 1.5 GB here)."""
    assert size % 2 ** 20 == 0
    block = zlib.compressobj(6, zlib.DEFLATED, -15)
    mib = block.compress(b"\0" * 2 ** 20) + block.flush(zlib.Z_FULL_FLUSH)
    data = mib * (size // 2 ** 20) + b"\x03\x00"  # the last block: empty, final
    crc = 0
    zeros = bytes(2 ** 20)
    for _ in range(size // 2 ** 20):
        crc = zlib.crc32(zeros, crc)
    declared = size if declared is None else declared
    raw = name.encode()
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(data), declared, len(raw), 0) + raw
    central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(data), declared, len(raw),
                          0, 0, 0, 0, 0, 0) + raw
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central), len(local) + len(data), 0)
    return local + data + central + end


# ---------------------------------------------------------------------------- running `envtool matrix update`


@pytest.fixture
def matrices(tmp_path):
    target = tmp_path / "matrices"
    target.mkdir()
    for path in REPO_MATRICES.glob("*.toml"):
        shutil.copy2(path, target / path.name)
    return target


def snapshot(directory: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def update(url: str, directory: Path, seconds: float = 20):
    """`envtool matrix update` in this process (so the caps and the deadline can be made small), in a thread
    joined with a bound: (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    from resolver.cli import app

    box = {}
    args = ["matrix", "update", "--pypi-url", url, "--torch-index-url", f"{url}/whl/{{variant}}", "--no-builds",
            "--matrix-dir", str(directory)]
    worker = threading.Thread(target=lambda: box.setdefault("result", CliRunner().invoke(app, args)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"envtool matrix update still running after {seconds} s"
    result = box["result"]
    assert isinstance(result.exception, SystemExit), result.exception  # no exception but the exit
    return result.exit_code, result.stdout, result.stderr


def one_line(code: int, stdout: str, stderr: str, *expected: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, (code, stdout, stderr)
    assert lines[0].startswith("envtool: error: ") and all(e in lines[0] for e in expected), lines[0]
    return lines[0]


def wheel_routes(wheel: bytes, **more) -> dict:
    return {"/pypi/torch/json": answer(project()), f"/files/{WHEEL}": ranges(wheel), **more}


# ---------------------------------------------------------------------------- the cases


@pytest.mark.parametrize("body, expected", [
    ('{"info": null, "releases": {}}', "/pypi/torch/json: info is null, not an object"),
    (project("oops"), "/pypi/torch/json: releases['2.9.1'] is a string, not a list or null"),
    (project([["a list, not a file"]]), "/pypi/torch/json: releases['2.9.1'][0] is a list, not an object"),
    (project([{"filename": 3}]), "/pypi/torch/json: releases['2.9.1'][0].filename is a number, not a string"),
    (project([{"filename": WHEEL, "url": f"/files/{WHEEL}", "requires_python": [3]}]),
     "releases['2.9.1'][0].requires_python is a list, not a string or null"),
    ("[" * 200_000 + "]" * 200_000, "/pypi/torch/json: the JSON answer is nested too deep to read"),
    ("<html>busy</html>", "/pypi/torch/json: the answer is not JSON"),
    ('["releases"]', "/pypi/torch/json: not a PyPI JSON API project page"),
], ids=["info null", "releases a string", "file a list", "filename a number", "requires_python a list",
        "200000 deep", "html", "a list"])
def test_json_of_the_wrong_shape_is_one_line_naming_url_and_field(matrices, body, expected):
    before = snapshot(matrices)
    with hostile({"/pypi/torch/json": answer(body)}) as url:
        one_line(*update(url, matrices), url + "/pypi/torch/json", expected.split("/pypi/torch/json")[-1])
    assert snapshot(matrices) == before


def test_a_server_dripping_a_byte_at_a_time_is_cut_off_at_the_deadline(matrices, monkeypatch):
    monkeypatch.setattr(upstream, "DEADLINE", 1.0)
    with hostile({"/pypi/torch/json": drip}) as url:
        line = one_line(*update(url, matrices, seconds=10), f"{url}/pypi/torch/json: no complete answer within 1 s")
    assert "sends too slowly" in line


def test_a_lying_content_range_is_an_error_not_a_spin(matrices):
    before = snapshot(matrices)
    with hostile({"/pypi/torch/json": answer(project()), f"/files/{WHEEL}": lying_tail}) as url:
        one_line(*update(url, matrices), f"{url}/files/{WHEEL}: asked for the last 524288 bytes, the server sent "
                 "bytes 0-0 of 100")
    assert snapshot(matrices) == before


def test_a_range_answer_for_other_bytes_than_asked_is_an_error(tmp_path):
    member = ("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1\n" + "X" * 3_000_000).encode()
    wheel = _stored_zip(MEMBER, member)
    with hostile({f"/files/{WHEEL}": ranges(wheel, lie_about_blocks=True)}) as url:
        with pytest.raises(UpstreamError, match=r"Content-Range does not hold \(bytes \d+-\d+/\d+: not the bytes"):
            bounded(lambda: Client(url).metadata_from_wheel(f"{url}/files/{WHEEL}"))


def _stored_zip(name: str, data: bytes) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:  # stored: the member spans several range blocks
        z.writestr(name, data)
    return buffer.getvalue()


def bounded(work, seconds: float = 10):
    box = {}

    def run():
        try:
            box["value"] = work()
        except BaseException as e:
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_metadata_member_of_1_5_gb_in_a_small_zip_is_not_unpacked(matrices):
    wheel = zip_member(MEMBER, size=1536 * 2 ** 20)
    assert len(wheel) < 2 * 2 ** 20
    with hostile(wheel_routes(wheel)) as url:
        one_line(*update(url, matrices), f"{url}/files/{WHEEL}: its {MEMBER} is 1610612736 bytes unpacked, over "
                 "the 16 MiB read from one")


def test_a_metadata_member_whose_header_lies_about_its_size_is_not_unpacked_past_it(matrices):
    wheel = zip_member(MEMBER, size=64 * 2 ** 20, declared=1000)
    with hostile(wheel_routes(wheel)) as url:
        one_line(*update(url, matrices), f"{url}/files/{WHEEL}: not a readable wheel (BadZipFile")


def test_an_answer_over_the_size_cap_is_not_read_further(matrices, monkeypatch):
    monkeypatch.setattr(upstream, "MAX_BODY", 2 ** 20)
    with hostile({"/pypi/torch/json": answer(" " * (2 * 2 ** 20))}) as url:
        one_line(*update(url, matrices), f"{url}/pypi/torch/json: the answer is 2097152 bytes, over the 1 MiB")


def test_a_pep658_metadata_file_over_the_cap_is_not_read(matrices):
    simple = json.dumps({"files": [{"filename": WHEEL, "url": f"/files/{WHEEL}", "core-metadata": True}]})
    routes = {"/pypi/torch/json": answer(project()),
              "/simple/torch/": answer(simple, "application/vnd.pypi.simple.v1+json"),
              f"/files/{WHEEL}.metadata": answer(b"\0" * (17 * 2 ** 20), "application/octet-stream")}
    with hostile(routes) as url:
        one_line(*update(url, matrices), f"{url}/files/{WHEEL}.metadata: the answer is 17825792 bytes, over the "
                 "16 MiB")


def test_the_installed_command_ends_on_a_lying_content_range_with_one_line(matrices, tmp_path):
    """The same as a user runs it: a process of its own, which must end (it spun a core for good)."""
    with hostile({"/pypi/torch/json": answer(project()), f"/files/{WHEEL}": lying_tail}) as url:
        out = run_envtool("matrix", "update", "--pypi-url", url, "--no-builds", "--matrix-dir", str(matrices),
                          timeout=30, XDG_CACHE_HOME=str(tmp_path / "cache"))
    one_line(out.returncode, out.stdout, out.stderr, f"{url}/files/{WHEEL}: asked for the last")


# ---------------------------------------------------------------------------- generated JSON shapes

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=3), max_leaves=8)
FILE = st.fixed_dictionaries({}, optional={"filename": JSON | st.just(WHEEL), "url": JSON | st.just("/f.whl"),
                                           "requires_python": JSON | st.just(">=3.9"), "yanked": JSON,
                                           "core-metadata": JSON})
PAGE = st.fixed_dictionaries({}, optional={
    "info": JSON | st.fixed_dictionaries({}, optional={"name": JSON}),
    "releases": JSON | st.dictionaries(st.sampled_from(["2.9.1", "x", "1.0"]), JSON | st.lists(FILE | JSON,
                                                                                               max_size=3)),
    "files": JSON | st.lists(FILE | JSON, max_size=3)}) | JSON


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PAGE)
def test_any_json_shape_is_a_project_or_one_line_naming_the_url(data):
    """Whatever JSON an index sends, the parsers give a result or an UpstreamError: one line naming the URL."""
    url = "http://index.test/pypi/torch/json"
    for parse in (parse_project, parse_simple):
        try:
            parse(data, url)
        except UpstreamError as e:
            assert str(e).startswith(url + ": ") and "\n" not in str(e)


def test_releases_that_never_settle_are_bounded_not_a_spin(monkeypatch):
    """An index listing many releases of two packages, each requiring what the other never is: the backtracking
    search (exponential in what an index lists) stops at its bound with one line."""
    from email.message import Message

    from packaging.version import Version

    from resolver import update
    from resolver.upstream import Project, Release, WheelFile

    def release(name: str, version: str) -> Release:
        wheel = WheelFile(f"{name}-{version}-py3-none-any.whl", "", Version(version), None, True,
                          frozenset({"any"}), None, False)
        return Release(Version(version), [wheel], None, False)

    class Index:
        base_url = "http://index.test"

        def project(self, name):
            return Project(name, {Version(f"1.{i}"): release(name, f"1.{i}") for i in range(60)})

        def metadata(self, name, wheel):
            message = Message()
            message["Requires-Dist"] = "beta==0.1" if name == "alpha" else "alpha==0.1"
            return message

    monkeypatch.setattr(update, "MAX_TRIES", 500)
    with pytest.raises(UpstreamError, match=r"^http://index.test: alpha, beta do not settle .* within 500 tries"):
        bounded(lambda: update.co_installable(Index(), {"alpha": "1.0", "beta": "1.0"}, "3.12"))
