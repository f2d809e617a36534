"""A stand-in for the upstream servers `envtool matrix` reads, on 127.0.0.1: PyPI's JSON API, its PEP 691
simple pages and PEP 658 metadata files, served from captured real answers (tests/resolver/data/upstream),
plus any extra paths a test adds (torch index pages, release assets behind a redirect, wheels with Range)."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import re
import threading
import zipfile
from pathlib import Path

CAPTURED = Path(__file__).resolve().parents[1] / "resolver" / "data" / "upstream"
FILES_HOST = "https://files.pythonhosted.org"


class World:
    """What the server answers. `pypi`: project -> JSON API document (editable by tests); `paths`: extra
    path -> (status, body, headers); `fail`: path -> status returned instead of the real answer."""

    def __init__(self, captured: Path = CAPTURED):
        self.pypi = {p.stem: json.loads(p.read_text()) for p in (captured / "pypi").glob("*.json")}
        self.simple = {p.stem: json.loads(p.read_text()) for p in (captured / "simple").glob("*.json")}
        self.metadata = {p.name.removesuffix(".metadata"): p.read_bytes() for p in (captured / "metadata").iterdir()}
        # wheel filename -> {member: text}: the captured members of the stack's wheels (see capture.py), served as
        # a wheel of just those members, with range requests
        self.wheels = {p.name.removesuffix(".json"): json.loads(p.read_text())
                       for p in (captured / "wheels").glob("*.json")}
        self._zips: dict[str, bytes] = {}
        self.paths: dict[str, tuple[int, bytes, dict]] = {}
        # pytorch/pytorch files captured at release tags (capture.py --pytorch-git), at /pytorch/<tag>/<path>
        root = captured / "pytorch"
        for f in (p for p in root.glob("v*/**/*") if p.is_file()) if root.is_dir() else ():
            self.paths[f"/pytorch/{f.relative_to(root).as_posix()}"] = (200, f.read_bytes(),
                                                                       {"Content-Type": "text/plain"})
        self.fail: dict[str, int] = {}
        self.head_fail: dict[str, int] = {}  # path -> status for HEAD only (storage URLs signed for GET)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.base = ""

    def drop_releases(self, project: str, newer_than: str) -> None:
        """Serve the project as it was before its releases newer than `newer_than` (a trimmed capture)."""
        from packaging.version import Version

        doc = self.pypi[project]
        doc["releases"] = {v: f for v, f in doc["releases"].items() if Version(v) <= Version(newer_than)}

    def answer(self, method: str, path: str, accept: str) -> tuple[int, bytes, dict]:
        if method == "HEAD" and path in self.head_fail:
            return self.head_fail[path], b"", {"Content-Type": "application/xml"}
        for prefix, status in self.fail.items():
            if path.startswith(prefix):
                return status, b"<html><body>error</body></html>", {"Content-Type": "text/html"}
        if path in self.paths:
            return self.paths[path]
        m = re.fullmatch(r"/pypi/([^/]+)/json", path)
        if m and m.group(1) in self.pypi:
            return 200, self._rebase(json.dumps(self.pypi[m.group(1)])), {"Content-Type": "application/json"}
        m = re.fullmatch(r"/simple/([^/]+)/", path)
        if m and m.group(1) in self.simple:
            if "application/vnd.pypi.simple.v1+json" not in accept:
                return 406, b"only PEP 691 JSON here", {"Content-Type": "text/plain"}
            return (200, self._rebase(json.dumps(self.simple[m.group(1)])),
                    {"Content-Type": "application/vnd.pypi.simple.v1+json"})
        if path.endswith(".whl") and path.rsplit("/", 1)[-1] in self.wheels:
            name = path.rsplit("/", 1)[-1]
            if name not in self._zips:
                buffer = io.BytesIO()
                with zipfile.ZipFile(buffer, "w") as z:
                    for member, text in self.wheels[name].items():
                        z.writestr(member, text)
                self._zips[name] = buffer.getvalue()
            return 200, self._zips[name], {"Content-Type": "application/zip", "Accept-Ranges": "bytes"}
        if path.endswith(".whl.metadata"):
            name = path.rsplit("/", 1)[-1].removesuffix(".metadata")
            if name in self.metadata:
                return 200, self.metadata[name], {"Content-Type": "application/octet-stream"}
        return 404, b"<html><body>404 Not Found</body></html>", {"Content-Type": "text/html"}

    def _rebase(self, text: str) -> bytes:
        return text.replace(FILES_HOST, self.base).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    world: World

    def log_message(self, *args):
        pass

    def _reply(self, body_too: bool) -> None:
        path = self.path.split("?", 1)[0]
        self.world.requests.append((self.command, path, self.headers.get("Range")))
        status, body, headers = self.world.answer(self.command, path, self.headers.get("Accept", ""))
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range") or "")
        if status == 200 and m and headers.get("Accept-Ranges") == "bytes":
            size = len(body)
            first, last = m.groups()
            start, end = (size - int(last), size - 1) if first == "" else (int(first), min(size - 1, int(last or size - 1)))
            start = max(0, start)
            body, status = body[start:end + 1], 206
            headers = dict(headers, **{"Content-Range": f"bytes {start}-{end}/{size}"})
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body_too:
            self.wfile.write(body)

    def do_GET(self):
        self._reply(True)

    def do_HEAD(self):
        self._reply(False)


@contextlib.contextmanager
def serve(world: World):
    """Serve `world` on a free port of 127.0.0.1; yields the base URL."""
    handler = type("Handler", (_Handler,), {"world": world})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    world.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield world.base
    finally:
        server.shutdown()
        server.server_close()
