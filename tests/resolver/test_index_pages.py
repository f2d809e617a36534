"""The tests' local index serves pages of the same shape as the real ones (tests/support/captured/, see its
SOURCES.md): download.pytorch.org's percent-encoded `+` and root-relative links, PyPI's absolute links,
HTML-escaped data-requires-python and PEP 691 JSON by content negotiation. A stand-in that drifts from the real
pages would hide bugs like the `%2B` one (`envtool lock --wheelhouse` crashed on the real PyTorch index)."""

import html.parser
import json
import re
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.pypi import LINUX_CP311, MIRROR, make_wheel, serve, write_simple_index

CAPTURED = Path(__file__).resolve().parents[1] / "support" / "captured"
# What uv sends (astral-sh/uv crates/uv-client/src/registry_client.rs)
UV_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


class Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.anchors: list[tuple[dict, str]] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._open, self._text = dict(attrs), ""

    def handle_data(self, data):
        if self._open is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "a" and self._open is not None:
            self.anchors.append((self._open, self._text))
            self._open = None


def shape(page: str) -> dict:
    """What a client relies on in a PEP 503 project page, as a comparable description."""
    parser = Anchors()
    parser.feed(page)
    assert parser.anchors, "no links"
    forms, fragments, attrs = set(), set(), set()
    for a, text in parser.anchors:
        href = a["href"]
        url = urllib.parse.urlsplit(href)
        forms.add("absolute" if url.scheme else "root-relative" if href.startswith("/") else "relative")
        fragments.add(re.sub(r"=[0-9a-f]{64}$", "=<hex64>", url.fragment))
        name = urllib.parse.unquote(url.path.rsplit("/", 1)[-1])
        assert name == text.strip(), (href, text)  # the link names the file it points to
        assert "+" not in url.path, href  # a `+` in a file name is percent-encoded in the link
        attrs |= set(a) - {"href"}
    raw_requires = re.findall(r'data-requires-python="([^"]*)"', page)
    return {"href": forms, "fragment": fragments, "attrs": attrs,
            "requires_python_escaped": all("<" not in v and ">" not in v for v in raw_requires),
            "pluses_encoded": any("%2B" in a["href"] for a, _ in parser.anchors),
            "br": set(re.findall(r"</a>(<br ?/?>)", page)), "trailer": re.findall(r"<!--(\w+) \d+-->\s*$", page)}


def get(url: str, accept: str) -> tuple[str, str]:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=30) as r:
        return r.headers["Content-Type"], r.read().decode()


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """The stand-in's torch page (a local version, like torch+cu126) and PyPI page (a real wheel from the mirror,
    which declares Requires-Python)."""
    root = tmp_path_factory.mktemp("index")
    wheels = tmp_path_factory.mktemp("wheels")
    torch = make_wheel(wheels, "torch", "2.8.0+cu126", tag=LINUX_CP311)
    from tests.support.oracle import require_setup

    require_setup(MIRROR, "the wheel mirror (a real packaging wheel)")
    packaging = next(MIRROR.glob("packaging-*.whl"))
    write_simple_index(root, "whl/cu126", [torch], style="pytorch")
    write_simple_index(root, "simple", [packaging], style="pypi")
    with serve(root) as url:
        yield url


@pytest.mark.parametrize("captured", ["download.pytorch.org-whl-cu126-torch.html",
                                      "download.pytorch.org-whl-cu117-torch-excerpt.html"])
def test_the_torch_index_stand_in_has_download_pytorch_orgs_shape(standin, captured):
    real = shape((CAPTURED / captured).read_text())
    assert real["pluses_encoded"] and real["href"] == {"root-relative"}  # what the captures show
    kind, page = get(f"{standin}/whl/cu126/torch/", UV_ACCEPT)
    assert kind.startswith("text/html")  # asked for JSON first, as uv does: download.pytorch.org has only HTML
    assert shape(page) == real


def test_the_pypi_stand_in_has_pypis_html_shape(standin):
    real = shape((CAPTURED / "pypi.org-simple-packaging.html").read_text())
    assert real["href"] == {"absolute"} and "data-requires-python" in real["attrs"]
    kind, page = get(f"{standin}/simple/packaging/", "text/html")
    assert kind.startswith("text/html")
    ours = shape(page)
    assert ours["attrs"] <= real["attrs"] and "data-requires-python" in ours["attrs"]
    assert {k: v for k, v in ours.items() if k not in ("attrs", "pluses_encoded")} == \
        {k: v for k, v in real.items() if k not in ("attrs", "pluses_encoded")}
    assert '&gt;=' in page  # `>=` HTML-escaped, as PyPI writes it


def test_the_pypi_stand_in_answers_pep_691_json_like_pypi(standin):
    real = json.loads((CAPTURED / "pypi.org-simple-packaging.json").read_text())
    kind, body = get(f"{standin}/simple/packaging/", UV_ACCEPT)
    assert kind == "application/vnd.pypi.simple.v1+json"
    ours = json.loads(body)
    assert set(ours) == set(real) and ours["meta"]["api-version"] == real["meta"]["api-version"]
    assert {tuple(sorted(f)) for f in ours["files"]} == {tuple(sorted(f)) for f in real["files"]}
    (entry,) = ours["files"]
    assert entry["url"].startswith(standin + "/") and re.fullmatch(r"[0-9a-f]{64}", entry["hashes"]["sha256"])
    assert entry["requires-python"] and entry["requires-python"].startswith(">=")


def test_the_shape_check_can_fail():
    """A page written the way the stand-in used to write it (a raw `+`, relative links, no trailer) differs."""
    old = ('<!DOCTYPE html><html><body>\n<a href="../../files/torch-2.8.0+cu126-cp311-cp311-manylinux_2_28_x86_64.whl'
           f'#sha256={"0" * 64}">torch-2.8.0+cu126-cp311-cp311-manylinux_2_28_x86_64.whl</a><br>\n</body></html>\n')
    with pytest.raises(AssertionError):
        shape(old)
    real = shape((CAPTURED / "download.pytorch.org-whl-cu126-torch.html").read_text())
    assert shape(old.replace("+cu126-cp311-cp311-manylinux_2_28_x86_64.whl#", "%2Bcu126-cp311-cp311-manylinux_2_28_x86_64.whl#", 1)) != real
