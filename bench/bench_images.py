"""Image size and rebuild time of envtool's multi-stage image, each against a baseline from the same run.

1. Size: envtool's image for the CPU plan (real torch 2.13.0 CPU wheel and the real training stack) against a
   naive single-stage Dockerfile installing the same lock from the same wheelhouse with pip (the wheelhouse
   and pip's cache stay in the image, as in a one-stage `-devel`-style build; a CUDA -devel base would add
   several GB on top, which cannot be pulled here).
2. Rebuild: a full build with no cache against a rebuild after a trainer-only change (envtool's wheel
   changes, the dependency layers do not).

Needs a Docker engine and the local base image (`bash .ci/docker-up`). Usage: python bench/bench_images.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resolver import docker as images  # noqa: E402
from resolver.lock import Sources, lock  # noqa: E402
from resolver.matrix import load  # noqa: E402
from resolver.wheelhouse import fill  # noqa: E402
from tests.support.pypi import MIRROR, build_indexes, index_env, serve  # noqa: E402

BASE = "envtool-test-base:bookworm"
NAIVE = """FROM {base}
COPY wheelhouse/ /wheelhouse/
RUN python3 -m venv /opt/venv \\
 && /opt/venv/bin/pip install --no-index --find-links /wheelhouse/deps -r /wheelhouse/deps/requirements.txt \\
 && /opt/venv/bin/pip install --no-index --no-deps /wheelhouse/project/*.whl
ENV PATH=/opt/venv/bin:$PATH
"""


def plan_for_cpu() -> Plan:
    from resolver import hardware, solve

    m = load()
    req = solve.Request(gpu=hardware.lookup("cpu", m), driver=None, python="3.11", platform="x86_64",
                        torch="2.13", target="cpu")
    return solve.solve(req, m)


def size_of(tag: str) -> float:
    return images.client().images.get(tag).attrs["Size"] / 2**30


def timed_build(context: Path, tag: str, nocache: bool) -> float:
    start = time.perf_counter()
    api = images.client().api
    for chunk in api.build(path=str(context), tag=tag, rm=True, forcerm=True, decode=True, nocache=nocache,
                           network_mode="none", pull=False):
        if "error" in chunk:
            raise SystemExit(chunk["error"])
    return time.perf_counter() - start


def change_trainer(wheel: Path) -> None:
    """A trainer-only change: one more module in envtool's wheel."""
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr("trainer/_bench_change.py", f"CHANGED = {time.time()!r}\n")


def main() -> None:
    recorded = ROOT / ".ci-cache" / "docker-host"
    if "DOCKER_HOST" not in os.environ and recorded.is_file():
        os.environ["DOCKER_HOST"] = recorded.read_text().strip()
    m = load()
    plan = plan_for_cpu()
    with tempfile.TemporaryDirectory(prefix="envtool-bench-images-") as tmp:
        tmp = Path(tmp)
        build_indexes(tmp / "index", json.loads(plan.to_json()), [],
                      real_torch=next(MIRROR.glob("torch-2.13.0+cpu-*.whl")))
        with serve(tmp / "index") as url:
            os.environ.update(index_env(url))
            plan = plan_for_cpu()  # again, now with the local index URLs
            env_dir = lock(plan, tmp / "env", Sources(index_url=f"{url}/pypi/"), m, quiet=True)
            fill(env_dir, tmp / "wheelhouse", plan.python, plan.platform, quiet=True)
        context = tmp / "context"
        images.prepare_context(plan, m, env_dir, tmp / "wheelhouse", context, BASE)
        naive = tmp / "naive"
        images.prepare_context(plan, m, env_dir, tmp / "wheelhouse", naive, BASE)
        (naive / "Dockerfile").write_text(NAIVE.format(base=BASE))

        full = timed_build(context, "envtool-bench:multi", nocache=True)
        timed_build(naive, "envtool-bench:naive", nocache=True)
        multi_size, naive_size = size_of("envtool-bench:multi"), size_of("envtool-bench:naive")
        change_trainer(next((context / "wheelhouse" / "project").glob("envtool_llm-*.whl")))
        rebuild = timed_build(context, "envtool-bench:multi", nocache=False)

    print(f"CPU plan (torch {plan.torch.version}+cpu, transformers {plan.packages['transformers']}), base {BASE}")
    print(f"  image size: multi-stage {multi_size:.2f} GiB, naive single-stage {naive_size:.2f} GiB "
          f"-> {naive_size / multi_size:.2f}x smaller")
    print(f"  build time: full (no cache) {full:.1f} s, after a trainer-only change {rebuild:.1f} s "
          f"-> rebuild takes {rebuild / full:.2f} of a full build")


if __name__ == "__main__":
    main()
