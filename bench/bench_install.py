"""`envtool install` of a locked environment against `pip install -r` of the same exported requirements.

Both install the real CPU plan (torch 2.13.0's CPU wheel, transformers, peft, trl, accelerate, datasets) from
the same PEP 503 index on 127.0.0.1 (served from .ci-cache/pypi-mirror, filled by .ci/setup), into a new venv,
and end with the same import check. Cold: an empty package cache; warm: the cache the cold run filled.
Prints each time and the ratio pip / envtool. Usage: python bench/bench_install.py
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

from tests.support.pypi import MIRROR, build_indexes, index_env, serve  # noqa: E402

BIN = Path(sys.executable).parent
CHECK = "import torch, transformers, trainer"
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

            results = {}
            for name, fn in (("envtool install", envtool_install), ("pip install -r", pip_install)):
                cache = work / f"cache-{name.split()[0]}"
                results[name] = (timed(lambda: fn(cache, 1)), timed(lambda: fn(cache, 2)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("new venv + locked CPU stack (torch 2.13.0 CPU, transformers, ...) + import check, from 127.0.0.1")
    for name, (cold, warm) in results.items():
        print(f"  {name:16s} cold cache {cold:6.1f} s   warm cache {warm:6.1f} s")
    (uv_cold, uv_warm), (pip_cold, pip_warm) = results["envtool install"], results["pip install -r"]
    print(f"ratio pip / envtool: cold {pip_cold / uv_cold:.1f}x, warm {pip_warm / uv_warm:.1f}x")


if __name__ == "__main__":
    main()
