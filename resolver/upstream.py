"""Reading package metadata from a PyPI-compatible index: what `envtool matrix update` regenerates from.

Three sources, all overridable with --pypi-url / $ENVTOOL_PYPI_URL (a mirror serving the same paths):
- the JSON API `{pypi}/pypi/{name}/json`: every release with its files (filename, requires_python, yanked);
- the PEP 691 JSON simple API `{pypi}/simple/{name}/`, whose `core-metadata` (PEP 714; older name
  `data-dist-info-metadata`) says a wheel's METADATA is served beside it as `<wheel url>.metadata` (PEP 658);
- where an index does not serve PEP 658 files, the wheel's own METADATA member, read with HTTP range requests
  (the zip's central directory, then that one member: a few hundred KB of a 900 MB torch wheel).

Imported only by the `matrix` commands: requests stays off `envtool resolve`'s path.
"""

from __future__ import annotations

import io
import json as jsonlib
import os
import re
import threading
import zipfile
from email.message import Message
from email.parser import HeaderParser
from typing import Callable, Mapping, NamedTuple
from urllib.parse import urljoin

import requests
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from . import __version__
from .errors import EnvtoolError

PYPI_URL_ENV = "ENVTOOL_PYPI_URL"
DEFAULT_PYPI_URL = "https://pypi.org"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
TIMEOUT = (10, 60)  # connect, read (seconds): each socket operation
# Everything an index or server sends is untrusted: each fetch has an overall deadline (a server dripping a byte
# every few seconds never trips the read timeout), each answer a size cap (read in chunks, stopped at the cap), and
# a zip member is never unpacked past its cap. Real answers are far below each: PyPI's torch page is 0.2 MB, a
# METADATA at most a few hundred KB.
DEADLINE = 180.0  # seconds for one fetch, from connecting to its last byte
MIB = 2 ** 20
MAX_BODY = 64 * MIB  # one answer
MAX_MEMBER = 16 * MIB  # one METADATA (PEP 658 file or zip member), unpacked
MAX_RANGE_READ = 64 * MIB  # all range requests into one remote wheel together
RANGE_BLOCK = 512 * 1024


class UpstreamError(EnvtoolError):
    """Exit code 1: an upstream server could not be reached or answered with an error."""


class Unreachable(UpstreamError):
    """No answer at all (DNS, connection refused, timeout): the server's facts are unread, not wrong."""


class Answer(NamedTuple):
    """A server's answer, read whole within the deadline and the size cap."""

    url: str
    status_code: int
    reason: str
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        """The body as JSON; UpstreamError (naming the URL) where it is not JSON or nested too deep to read."""
        try:
            return jsonlib.loads(self.content)
        except RecursionError:
            raise UpstreamError(f"{self.url}: the JSON answer is nested too deep to read") from None
        except ValueError:
            raise UpstreamError(f"{self.url}: the answer is not JSON "
                                f"({self.headers.get('Content-Type', '?')})") from None


def pypi_url(option: str | None = None) -> str:
    return (option or os.environ.get(PYPI_URL_ENV) or DEFAULT_PYPI_URL).rstrip("/")


class WheelFile(NamedTuple):
    filename: str
    url: str
    version: Version
    python: tuple[int, int] | None  # from the cpXY / pyXY tag; None for a plain py3 wheel
    later: bool  # also installs on every later Python (a cpXY-abi3 or pyXY-none wheel)
    platforms: frozenset[str]  # the platform tags, e.g. {"manylinux_2_28_x86_64"}
    requires_python: str | None
    yanked: bool

    def for_linux(self, machine: str) -> bool:
        return any(p.startswith(("manylinux", "linux")) and p.endswith(machine) for p in self.platforms)


class Release(NamedTuple):
    version: Version
    files: list[WheelFile]  # wheels only
    requires_python: str | None  # of its files (they agree on every project envtool reads)
    yanked: bool  # every file yanked


class Project(NamedTuple):
    name: str
    releases: dict[Version, Release]

    def final(self) -> list[Release]:
        """Releases a resolver would pick: not pre/dev releases, not (wholly) yanked, with files; oldest first."""
        return sorted((r for r in self.releases.values() if not r.version.is_prerelease and not r.yanked),
                      key=lambda r: r.version)


class Client:
    """A requests session with timeouts, one-line errors, a response cache and a progress hook."""

    def __init__(self, base_url: str, *, on_request: Callable[[str], None] | None = None):
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        self.session.headers["User-Agent"] = f"envtool/{__version__} (matrix update)"
        self.on_request = on_request or (lambda url: None)
        self._projects: dict[str, Project] = {}
        self._simple: dict[str, dict[str, dict]] = {}
        self._metadata: dict[str, Message] = {}

    # ------------------------------------------------------------------ HTTP

    def get(self, url: str, *, accept: str | None = None, headers: dict | None = None,
            ok: tuple[int, ...] = (200,), limit: int | None = None) -> Answer:
        """The answer at `url`, read whole (its body only where its status is in `ok`); UpstreamError where the
        server cannot be reached, answers another status, sends more than `limit` bytes or takes longer than
        DEADLINE seconds in all. limit: MAX_BODY where None."""
        limit = MAX_BODY if limit is None else limit
        self.on_request(url)
        h = dict(headers or {})
        if accept:
            h["Accept"] = accept
        answer = self._within_deadline(url, lambda: self._fetch(url, h, ok, limit))
        if answer.status_code not in ok:
            raise UpstreamError(f"{url}: HTTP {answer.status_code} {answer.reason or ''}".rstrip())
        return answer

    @staticmethod
    def _within_deadline(url: str, work: Callable[[], object]):
        """work() (one fetch of `url`), in a thread of its own so DEADLINE holds whatever the server does (drips a
        byte at a time in the headers or the body): a fetch left running past it dies with the process."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["value"] = work()
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        worker = threading.Thread(target=run, name=f"envtool fetch {url[:200]}", daemon=True)
        worker.start()
        worker.join(DEADLINE)
        if worker.is_alive():
            raise UpstreamError(f"{url}: no complete answer within {DEADLINE:g} s (the server sends too slowly); "
                                "not read further")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _fetch(self, url: str, headers: dict, ok: tuple[int, ...], limit: int) -> Answer:
        try:
            with self.session.get(url, headers=headers, timeout=TIMEOUT, stream=True) as r:
                body = bytearray()
                if r.status_code in ok:
                    declared = r.headers.get("Content-Length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise UpstreamError(f"{url}: the answer is {int(declared)} bytes, over the "
                                            f"{limit / MIB:g} MiB read from one; not read")
                    for chunk in r.iter_content(64 * 1024):
                        body += chunk
                        if len(body) > limit:
                            raise UpstreamError(f"{url}: the answer is over the {limit / MIB:g} MiB read from one; "
                                                "not read further")
                return Answer(url, r.status_code, r.reason or "", r.headers, bytes(body))
        except requests.RequestException as e:
            raise Unreachable(f"cannot reach {url}: {_reason(e)}") from None

    def json(self, url: str, *, accept: str | None = None):
        return self.get(url, accept=accept).json()

    # ------------------------------------------------------------------ the JSON API

    def project(self, name: str) -> Project:
        key = canonicalize_name(name)
        if key not in self._projects:
            url = f"{self.base_url}/pypi/{key}/json"
            self._projects[key] = parse_project(self.json(url), url)
        return self._projects[key]

    # ------------------------------------------------------------------ PEP 691 + PEP 658

    def simple_files(self, name: str) -> dict[str, dict]:
        """filename -> the PEP 691 file entry (with absolute url)."""
        key = canonicalize_name(name)
        if key not in self._simple:
            url = f"{self.base_url}/simple/{key}/"
            r = self.get(url, headers={"Accept": SIMPLE_JSON}, ok=(200, 404, 406))
            if r.status_code != 200 or "json" not in r.headers.get("Content-Type", ""):
                self._simple[key] = {}  # no PEP 691 here (an older mirror): no PEP 658 either; wheels are read
                return self._simple[key]
            self._simple[key] = parse_simple(r.json(), url)
        return self._simple[key]

    def metadata(self, name: str, wheel: WheelFile) -> Message:
        """The wheel's core metadata (METADATA): its PEP 658 file when the index serves one, else read from
        the wheel with range requests."""
        if wheel.filename in self._metadata:
            return self._metadata[wheel.filename]
        entry = self.simple_files(name).get(wheel.filename)
        advertised = entry and (entry.get("core-metadata") or entry.get("data-dist-info-metadata"))
        url = entry["url"] if entry else wheel.url
        if advertised:
            text = self.get(url + ".metadata", limit=MAX_MEMBER).text
        else:
            text = self.metadata_from_wheel(url)
        message = HeaderParser().parsestr(text)
        self._metadata[wheel.filename] = message
        return message

    def metadata_from_wheel(self, url: str) -> str:
        text = self.wheel_member(url, r"[^/]+\.dist-info/METADATA")
        if text is None:
            raise UpstreamError(f"{url}: no single *.dist-info/METADATA in the wheel")
        return text

    def wheel_member(self, url: str, pattern: str) -> str | None:
        """The text of the one member of a remote wheel whose path matches `pattern` (None: no single one), read
        with range requests (the zip's central directory, then that member)."""
        remote = _RangeFile(self, url)
        try:
            with zipfile.ZipFile(remote) as z:
                names = [n for n in z.namelist() if re.fullmatch(pattern, n)]
                if len(names) != 1:
                    return None
                info = z.getinfo(names[0])
                if info.file_size > MAX_MEMBER:
                    raise UpstreamError(f"{url}: its {names[0]} is {info.file_size} bytes unpacked, over the "
                                        f"{MAX_MEMBER / MIB:g} MiB read from one; not read")
                with z.open(info) as member:  # the size in the header may lie: never unpack past the cap
                    data = member.read(MAX_MEMBER + 1)
                if len(data) > MAX_MEMBER:
                    raise UpstreamError(f"{url}: its {names[0]} unpacks past the {MAX_MEMBER / MIB:g} MiB read "
                                        "from one; not read further")
                return data.decode("utf-8", "replace")
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError,
                RuntimeError, RecursionError) as e:
            raise UpstreamError(f"{url}: not a readable wheel ({type(e).__name__}: {str(e)[:160]})") from None

    # ------------------------------------------------------------------ HEAD (verify)

    def exists(self, url: str) -> tuple[bool, str]:
        """(found, what the server said) after following redirects; servers that refuse HEAD get a GET."""
        self.on_request(url)
        return self._within_deadline(url, lambda: self._exists(url))

    def _exists(self, url: str) -> tuple[bool, str]:
        try:
            r = self.session.head(url, allow_redirects=True, timeout=TIMEOUT)
            if r.status_code in (403, 405, 501):  # some CDNs answer HEAD differently from GET
                r = self.session.get(url, allow_redirects=True, timeout=TIMEOUT, stream=True)
                r.close()
        except requests.RequestException as e:
            raise UpstreamError(f"cannot reach {url}: {_reason(e)}") from None
        return r.status_code == 200, f"HTTP {r.status_code}"


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file, fetched in blocks with HTTP Range requests. Every answer's
    Content-Range must be the range asked for, with that many bytes (a server that says otherwise is an error,
    never a loop), and all the blocks together stay within MAX_RANGE_READ."""

    def __init__(self, client: Client, url: str):
        self.client, self.url, self.pos, self.fetched = client, url, 0, 0
        self.blocks: dict[int, bytes] = {}
        self._tail_start: int | None = None
        self._tail = b""
        # The last block also tells the size (Content-Range: bytes a-b/SIZE).
        r = client.get(url, headers={"Range": f"bytes=-{RANGE_BLOCK}"}, ok=(206, 200), limit=MAX_RANGE_READ)
        if r.status_code == 200:  # no range support: the whole file came back (within the cap)
            self.size = len(r.content)
            self.blocks = {i: r.content[i * RANGE_BLOCK:(i + 1) * RANGE_BLOCK]
                           for i in range(self.size // RANGE_BLOCK + 1)}
            return
        start, end, self.size = self._checked(r, None)
        if end != self.size - 1:
            raise UpstreamError(f"{url}: asked for the last {RANGE_BLOCK} bytes, the server sent bytes {start}-{end} "
                                f"of {self.size} (Content-Range: {r.headers.get('Content-Range')})")
        # Kept as it came: the tail may start mid-block.
        self._tail_start, self._tail = start, r.content

    def _checked(self, r: Answer, asked: tuple[int, int] | None) -> tuple[int, int, int]:
        """(first, last, size) of a 206 answer, checked against what was asked and what came."""
        header = r.headers.get("Content-Range", "")
        m = _CONTENT_RANGE.fullmatch(header.strip())
        if not m:
            raise UpstreamError(f"{self.url}: a range request came back without a valid Content-Range "
                                f"({header[:80] or 'none'})")
        first, last, size = map(int, m.groups())
        self.fetched += len(r.content)
        problem = ("its range is not within its size" if not first <= last < size else
                   f"not the bytes {asked[0]}-{asked[1]} asked for" if asked and (first, last) != asked else
                   f"it carries {len(r.content)} bytes" if len(r.content) != last - first + 1 else
                   f"a size of {size}, not the {self.size} it said before" if asked and size != self.size else
                   f"over {MAX_RANGE_READ / MIB:g} MiB read from it in all" if self.fetched > MAX_RANGE_READ else "")
        if problem:
            raise UpstreamError(f"{self.url}: the server's Content-Range does not hold ({header}: {problem})")
        return first, last, size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")  # a zip directory pointing before the file
        self.pos = pos
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            chunk = self._chunk(self.pos, end)
            if not chunk:  # never spin on an empty answer
                raise UpstreamError(f"{self.url}: a range request came back short")
            out += chunk
            self.pos += len(chunk)
        return bytes(out)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def _chunk(self, pos: int, end: int) -> bytes:
        tail_start = self._tail_start
        if tail_start is not None and pos >= tail_start:
            return self._tail[pos - tail_start:end - tail_start]
        index = pos // RANGE_BLOCK
        if index not in self.blocks:
            first = index * RANGE_BLOCK
            last = min(self.size, first + RANGE_BLOCK) - 1
            if tail_start is not None:
                last = min(last, tail_start - 1)
            r = self.client.get(self.url, headers={"Range": f"bytes={first}-{last}"}, ok=(206,),
                                limit=last - first + 1)
            self._checked(r, (first, last))
            self.blocks[index] = r.content
        block = self.blocks[index]
        offset = pos - index * RANGE_BLOCK
        if offset >= len(block):
            raise UpstreamError(f"{self.url}: a range request came back short")
        return block[offset:offset + (end - pos)]


def _reason(e: Exception) -> str:
    text = str(e)
    for pattern in (r"Failed to resolve '[^']+'", r"Connection refused", r"timed out", r"Name or service not known",
                    r"CERTIFICATE_VERIFY_FAILED"):
        m = re.search(pattern, text)
        if m:
            return m.group(0)
    return type(e).__name__ + (f": {text[:160]}" if text else "")


# ---------------------------------------------------------------------------- parsing


def _typed(value, types: type | tuple[type, ...], url: str, where: str):
    """`value` where it is one of `types`; else UpstreamError naming the URL, the place and what came."""
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                                                 else (types,))):
        return value
    names = {str: "a string", list: "a list", dict: "an object", bool: "true or false", type(None): "null",
             int: "a number", float: "a number"}
    wanted = " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in (types if isinstance(types, tuple)
                                                                          else (types,))))
    came = names.get(type(value), type(value).__name__)
    raise UpstreamError(f"{url}: {where} is {came}, not {wanted}")


def parse_project(data: dict, url: str) -> Project:
    """A PyPI JSON API project page; UpstreamError (one line naming the URL and the field) where a value has the
    wrong type."""
    if not isinstance(data, dict) or not isinstance(data.get("releases"), dict):
        raise UpstreamError(f"{url}: not a PyPI JSON API project page (no 'releases' object)")
    info = _typed(data.get("info", {}), dict, url, "info")
    given = _typed(info.get("name"), (str, type(None)), url, "info.name")
    name = canonicalize_name(given or url.rstrip("/").split("/")[-2])
    releases: dict[Version, Release] = {}
    for text, files in data["releases"].items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        where = f"releases[{text[:40]!r}]"
        wheels, requires, yanked = [], None, bool(files)
        for i, f in enumerate(_typed(files, (list, type(None)), url, where) or []):
            _typed(f, dict, url, f"{where}[{i}]")
            requires = requires or _typed(f.get("requires_python"), (str, type(None)), url,
                                          f"{where}[{i}].requires_python")
            yanked = yanked and bool(_typed(f.get("yanked", False), (bool, str, type(None)), url,
                                            f"{where}[{i}].yanked"))
            wheel = parse_wheel(f, url, f"{where}[{i}]")
            if wheel:
                wheels.append(wheel)
        releases[version] = Release(version, wheels, requires, yanked if files else True)
    return Project(name, releases)


def parse_wheel(f: dict, base: str, where: str = "a file") -> WheelFile | None:
    filename = _typed(f.get("filename", ""), str, base, f"{where}.filename")
    if not filename.endswith(".whl"):
        return None
    try:
        _, version, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    pythons = {(3, int(t.interpreter[3:])) for t in tags if re.fullmatch(r"(cp|py)3\d+", t.interpreter)}
    later = any(t.abi == "abi3" or (t.interpreter.startswith("py") and t.abi == "none") for t in tags)
    url = _typed(f.get("url", ""), str, base, f"{where}.url")
    requires = _typed(f.get("requires_python"), (str, type(None)), base, f"{where}.requires_python")
    yanked = _typed(f.get("yanked", False), (bool, str, type(None)), base, f"{where}.yanked")
    return WheelFile(filename=filename, url=urljoin(base, url), version=version,
                     python=min(pythons) if pythons else None, later=later,
                     platforms=frozenset(t.platform for t in tags), requires_python=requires, yanked=bool(yanked))


def parse_simple(data, url: str) -> dict[str, dict]:
    """A PEP 691 project page: filename -> its file entry (with an absolute url); UpstreamError (one line naming
    the URL and the field) where a value has the wrong type."""
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise UpstreamError(f"{url}: not a PEP 691 project page (no 'files' list)")
    out = {}
    for i, f in enumerate(data["files"]):
        where = f"files[{i}]"
        _typed(f, dict, url, where)
        if "filename" not in f or "url" not in f:
            continue
        filename = _typed(f["filename"], str, url, f"{where}.filename")
        for key in ("core-metadata", "data-dist-info-metadata"):
            _typed(f.get(key), (bool, dict, str, type(None)), url, f"{where}.{key}")
        out[filename] = dict(f, url=urljoin(url, _typed(f["url"], str, url, f"{where}.url")))
    return out


def python_range(release: Release, machine: str = "x86_64") -> str | None:
    """The Pythons the release's Linux wheels for `machine` install on, as ">=3.10,<3.15" (the cpXY tags,
    within its Requires-Python), or ">=3.9" where a cpXY-abi3 / pyXY-none wheel covers every later Python."""
    wheels = [w for w in release.files if w.python and w.for_linux(machine) and not w.yanked]
    spec = SpecifierSet()
    if release.requires_python:
        try:
            spec = SpecifierSet(release.requires_python)
        except InvalidSpecifier:
            pass
    pythons = sorted({w.python for w in wheels if spec.contains(f"{w.python[0]}.{w.python[1]}", prereleases=True)})
    if not pythons:
        return None
    low, high = pythons[0], pythons[-1]
    if any(w.later for w in wheels):
        return f">={low[0]}.{low[1]}"
    return f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


MACHINES = ("x86_64", "aarch64")


def linux_machines(release: Release) -> list[str]:
    """The Linux machines (x86_64, aarch64) the release publishes wheels for."""
    return [m for m in MACHINES if any(w.for_linux(m) and not w.yanked for w in release.files)]


def admits_python(release: Release, python: str) -> bool:
    """Whether pip would install this release on `python` (its Requires-Python)."""
    if not release.requires_python:
        return True
    try:
        return SpecifierSet(release.requires_python).contains(python, prereleases=True)
    except InvalidSpecifier:
        return True


def linux_wheel(release: Release, machine: str = "x86_64") -> WheelFile | None:
    """The release's Linux wheel for `machine` with the lowest CPython tag (not free-threaded): the one whose
    METADATA is read."""
    wheels = [w for w in release.files if w.for_linux(machine) and not w.yanked]
    regular = [w for w in wheels if not re.search(r"-cp3\d+t-", w.filename)] or wheels
    return min(regular, key=lambda w: (w.python or (9, 99), w.filename), default=None)


class Pin(NamedTuple):
    version: str  # the lowest version the requirement accepts ("3.8.0" for ~=3.8.0)
    specifier: str  # as written: "==3.1.0", "~=3.8.0"
    marker: str  # "" when unconditional


def requirement(metadata: Message, name: str) -> Pin | None:
    """The Requires-Dist entry for `name` that applies without extras, if any."""
    # start-up: packaging imported only when this runs
    from packaging.requirements import InvalidRequirement, Requirement

    for line in metadata.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != canonicalize_name(name):
            continue
        marker = str(req.marker) if req.marker else ""
        if "extra ==" in marker:
            continue
        lows = [s.version for s in req.specifier if s.operator in ("==", "~=", ">=", "===") and _version(s.version)]
        return Pin(version=min(lows, key=Version) if lows else "", specifier=str(req.specifier), marker=marker)
    return None


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:  # `===anything` is a valid specifier
        return None


def any_wheel(release: Release) -> WheelFile | None:
    """The wheel whose METADATA stands for the release on Linux: its pure-Python wheel, else its Linux x86_64 one."""
    pure = [w for w in release.files if "any" in w.platforms and not w.yanked]
    return min(pure, key=lambda w: w.filename) if pure else linux_wheel(release)


def requirements(metadata: Message, python: str, machine: str = "x86_64") -> list:
    """The Requires-Dist entries (packaging Requirements) that apply without extras on Linux `machine` with
    `python` ("3.11")."""
    # start-up: packaging imported only when this runs
    from packaging.markers import UndefinedComparison, UndefinedEnvironmentName
    from packaging.requirements import InvalidRequirement, Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": machine,
           "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix", "extra": ""}
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        try:
            applies = req.marker is None or req.marker.evaluate(env)
        except (UndefinedComparison, UndefinedEnvironmentName, InvalidVersion):
            continue  # a marker no installer can evaluate either: skipped like a malformed requirement
        if applies:
            out.append(req)
    return out
