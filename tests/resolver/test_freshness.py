"""Freshness (issue 43): a matrix row that says when it was checked is stale once the captured upstream metadata
(tests/resolver/data/upstream/pypi/*.json, PyPI's JSON API pages as capture.py trims them) shows a release newer
than the row's that was uploaded after that date. Re-capturing the metadata (capture.py) makes this fail until
`envtool matrix update` (or a human, for what it leaves for review) brings the rows forward.

Rows checked: packages.toml [[stack]] (each pinned package, releases admitting the row's lowest Python, a `hold`
respected), the newest [[kernels_release]], and torch.toml [[release]] (the newest patch of each minor). The date of
a row is the latest YYYY-MM-DD its source names; a row whose source names none is not judged here.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPI = Path(__file__).resolve().parent / "data" / "upstream" / "pypi"
DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")


def captured() -> dict[str, dict[Version, tuple[str, str | None]]]:
    """name -> {final version: (upload date, Requires-Python)} of the captured PyPI pages (yanked files left out)."""
    out = {}
    for page in sorted(PYPI.glob("*.json")):
        releases = {}
        for text, files in json.loads(page.read_text())["releases"].items():
            files = [f for f in files if not f.get("yanked")]
            version = Version(text)
            if files and not version.is_prerelease:
                releases[version] = (min(f["upload_time_iso_8601"][:10] for f in files), files[0].get("requires_python"))
        out[page.stem] = releases
    return out


def checked(row: dict) -> str | None:
    dates = DATE.findall(str(row.get("source", "")))
    return max(dates) if dates else None


def lowest_python(spec: str) -> str:
    return next(f"3.{n}" for n in range(0, 40) if SpecifierSet(spec).contains(f"3.{n}"))


def stale_rows(packages: dict, torch: dict, upstream: dict) -> list[str]:
    found = []

    def newer(name: str, than: str, date: str, fits=lambda v, rp: True) -> list[str]:
        return [f"{name} {v} (uploaded {up})" for v, (up, rp) in sorted(upstream.get(name, {}).items())
                if v > Version(than) and up > date and fits(v, rp)]

    for row in packages.get("stack", []):
        date = checked(row)
        if date is None:
            continue
        python = lowest_python(row["python"])
        holds = {n: SpecifierSet(s) for n, s in row.get("hold", {}).items()}
        for name, pin in row["packages"].items():
            def fits(v, rp, name=name):
                return (not rp or SpecifierSet(rp).contains(python)) and (name not in holds or holds[name].contains(v))
            for release in newer(name, pin, date, fits):
                found.append(f"packages.toml [[stack]] python{row['python']} (checked {date}): {release}")
    kernels = packages.get("kernels_release", [])
    if kernels:
        top = max(kernels, key=lambda r: Version(r["version"]))
        date = checked(top)
        for release in newer("kernels", top["version"], date or "0000-00-00"):
            found.append(f"packages.toml [[kernels_release]] {top['version']} (checked {date}): {release}")
    for row in torch.get("release", []):
        date = checked(row)
        if date is None:
            continue
        minor = Version(row["version"]).release[:2]
        for release in newer("torch", row["version"], date, lambda v, rp: v.release[:2] == minor):
            found.append(f"torch.toml torch {row['version']} (checked {date}): {release}")
    return found


def matrices() -> tuple[dict, dict]:
    return (tomllib.loads((ROOT / "matrices" / "packages.toml").read_text()),
            tomllib.loads((ROOT / "matrices" / "torch.toml").read_text()))


def test_no_row_is_older_than_the_newest_upstream_release_the_captured_metadata_shows():
    packages, torch = matrices()
    stale = stale_rows(packages, torch, captured())
    assert stale == [], "stale rows (run `envtool matrix update`, then re-capture):\n" + "\n".join(stale)


def test_a_release_uploaded_after_a_rows_check_makes_it_stale():
    """The same check on the captured metadata plus one release each, uploaded the day after the rows were
    checked: each row they outdate is named; a release the row's hold excludes is not."""
    packages, torch = matrices()
    upstream = copy.deepcopy(captured())
    upstream["peft"][Version("0.23.0")] = ("2026-12-08", ">=3.11")
    upstream["transformers"][Version("5.26.0")] = ("2026-12-08", ">=3.11")  # past the row's hold <5.24
    upstream["kernels"][Version("0.20.0")] = ("2026-12-08", ">=3.10")
    upstream["torch"][Version("2.15.1")] = ("2026-12-08", ">=3.10")
    stale = "\n".join(stale_rows(packages, torch, upstream))
    assert "[[stack]] python>=3.11 (checked 2026-12-07): peft 0.23.0 (uploaded 2026-12-08)" in stale
    assert "transformers 5.26.0" not in stale
    assert "[[kernels_release]] 0.19.1 (checked 2026-12-07): kernels 0.20.0" in stale
    assert "torch 2.15.0" in stale and "torch 2.15.1 (uploaded 2026-12-08)" in stale
