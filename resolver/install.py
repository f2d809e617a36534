"""envtool install: a locked environment into a venv, swapped in atomically, or into an existing interpreter.

The venv path is a symlink into `<venv>.versions/`. Each install builds a new version there with uv (`uv sync
--frozen`, or `uv pip sync` from a wheelhouse when offline), checks that it imports, and only then replaces
the symlink in one rename. A failed or interrupted install leaves the previous venv in place and working;
its half-built version is removed by the next install.

`install_into` is the notebook path (`install --system` / `--python PATH`): `uv pip install` of the lock's
exported requirements (hash-checked) into an interpreter that already exists, never building a CUDA package
from source, and leaving alone a torch that the pipeline decided to keep.

Every environment gets its plan as `<prefix>/plan.json`, where the trainer looks (trainer/runtime/planfile.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import DISTRIBUTION
from .credentials import given, lock_indexes, uv_index_env
from .errors import BadInput, EnvtoolError
from .files import one_writer, write_atomic
from .lock import load_plan
from .plan import PLAN_FILE
from .uvrun import run_uv, uv_env
from .uvrun import uv_binary
from .wheelhouse import check as check_wheelhouse

IMPORT_CHECK = (  # --check-imports: runs them (torch's native libraries load); seconds, mostly compiling bytecode
    "import json, importlib.metadata as md, torch, transformers, trainer; "
    "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, "
    f"'envtool': md.version({DISTRIBUTION!r})}}))"
)
PRESENCE_CHECK = (  # the default: the interpreter starts and finds them, at the installed versions; ~0.1 s
    "import json, importlib.metadata as md, importlib.util as u; "
    "missing = [m for m in ('torch', 'transformers', 'trainer') if u.find_spec(m) is None]; "
    "assert not missing, 'cannot find ' + ', '.join(missing); "
    "print(json.dumps({**{n: md.version(n) for n in ('torch', 'transformers')}, "
    f"'envtool': md.version({DISTRIBUTION!r})}}))"
)


def find_python(version: str) -> str:
    """The interpreter uv would make a Python `version` venv from (never downloading one), or a one-line refusal
    before anything is locked or built."""
    env = uv_env(None, {"UV_PYTHON_DOWNLOADS": "never"})
    out = subprocess.run([uv_binary(), "python", "find", "--no-project", version], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise BadInput(f"the plan is for Python {version} and uv finds no Python {version} interpreter on this "
                       f"machine: install one (`uv python install {version}`) or drop --python to plan for this one")
    return out.stdout.strip()


def versions_dir(venv: Path) -> Path:
    return venv.parent / f"{venv.name}.versions"


def check_host(plan, env_dir: Path) -> None:
    """A lock installs where its wheels run: a macOS arm64 (MPS) lock only on a Mac with Apple silicon, a Linux
    lock only on Linux. One line before anything is made."""
    # start-up: platform imported only when this runs
    import platform

    mac = plan.torch.backend == "mps"
    here_mac = sys.platform == "darwin" and platform.machine() == "arm64"
    if mac and not here_mac:
        raise BadInput(f"{env_dir} is locked for macOS on Apple silicon (MPS: {plan.gpu['name']}): install it on the "
                       f"Mac; here ({sys.platform} {platform.machine()}) its wheels do not run")
    if not mac and sys.platform != "linux":
        raise BadInput(f"{env_dir} is locked for linux {plan.platform}; this is {sys.platform}")


def install(env_dir: Path, venv: Path, *, offline: bool = False, wheelhouse: Path | None = None,
            ca_bundle: str | None = None, quiet: bool = False, check_imports: bool = False,
            secrets: dict | None = None) -> dict:
    env_dir, venv = env_dir.resolve(), Path(os.path.abspath(venv))
    plan = load_plan(env_dir)
    check_host(plan, env_dir)
    if not (env_dir / "uv.lock").is_file():
        raise BadInput(f"{env_dir}: no uv.lock; run `envtool lock` first")
    if venv.exists() and not venv.is_symlink():
        raise BadInput(f"{venv} exists and was not made by `envtool install` (it is not a managed symlink); "
                       f"remove it or choose another --venv")
    if offline:
        wheelhouse = wheelhouse or env_dir / "wheelhouse"
        requirements = check_wheelhouse(wheelhouse)

    source = _Source(offline, wheelhouse, requirements if offline else None, ca_bundle, secrets)
    with one_writer(venv, "the venv"):  # two installs into one venv: the second waits, then swaps in its own
        return _build_and_swap(env_dir, venv, plan, source, quiet=quiet, check_imports=check_imports)


@dataclass(frozen=True)
class _Source:
    """Where an install takes its packages: the lock's indexes (with `secrets`, the index credentials) or, `offline`,
    a hash-checked wheelhouse and its requirements file; `ca_bundle` for a proxy with its own CA."""

    offline: bool
    wheelhouse: Path | None
    requirements: Path | None
    ca_bundle: str | None
    secrets: dict | None


def _build_and_swap(env_dir: Path, venv: Path, plan, source: _Source, *, quiet: bool, check_imports: bool) -> dict:
    store = versions_dir(venv)
    store.mkdir(parents=True, exist_ok=True)
    current = venv.resolve() if venv.is_symlink() else None
    for leftover in store.iterdir():  # half-built versions of interrupted installs, and older ones
        if leftover != current:
            shutil.rmtree(leftover, ignore_errors=True)

    new = store / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    env = uv_env(source.ca_bundle, {"UV_PYTHON_DOWNLOADS": "never"})
    try:
        run_uv(["venv", "--quiet", "--python", plan.python, str(new)], what="Creating the venv", env=env,
               quiet=quiet)
        if source.offline:
            run_uv(["pip", "sync", "--offline", "--no-index", "--find-links", str(source.wheelhouse),
                    "--require-hashes", "--python", str(new / "bin" / "python"), str(source.requirements)],
                   what="Installing from the wheelhouse", env=env, quiet=quiet)
        else:
            run_uv(["sync", "--frozen", "--project", str(env_dir)], what="Installing the locked environment",
                   env={**env, **uv_index_env(lock_indexes(env_dir), source.secrets or given([])),
                        "UV_PROJECT_ENVIRONMENT": str(new)}, quiet=quiet)
        versions = import_check(new / "bin" / "python", full=check_imports)
        (new / PLAN_FILE).write_text(plan.to_json() + "\n")
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    link = venv.parent / f".{venv.name}.link-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(new)
    os.replace(link, venv)  # the one atomic step: the venv path now names the finished environment
    return {"venv": str(venv), "path": str(new), "previous": str(current) if current else None, **versions}


def import_check(python: Path, what: str = "the new environment",
                 after: str = "the previous venv was left as it was", full: bool = False) -> dict:
    """torch, transformers and the trainer are there (full: they import); their versions."""
    out = subprocess.run([str(python), "-c", IMPORT_CHECK if full else PRESENCE_CHECK], capture_output=True,
                         text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EnvtoolError(f"{what} does not {'import' if full else 'have'} torch, transformers and the trainer: "
                           f"{last}; {after}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def interpreter_prefix(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    if out.returncode != 0:
        raise BadInput(f"--python {python}: not a Python interpreter that runs")
    return Path(out.stdout.strip())


def install_into(env_dir: Path, python: str, *, keep: tuple[str, ...] = (), no_build: list[str] = (),
                 ca_bundle: str | None = None, quiet: bool = False, check_imports: bool = False,
                 secrets: dict | None = None) -> dict:
    """Install the lock in `env_dir` into the existing interpreter `python` with `uv pip install`.

    Hash-checked (the lock's hashes), CUDA packages (`no_build`) only as wheels, and the packages in `keep`
    (a preinstalled torch the plan was made for) neither reinstalled nor replaced: they are constrained to the
    installed version. The plan goes to `<prefix>/plan.json` when the prefix is writable."""
    env_dir = env_dir.resolve()
    plan = load_plan(env_dir)
    check_host(plan, env_dir)
    if not (env_dir / "uv.lock").is_file():
        raise BadInput(f"{env_dir}: no uv.lock; run `envtool lock` first")
    prefix = interpreter_prefix(python)
    env = uv_env(ca_bundle, {"UV_PYTHON_DOWNLOADS": "never",
                             **uv_index_env(lock_indexes(env_dir), secrets or given([]))})
    exported = run_uv(["export", "--frozen", "--no-header", "--no-emit-project", "--emit-index-url",
                       "--emit-find-links", "--format", "requirements-txt", "--project", str(env_dir)],
                      what="Exporting the lock", env=env, quiet=True).stdout
    lines = exported.splitlines()
    constraints = []
    for name in sorted(keep):  # the lock pins the kept package at its installed version; never another one
        version = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                                 capture_output=True, text=True).stdout.strip()
        if version:
            constraints.append(f"{name}=={version}")
    work = env_dir / f".system-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        (work / "requirements.txt").write_text("\n".join(lines) + "\n")
        (work / "constraints.txt").write_text("\n".join(constraints) + "\n")
        args = ["pip", "install", "--python", python, "--require-hashes", "-r", str(work / "requirements.txt"),
                "-c", str(work / "constraints.txt")]
        for package in sorted(set(no_build)):
            args += ["--only-binary", package]
        run_uv(args, what=f"Installing into {python}", env=env, cwd=env_dir, quiet=quiet)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    versions = import_check(Path(python), what=python, after="see the uv output above", full=check_imports)
    plan_path = prefix / PLAN_FILE
    try:
        write_atomic(plan_path, plan.to_json() + "\n")
        written = str(plan_path)
    except OSError:
        written = None  # a read-only prefix: the trainer then needs ENVTOOL_PLAN (the CLI says so)
    return {"python": python, "prefix": str(prefix), "plan": written, "kept": constraints, **versions}
