"""envtool install: a locked environment into a venv, swapped in atomically.

The venv path is a symlink into `<venv>.versions/`. Each install builds a new version there with uv (`uv sync
--frozen`, or `uv pip sync` from a wheelhouse when offline), checks that it imports, and only then replaces
the symlink in one rename. A failed or interrupted install leaves the previous venv in place and working;
its half-built version is removed by the next install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .errors import BadInput, EnvtoolError
from .lock import load_plan
from .uvrun import run_uv, uv_env
from .wheelhouse import check as check_wheelhouse

PLAN_IN_VENV = "envtool-plan.json"
IMPORT_CHECK = (
    "import json, importlib.metadata as md, torch, transformers, trainer; "
    "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, "
    "'envtool': md.version('envtool')}))"
)


def versions_dir(venv: Path) -> Path:
    return venv.parent / f"{venv.name}.versions"


def install(env_dir: Path, venv: Path, *, offline: bool = False, wheelhouse: Path | None = None,
            ca_bundle: str | None = None, quiet: bool = False) -> dict:
    env_dir, venv = env_dir.resolve(), Path(os.path.abspath(venv))
    plan = load_plan(env_dir)
    if not (env_dir / "uv.lock").is_file():
        raise BadInput(f"{env_dir}: no uv.lock; run `envtool lock` first")
    if venv.exists() and not venv.is_symlink():
        raise BadInput(f"{venv} exists and was not made by `envtool install` (it is not a managed symlink); "
                       f"remove it or choose another --venv")
    if offline:
        wheelhouse = wheelhouse or env_dir / "wheelhouse"
        requirements = check_wheelhouse(wheelhouse)

    store = versions_dir(venv)
    store.mkdir(parents=True, exist_ok=True)
    current = venv.resolve() if venv.is_symlink() else None
    for leftover in store.iterdir():  # half-built versions of interrupted installs, and older ones
        if leftover != current:
            shutil.rmtree(leftover, ignore_errors=True)

    new = store / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    env = uv_env(ca_bundle, {"UV_PYTHON_DOWNLOADS": "never"})
    try:
        run_uv(["venv", "--quiet", "--python", plan["python"], str(new)], what="Creating the venv", env=env,
               quiet=quiet)
        if offline:
            run_uv(["pip", "sync", "--offline", "--no-index", "--find-links", str(wheelhouse), "--require-hashes",
                    "--python", str(new / "bin" / "python"), str(requirements)],
                   what="Installing from the wheelhouse", env=env, quiet=quiet)
        else:
            run_uv(["sync", "--frozen", "--project", str(env_dir)], what="Installing the locked environment",
                   env={**env, "UV_PROJECT_ENVIRONMENT": str(new)}, quiet=quiet)
        versions = import_check(new)
        (new / PLAN_IN_VENV).write_text(json.dumps(plan, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    link = venv.parent / f".{venv.name}.link-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(new)
    os.replace(link, venv)  # the one atomic step: the venv path now names the finished environment
    return {"venv": str(venv), "path": str(new), "previous": str(current) if current else None, **versions}


def import_check(venv: Path) -> dict:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", IMPORT_CHECK], capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EnvtoolError(f"the new environment does not import (torch, transformers, trainer): {last}; "
                           f"the previous venv was left as it was")
    return json.loads(out.stdout.strip().splitlines()[-1])
