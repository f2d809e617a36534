"""Stand-ins for the package indexes envtool talks to: small generated wheels and simple indexes served on
127.0.0.1 the way PyPI and download.pytorch.org serve theirs (see write_simple_index), so uv really resolves,
locks, hashes and installs without the real gigabytes."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import http.server
import io
import os
import re
import shutil
import threading
import time
import urllib.parse
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str, version: str, *, tag: str = "py3-none-any",
               requires: list[str] = (), files: dict[str, str] | None = None) -> Path:
    """Write a valid wheel `name-version-tag.whl` whose package `name` (import name) holds `files`."""
    dist = re.sub(r"[-_.]+", "_", name)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{dist}-{version}-{tag}.whl"
    module = dist.lower()
    files = files if files is not None else {f"{module}/__init__.py": f'__version__ = "{version}"\n'}
    info = f"{dist}-{version}.dist-info"
    metadata = "Metadata-Version: 2.1\n" f"Name: {name}\n" f"Version: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel = f"Wheel-Version: 1.0\nGenerator: envtool-tests\nRoot-Is-Purelib: true\nTag: {tag}\n"
    entries = dict(files)
    entries[f"{info}/METADATA"] = metadata
    entries[f"{info}/WHEEL"] = wheel
    record = "".join(f"{p},{_record_hash(c.encode())},{len(c.encode())}\n" for p, c in entries.items())
    record += f"{info}/RECORD,,\n"
    entries[f"{info}/RECORD"] = record
    with zipfile.ZipFile(path, "w") as z:
        for p, content in entries.items():
            z.writestr(p, content)
    return path


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(filename: str) -> str:
    if filename.endswith((".tar.gz", ".zip")):  # an sdist: name-version.tar.gz, the name may hold dashes
        return normalize(filename.rsplit("-", 1)[0])
    return normalize(filename.split("-")[0])


# Index pages as the real indexes write them (tests/support/captured/ holds the real ones, and
# tests/resolver/test_index_pages.py checks these against them):
# - "pypi": pypi.org/simple/<project>/ — absolute links to the files host with a #sha256= fragment,
#   data-requires-python HTML-escaped (`&gt;=3.8`), and the same page as PEP 691 JSON
#   (application/vnd.pypi.simple.v1+json) when the client asks for it.
# - "pytorch": download.pytorch.org/whl/<variant>/<project>/ — root-relative links whose `+` is written %2B
#   (`/whl/cu126/torch-2.8.0%2Bcu126-...whl#sha256=...`), the file name as the text, `<br/>` after each,
#   a `<!--TIMESTAMP n-->` trailer, and HTML only (the JSON request is answered with the HTML page).
# - "local": a static index on disk (served as file://): relative links, `+` percent-encoded.
PAGE_STYLES = ("pypi", "pytorch", "local")
BASE = "{base}"  # replaced by the server's own URL when a page is served (pypi links are absolute)


def requires_python(path: Path) -> str | None:
    """The Requires-Python of a wheel's METADATA (what PyPI shows as data-requires-python)."""
    if not path.name.endswith(".whl"):
        return None
    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            return None
        for line in z.read(name).decode("utf-8", "replace").splitlines():
            if not line.strip():
                break
            if line.lower().startswith("requires-python:"):
                return line.split(":", 1)[1].strip() or None
    return None


def _href(style: str, index: str, name: str) -> str:
    quoted = urllib.parse.quote(name)  # `+` -> %2B, as download.pytorch.org and PyPI write it
    if style == "pytorch":
        return f"/files/{quoted}"
    if style == "pypi":
        return f"{BASE}/files/{quoted}"
    return "../" * (len(Path(index).parts) + 1) + f"files/{quoted}"


def write_simple_index(root: Path, index: str, files: list[Path], style: str = "pypi") -> None:
    """A simple index at root/<index>/ (PEP 503 HTML, plus PEP 691 JSON for style "pypi"), one page per project,
    the distribution files (wheels or sdists) in root/files/."""
    import datetime
    import json

    assert style in PAGE_STYLES, style
    base = root / index
    store = root / "files"
    store.mkdir(parents=True, exist_ok=True)
    projects: dict[str, list[Path]] = {}
    for dist in files:
        target = store / dist.name
        if not target.exists():
            shutil.copy2(dist, target)
        projects.setdefault(project_of(dist.name), []).append(target)
    for project, paths in projects.items():
        page = base / project
        page.mkdir(parents=True, exist_ok=True)
        entries = []
        for path in sorted(paths, key=lambda p: p.name):
            data = path.read_bytes()
            entries.append({"filename": path.name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "requires_python": requires_python(path), "href": _href(style, index, path.name),
                            "upload_time": datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
                            .strftime("%Y-%m-%dT%H:%M:%S.%fZ")})
        if style == "pytorch":  # pytorch/test-infra s3_management/manage.py, to_simple_package_html
            lines = ["<!DOCTYPE html>", "<html>", "  <body>", f"    <h1>Links for {project}</h1>"]
            lines += [f'    <a href="{e["href"]}#sha256={e["sha256"]}">{e["filename"]}</a><br/>' for e in entries]
            lines += ["  </body>", "</html>", f"<!--TIMESTAMP {int(time.time())}-->"]
            (page / "index.html").write_text("\n".join(lines))
            continue
        anchors = []
        for e in entries:
            attrs = (f' data-requires-python="{html.escape(e["requires_python"])}"' if e["requires_python"] else "")
            anchors.append(f'<a href="{e["href"]}#sha256={e["sha256"]}"{attrs}>{html.escape(e["filename"])}</a><br/>')
        (page / "index.html").write_text(  # as pypi.org writes it (tests/support/captured)
            f"<!DOCTYPE html>\n<html>\n<head><title>Links for {project}</title></head>\n<body>\n"
            f"<h1>Links for {project}</h1>\n" + "".join(f"{a}\n" for a in anchors) + "</body>\n</html>\n")
        if style == "pypi":
            from packaging.utils import parse_sdist_filename, parse_wheel_filename

            versions = sorted({str((parse_wheel_filename if e["filename"].endswith(".whl") else parse_sdist_filename)(
                e["filename"])[1]) for e in entries})
            (page / "index.json").write_text(json.dumps({
                "files": [{"filename": e["filename"], "hashes": {"sha256": e["sha256"]},
                           "requires-python": e["requires_python"], "size": e["size"],
                           "upload-time": e["upload_time"], "url": e["href"], "yanked": False} for e in entries],
                "meta": {"_last-serial": "1", "api-version": "1.1"}, "name": project, "versions": versions}))
    names = sorted(p.name for p in base.iterdir() if p.is_dir())
    (base / "index.html").write_text(
        "<!DOCTYPE html>\n<html>\n  <body>\n" + "".join(f'    <a href="{n}/">{n}</a><br/>\n' for n in names)
        + "  </body>\n</html>\n")
    if style == "pypi":
        (base / "index.json").write_text(json.dumps({"meta": {"_last-serial": "1", "api-version": "1.1"},
                                                     "projects": [{"name": n} for n in names]}))


PEP691 = "application/vnd.pypi.simple.v1+json"


class _Index(http.server.SimpleHTTPRequestHandler):
    """Files as they are; a directory's page by content negotiation (PEP 691): index.json as
    application/vnd.pypi.simple.v1+json when the client accepts it and the index has one, else index.html; the
    server's own URL put where a page says {base}."""

    auth: str | None = None  # "user:password": every request must carry it (HTTP Basic), as a private mirror's
    seen: list | None = None  # where the server records each request's path and whether it was authorized

    def log_message(self, *args):
        pass

    def send_head(self):
        if self.auth is not None:
            given = self.headers.get("Authorization", "")
            ok = given == "Basic " + base64.b64encode(self.auth.encode()).decode()
            if self.seen is not None:
                self.seen.append((self.path, ok))
            if not ok:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="envtool-test"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
        path = self.translate_path(self.path)
        if not os.path.isdir(path) or not self.path.split("?")[0].endswith("/"):
            return super().send_head()
        page, kind = os.path.join(path, "index.html"), "text/html"
        if PEP691 in self.headers.get("Accept", "") and os.path.isfile(os.path.join(path, "index.json")):
            page, kind = os.path.join(path, "index.json"), PEP691
        if not os.path.isfile(page):
            return super().send_head()
        scheme = "https" if isinstance(self.connection, __import__("ssl").SSLSocket) else "http"
        body = Path(page).read_text().replace(BASE, f"{scheme}://{self.headers.get('Host')}").encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


@contextlib.contextmanager
def serve(root: Path, tls: tuple[Path, Path] | None = None, auth: str | None = None, seen: list | None = None):
    """Serve `root` on 127.0.0.1 (a free port), over HTTPS with `tls` = (certificate, key); yields the base URL.
    `auth` ("user:password"): every request needs HTTP Basic credentials (401 without), as a private mirror does;
    `seen` collects (path, authorized) per request."""
    handler_class = type("_AuthIndex", (_Index,), {"auth": auth, "seen": seen}) if auth else _Index
    handler = lambda *a, **kw: handler_class(*a, directory=str(root), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------- the plan's packages as stand-ins

ROOT = Path(__file__).resolve().parents[2]
MIRROR = ROOT / ".ci-cache" / "pypi-mirror"
LINUX_CP311 = "cp311-cp311-manylinux_2_28_x86_64"


# What a ROCm torch reports, captured: torch 2.5.1+rocm6.2's torch.version.hip (a project's backend check, printing
# `torch: 2.5.1+rocm6.2` / `torch.version.hip: 6.2.41133-dd7f95766`) and torch.cuda.get_arch_list() of the same
# build (astral-sh/uv issue #14086). Other ROCm builds get a HIP version that says it is a stand-in.
CAPTURED_HIP = {"rocm6.2": "6.2.41133-dd7f95766"}
CAPTURED_ROCM_ARCH = {("2.5.1", "rocm6.2"): ["gfx900", "gfx906", "gfx908", "gfx90a", "gfx1030", "gfx1100", "gfx942"]}


def torch_files(version: str, variant: str, arch_list: list[str]) -> dict[str, str]:
    """The modules of a stand-in torch that answers like a CUDA, ROCm (HIP) or CPU build: its version, CUDA or
    HIP version and compiled arch list (what envtool doctor reads)."""
    rocm = variant.startswith("rocm")
    cuda = None if variant == "cpu" or rocm else f"{variant[2:-1]}.{variant[-1]}"
    hip = CAPTURED_HIP.get(variant, f"{variant[4:]}.0-standin") if rocm else None
    return {
        "torch/__init__.py": f'__version__ = "{version}+{variant}"\nfrom . import version, _C, cuda\n',
        "torch/version.py": f"cuda = {cuda!r}\nhip = {hip!r}\n",
        "torch/_C.py": f"def _cuda_getArchFlags():\n    return {' '.join(arch_list)!r}\n",
        "torch/cuda.py": "def is_available():\n    return False\n",
    }


def torch_standin(directory: Path, version: str, variant: str, arch_list: list[str], triton: str | None,
                  triton_package: str = "triton") -> Path:
    """A `torch` wheel that answers like a CUDA, ROCm or CPU build (torch_files), requiring its triton."""
    files = torch_files(version, variant, arch_list)
    requires = [f"{triton_package}=={triton}; platform_machine == 'x86_64' and sys_platform == 'linux'"] if triton else []
    return make_wheel(directory, "torch", f"{version}+{variant}", tag=LINUX_CP311, requires=requires, files=files)


def is_torch_triton(name: str) -> bool:
    """A ROCm / XPU torch's own triton distribution (pytorch-triton-rocm, triton-rocm, triton-xpu ...): it lives on
    the PyTorch index of the build, not on PyPI."""
    return name != "triton" and "triton" in name


def fa3_standin(directory: Path, filename: str) -> Path:
    """flash_attn_3 as download.pytorch.org serves it (flash_attn_3-3.0.0-cp39-abi3-manylinux_2_28_x86_64.whl):
    its Requires-Dist (hopper/setup.py install_requires) and its modules: `flash_attn_interface`, which loads
    the compiled `flash_attn_3._C` (a stand-in here; the real one needs a GPU)."""
    _, version, tag = filename.removesuffix(".whl").split("-", 2)
    return make_wheel(directory, "flash_attn_3", version, tag=tag, requires=["torch", "einops", "packaging", "ninja"],
                      files={"flash_attn_interface.py": "import flash_attn_3._C as _C\n\n"
                                                        "def flash_attn_varlen_func(*args, **kwargs):\n"
                                                        "    return _C.fwd(*args, **kwargs)\n",
                             "flash_attn_3/__init__.py": f'__version__ = "{version}"\n',
                             "flash_attn_3/_C.py": "def fwd(*args, **kwargs):\n    raise RuntimeError('no GPU')\n"})


def standins(plan: dict, directory: Path, sass: list[str]) -> dict[str, Path]:
    """Small wheels for every package of the plan that is big or CUDA-specific, with the plan's versions."""
    made = {}
    for name, version in plan["packages"].items():
        if name == "torch":
            rocm = plan["torch"]["variant"].startswith("rocm")
            arch = list(sass) if rocm else [f"sm_{s.replace('.', '')}" for s in sass]
            triton_package = next((n for n in plan["packages"] if is_torch_triton(n)), "triton")
            made[name] = torch_standin(directory, version, plan["torch"]["variant"], arch, plan["triton"],
                                       triton_package)
        elif is_torch_triton(name):
            made[name] = make_wheel(directory, name, version, tag=LINUX_CP311)
        elif name == "flash-attn":
            fa = plan["flash_attn"]
            made[name] = make_wheel(directory / "fa", "flash_attn", fa["filename"].split("-")[1],
                                    tag=fa["filename"].split("-", 2)[2].removesuffix(".whl"))
            assert made[name].name == fa["filename"], made[name].name
        elif name == "flash-attn-3":  # shaped like PyTorch's: abi3 tag, manylinux platform, its metadata
            fa = plan["flash_attn"]
            made[name] = fa3_standin(directory / "fa3", fa["filename"])
            assert made[name].name == fa["filename"], made[name].name
        elif name in ("triton", "bitsandbytes", "deepspeed", "xformers"):
            made[name] = make_wheel(directory, name, version, tag=LINUX_CP311 if name == "triton" else "py3-none-any")
        else:
            made[name] = make_wheel(directory, name, version, files={
                f"{name.replace('-', '_')}/__init__.py": f'__version__ = "{version}"\n'})
    return made


def build_indexes(root: Path, plan: dict, sass: list[str], *, serve_flash_attn: bool = True,
                  serve_torch_triton: bool = True,
                  extra_pypi: list[Path] = (), real_torch: Path | None = None, on_disk: bool = False) -> None:
    """root/pypi: the mirror's real wheels plus stand-ins; root/torch/<variant>: torch; root/gh/...: flash-attn.
    Written as PyPI and download.pytorch.org serve them, or, `on_disk`, as a static index read through file://."""
    made = standins(plan, root.parent / "standins", sass) if real_torch is None else {}
    if real_torch is not None:
        made["torch"] = real_torch
    replaced = {normalize(n) for n in made}
    mirror = [w for w in sorted(MIRROR.glob("*.whl")) if project_of(w.name) not in replaced]
    on_torch_index = [n for n in made if is_torch_triton(n)]
    pypi = mirror + [w for n, w in made.items() if n not in ("torch", "flash-attn", "flash-attn-3", *on_torch_index)] \
        + list(extra_pypi)
    write_simple_index(root, "pypi", pypi, style="local" if on_disk else "pypi")
    # flash-attn-3 is on the PyTorch index, in the torch build's variant folder; so is a ROCm/XPU torch's triton
    torch_index = [made["torch"]] + ([made["flash-attn-3"]] if serve_flash_attn and "flash-attn-3" in made else []) \
        + [made[n] for n in on_torch_index if serve_torch_triton]
    write_simple_index(root, f"torch/{plan['torch']['variant']}", torch_index,
                       style="local" if on_disk else "pytorch")
    if serve_flash_attn and "flash-attn" in made:
        fa = plan["flash_attn"]
        target = root / "gh" / f"v{fa['version']}"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(made["flash-attn"], target / fa["filename"])


def index_env(url: str) -> dict[str, str]:
    """Point every URL a plan names at the local server."""
    return {"ENVTOOL_TORCH_INDEX_URL": f"{url}/torch/{{variant}}/",
            "ENVTOOL_FLASH_ATTN_URL": f"{url}/gh/v{{version}}/{{filename}}"}


def make_ca_and_server_cert(directory: Path) -> tuple[Path, Path, Path]:
    """A private CA and a certificate for 127.0.0.1 signed by it (like a proxy's), made with openssl."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr",
                                                            "server.pem"))
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth\n")
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=envtool test CA",
        "-keyout", str(ca_key), "-out", str(ca))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "2",
        "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key
