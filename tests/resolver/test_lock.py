"""lock / install / export against a PEP 503 index on 127.0.0.1: uv really locks, hashes and installs.

The index serves the real wheels of .ci-cache/pypi-mirror (filled by .ci/setup) plus small stand-ins for the
plan's CUDA packages (torch+cu126, triton, flash-attn ...) named and versioned as the plan says.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.support.pypi import LINUX_CP311, MIRROR, build_indexes, index_env, make_wheel, serve, write_simple_index

from resolver.matrix import load

from .conftest import ENVTOOL, run_envtool

pytestmark = pytest.mark.slow
A100 = ["--gpu", "a100", "--python", "3.11", "--platform", "x86_64", "--torch", "2.8"]


@pytest.fixture(scope="session")
def uv_cache(tmp_path_factory):
    assert MIRROR.is_dir(), "run `bash .ci/setup` first: it fills .ci-cache/pypi-mirror"
    return str(tmp_path_factory.mktemp("uv-cache"))


def plan_for(args, env):
    out = run_envtool("resolve", "--json", *args, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sass_of(plan, m):
    release = next(r for r in m.torch if r.version == plan["torch"]["version"])
    return next(b for b in release.build if b.variant == plan["torch"]["variant"]).sass


@pytest.fixture
def a100_index(tmp_path, uv_cache, m):
    """Indexes for the A100 plan, served; yields (index url, env for envtool, plan)."""
    root = tmp_path / "index"
    env = {**os.environ, "UV_CACHE_DIR": uv_cache, "UV_PYTHON_DOWNLOADS": "never"}

    def start(**options):
        plan = plan_for(A100, env)
        build_indexes(root, plan, sass_of(plan, m), **options)
        return plan

    return root, env, start


def lock_a100(tmp_path, url, env, *extra):
    return run_envtool("lock", *A100, "--out", str(tmp_path / "envs" / "a100"), "--index-url", f"{url}/pypi/",
                       *extra, env={**env, **index_env(url)})


def test_lock_pins_the_plan_with_hashes_and_routes_each_source(tmp_path, a100_index):
    root, env, start = a100_index
    plan = start()
    with serve(root) as url:
        out = lock_a100(tmp_path, url, env)
        assert out.returncode == 0, out.stderr
    env_dir = tmp_path / "envs" / "a100"
    assert {p.name for p in env_dir.iterdir()} == {"pyproject.toml", "uv.lock", "plan.json", "wheels"}
    assert json.loads((env_dir / "plan.json").read_text())["torch"] == {**plan["torch"],
                                                                        "index_url": f"{url}/torch/cu126/"}
    project = tomllib.loads((env_dir / "pyproject.toml").read_text())
    assert "flash-attn" in project["tool"]["uv"]["no-build-package"]
    lock = {p["name"]: p for p in tomllib.loads((env_dir / "uv.lock").read_text())["package"]}
    torch = lock["torch"]
    assert torch["version"] == "2.8.0+cu126"
    assert torch["source"] == {"registry": f"{url}/torch/cu126/"}  # not the torch stand-in-free PyPI mirror
    assert lock["flash-attn"]["source"] == {"url": index_env(url)["ENVTOOL_FLASH_ATTN_URL"].format(
        version=plan["flash_attn"]["version"], filename=plan["flash_attn"]["filename"])}
    assert lock["transformers"]["version"] == plan["packages"]["transformers"]
    assert lock["envtool-llm"]["source"] == {"path": f"wheels/{next((env_dir / 'wheels').iterdir()).name}"}
    for package in lock.values():
        for wheel in package.get("wheels", []):
            assert wheel["hash"].startswith("sha256:"), package["name"]


def test_missing_flash_attn_wheel_fails_in_seconds_naming_it(tmp_path, a100_index):
    root, env, start = a100_index
    plan = start(serve_flash_attn=False)
    with serve(root) as url:
        began = time.monotonic()
        out = lock_a100(tmp_path, url, env)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1
    assert plan["flash_attn"]["filename"] in line and "never builds flash-attn from source" in line
    assert time.monotonic() - began < 120  # not an hour-long compile; generous for a loaded CI machine
    assert not (tmp_path / "envs" / "a100").exists()  # nothing half-written


def test_a_package_with_only_an_sdist_is_never_built_and_the_nearest_wheel_is_named(tmp_path, a100_index):
    root, env, start = a100_index
    plan = start()
    # the index holds bitsandbytes as an sdist only at the plan's version, and a wheel of an older release
    version = plan["packages"]["bitsandbytes"]
    older = make_wheel(tmp_path / "other", "bitsandbytes", "0.45.5")
    sdist = tmp_path / "other" / f"bitsandbytes-{version}.tar.gz"
    sdist.write_bytes(b"not really an sdist")
    write_simple_index(root, "pypi", [older, sdist])
    with serve(root) as url:
        out = lock_a100(tmp_path, url, env)
    assert out.returncode == 2, out.stderr
    assert f"no prebuilt wheel of bitsandbytes=={version}" in out.stderr
    assert "nearest published: bitsandbytes-0.45.5-py3-none-any.whl" in out.stderr


def test_install_is_atomic_and_offline_install_needs_no_network(tmp_path, a100_index):
    root, env, start = a100_index
    start()
    env_dir, venv, wheelhouse = tmp_path / "envs" / "a100", tmp_path / ".venv-a100", tmp_path / "wheelhouse"
    with serve(root) as url:
        out = lock_a100(tmp_path, url, env, "--wheelhouse", str(wheelhouse))
        assert out.returncode == 0, out.stderr
        out = run_envtool("install", str(env_dir), "--venv", str(venv), "--json", env=env)
        assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout)
    assert first["torch"] == "2.8.0+cu126" and venv.is_symlink()
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import torch, flash_attn, trainer; print(torch.version.cuda)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "12.6", probe.stderr

    # every locked wheel is in the wheelhouse, hash-checked, with its requirements file
    requirements = (wheelhouse / "requirements.txt").read_text()
    assert "torch==2.8.0+cu126 --hash=sha256:" in requirements
    assert len(list(wheelhouse.glob("*.whl"))) == len([l for l in requirements.splitlines() if "==" in l])

    # the server is gone: an offline install from the wheelhouse still works, and swaps atomically
    out = run_envtool("install", str(env_dir), "--venv", str(venv), "--offline", "--wheelhouse", str(wheelhouse),
                      "--json", env=env)
    assert out.returncode == 0, out.stderr
    second = json.loads(out.stdout)
    assert second["previous"] == first["path"] and Path(second["path"]).exists()

    # a wheel that does not match its hash (and no copy in uv's cache to fall back on): the install fails
    # and the venv in place is untouched
    victim = next(wheelhouse.glob("transformers-*.whl"))
    make_wheel(tmp_path / "evil", "transformers", victim.name.split("-")[1]).replace(victim)
    out = run_envtool("install", str(env_dir), "--venv", str(venv), "--offline", "--wheelhouse", str(wheelhouse),
                      env={**env, "UV_CACHE_DIR": str(tmp_path / "empty-cache")})
    assert out.returncode != 0
    assert "hash" in out.stderr.lower()
    assert venv.resolve() == Path(second["path"]).resolve()
    assert subprocess.run([str(python), "-c", "import torch"]).returncode == 0


def test_a_file_index_and_find_links_fill_the_wheelhouse_from_where_the_wheels_are(tmp_path, uv_cache, m):
    """Indexes on disk (file://, as an air-gapped site keeps them) and a --find-links directory: uv records their
    wheels by path, and `lock --wheelhouse` copies each from that path, then `install --offline` installs."""
    env = {**os.environ, "UV_CACHE_DIR": uv_cache, "UV_PYTHON_DOWNLOADS": "never"}
    plan = plan_for(A100, env)
    root = tmp_path / "site"
    build_indexes(root, plan, sass_of(plan, m), on_disk=True)
    links = tmp_path / "links"  # bitsandbytes only there (uv records no hash for a --find-links file)
    links.mkdir()
    shutil.rmtree(root / "pypi" / "bitsandbytes")
    bnb = next((root / "files").glob("bitsandbytes-*.whl"))
    bnb = bnb.rename(links / bnb.name)
    env_dir, wheelhouse, venv = tmp_path / "envs" / "a100", tmp_path / "wheelhouse", tmp_path / ".venv"
    uri = root.as_uri()
    out = run_envtool("lock", *A100, "--out", str(env_dir), "--index-url", f"{uri}/pypi/", "--find-links",
                      str(links), "--wheelhouse", str(wheelhouse),
                      env={**env, "ENVTOOL_TORCH_INDEX_URL": f"{uri}/torch/{{variant}}/",
                           "ENVTOOL_FLASH_ATTN_URL": f"{uri}/gh/v{{version}}/{{filename}}"})
    assert out.returncode == 0, out.stderr
    lock = {p["name"]: p for p in tomllib.loads((env_dir / "uv.lock").read_text())["package"]}
    assert "path" in lock["torch"]["wheels"][0]  # by path, not beside the lock
    assert lock["bitsandbytes"]["source"] == {"registry": str(links)} and "hash" not in lock["bitsandbytes"]["wheels"][0]
    torch = next(wheelhouse.glob("torch-*.whl"))
    assert torch.name == f"torch-2.8.0+cu126-{LINUX_CP311}.whl"
    assert torch.read_bytes() == (root / "files" / torch.name).read_bytes()
    requirements = (wheelhouse / "requirements.txt").read_text()
    assert "torch==2.8.0+cu126 --hash=sha256:" in requirements
    assert f"bitsandbytes=={plan['packages']['bitsandbytes']} --hash=sha256:{hashlib.sha256(bnb.read_bytes()).hexdigest()}" \
        in requirements
    out = run_envtool("install", str(env_dir), "--venv", str(venv), "--offline", "--wheelhouse", str(wheelhouse),
                      "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["torch"] == "2.8.0+cu126"


def test_killing_an_install_midway_leaves_the_previous_venv(tmp_path, a100_index):
    root, env, start = a100_index
    start()
    env_dir, venv = tmp_path / "envs" / "a100", tmp_path / ".venv"
    with serve(root) as url:
        assert lock_a100(tmp_path, url, env).returncode == 0
        assert run_envtool("install", str(env_dir), "--venv", str(venv), env=env).returncode == 0
        before = venv.resolve()
        # a second install, killed as soon as its new version directory appears
        store = tmp_path / ".venv.versions"
        proc = subprocess.Popen([str(Path(sys.executable).parent / "envtool"), "install", str(env_dir),
                                 "--venv", str(venv)], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while len(list(store.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, "the install finished before it could be interrupted"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert venv.resolve() == before
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, trainer"]).returncode == 0
    with serve(root) as url:  # the next install cleans up what the killed one left
        out = run_envtool("install", str(env_dir), "--venv", str(venv), "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert sorted(store.iterdir()) == sorted({venv.resolve(), before})


def test_install_refuses_a_venv_it_did_not_make(tmp_path, a100_index):
    root, env, start = a100_index
    start()
    (tmp_path / "plain").mkdir()
    with serve(root) as url:
        assert lock_a100(tmp_path, url, env).returncode == 0
    out = run_envtool("install", str(tmp_path / "envs" / "a100"), "--venv", str(tmp_path / "plain"), env=env)
    assert out.returncode == 2 and "was not made by `envtool install`" in out.stderr


def test_export_requirements_with_hashes(tmp_path, a100_index):
    root, env, start = a100_index
    start()
    with serve(root) as url:
        assert lock_a100(tmp_path, url, env).returncode == 0
    target = tmp_path / "requirements.txt"
    out = run_envtool("export", str(tmp_path / "envs" / "a100"), "--format", "requirements", "-o", str(target), env=env)
    assert out.returncode == 0, out.stderr
    text = target.read_text()
    assert "torch==2.8.0+cu126" in text and "--hash=sha256:" in text
    assert "flash-attn @ " in text


@pytest.mark.parametrize("args, message", [
    (["export", "nowhere"], "nowhere: no plan.json here"),
    (["install", "nowhere"], "nowhere: no plan.json here"),
    (["install"], "give a lock directory"),
    (["lock", "--gpu", "t4,a100", "--out", "x"], "give --gpu a single target"),
    (["lock", "--gpu", "t4", "--out", "x", "--ca-bundle", "/no/such/ca.pem"], "--ca-bundle /no/such/ca.pem: no such file"),
])
def test_bad_input(tmp_path, args, message):
    out = subprocess.run([str(Path(sys.executable).parent / "envtool"), *args], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_cpu_end_to_end_with_the_real_torch(tmp_path, uv_cache):
    """The real thing: torch 2.13.0's CPU wheel from a local PyTorch-index mirror, the real training stack from a
    local PyPI mirror; the venv imports torch and transformers and runs the bundled trainer and doctor."""
    real_torch = next(MIRROR.glob("torch-2.13.0+cpu-*.whl"))
    args = ["--gpu", "cpu", "--torch", "2.13", "--python", "3.11", "--platform", "x86_64"]
    env = {**os.environ, "UV_CACHE_DIR": uv_cache, "UV_PYTHON_DOWNLOADS": "never"}
    plan = plan_for(args, env)
    root = tmp_path / "index"
    build_indexes(root, plan, [], real_torch=real_torch)
    env_dir, venv = tmp_path / "envs" / "cpu", tmp_path / ".venv-cpu"
    with serve(root) as url:
        out = run_envtool("lock", *args, "--out", str(env_dir), "--index-url", f"{url}/pypi/",
                          env={**env, **index_env(url)})
        assert out.returncode == 0, out.stderr
        out = run_envtool("install", str(env_dir), "--venv", str(venv), "--json", "--check-imports", env=env)
        assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["torch"] == "2.13.0+cpu"
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
                           capture_output=True, text=True)
    assert probe.stdout.split() == ["2.13.0+cpu", plan["packages"]["transformers"]], probe.stderr
    trainer = subprocess.run([python, "-m", "trainer", "--version"], capture_output=True, text=True)
    assert trainer.returncode == 0 and trainer.stdout.strip(), trainer.stderr
    doctor = subprocess.run([str(venv / "bin" / "envtool"), "doctor", "--json"], capture_output=True, text=True,
                            env={**env, "PATH": "/usr/bin:/bin", "ENVTOOL_GPU": "cpu"})
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert json.loads(doctor.stdout)["ok"]


def test_the_next_step_lock_prints_is_an_install_that_works(tmp_path, a100_index):
    """Where a venv envtool did not make is in the way (install refuses to replace it), the hint names another."""
    import shlex

    root, env, start = a100_index
    start()
    work = tmp_path / "project"
    (work / ".venv" / "bin").mkdir(parents=True)  # the user's own venv
    with serve(root) as url:
        out = subprocess.run([str(ENVTOOL), "lock", *A100, "--out", "envs/a100", "--index-url", f"{url}/pypi/"],
                             capture_output=True, text=True, cwd=work, env={**env, **index_env(url)}, timeout=300)
        assert out.returncode == 0, out.stderr
        hint = out.stdout.strip().splitlines()[-1]
        assert hint == "next: envtool install envs/a100 --venv .venv-a100"
        command = shlex.split(hint.removeprefix("next: "))
        done = subprocess.run([str(ENVTOOL), *command[1:]], capture_output=True, text=True, cwd=work, env=env,
                              timeout=300)
    assert done.returncode == 0, done.stderr
    assert (work / ".venv-a100").is_symlink() and (work / ".venv" / "bin").is_dir()  # the user's venv untouched


def test_doctor_on_an_installed_a100_environment_run_on_a_t4(tmp_path, a100_index):
    root, env, start = a100_index
    start()
    venv = tmp_path / ".venv"
    with serve(root) as url:
        assert lock_a100(tmp_path, url, env).returncode == 0
        assert run_envtool("install", str(tmp_path / "envs" / "a100"), "--venv", str(venv), env=env).returncode == 0
    out = run_envtool("doctor", "--venv", str(venv), "--gpu", "t4", "--driver", "560.35.03", "--json", env=env)
    assert out.returncode == 1
    found = {f["check"]: f for f in json.loads(out.stdout)["findings"]}
    assert found["flash-attn"]["level"] == "error" and found["precision"]["level"] == "error"
    fix = found["flash-attn"]["fix"]
    assert fix == f"envtool install --gpu t4 --driver 560.35.03 --venv {venv}"  # the GPU it checked, not auto
    ok = run_envtool("doctor", "--venv", str(venv), "--gpu", "a100", "--driver", "560.35.03", "--json", env=env)
    assert ok.returncode == 0, ok.stdout

    # the fix fixes: run as printed (with this test's index for the T4 plan), then doctor finds nothing wrong
    t4 = plan_for(["--gpu", "t4", "--driver", "560.35.03"], env)
    t4_root = tmp_path / "t4-index"
    build_indexes(t4_root, t4, sass_of(t4, load()))
    with serve(t4_root) as url:
        fixed = run_envtool(*fix.split()[1:], "--index-url", f"{url}/pypi/", env={**env, **index_env(url)},
                            timeout=300)
    assert fixed.returncode == 0, fixed.stderr
    again = run_envtool("doctor", "--venv", str(venv), "--gpu", "t4", "--driver", "560.35.03", "--json", env=env)
    assert again.returncode == 0, again.stdout


def test_an_index_behind_a_private_ca_needs_ca_bundle(tmp_path, a100_index):
    from tests.support.pypi import make_ca_and_server_cert

    root, env, start = a100_index
    start()
    ca, cert, key = make_ca_and_server_cert(tmp_path / "tls")
    env = {k: v for k, v in env.items() if k != "SSL_CERT_FILE"}
    with serve(root, tls=(cert, key)) as url:
        refused = lock_a100(tmp_path, url, env)
        assert refused.returncode == 1
        assert len(refused.stderr.strip().splitlines()) == 1 and "certificate" in refused.stderr.lower()
        out = lock_a100(tmp_path, url, env, "--ca-bundle", str(ca), "--wheelhouse", str(tmp_path / "wh"))
        assert out.returncode == 0, out.stderr
    assert (tmp_path / "wh" / "requirements.txt").is_file()  # the wheelhouse downloads trusted the CA too


def test_install_with_gpu_resolves_locks_and_installs_in_one_step(tmp_path, a100_index):
    root, env, start = a100_index
    start()
    venv = tmp_path / ".venv"
    with serve(root) as url:
        out = run_envtool("install", "--gpu", "a100", "--python", "3.11", "--torch", "2.8", "--venv", str(venv),
                          "--index-url", f"{url}/pypi/", env={**env, **index_env(url)})
    assert out.returncode == 0, out.stderr
    assert "installed torch 2.8.0+cu126" in out.stdout
    assert json.loads((tmp_path / ".venv.lock" / "plan.json").read_text())["gpu"]["name"] == "NVIDIA A100"
    assert json.loads((venv / "plan.json").read_text())["attention"] == "flash_attention_2"
