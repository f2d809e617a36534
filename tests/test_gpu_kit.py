"""The GPU acceptance kit (bench/gpu/, issue 28): its wheel bundle's manifest check, its time budget, and its CPU mode
run as a user runs it (`bash bench/gpu/run.sh --cpu`), so the kit cannot rot between GPU hosts."""

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import bundle  # noqa: E402
import kit  # noqa: E402


def _wheel(folder: Path, name: str, version: str, payload: bytes = b"x") -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", payload)
    return path


def test_a_bundle_matches_its_manifest_until_a_wheel_changes_goes_missing_or_is_added(tmp_path):
    a = _wheel(tmp_path, "alpha", "1.0")
    _wheel(tmp_path, "beta_pkg", "2.0", b"y" * 1000)
    manifest = bundle.write_manifest(tmp_path, ["alpha", "beta-pkg"])
    assert [(w["name"], w["version"]) for w in manifest["wheels"]] == [("alpha", "1.0"), ("beta-pkg", "2.0")]
    assert bundle.check_bundle(tmp_path) == []
    assert bundle.check_bundle(tmp_path, limit_mib=1000 / 2 ** 20) == [
        f"the wheels add up to {manifest['total_size'] / 2 ** 20:.1f} MiB, over the {1000 / 2 ** 20:g} MiB limit"]

    extra = _wheel(tmp_path, "gamma", "3.0")
    assert bundle.check_bundle(tmp_path) == [f"{extra.name}: not in the manifest"]
    extra.unlink()
    data = a.read_bytes()
    a.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert bundle.check_bundle(tmp_path) == [f"{a.name}: sha256 differs from the manifest's"]
    a.unlink()
    assert bundle.check_bundle(tmp_path) == [f"{a.name}: missing"]
    assert "no manifest" in bundle.check_bundle(tmp_path / "nowhere")[0]


GOOD = {"file": "alpha-1.0-py3-none-any.whl", "size": 1, "sha256": "0" * 64}
MALFORMED = {  # manifest.json as written -> what --check says (each a traceback before, or a path followed out)
    "not utf-8": (b"\xff\xfe{", "not UTF-8 text"),
    "not json": (b"{wheels", "not JSON"),
    "200000 deep": (b"[" * 200_000 + b"]" * 200_000, "JSON nested too deep to read"),
    "a list": (b"[1]", "not a JSON object"),
    "wheels an object": (b'{"wheels": {"a": 1}}', "'wheels' is not a list"),
    "limit a string": (b'{"wheels": [], "limit_mib": "40"}', "'limit_mib' is not a positive number"),
    "a pip option": (b'{"wheels": [], "requirements": ["--index-url=http://x"]}', "'requirements' is not a list"),
    "no file": (json.dumps({"wheels": [{"size": 1}]}).encode(), "wheels[0] has no file, sha256"),
    "file a number": (json.dumps({"wheels": [dict(GOOD, file=3)]}).encode(), "file '3' is not a wheel's file name"),
    "a path out": (json.dumps({"wheels": [dict(GOOD, file="../x.whl")]}).encode(), "file '../x.whl' is not a"),
    "size a string": (json.dumps({"wheels": [dict(GOOD, size="1")]}).encode(), "size '1' is not a number of bytes"),
    "no sha256": (json.dumps({"wheels": [{"file": GOOD["file"], "size": 1}]}).encode(), "wheels[0] has no sha256"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_manifest_is_one_line_each_from_check(tmp_path, case):
    body, expected = MALFORMED[case]
    (tmp_path / bundle.MANIFEST).write_bytes(body)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bundle.py"), "--check", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"bundle.py: {tmp_path / bundle.MANIFEST}") and expected in line, line


def test_a_manifest_that_is_no_regular_file_is_one_line(tmp_path):
    (tmp_path / bundle.MANIFEST).mkdir()
    assert bundle.check_bundle(tmp_path) == [f"{tmp_path / bundle.MANIFEST}: not a regular file"]
    os.rmdir(tmp_path / bundle.MANIFEST)
    os.mkfifo(tmp_path / bundle.MANIFEST)  # never opened: a FIFO would block the read
    assert bundle.check_bundle(tmp_path) == [f"{tmp_path / bundle.MANIFEST}: not a regular file"]


def _json_values():
    from hypothesis import strategies as st

    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12) | \
        st.sampled_from(["../x.whl", "/etc/passwd", "a.whl", "0" * 64, "--pre"])
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) |
                        st.dictionaries(st.sampled_from(["file", "size", "sha256", "wheels", "limit_mib",
                                                         "requirements", "total_size", "x"]), inner, max_size=4),
                        max_leaves=10)


def test_any_manifest_shape_gives_problems_as_lines_never_an_exception(tmp_path_factory):
    from hypothesis import given, settings

    folder = tmp_path_factory.mktemp("bundle")

    @settings(max_examples=200, deadline=None)
    @given(_json_values())
    def check(data):
        (folder / bundle.MANIFEST).write_text(json.dumps(data))
        problems = bundle.check_bundle(folder)
        assert all(isinstance(p, str) and "\n" not in p for p in problems)
        if not isinstance(data, dict):
            assert problems

    check()


def test_every_dependency_of_the_project_is_in_the_bundle_on_the_host_or_left_out_with_a_reason():
    """A dependency added to pyproject.toml fails here until the bundle takes it (or says why not)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = {bundle.canonical(Requirement(r).name) for r in bundle.roots()}
    wanted = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["train"]
    for text in wanted + project["build-system"]["requires"]:
        name = bundle.canonical(Requirement(text).name)
        assert name in roots or name in bundle.HOST or name in bundle.LEFT_OUT, name
    assert not roots & set(bundle.HOST)
    assert {"pydantic", "datasets", "trl", "tomlkit", "uv-build"} <= roots


def test_the_closure_follows_extras_and_markers_and_never_enters_the_hosts_stack():
    resolved = {
        "datasets": {"version": "5.0.1", "requires_dist": ["fsspec[http]<=2026.6.0", "pyarrow>=21", "dill",
                                                           "tomli; python_version < '3.11'"]},
        "fsspec": {"version": "2026.6.0", "requires_dist": ["aiohttp; extra == 'http'", "gcsfs; extra == 'gcs'"]},
        "aiohttp": {"version": "3.14.5", "requires_dist": ["torch"]},  # (a host package: never followed)
        "dill": {"version": "0.4.1", "requires_dist": []},
        "tomli": {"version": "2.0", "requires_dist": []},
        "gcsfs": {"version": "1", "requires_dist": []},
        "pyarrow": {"version": "26", "requires_dist": []},
        "torch": {"version": "2.11.0", "requires_dist": []},
    }
    assert bundle.closure(["datasets==5.0.1"], resolved) == [
        ("aiohttp", "3.14.5"), ("datasets", "5.0.1"), ("dill", "0.4.1"), ("fsspec", "2026.6.0")]


def test_the_bundle_built_here_matches_its_manifest_and_carries_none_of_the_hosts_stack():
    """The bundle .ci/setup builds (bench/gpu/bundle.py): never skipped under CI, so the builder itself cannot rot."""
    from tests.support.oracle import require_setup

    require_setup(bundle.DEFAULT_OUT / bundle.MANIFEST, "the GPU kit's wheel bundle")
    assert bundle.check_bundle(bundle.DEFAULT_OUT, limit_mib=bundle.LIMIT_MIB) == []
    manifest = json.loads((bundle.DEFAULT_OUT / bundle.MANIFEST).read_text())
    assert not {w["name"] for w in manifest["wheels"]} & set(bundle.HOST)


def test_a_spent_budget_skips_every_step_with_the_reason_and_still_writes_the_report(tmp_path):
    code = kit.main(["--cpu", "--budget", "1", "--out", str(tmp_path)])
    assert code == 0
    (report,) = tmp_path.glob("gpu-kit-*.json")
    steps = json.loads(report.read_text())["steps"]
    assert list(steps) == [s[0] for s in kit.STEPS]
    assert {s["status"] for s in steps.values()} == {"skipped"}
    assert all("budget" in s["reason"] for s in steps.values())
    assert report.with_suffix(".md").is_file()


def test_a_step_past_its_bound_is_killed_and_recorded_as_failed(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "context.json").write_text(json.dumps({"cpu": True, "python": sys.executable}))
    result = kit.spawn_step("detect", sys.executable, tmp_path, cpu=True, limit=0.05)
    assert result["status"] == "failed"
    assert result["reason"] == "timed out after 0 s (the step's bound)"


@pytest.mark.slow
def test_the_cpu_mode_runs_every_step_through_run_sh_and_reports_each_figure_or_why_not(tmp_path):
    """`bash bench/gpu/run.sh --cpu` as a user runs it: every step ok or skipped with a reason, the GPU-only parts
    skipped, the figures the CPU can give present; one report, JSON and Markdown, in $OUT."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run.sh"), "--cpu"], capture_output=True, text=True,
                          env=env, timeout=1500)
    (report_path,) = out.glob("gpu-kit-cpu-*.json")
    report = json.loads(report_path.read_text())
    steps = report["steps"]
    assert proc.returncode == 0, {n: (s["status"], s.get("reason"), s.get("log_tail")) for n, s in steps.items()}
    assert (out / report_path.name.replace(".json", ".md")).is_file()
    assert list(steps) == [s[0] for s in kit.STEPS]
    for name, step in steps.items():
        assert step["status"] in ("ok", "skipped"), (name, step.get("reason"))

    detect = steps["detect"]["figures"]
    assert detect["resolve"]["plan"]["gpu"]["name"] == "CPU" and detect["doctor"]["exit"] == 0

    numerics = steps["numerics"]["figures"]
    assert numerics["varlen_attn"]["status"] == "skipped" and "CUDA" in numerics["varlen_attn"]["reason"]
    assert numerics["masked_sdpa_default"]["within"] is True
    assert numerics["no_isolation"]["within"] is False  # the comparison tells isolation from none

    speed = steps["speed"]["figures"]
    assert speed["varlen"]["status"] == "skipped"
    assert speed["mask"]["tokens_per_s"] > 0 and speed["padding"]["tokens_per_s"] > 0

    memory = steps["memory"]["figures"]
    for key in ("full_bf16", "lora"):
        assert memory[key]["estimate_high_gib"] >= memory[key]["estimate_gib"] >= memory[key]["estimate_low_gib"] > 0
        assert memory[key]["measured"].startswith("skipped: ")
    assert memory["auto_batch"]["record"]["micro_batch_size"] >= 1

    train = steps["train"]["figures"]
    assert train["dry_run"]["kind"] == "active" and train["run"]["exit"] == 0
    assert any(n.endswith(".safetensors") for n in train["run"]["saved"])


def test_the_kit_removes_only_a_venv_it_made(tmp_path):
    """KIT_VENV naming a project folder, a file or a link: refused in one line, nothing deleted; the kit's own venv
    (its mark in the root) is removed before the next run makes it anew."""
    project = tmp_path / "my-project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "work.py").write_text("precious = True\n")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me\n")
    link = tmp_path / "link"
    link.symlink_to(project)
    for path in (project, a_file, link):
        with pytest.raises(RuntimeError, match=rf"KIT_VENV {path}: exists and is not a venv this kit made"):
            kit.remove_own_venv(path)
    assert (project / "src" / "work.py").read_text() == "precious = True\n" and a_file.read_text() == "keep me\n"
    own = tmp_path / "kit-venv"
    (own / "lib").mkdir(parents=True)
    (own / kit.KIT_MARK).write_text("made by the kit\n")
    kit.remove_own_venv(own)
    assert not own.exists()
    kit.remove_own_venv(tmp_path / "never-made")  # nothing there: nothing to do
