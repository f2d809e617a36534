"""Per-architecture images: render dockerfiles/Dockerfile.j2 for a plan, build it with the Docker SDK from a
context that holds everything (the wheelhouse, uv, the plan), and run images with what training needs.

The build itself needs no network: the wheelhouse is filled and hash-checked on the host (see wheelhouse.py),
and the image installs from it with `uv pip sync --offline --require-hashes`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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


NO_IMAGE = {
    "mps": ("torch's MPS backend is macOS's Metal, which no Linux container reaches (Docker on a Mac runs a "
            "Linux VM): train on the Mac itself (`envtool train CONFIG --gpu auto`)"),
    "xpu": ("images.toml records no base image for torch's xpu builds: an XPU container needs Intel's GPU user-space "
            "driver (Level Zero, the compute runtime), which no recorded base carries; train on the host "
            "(`envtool train`), or pass --base-image with an image that has it"),
}


# A Docker image reference, as distribution/reference's grammar (reference/regexp.go) writes it: [host[:port]/]path
# [:tag][@digest]. What --base-image may be; anything else (a newline, a space, a quote) is refused before rendering.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")


def check_image_reference(value: str, option: str = "--base-image") -> str:
    if not IMAGE_REFERENCE.fullmatch(value):
        raise BadInput(f"{option} {value!r} is not an image reference ([registry/]name[:tag][@digest], e.g. "
                       f"nvcr.io/nvidia/pytorch:24.08-py3)")
    return value


def base_image(plan: Plan, m: Matrix, override: str | None) -> tuple[str, str]:
    if override is not None:
        check_image_reference(override)
        return override, f"{override} (--base-image)"
    if plan.torch.backend in NO_IMAGE:
        raise BadInput(f"no image for {plan.gpu['name']}: {NO_IMAGE[plan.torch.backend]}")
    row = next((b for b in m.base_images if plan.torch.variant.startswith(b.variant_prefix)), None)
    if row is None:
        raise EnvtoolError(f"images.toml has no base image for variant {plan.torch.variant}")
    if row.python is not None and row.python != plan.python:
        raise BadInput(f"the base image for {plan.torch.variant} builds, {row.image.format(python=plan.python, rocm=plan.torch.rocm)}, "
                       f"brings Python {row.python}, and the plan is for Python {plan.python}: pass --python "
                       f"{row.python} (or --base-image with a Python {plan.python} image)")
    image = row.image.format(python=plan.python, rocm=plan.torch.rocm)
    return image, f"{image}: {row.reason}"


def labels(plan: Plan) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": "envtool-trainer",
        "org.opencontainers.image.description": (
            f"LLM fine-tuning for {plan.gpu['name']} ({plan.target_label}): "
            f"torch {plan.torch.version}+{plan.torch.variant}, {plan.attention}, {plan.precision}"),
        "org.opencontainers.image.version": __version__,
        "io.envtool.target": plan.target,
        "io.envtool.matrix-version": plan.matrix_version,
        PLAN_LABEL: json.dumps(plan.to_dict(), separators=(",", ":"), sort_keys=True),
    }


# The template's escaping. Every value it writes passes `_one_line` (jinja's finalize): a Dockerfile instruction
# ends at a line break, so a value holding one (or any control character) is refused, never written. Values in
# double quotes (ENV, LABEL, ARG) go through `dq`: backslash, quote and `$` (variable expansion) escaped.


def _one_line(value):
    if isinstance(value, str) and any(not c.isprintable() for c in value):
        raise BadInput(f"{value!r} would break a Dockerfile line: a value with a line break or a control character "
                       f"is never written into a Dockerfile")
    return value


def _dockerfile_quote(value) -> str:
    text = _one_line(str(value))
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def render(plan: Plan, m: Matrix, base_override: str | None = None) -> str:
    # start-up: jinja2, dockerfiles imported only when this runs
    import jinja2

    import dockerfiles

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(dockerfiles.__file__).parent),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, finalize=_one_line,
                             autoescape=False)
    env.filters["dq"] = _dockerfile_quote
    image, reason = base_image(plan, m, base_override)
    return env.get_template(TEMPLATE).render(plan=plan.to_dict(), target=plan.target, base_image=image,
                                             base_reason=reason, labels=labels(plan))


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


DEFAULT_SOCKET = "unix:///var/run/docker.sock"
ADDRESS_FILE = Path(".ci-cache") / "docker-host"  # written by .ci/docker-up (the set-up's private engine)


def address_files() -> list[Path]:
    """Where .ci/docker-up leaves the address of the engine it started: the checkout envtool runs from (an
    editable install), then the working directory (a clone, with envtool installed from a wheel)."""
    checkout = Path(__file__).resolve().parents[1]
    found = []
    for root in (checkout, Path.cwd()):
        path = root / ADDRESS_FILE
        if path.is_file() and path.resolve() not in [f.resolve() for f in found]:
            found.append(path)
    return found


def engines() -> tuple[list[tuple[str, str]], bool]:
    """The Docker engines to try, in order, each with where its address came from; and whether the first was
    chosen explicitly (then it alone is tried, as the docker CLI would). The order:

    1. DOCKER_HOST, when set;
    2. the docker CLI's current context (DOCKER_CONTEXT, else `currentContext` in ~/.docker/config.json), when it
       is not `default`;
    3. the default socket, unix:///var/run/docker.sock;
    4. the address .ci/docker-up wrote to .ci-cache/docker-host (the engine `bash .ci/setup` started)."""
    if os.environ.get("DOCKER_HOST"):
        return [(os.environ["DOCKER_HOST"], "DOCKER_HOST")], True
    try:
        # optional: docker is imported only where it is used
        from docker.context import ContextAPI

        context = ContextAPI.get_context(os.environ.get("DOCKER_CONTEXT"))
    except Exception:  # an unreadable docker config: the CLI's default context
        context = None
    if context is not None and context.Name != "default" and context.Host:
        return [(context.Host, f"docker context {context.Name}")], True
    found = [(DEFAULT_SOCKET, "the default socket")]
    for path in address_files():
        address = path.read_text().strip()
        if address and address not in (a for a, _ in found):
            found.append((address, f"{path}, written by .ci/docker-up"))
    return found, False


def _why(error: Exception) -> str:
    """Why an engine did not answer, in a few words."""
    text = str(error)
    for needle, why in (("FileNotFoundError", "no such socket"), ("No such file", "no such socket"),
                        ("Connection refused", "connection refused"),
                        ("Permission denied", "permission denied: join the docker group or use sudo"),
                        ("PermissionError", "permission denied: join the docker group or use sudo"),
                        ("timed out", "timed out")):
        if needle in text:
            return why
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 100 else first[:97] + "..."


def client():
    """A client of the first engine that answers (see `engines`); one line naming what was tried if none does."""
    # optional: docker is imported only where it is used
    import docker

    candidates, explicit = engines()
    tried = []
    for address, origin in candidates:
        try:
            c = docker.DockerClient(base_url=address, version="auto", timeout=600)
            c.ping()
            return c
        except docker.errors.DockerException as e:
            tried.append(f"{address} ({origin}: {_why(e)})")
    hint = ("point DOCKER_HOST at an engine that answers, or unset it" if explicit else
            "start one (`sudo systemctl start docker`, `dockerd &`, or `bash .ci/docker-up` in a clone of envtool) "
            "or point DOCKER_HOST at it")
    raise NoEngine(f"no Docker engine answers at {'; '.join(tried)}: {hint}")


def build(context: Path, tag: str, network: str | None = None, quiet: bool = False) -> str:
    """Build the context into `tag`, streaming progress; return the image id."""
    # start-up: rich imported only when this runs
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


INVOKING_USER = "invoking"  # `run(user=...)`: the uid:gid running envtool
IMAGE_USER = "image"  # the image's own USER (uid 1000, `trainer`)
CONTAINER_HOME = "/tmp/envtool-home"  # HOME for a user the image's /etc/passwd does not know


def container_user(user: str | None) -> str | None:
    """What `docker run --user` gets: the invoking uid:gid by default, so that files written to a mounted
    directory are the user's and the container can write where the user can (root, a cluster's uid, a CI
    runner's); `image` keeps the image's user; anything else is passed as it is (NAME, UID or UID:GID)."""
    if user in (None, INVOKING_USER):
        return f"{os.getuid()}:{os.getgid()}"
    if user == IMAGE_USER:
        return None

    if not re.fullmatch(r"[\w.-]+(:[\w.-]+)?", user):
        raise BadInput(f"--user {user!r}: give UID[:GID], a user name, '{INVOKING_USER}' or '{IMAGE_USER}'")
    return user


def gpu_options(plan: dict | None, gpus: str | None, dev: Path = Path("/dev")) -> dict:
    """What `docker run` needs to reach the GPUs of the plan an image was built for (its io.envtool.plan label):
    NVIDIA's device request (`--gpus`, the container toolkit), or for AMD and Intel the device nodes, the host
    groups that own them (added by GID: the image does not know the host's names) and, for ROCm, the seccomp
    profile AMD documents (rocm.toml / intel.toml [container]). {} without `gpus`; one line when a node the
    vendor needs is missing here (no driver loaded), before anything starts."""
    if not gpus:
        return {}
    vendor = (plan or {}).get("gpu", {}).get("vendor") or "nvidia"
    if vendor in ("nvidia", "cpu"):
        # optional: docker is imported only where it is used
        import docker

        count = -1 if gpus == "all" else int(gpus)
        return {"device_requests": [docker.types.DeviceRequest(count=count, capabilities=[["gpu"]])]}
    if vendor == "apple":
        raise BadInput(NO_IMAGE["mps"])
    from .vendors import load

    v = load()
    row = v.rocm_container if vendor == "amd" else v.xpu_container
    if gpus != "all":
        raise BadInput(f"--gpus {gpus}: for {plan['gpu']['name']} give --gpus all (every device node is passed; "
                       f"pick devices inside with {'HIP_VISIBLE_DEVICES' if vendor == 'amd' else 'ZE_AFFINITY_MASK'})")
    devices, gids = [], []
    for node in row.devices:
        path = dev / Path(node).relative_to("/dev")
        if not path.exists():
            why = "the amdgpu driver with KFD is not loaded" if node == "/dev/kfd" else "no GPU driver is loaded"
            raise BadInput(f"--gpus all for {plan['gpu']['name']}: no {node} on this host ({why})")
        devices.append(f"{node}:{node}:rwm")
        owners = [path] + (sorted(path.glob("renderD*")) if path.is_dir() else [])
        gids += [o.stat().st_gid for o in owners]
    import grp

    for name in row.groups:
        try:
            gids.append(grp.getgrnam(name).gr_gid)
        except KeyError:
            pass  # not on this host: the device nodes' owners above are what counts
    return {"devices": devices, "group_add": sorted({str(g) for g in gids if g != 0}, key=int),
            "security_opt": list(row.security_opt) or None}


def image_plan(image) -> dict | None:
    """The plan an envtool image was built for (its io.envtool.plan label), else None."""
    text = (image.labels or {}).get(PLAN_LABEL)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def check_gpus(gpus: str | None) -> None:
    if gpus is not None and not re.fullmatch(r"all|[1-9][0-9]{0,3}", gpus):
        raise BadInput(f"--gpus {gpus!r}: give 'all' or a count of GPUs (1, 2, ...)")


def parse_volume(spec: str) -> tuple[str, str, bool]:
    """`-v HOST:CONTAINER[:ro|rw]` -> (host path, container path, read-only), or one line."""
    host, _, rest = spec.partition(":")
    inside, _, mode = rest.partition(":")
    if not host or not inside:
        raise BadInput(f"-v {spec}: use HOST:CONTAINER or HOST:CONTAINER:ro")
    if mode not in ("", "ro", "rw"):
        raise BadInput(f"-v {spec}: the mode after the second ':' is ro or rw, not {mode!r}")
    if not inside.startswith("/"):
        raise BadInput(f"-v {spec}: the path in the container must be absolute")
    if not Path(host).exists():
        raise BadInput(f"-v {spec}: {host} does not exist on this host")
    return str(Path(host).resolve()), inside, mode == "ro"


RUN_LABEL = "io.envtool.run"  # on containers `envtool run` / `train --image` start: the pid of the envtool running it
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@dataclass(frozen=True)
class RunOptions:
    """What a container gets from `envtool run` and `envtool train --image` (docker.run): devices, memory, the
    Hugging Face cache, environment variables by name, bind mounts, the working directory, the network, the user."""

    gpus: str | None = None  # 'all' or a count (check_gpus); None: no device
    shm_size: str = "8g"
    hf_cache: Path | None = None  # a host directory mounted as the Hugging Face cache
    env_names: tuple[str, ...] = ()  # passed by name: the values are read from envtool's environment at run time
    volumes: tuple[str, ...] = ()  # `-v HOST:CONTAINER` specs
    workdir: str | None = None
    environment: dict[str, str] = field(default_factory=dict)  # set in the container (no secret: those go by name)
    network_mode: str | None = None
    user: str | None = INVOKING_USER  # see container_user (default: the invoking uid:gid)
    mounts: tuple = ()  # (host, container, read-only) binds

    def check(self) -> None:
        """One line for an option docker would refuse later, or worse, misread."""
        check_gpus(self.gpus)
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?[bkmgBKMG]?", self.shm_size or ""):
            raise BadInput(f"--shm-size {self.shm_size!r}: give a size such as 8g or 512m")
        for name in self.env_names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise BadInput(f"-e {name!r}: give the name of an environment variable (its value is read from yours)")


def run(image: str, command: list[str], options: RunOptions, output: Callable[[str], None] | None = None) -> int:
    """Run `command` in `image` with what training needs (`options`); secrets travel as run-time environment only.
    The container runs under an init (signals reach the command as they would outside, it is not
    PID 1); SIGTERM, SIGINT, SIGHUP and SIGQUIT sent to envtool are passed to it, and the container is removed
    however envtool's wait ends; the exit code is the container's (143 after SIGTERM). `output`: given the
    container's output line by line (a line ends at \n or a progress bar's \r) instead of writing it to stdout."""
    # optional: docker is imported only where it is used
    import docker

    options.check()
    gpus, shm_size, hf_cache, env_names = options.gpus, options.shm_size, options.hf_cache, options.env_names
    binds = [*options.mounts, *(parse_volume(v) for v in options.volumes)]
    run_as = container_user(options.user)
    c = client()
    try:
        found = c.images.get(image)
    except docker.errors.ImageNotFound:
        raise BadInput(f"no image {image}; build it with `envtool build`") from None
    plan = image_plan(found)
    gpu_kwargs = gpu_options(plan, gpus)
    environment = dict(options.environment)
    if run_as is not None:
        # The image's /etc/passwd knows uid 1000 only: give any other user a HOME it can write (torch, triton
        # and the Hugging Face hub keep caches there) and a name (getpass.getuser(), which torch's compile cache
        # calls, reads USER before the passwd file).
        environment.setdefault("HOME", CONTAINER_HOME)
        environment.setdefault("USER", os.environ.get("USER") or "envtool")
        if not hf_cache:
            environment.setdefault("HF_HOME", f"{CONTAINER_HOME}/.cache/huggingface")
    for name in env_names:
        if name not in os.environ:
            raise BadInput(f"-e {name}: not set in this environment (envtool passes values through, never stores them)")
        environment[name] = os.environ[name]
    if hf_cache:
        hf_cache.mkdir(parents=True, exist_ok=True)
        binds.append((str(hf_cache.resolve()), "/home/trainer/.cache/huggingface", False))
    binds_as_mounts = [docker.types.Mount(inside, host, type="bind", read_only=read_only)
                       for host, inside, read_only in binds]
    with _forwarding_signals() as forward:
        container = c.containers.create(image, command or None, environment=environment,
                                        mounts=binds_as_mounts, shm_size=shm_size, network_mode=options.network_mode,
                                        working_dir=options.workdir, user=run_as or "", init=True,
                                        labels={RUN_LABEL: str(os.getpid())}, **gpu_kwargs)
        try:
            try:
                container.start()
            except docker.errors.APIError as e:
                refusal = gpu_runtime_missing(e, gpus)
                if refusal:
                    raise BadInput(refusal) from None
                raise
            forward(container)
            pending = b""
            for chunk in container.logs(stream=True, follow=True):
                if output is None:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                    continue
                *lines, pending = re.split(rb"(?<=[\r\n])", pending + chunk)
                for line in lines:
                    output(line.decode(errors="replace"))
            if pending:
                output(pending.decode(errors="replace"))
            return container.wait()["StatusCode"]
        finally:
            container.remove(force=True)


# What the engine answers when it starts a container with a GPU device request and has no GPU runtime: no NVIDIA
# Container Toolkit (moby's daemon/devices.go, `docker run --gpus all` on a fresh host), or CDI devices it cannot
# resolve (Docker 25+ with the CDI feature on and no spec in /etc/cdi or /var/run/cdi).
NO_GPU_RUNTIME = ("could not select device driver", "unresolvable CDI devices", "nvidia-container-cli",
                  'unknown or invalid runtime name: nvidia')


def gpu_runtime_missing(error: Exception, gpus: str | None) -> str | None:
    """The one line for an engine that cannot give a container GPUs (None: another failure)."""
    text = str(getattr(error, "explanation", None) or error)
    if not gpus or not any(needle in text for needle in NO_GPU_RUNTIME):
        return None
    said = next((line.strip() for line in text.splitlines() if any(n in line for n in NO_GPU_RUNTIME)), text)
    return (f"--gpus {gpus}: this Docker engine cannot give containers GPUs ({said[:160]}): install the NVIDIA "
            "Container Toolkit and register it (`sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl "
            "restart docker`), or generate its CDI spec (`sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`);"
            " see https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html")


@contextlib.contextmanager
def _forwarding_signals():
    """While a container runs: the signals envtool gets go to the container (a kill from a thread: the handler only
    starts it), and envtool itself keeps waiting for the container's exit, then removes it. Yields `forward(container)`
    to call once the container exists; a signal that came before is passed on then."""
    # start-up: resolver.forwarding imported only when this runs
    from .forwarding import forwarding

    state: dict = {"container": None, "pending": []}

    def handler(signum):
        if state["container"] is None:
            state["pending"].append(signum)
        else:
            threading.Thread(target=_kill, args=(state["container"], signum), daemon=True).start()

    def forward(container):
        state["container"] = container
        for signum in state["pending"]:
            _kill(container, signum)

    with forwarding(FORWARDED, handler):
        yield forward


def _kill(container, signum: int) -> None:
    # optional: docker is imported only where it is used
    import docker

    try:
        container.kill(signal=int(signum))
    except docker.errors.APIError:
        pass  # it has exited already
