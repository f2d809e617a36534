"""The wheels the GPU acceptance kit installs on a GPU host that has no network: built here, carried there.

    python bench/gpu/bundle.py [--out bench/gpu/wheels] [--limit-mib 40]

The GPU hosts at hand (issue 28) have Python 3.12 with torch 2.11.0+cu130, triton 3.6, transformers 5.17, peft,
accelerate, safetensors, tokenizers, numpy, pyarrow, pandas, pyyaml, rich, typer, requests, nvidia-ml-py and pytest
(`HOST`), and not datasets, trl, pydantic, tomlkit (`ROOTS`). This script

1. resolves `ROOTS` for CPython 3.12 on manylinux x86_64 (binary wheels only) together with the host's own pins
   (`HOST_VERSIONS`, `HOST_CONSTRAINTS`: transformers 5.17 wants huggingface-hub < 2, so the datasets picked must
   take that hub), with pip's own resolver (`pip install --dry-run --report`, nothing installed here);
2. keeps the packages reached from `ROOTS` without passing through a package of `HOST` (torch's, transformers' and
   the rest of the host's stack are never downloaded: the kit installs next to the machine's own torch);
3. downloads exactly those wheels (`pip download --no-deps`, each pinned) into the ignored folder `--out`, and writes
   `manifest.json` there: name, version, file, sha256 and size of each wheel, the requirements to install, what was
   left out and why; refuses (exit 1, nothing left behind) when the wheels exceed `--limit-mib`.

`check_bundle(folder)` is the check the kit (bench/gpu/kit.py) runs before it installs anything: every wheel of the
manifest present with its size and sha256, no wheel the manifest does not name, the total within the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from trainer.runtime.digest import sha256_file as sha256  # noqa: E402 (stdlib only: runs before anything is installed)

DEFAULT_OUT = Path(__file__).resolve().parent / "wheels"
MANIFEST = "manifest.json"
LIMIT_MIB = 40
MIB = 2 ** 20

PYTHON = os.environ.get("BUNDLE_PYTHON", "3.12")  # (another minor version only to try the kit on this machine)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")  # pip widens each to the older manylinux tags

# What the GPU hosts have already (issue 28). Never downloaded; a root's dependency on one of them is left to the
# host's copy. torch's own dependencies (triton, the nvidia-* libraries, sympy, networkx) are part of it.
HOST = ("torch", "triton", "transformers", "peft", "accelerate", "safetensors", "tokenizers", "numpy", "pyarrow",
        "pandas", "pyyaml", "rich", "typer", "requests", "nvidia-ml-py", "pytest", "sympy", "networkx", "mpmath")
# The host's versions where issue 28 names them (else a stand-in version that satisfies any floor), and transformers
# 5.17's own Requires-Dist on huggingface-hub (its wheel's METADATA): the roots are resolved against these.
HOST_VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
HOST_CONSTRAINTS = ("huggingface-hub>=1.5.0,<2.0",)

# The project's runtime dependencies and its `train` extra that the host lacks, and the build backend that installs
# the project from the working tree. Pins where the newest release does not run beside the host's stack:
#   datasets 5.0.1: 5.1+ needs huggingface-hub >= 1.31 and pyarrow >= 24 (5.2: hub < 3 too), the last to take
#     huggingface-hub >= 0.25, < 2 (transformers 5.17's range) and pyarrow >= 21;
#   trl 1.13.0: the release beside transformers 5.17 (1.16 needs Python >= 3.11 and datasets >= 4.7; 1.13 needs
#     transformers >= 4.56.2, accelerate >= 1.4); the trainer itself does not import trl.
PINS = {"datasets": "datasets==5.0.1", "trl": "trl==1.13.0"}
# Left out, with the reason (written into the manifest):
LEFT_OUT = {
    "uv": "only `envtool lock/install/build` run uv (a 20+ MiB binary wheel); the kit trains in the machine's "
          "environment, so the project is installed with --no-deps",
    "bitsandbytes": "QLoRA/8-bit only (a 60+ MiB wheel); the kit runs no quantized step",
    "deepspeed": "ZeRO only (an sdist that compiles); the kit runs one process",
    "tomli": "Python < 3.11 only",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def roots() -> list[str]:
    """pyproject's dependencies and `train` extra, less the host's stack and LEFT_OUT, pinned by PINS, plus the
    build backend ([build-system].requires)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["train"]
    out: dict[str, str] = {}
    for text in wanted + project["build-system"]["requires"]:
        req = Requirement(text)
        name = canonical(req.name)
        if name in HOST or name in LEFT_OUT or name in out:
            continue
        out[name] = PINS.get(name, str(req))
    return list(out.values())


def _environment() -> dict:
    return {"python_version": PYTHON, "python_full_version": PYTHON + ".3", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _pip_target_options() -> list[str]:
    options = ["--python-version", PYTHON, "--implementation", "cp", "--abi", "cp" + PYTHON.replace(".", ""),
               "--only-binary=:all:"]
    for platform in PLATFORMS:
        options += ["--platform", platform]
    return options


def _host_stand_ins(folder: Path) -> list[str]:
    """A metadata-only wheel per HOST package at the host's version (a local `+host` version, which sorts above
    the index's own release of it), and the constraints that pick them: pip resolves the roots against the host's
    installed stack without fetching torch's (or anything else's) own dependencies."""
    import zipfile

    constraints = list(HOST_CONSTRAINTS)
    for name in HOST:
        version = HOST_VERSIONS.get(name, "999") + "+host"
        stem = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as whl:
            info = f"{stem}.dist-info"
            whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: bench/gpu/bundle.py\n"
                                          "Root-Is-Purelib: true\nTag: py3-none-any\n")
            whl.writestr(f"{info}/RECORD", "")
        constraints.append(f"{name}=={version}")
    return constraints


def resolve(requirements: list[str]) -> dict[str, dict]:
    """{canonical name: pip report's metadata} of the resolution of `requirements` beside the host's stack."""
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        tmp = Path(tmp)
        (tmp / "host").mkdir()
        (tmp / "constraints.txt").write_text("\n".join(_host_stand_ins(tmp / "host")) + "\n")
        report = tmp / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), "--target", str(tmp / "t"), *_pip_target_options(),
                        "--find-links", str(tmp / "host"), "-c", str(tmp / "constraints.txt"), *requirements],
                       check=True)
        data = json.loads(report.read_text())
    return {canonical(item["metadata"]["name"]): item["metadata"] for item in data["install"]}


def closure(requirements: list[str], resolved: dict[str, dict]) -> list[tuple[str, str]]:
    """(name, version) of every package reached from `requirements` through Requires-Dist (markers evaluated for
    CPython 3.12 on Linux x86_64, extras followed) without passing through a HOST package."""
    from packaging.requirements import Requirement

    seen: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in HOST or name not in resolved:
            continue
        extras = set(req.extras)
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        for text in resolved[name].get("requires_dist") or []:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({**_environment(), "extra": e})
                                         for e in (seen[name] or {""})):
                todo.append(dep)
    return sorted((n, resolved[n]["version"]) for n in seen)


def write_manifest(folder: Path, requirements: list[str], limit_mib: float = LIMIT_MIB) -> dict:
    """manifest.json for the wheels in `folder` (written atomically) and returned."""
    wheels = []
    for path in sorted(folder.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        wheels.append({"name": canonical(name), "version": version, "file": path.name, "sha256": sha256(path),
                       "size": path.stat().st_size})
    manifest = {"python": PYTHON, "platforms": list(PLATFORMS), "host": list(HOST), "host_versions": HOST_VERSIONS,
                "host_constraints": list(HOST_CONSTRAINTS),
                "requirements": requirements, "left_out": LEFT_OUT, "limit_mib": limit_mib,
                "total_size": sum(w["size"] for w in wheels), "wheels": wheels}
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(folder / MANIFEST)
    return manifest


MANIFEST_MAX = 4 * MIB  # a real manifest is a few KB


def read_manifest(folder: Path) -> tuple[dict | None, list[str]]:
    """(the manifest, []) or (None, [one line saying why it cannot be read]): a regular file of at most
    MANIFEST_MAX bytes, UTF-8 JSON, an object whose `wheels` is a list and whose `limit_mib` (where given) is a
    number. The folder may come from anywhere (carried to a GPU host): nothing in it is trusted."""
    path = folder / MANIFEST
    try:
        if not path.is_file():
            return None, [f"{path}: " + ("no manifest (build the bundle: python bench/gpu/bundle.py)"
                                         if not path.exists() else "not a regular file")]
        if path.stat().st_size > MANIFEST_MAX:
            return None, [f"{path}: {path.stat().st_size} bytes, over the {MANIFEST_MAX // MIB} MiB a manifest is"]
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return None, [f"{path}: not UTF-8 text"]
    except RecursionError:
        return None, [f"{path}: JSON nested too deep to read"]
    except json.JSONDecodeError as err:
        return None, [f"{path}: not JSON ({err})"]
    except OSError as err:
        return None, [f"{path}: cannot be read ({err.strerror or err})"]
    if not isinstance(manifest, dict):
        return None, [f"{path}: not a JSON object"]
    if not isinstance(manifest.get("wheels", []), list):
        return None, [f"{path}: 'wheels' is not a list"]
    limit = manifest.get("limit_mib", LIMIT_MIB)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        return None, [f"{path}: 'limit_mib' is not a positive number"]
    total = manifest.get("total_size", 0)
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        return None, [f"{path}: 'total_size' is not a number of bytes"]
    # kit.py hands these to pip: requirements only, never an option (--index-url ...)
    requirements = manifest.get("requirements", [])
    if not isinstance(requirements, list) or not all(isinstance(r, str) and r.strip() and not r.lstrip()
                                                     .startswith("-") for r in requirements):
        return None, [f"{path}: 'requirements' is not a list of requirements (no pip options)"]
    return manifest, []


def _entry_problem(folder: Path, i: int, wheel) -> str | None:
    """What is wrong with the manifest's wheel entry `i` as written (None: nothing): an object with a plain
    `*.whl` file name in the folder (never a path out of it), a size in bytes and a sha256."""
    where = f"{folder / MANIFEST}: wheels[{i}]"
    if not isinstance(wheel, dict):
        return f"{where} is not an object"
    missing = [k for k in ("file", "size", "sha256") if k not in wheel]
    if missing:
        return f"{where} has no {', '.join(missing)}"
    name, size, digest = wheel["file"], wheel["size"], wheel["sha256"]
    if not isinstance(name, str) or not name.endswith(".whl") or name != Path(name).name or name.startswith(".") \
            or "\\" in name:
        return f"{where}: file {str(name)[:80]!r} is not a wheel's file name in the folder"
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"{where}: size {str(size)[:40]!r} is not a number of bytes"
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return f"{where}: sha256 {str(digest)[:80]!r} is not a sha256 digest"
    return None


def check_bundle(folder: Path, limit_mib: float | None = None) -> list[str]:
    """What is wrong with the bundle in `folder` (empty: nothing): no manifest or one that cannot be read (each a
    line), a wheel missing or changed (size, sha256), a wheel the manifest does not name, the total over the
    limit (the manifest's, or `limit_mib`)."""
    folder = Path(folder)
    manifest, problems = read_manifest(folder)
    if manifest is None:
        return problems
    wheels = manifest.get("wheels", [])
    problems = [p for p in (_entry_problem(folder, i, w) for i, w in enumerate(wheels)) if p]
    if problems:
        return problems
    named = set()
    for wheel in wheels:
        path = folder / wheel["file"]
        named.add(wheel["file"])
        if path.is_symlink() or (path.exists() and not path.is_file()):
            problems.append(f"{wheel['file']}: not a regular file")
        elif not path.is_file():
            problems.append(f"{wheel['file']}: missing")
        elif path.stat().st_size != wheel["size"]:
            problems.append(f"{wheel['file']}: {path.stat().st_size} bytes, the manifest says {wheel['size']}")
        elif sha256(path) != wheel["sha256"]:
            problems.append(f"{wheel['file']}: sha256 differs from the manifest's")
    problems += [f"{p.name}: not in the manifest" for p in sorted(folder.glob("*.whl")) if p.name not in named]
    total = sum(w["size"] for w in wheels)
    limit = manifest.get("limit_mib", LIMIT_MIB) if limit_mib is None else limit_mib
    if total > limit * MIB:
        problems.append(f"the wheels add up to {total / MIB:.1f} MiB, over the {limit:g} MiB limit")
    return problems


def build(out: Path, limit_mib: float) -> dict:
    requirements = roots()
    resolved = resolve(requirements)
    picked = closure(requirements, resolved)
    staging = Path(tempfile.mkdtemp(prefix=".wheels-", dir=out.parent))
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(staging),
                        *_pip_target_options(), *(f"{n}=={v}" for n, v in picked)], check=True)
        manifest = write_manifest(staging, requirements, limit_mib)
        problems = check_bundle(staging)
        if problems:
            raise SystemExit("bundle.py: " + "; ".join(problems))
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return manifest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    parser.add_argument("--check", action="store_true", help="only check the bundle in --out against its manifest")
    args = parser.parse_args()
    if args.check:
        problems = check_bundle(args.out)
        for p in problems:
            print(f"bundle.py: {p}", file=sys.stderr)
        return 1 if problems else 0
    manifest = build(args.out.resolve(), args.limit_mib)
    for w in manifest["wheels"]:
        print(f"{w['name']:24s} {w['version']:12s} {w['size'] / MIB:6.2f} MiB")
    print(f"{len(manifest['wheels'])} wheels, {manifest['total_size'] / MIB:.1f} MiB in {args.out} "
          f"(limit {args.limit_mib:g} MiB); install: {' '.join(manifest['requirements'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
