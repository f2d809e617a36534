"""A stand-in for the Hugging Face Hub's file endpoint on 127.0.0.1: `{endpoint}/{org}/{name}/resolve/{revision}/{file}`
(HEAD for the metadata huggingface_hub checks, then GET), for the fit estimate's one request (config.json) and for a
whole model a run downloads (a repository served from a folder: config, weights, tokenizer).

The headers are the ones huggingface_hub's file_download.py reads from the Hub (its constants
HUGGINGFACE_HEADER_X_REPO_COMMIT, ETag, Content-Length; no X-Xet-* header, so it downloads over plain HTTP);
gated repositories answer 401 with X-Error-Code GatedRepo, missing ones 404 with RepoNotFound/EntryNotFound, as
huggingface.co does, and so does any other endpoint (the API's file listings): the client then goes on without it.
Every request is recorded, so a test can assert what was asked for. The config files come from
bench/data/model_configs.toml (sizes as the Hub publishes).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import threading
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "bench" / "data" / "model_configs.toml"


def published_config(name: str) -> dict:
    """A model's config.json as bench/data/model_configs.toml records it."""
    return tomllib.loads(CONFIGS.read_text())["models"][name]["config"]


def _file(repo: dict | Path, name: str) -> bytes | None:
    if isinstance(repo, dict):
        return json.dumps(repo, indent=2).encode() if name == "config.json" else None
    path = (repo / name).resolve()
    return path.read_bytes() if path.is_file() and path.is_relative_to(repo.resolve()) else None


def _files(repo: dict | Path) -> dict[str, int]:
    if isinstance(repo, dict):
        return {"config.json": len(_file(repo, "config.json") or b"")}
    return {str(p.relative_to(repo)): p.stat().st_size for p in sorted(repo.rglob("*")) if p.is_file()}


def _api(name: str, repo: dict | Path, rest: list[str], commit: str) -> bytes | None:
    """`/api/models/{repo}` (model_info: the fields huggingface_hub's ModelInfo reads, the files as `siblings`) and
    `/api/models/{repo}/tree/{revision}[/{path}]` (list_repo_tree: one entry per file under path; a path with no
    file is EntryNotFound, as an empty folder is on the Hub: a Git repository holds no empty folder)."""
    files = _files(repo)
    if not rest or rest[0] == "revision":
        return json.dumps({"id": name, "modelId": name, "sha": commit, "private": False, "gated": False,
                           "disabled": False, "tags": [], "siblings": [{"rfilename": f} for f in files]}).encode()
    if rest[0] != "tree" or len(rest) < 2:
        return None
    under = "/".join(rest[2:])
    entries = [{"type": "file", "path": f, "size": size, "oid": hashlib.sha1(f.encode()).hexdigest()}
               for f, size in files.items() if not under or f.startswith(under + "/")]
    return json.dumps(entries).encode() if entries else None


@contextlib.contextmanager
def fake_hub(repos: dict[str, dict | Path], gated: tuple[str, ...] = ()):
    """Serve {repo id: config dict (the repository's config.json alone), or a folder (its files)}; yields (endpoint
    URL, list of (method, path) requested)."""
    requests: list[tuple[str, str]] = []
    commit = "a" * 40

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bool) -> None:
            requests.append((self.command, self.path))
            parts = self.path.split("?")[0].strip("/").split("/")
            api = parts[:2] == ["api", "models"]  # the API: model info and file listings
            repo = "/".join(parts[2:4] if api else parts[:2])
            if repo in gated:
                self.send_response(401)
                self.send_header("X-Error-Code", "GatedRepo")
                self.send_header("X-Error-Message", "Access to this model is restricted")
                self.end_headers()
                return
            if repo not in repos or (not api and (len(parts) < 5 or parts[2] != "resolve")):
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                return
            data = _api(repo, repos[repo], parts[4:], commit) if api else _file(repos[repo], "/".join(parts[4:]))
            if data is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", '"' + hashlib.sha1(data).hexdigest() + '"')
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self):  # noqa: N802
            self._answer(False)

        def do_GET(self):  # noqa: N802
            self._answer(True)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def fake_hub_uploads(user: str = "tester"):
    """The Hub's write side for a push (huggingface_hub's whoami, create_repo, create_branch, preupload and commit
    endpoints): every file is uploaded `regular` (in the commit's NDJSON, no LFS). Yields (endpoint URL, the commits
    received: {"repo", "revision", "files"}, the branches created: (repo, branch)); every other request is 404."""
    commits: list[dict] = []
    branches: list[tuple[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict | list | None = None, error: str | None = None) -> None:
            data = json.dumps(payload).encode() if payload is not None else b""
            self.send_response(status)
            if error:
                self.send_header("X-Error-Code", error)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/api/whoami-v2":
                return self._send(200, {"name": user, "type": "user", "orgs": [],
                                        "auth": {"accessToken": {"role": "write"}}})
            self._send(404, {"error": "not found"}, "EntryNotFound")

        def do_HEAD(self):  # noqa: N802
            self._send(404, None, "EntryNotFound")

        def do_POST(self):  # noqa: N802
            path, body = self.path.split("?")[0], self._body()
            parts = path.strip("/").split("/")
            if path == "/api/validate-yaml":  # a model card's metadata, checked before it is uploaded
                return self._send(200, {"errors": [], "warnings": []})
            if path == "/api/repos/create":
                name = json.loads(body)
                return self._send(200, {"url": f"http://{self.headers['Host']}/{name.get('organization') or user}/"
                                               f"{name['name']}"})
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "branch":
                branches.append(("/".join(parts[2:4]), "/".join(parts[5:])))
                return self._send(200, {})
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
                files = json.loads(body).get("files", [])
                return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                  for f in files]})
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
                lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                commits.append({"repo": "/".join(parts[2:4]), "revision": "/".join(parts[5:]),
                                "files": sorted(x["value"]["path"] for x in lines if x.get("key") == "file")})
                return self._send(200, {"commitUrl": f"http://{self.headers['Host']}/{'/'.join(parts[2:4])}/commit/"
                                                     + "b" * 40, "commitOid": "b" * 40})
            self._send(404, {"error": "not found"}, "EntryNotFound")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", commits, branches
    finally:
        server.shutdown()
        server.server_close()
