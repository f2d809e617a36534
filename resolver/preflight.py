"""envtool doctor --multi-gpu: the trainer's preflight (trainer/parallel/preflight.py) under the environment's own
torchrun with the job's launch settings, its ranks' reports turned into doctor findings.

Every rank writes its view to a report folder made for the run; the lowest rank that reported saw every rank's
facts, so its findings are the answer. torchrun is bounded (stopped past 4 x timeout + 2 minutes), so a hang in
the transport itself ends as a finding, never as a doctor that does not return.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from .doctor import Finding
from .errors import BadInput
from .hardware import GpuSpec
from .launch import Distribution
from .launch import launch_command
from .launch import read_config
from .matrix import load
from matrices.catalog import find_gpu, p2p_advice


def multi_gpu_processes(gpu: GpuSpec, dist: Distribution, *, timeout: float, config: Path | None = None) -> int:
    """The processes per machine the preflight starts (--nproc, else every GPU of the target, 2 on the CPU);
    BadInput for what cannot work, before anything starts."""
    dist.check()
    nproc, nnodes = dist.nproc, dist.nnodes
    if timeout <= 0:
        raise BadInput(f"--timeout {timeout:g}: give a number of seconds above 0")
    if config is not None:
        if not config.is_file():
            raise BadInput(f"--config {config}: no such file")

        read_config(config)  # the trainer's own reader: a bad config is its one line, exit 2, before torchrun
    count = nproc or (2 if gpu.is_cpu else max(gpu.count, 1))
    if count * nnodes < 2:
        raise BadInput(f"--multi-gpu on {gpu.name}: one process in all (give --nproc 2 or more, or --nnodes)")
    return count


def multi_gpu(python: str, gpu: GpuSpec, driver: str | None, dist: Distribution, *, timeout: float,
              config: Path | None = None) -> tuple[list[Finding], dict]:
    """Start `python -m trainer preflight` under the environment's torchrun with the job's launch settings, read
    what every rank reported, and turn it into findings (plus the catalog's P2P advice for a GPU named with
    --gpu that this machine does not have). Bounded: torchrun is stopped past 4 x timeout + 2 minutes."""
    # start-up: tempfile, trainer.errors imported only when this runs
    import tempfile

    count = multi_gpu_processes(gpu, dist, timeout=timeout, config=config)
    device = "cpu" if gpu.is_cpu else "auto"
    from trainer.errors import ERROR_DIR_ENV

    with tempfile.TemporaryDirectory(prefix="envtool-preflight-") as folder, \
            tempfile.TemporaryDirectory(prefix="envtool-preflight-errors-") as errors:
        args = ["preflight", "--timeout", f"{timeout:g}", "--device", device, "--report", folder]
        if config is not None:
            args += ["--config", str(config)]
        command = launch_command(python, "", dist._replace(nproc=count), rdzv_id="envtool-preflight",
                                 trainer_args=args)
        # torchrun's 3-line OMP banner, quietly; a rank's own error line (a trainer error) kept for the finding
        env = {"OMP_NUM_THREADS": "1", **os.environ, ERROR_DIR_ENV: errors}
        try:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", start_new_session=True)
        except OSError as e:
            raise BadInput(f"could not run {python}: {e.strerror}") from None
        try:
            output, _ = proc.communicate(timeout=4 * timeout + 120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        reports = {}
        for path in Path(folder).glob("rank-*.json"):
            try:
                report = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            reports[report["rank"]] = report
        recorded = []
        for path in Path(errors).glob("rank-*.json"):
            try:
                recorded.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    summary = {"nproc": count, "nnodes": dist.nnodes, "timeout_s": timeout, "exit_code": proc.returncode,
               "backend": None, "joined": [], "missing": [], "all_reduce": None, "ranks": {}, "ok": False}
    if not reports:
        if recorded:  # the trainer's own error line, as `envtool train` prints it
            why = min(recorded, key=lambda r: (r.get("time", 0), r.get("rank", 0)))["line"]
        else:
            lines = [line.strip() for line in output.splitlines() if line.strip() and not line.startswith("=")]
            why = (lines or ["(no output)"])[-1]
        return [Finding("error", "ranks", f"the preflight did not run under torchrun ({count} processes): {why}",
                        "run it by hand to see why: " + " ".join(command))], summary
    report = reports[min(reports)]  # the lowest rank that reported saw every rank's facts
    summary.update({k: report.get(k) for k in ("backend", "joined", "missing", "all_reduce", "ranks", "ok")})
    findings = [Finding(f["level"], f["check"], f["message"], f["fix"]) for f in report["findings"]]
    if report.get("backend") == "gloo" and not gpu.is_cpu:  # planning for a GPU this machine lacks: the catalog

        advice = p2p_advice(find_gpu(gpu.name, load().gpus), driver)
        if advice is not None:
            findings.append(Finding(advice[0], "p2p", advice[1], advice[2]))
    return findings, summary
