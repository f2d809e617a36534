"""A stand-in for the Hugging Face Hub's file endpoint on 127.0.0.1, for the one request the fit estimate makes:
`{endpoint}/{org}/{name}/resolve/{revision}/config.json` (HEAD for the metadata huggingface_hub checks, then GET).

The headers are the ones huggingface_hub's hf_hub_download reads from the real Hub (X-Repo-Commit, ETag,
Content-Length); gated repositories answer 401 with X-Error-Code GatedRepo, missing ones 404 with
RepoNotFound/EntryNotFound, as huggingface.co does. Every request is recorded, so a test can assert that only
config.json was asked for. The config files come from bench/data/model_configs.toml (sizes as the Hub publishes).
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


@contextlib.contextmanager
def fake_hub(repos: dict[str, dict], gated: tuple[str, ...] = ()):
    """Serve {repo id: config dict}; yields (endpoint URL, list of (method, path) requested)."""
    requests: list[tuple[str, str]] = []
    commit = "a" * 40

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bool) -> None:
            requests.append((self.command, self.path))
            parts = self.path.split("?")[0].strip("/").split("/")
            repo = "/".join(parts[:2])
            if repo in gated:
                self.send_response(401)
                self.send_header("X-Error-Code", "GatedRepo")
                self.send_header("X-Error-Message", "Access to this model is restricted")
                self.end_headers()
                return
            if len(parts) < 5 or parts[2] != "resolve" or repo not in repos:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                return
            if "/".join(parts[4:]) != "config.json":
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                return
            data = json.dumps(repos[repo], indent=2).encode()
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
