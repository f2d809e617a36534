"""`envtool install` of a locked environment against `pip install -r` of the same exported requirements, and
against raw `uv sync --frozen` of the same lock (what envtool install runs, without its venv swap and checks).

All install the real CPU plan (torch 2.13.0's CPU wheel, transformers, peft, trl, accelerate, datasets) from
the same PEP 503 index on 127.0.0.1 (served from .ci-cache/pypi-mirror, filled by .ci/setup), into a new venv.
envtool and pip end with the same check (torch, transformers and the trainer found, at their versions: what
`envtool install` checks by default); raw uv sync has none (envtool's overhead includes it).
Cold: an empty package cache; warm: the cache the cold run filled.
Prints each time, the ratio pip / envtool, and envtool / uv sync (aim: <= 1.1x warm).
Usage: python bench/bench_install.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resolver.install import PRESENCE_CHECK as CHECK  # noqa: E402  (what envtool install checks by default)
from resolver.uvrun import uv_binary  # noqa: E402
from tests.support.pypi import MIRROR, build_indexes, index_env, serve  # noqa: E402

BIN = Path(sys.executable).parent
PLAN_ARGS = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64"]


def run(cmd, **kw):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="envtool-bench-"))
    try:
        plan = json.loads(subprocess.run([str(BIN / "envtool"), "resolve", "--json", *PLAN_ARGS],
                                         capture_output=True, text=True, check=True).stdout)
        build_indexes(work / "index", plan, [], real_torch=next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
        env_dir = work / "env"
        with serve(work / "index") as url:
            env = {**os.environ, **index_env(url), "UV_PYTHON_DOWNLOADS": "never"}
            run([str(BIN / "envtool"), "lock", *PLAN_ARGS, "--out", str(env_dir), "--index-url", f"{url}/pypi/"],
                env=env)
            (work / "requirements.txt").write_text(subprocess.run(
                [str(BIN / "envtool"), "export", str(env_dir)], capture_output=True, text=True, check=True).stdout)

            def envtool_install(cache: Path, n: int):
                run([str(BIN / "envtool"), "install", str(env_dir), "--venv", str(work / f"uv-venv-{n}")],
                    env={**env, "UV_CACHE_DIR": str(cache)})

            def pip_install(cache: Path, n: int):
                venv = work / f"pip-venv-{n}"
                run([sys.executable, "-m", "venv", str(venv)])
                run([str(venv / "bin" / "python"), "-m", "pip", "install", "--isolated", "-q", "--cache-dir",
                     str(cache), "--index-url", f"{url}/pypi/", "--extra-index-url", f"{url}/torch/cpu/",
                     "--require-hashes", "-r", str(work / "requirements.txt")], cwd=env_dir)
                run([str(venv / "bin" / "python"), "-c", CHECK])

            def uv_sync(cache: Path, n: int):
                venv = work / f"uv-sync-venv-{n}"
                uv_env = {**env, "UV_CACHE_DIR": str(cache), "UV_PROJECT_ENVIRONMENT": str(venv)}
                uv_env.pop("VIRTUAL_ENV", None)
                run([uv_binary(), "venv", "--quiet", "--python", plan["python"], str(venv)], env=uv_env)
                run([uv_binary(), "sync", "--frozen", "--project", str(env_dir)], env=uv_env)

            results = {}
            for name, fn in (("envtool install", envtool_install), ("uv sync --frozen", uv_sync),
                             ("pip install -r", pip_install)):
                cache = work / f"cache-{name.split()[0]}"
                results[name] = (timed(lambda: fn(cache, 1)), timed(lambda: fn(cache, 2)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("new venv + locked CPU stack (torch 2.13.0 CPU, transformers, ...) from 127.0.0.1")
    for name, (cold, warm) in results.items():
        print(f"  {name:17s} cold cache {cold:6.1f} s   warm cache {warm:6.1f} s")
    (uv_cold, uv_warm), (pip_cold, pip_warm) = results["envtool install"], results["pip install -r"]
    sync_cold, sync_warm = results["uv sync --frozen"]
    print(f"ratio pip / envtool: cold {pip_cold / uv_cold:.1f}x, warm {pip_warm / uv_warm:.1f}x")
    print(f"ratio envtool / uv sync --frozen: cold {uv_cold / sync_cold:.2f}x, warm {uv_warm / sync_warm:.2f}x "
          f"(aim <= 1.1x)")


if __name__ == "__main__":
    main()
