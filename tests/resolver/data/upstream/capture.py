"""Re-capture the upstream metadata the `envtool matrix` tests serve (run by hand; the tests never go online).

    PYTHONPATH=$PWD .venv/bin/python tests/resolver/data/upstream/capture.py [https://pypi.org [NAME ...]]
    PYTHONPATH=$PWD .venv/bin/python tests/resolver/data/upstream/capture.py --pytorch-git DIR TAG [TAG ...]

The second form copies PyTorch's release build matrix files (resolver/buildmatrix.py: the matrix script and the
arch-list files) at each tag out of a pytorch/pytorch git directory, byte for byte (`git show TAG:PATH`), to
pytorch/<tag>/<path> here, and adds a line per file to pytorch/SOURCES.md (repository, tag, path, commit, date
read); a path the tag does not have is left out (the update reads the next one). tests/support/upstream.py serves
them at /pytorch/<tag>/<path>.

Writes, next to this file, trimmed but format-faithful copies of real answers:
- pypi/<name>.json: the JSON API project page, with the releases the tests need (from the oldest version the
  matrices pin) and, per release, its Linux wheels and sdist (plus one macOS wheel of torch, which the update
  must ignore); `info.description` emptied. Every kept value is as PyPI sent it.
- simple/<name>.json: the PEP 691 project page, the same files. Where the index did not advertise PEP 658
  metadata (the mirror these were captured from does not), the `core-metadata` / `data-dist-info-metadata`
  keys are added in PyPI's format (PEP 714) with the sha256 of the captured METADATA, as pypi.org serves them.
- metadata/<wheel filename>.metadata: the wheel's METADATA (read with range requests from the real wheel),
  its headers as published and its long description dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from packaging.version import Version

from resolver.upstream import Client, linux_wheel, parse_project

HERE = Path(__file__).parent
FLOORS = {"torch": "2.4.0", "xformers": "0.0.28", "flash-attn": "2.7.4", "triton": "3.0.0",
          "transformers": "4.57.0", "peft": "0.17.0", "trl": "0.24.0", "accelerate": "1.10.0", "datasets": "4.4.0",
          "deepspeed": "0.19.0", "bitsandbytes": "0.48.0", "kernels": "0.9.0", "vllm": "0.22.0",
          "flash-attn-4": "4.0.0b39"}
METADATA_OF = {"torch", "xformers"}
# The training stack's packages: per release, the members of its wheel `envtool matrix update` reads (METADATA
# without its long description, and the runtime version table of RUNTIME_TABLES) go to wheels/<filename>.json;
# the stand-in server rebuilds a wheel of just those members (tests/support/upstream.py).
WHEELS_OF = {"transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "vllm", "flash-attn-4"}
# Projects with pre-releases only (flash-attn-4: 4.0.0b*): their wheels are captured from the pre-releases kept.
# Their wheel's RECORD is kept too: the files it installs (flash_attn/cute/*) decide which packages clash.
RECORD_OF = {"flash-attn-4"}


def keep_file(name: str, f: dict) -> bool:
    fn = f["filename"]
    if fn.endswith(".tar.gz"):
        return True
    linux = ("manylinux" in fn or "linux_" in fn) and ("x86_64" in fn or "aarch64" in fn)
    if name in ("torch", "xformers", "triton"):
        return linux or (name == "torch" and fn.endswith("-cp312-cp312-macosx_14_0_arm64.whl"))
    return fn.endswith(".whl")


def main(base: str, names: list[str] | None = None) -> None:
    client = Client(base)
    for name, floor in FLOORS.items():
        if names and name not in names:
            continue
        data = client.json(f"{base}/pypi/{name}/json")
        data["info"]["description"] = ""
        releases = {}
        dev_kept = 0
        for text, files in data["releases"].items():
            v = Version(text)
            if v < Version(floor):
                continue
            if v.is_prerelease:
                dev_kept += 1
                if dev_kept > 2:
                    continue
            releases[text] = [f for f in files if keep_file(name, f)]
        data["releases"] = releases
        data["urls"] = [f for f in data.get("urls", []) if keep_file(name, f)]
        data["vulnerabilities"] = []
        (HERE / "pypi").mkdir(exist_ok=True)
        (HERE / "pypi" / f"{name}.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")
        if name in WHEELS_OF:
            capture_wheels(client, name, parse_project(data, f"{base}/pypi/{name}/json"))
        if name not in METADATA_OF:
            continue
        project = parse_project(data, f"{base}/pypi/{name}/json")
        kept = {f["filename"] for files in releases.values() for f in files}
        simple = client.json(f"{base}/simple/{name}/", accept="application/vnd.pypi.simple.v1+json")
        simple["files"] = [f for f in simple["files"] if f["filename"] in kept]
        by_name = {f["filename"]: f for f in simple["files"]}
        (HERE / "metadata").mkdir(exist_ok=True)
        wheels = [linux_wheel(r) for r in project.final()]
        if name == "torch":  # where the triton marker names no machine, the aarch64 wheel is read too
            for release in project.final():
                x86 = linux_wheel(release)
                if x86 is not None and "platform_machine" not in str(client.metadata(name, x86).get_all("Requires-Dist")):
                    wheels.append(linux_wheel(release, "aarch64"))
        for wheel in wheels:
            if wheel is None:
                continue
            text = client.metadata(name, wheel).as_string()
            head = client.metadata_from_wheel(by_name[wheel.filename]["url"]).split("\n\n", 1)[0] + "\n\n"
            (HERE / "metadata" / f"{wheel.filename}.metadata").write_text(head)
            digest = {"sha256": hashlib.sha256(head.encode()).hexdigest()}
            entry = by_name[wheel.filename]
            entry.setdefault("core-metadata", digest)
            entry.setdefault("data-dist-info-metadata", digest)
            del text
        (HERE / "simple").mkdir(exist_ok=True)
        (HERE / "simple" / f"{name}.json").write_text(json.dumps(simple, separators=(",", ":")) + "\n")
        print(name, len(releases), "releases")


def capture_wheels(client: Client, name: str, project) -> None:
    from resolver.update import RUNTIME_TABLES
    from resolver.upstream import any_wheel

    (HERE / "wheels").mkdir(exist_ok=True)
    releases = project.final() or sorted(project.releases.values(), key=lambda r: r.version)
    for release in releases:
        wheel = any_wheel(release)
        if wheel is None:
            continue
        members = {}
        text = client.wheel_member(wheel.url, r"[^/]+\.dist-info/METADATA")
        info = f"{wheel.filename.split('-')[0]}-{release.version}.dist-info"
        members[f"{info}/METADATA"] = text.split("\n\n", 1)[0] + "\n\n"
        if name in RECORD_OF:
            members[f"{info}/RECORD"] = client.wheel_member(wheel.url, r"[^/]+\.dist-info/RECORD")
        if name in RUNTIME_TABLES:
            path = RUNTIME_TABLES[name].replace("\\", "")
            members[path] = client.wheel_member(wheel.url, RUNTIME_TABLES[name])
        (HERE / "wheels" / f"{wheel.filename}.json").write_text(json.dumps(members, indent=1) + "\n")


def capture_pytorch(git_dir: str, tags: list[str]) -> None:
    import datetime
    import subprocess

    from resolver import buildmatrix

    today = datetime.date.today().isoformat()
    sources = HERE / "pytorch" / "SOURCES.md"
    sources.parent.mkdir(exist_ok=True)
    if not sources.exists():
        sources.write_text("# pytorch/pytorch files at release tags, byte for byte (`git show TAG:PATH`)\n\n"
                           "| tag | path | commit | read |\n|---|---|---|---|\n")
    for tag in tags:
        commit = subprocess.run(["git", "-C", git_dir, "rev-parse", f"{tag}^{{commit}}"], capture_output=True,
                                text=True, check=True).stdout.strip()
        for path in (buildmatrix.MATRIX_PATH, buildmatrix.ARCH_TABLE_PATH, buildmatrix.ARCH_SCRIPT_PATH):
            shown = subprocess.run(["git", "-C", git_dir, "show", f"{tag}:{path}"], capture_output=True)
            if shown.returncode != 0:
                continue
            target = HERE / "pytorch" / tag / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(shown.stdout)
            with sources.open("a") as f:
                f.write(f"| {tag} | {path} | {commit} | {today} |\n")
            print(tag, path, len(shown.stdout), "bytes")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pytorch-git"]:
        capture_pytorch(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "https://pypi.org", sys.argv[2:])
