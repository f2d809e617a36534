"""Per-architecture images: render dockerfiles/Dockerfile.j2 for a plan, build it with the Docker SDK from a
context that holds everything (the wheelhouse, uv, the plan), and run images with what training needs.

The build itself needs no network: the wheelhouse is filled and hash-checked on the host (see wheelhouse.py),
and the image installs from it with `uv pip sync --offline --require-hashes`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import deque
from pathlib import Path

from . import DISTRIBUTION, __version__
from .errors import BadInput, EnvtoolError
from .matrix import Matrix
from .plan import Plan
from .selfwheel import wheel_prefix
from .uvrun import uv_binary
from .wheelhouse import REQUIREMENTS

TEMPLATE = "Dockerfile.j2"
PLAN_LABEL = "io.envtool.plan"


class NoEngine(EnvtoolError):
    """No Docker engine answers."""


class BuildFailed(EnvtoolError):
    """docker build failed; the message names the step and ends with its last log lines."""


def base_image(plan: Plan, m: Matrix, override: str | None) -> tuple[str, str]:
    if override:
        return override, f"{override} (--base-image)"
    row = next((b for b in m.base_images if plan.torch.variant.startswith(b.variant_prefix)), None)
    if row is None:
        raise EnvtoolError(f"images.toml has no base image for variant {plan.torch.variant}")
    image = row.image.format(python=plan.python)
    return image, f"{image}: {row.reason}"


def labels(plan: Plan) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": "envtool-trainer",
        "org.opencontainers.image.description": (
            f"LLM fine-tuning for {plan.gpu['name']} (sm_{(plan.gpu['compute_capability'] or 'cpu').replace('.', '')}): "
            f"torch {plan.torch.version}+{plan.torch.variant}, {plan.attention}, {plan.precision}"),
        "org.opencontainers.image.version": __version__,
        "io.envtool.target": plan.target,
        "io.envtool.matrix-version": plan.matrix_version,
        PLAN_LABEL: json.dumps(plan.to_dict(), separators=(",", ":"), sort_keys=True),
    }


def _dockerfile_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def render(plan: Plan, m: Matrix, base_override: str | None = None) -> str:
    import jinja2

    import dockerfiles

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(dockerfiles.__file__).parent),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    image, reason = base_image(plan, m, base_override)
    text = env.get_template(TEMPLATE).render(plan=plan.to_dict(), target=plan.target, base_image=image,
                                             base_reason=reason)
    label_lines = " \\\n      ".join(f"{k}={_dockerfile_quote(v)}" for k, v in labels(plan).items())
    return text + f"LABEL {label_lines}\n"


def prepare_context(plan: Plan, m: Matrix, env_dir: Path, wheelhouse: Path, context: Path,
                    base_override: str | None) -> None:
    """Lay out the build context: Dockerfile, uv, plan.json, wheelhouse/deps (+ requirements), wheelhouse/project."""
    context.mkdir(parents=True, exist_ok=True)
    (context / "Dockerfile").write_text(render(plan, m, base_override))
    shutil.copy2(uv_binary(), context / "uv")
    shutil.copy2(env_dir / "plan.json", context / "plan.json")
    deps, project = context / "wheelhouse" / "deps", context / "wheelhouse" / "project"
    deps.mkdir(parents=True, exist_ok=True)
    project.mkdir(parents=True, exist_ok=True)
    lines = (wheelhouse / REQUIREMENTS).read_text().splitlines()
    kept = [line for line in lines if not line.startswith(f"{DISTRIBUTION}==")]
    (deps / REQUIREMENTS).write_text("\n".join(kept) + "\n")
    for wheel in wheelhouse.glob("*.whl"):
        target = (project if wheel.name.startswith(wheel_prefix()) else deps) / wheel.name
        try:
            os.link(wheel, target)  # same filesystem: no copy of gigabytes
        except OSError:
            shutil.copy2(wheel, target)


def client():
    import docker

    try:
        c = docker.from_env(version="auto", timeout=600)
        c.ping()
        return c
    except docker.errors.DockerException as e:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise NoEngine(f"no Docker engine answers at {where} ({str(e).splitlines()[0][:120]}): start one "
                       f"(`sudo systemctl start docker`, or `dockerd &`) or point DOCKER_HOST at it") from None


def build(context: Path, tag: str, network: str | None = None, quiet: bool = False) -> str:
    """Build the context into `tag`, streaming progress; return the image id."""
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    api = client().api
    tail: deque[str] = deque(maxlen=15)
    step = "?"
    image_id = None
    stream = api.build(path=str(context), tag=tag, rm=True, forcerm=True, decode=True, pull=False,
                       network_mode=network)
    with console.status(f"building {tag}") as status:
        for chunk in stream:
            if "error" in chunk:
                tail.append(chunk["error"].strip())
                raise BuildFailed(f"docker build of {tag} failed at {step}: " + " | ".join(
                    line for line in tail if line)[-1500:])
            text = chunk.get("stream", "")
            for line in text.splitlines():
                if line.startswith("Step "):
                    step = line.strip()
                    status.update(f"building {tag}: {step[:100]}")
                    console.print(f"[dim]{step[:160]}[/dim]", highlight=False)
                if line.strip():
                    tail.append(line.strip())
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
    if image_id is None:
        image_id = client().images.get(tag).id
    return image_id


def push(tag: str, quiet: bool = False) -> None:
    repository, _, version = tag.rpartition(":")
    for chunk in client().images.push(repository, version, stream=True, decode=True):
        if "error" in chunk:
            raise EnvtoolError(f"docker push {tag} failed: {chunk['error']}")


def run(image: str, command: list[str], *, gpus: str | None, shm_size: str, hf_cache: Path | None,
        env_names: list[str], volumes: list[str], workdir: str | None = None,
        environment: dict[str, str] | None = None, network_mode: str | None = None) -> int:
    """Run `command` in `image` with what training needs; secrets travel as run-time environment only."""
    import docker

    c = client()
    try:
        c.images.get(image)
    except docker.errors.ImageNotFound:
        raise BadInput(f"no image {image}; build it with `envtool build`") from None
    environment = dict(environment or {})
    for name in env_names:
        if name not in os.environ:
            raise BadInput(f"-e {name}: not set in this environment (envtool passes values through, never stores them)")
        environment[name] = os.environ[name]
    mounts = {}
    if hf_cache:
        hf_cache.mkdir(parents=True, exist_ok=True)
        mounts[str(hf_cache.resolve())] = {"bind": "/home/trainer/.cache/huggingface", "mode": "rw"}
    for spec in volumes:
        host, _, inside = spec.partition(":")
        if not inside:
            raise BadInput(f"-v {spec}: use HOST:CONTAINER")
        mounts[str(Path(host).resolve())] = {"bind": inside, "mode": "rw"}
    device_requests = []
    if gpus:
        count = -1 if gpus == "all" else int(gpus)
        device_requests = [docker.types.DeviceRequest(count=count, capabilities=[["gpu"]])]
    container = c.containers.run(image, command or None, detach=True, environment=environment, volumes=mounts,
                                 shm_size=shm_size, device_requests=device_requests or None, network_mode=network_mode,
                                 working_dir=workdir)
    try:
        for chunk in container.logs(stream=True, follow=True):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return container.wait()["StatusCode"]
    finally:
        container.remove(force=True)
