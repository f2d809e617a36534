"""use_ray: `python -m trainer train` runs the loop on Ray Train workers (a local Ray cluster on 127.0.0.1,
gloo on CPU). Ray's start-up is slow on a small machine, so three Ray runs serve every assertion: a DDP run
(module-scoped) checked against the same config under torchrun with 2 processes, FSDP2 against that DDP run, and
a DeepSpeed ZeRO-3 LoRA run shaped like Axolotl's lora-1b-ray.yml that resumes under Ray from torchrun's mid-run
checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.trainer.helpers import REPO, alpaca_rows, read_metrics, run_cli, torchrun_train, train_losses, write_jsonl
from trainer.config import parse_config

DS_CONFIGS = Path(__file__).parents[1] / "fixtures" / "deepspeed_configs"  # Axolotl's zero3.json, verbatim
RAY_TIMEOUT = 900  # a local Ray cluster starts in ~15 s alone; on 2 shared cores, far more
# one local Ray cluster at a time under pytest-xdist: each takes the machine's CPUs and a few GB, and the first two
# tests share the module's ddp_runs
pytestmark = pytest.mark.xdist_group("ray")


def ray_train(config: Path, timeout: int = RAY_TIMEOUT) -> subprocess.CompletedProcess:
    """`python -m trainer train CONFIG` as a user runs it: one process, which starts the Ray workers."""
    env = {k: v for k, v in os.environ.items() if k not in ("ENVTOOL_PLAN", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "trainer", "train", str(config)], capture_output=True, text=True,
                          env=env, cwd=config.parent, timeout=timeout)


def write_config(tmp: Path, name: str, tiny_llama: Path, **overrides) -> Path:
    data = tmp / "uneven.jsonl"
    if not data.exists():
        write_jsonl(data, alpaca_rows(64, seed=3, long_every=4))  # long-tailed lengths: uneven packs
    cfg = dict(base_model=str(tiny_llama), datasets=[{"path": str(data), "type": "alpaca"}],
               dataset_prepared_path=str(tmp / f"prepared-{name}"), output_dir=str(tmp / name), sequence_len=400,
               sample_packing=True, val_set_size=0.2, micro_batch_size=1, max_steps=4, eval_steps=2, save_steps=2,
               learning_rate=1e-3, lr_scheduler="cosine", warmup_steps=1, seed=1, attn_implementation="sdpa",
               ddp_timeout=120, **overrides)
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
    return path


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, tiny_llama):
    """The same config twice: under torchrun (2 processes) and under Ray (ray_num_workers: 2)."""
    tmp = tmp_path_factory.mktemp("ray-ddp")
    reference = torchrun_train(write_config(tmp, "torchrun", tiny_llama))
    assert reference.returncode == 0, reference.stderr[-4000:]
    ray = ray_train(write_config(tmp, "ray", tiny_llama, use_ray=True, ray_num_workers=2))
    return tmp / "torchrun", tmp / "ray", ray


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ray_workers_train_exactly_as_two_torchrun_processes(ddp_runs):
    torchrun_out, ray_out, ray = ddp_runs
    assert ray.returncode == 0, ray.stderr[-4000:]
    assert "Traceback" not in ray.stderr
    assert "training on 2 process(es)" in ray.stderr and "ray: 2 worker(s) trained, ranks 0, 1" in ray.stderr
    markers = [json.loads(p.read_text()) for p in sorted((ray_out / "ray" / "workers").glob("rank-*.json"))]
    assert [(m["rank"], m["world_size"], m["backend"]) for m in markers] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert markers[0]["pid"] != markers[1]["pid"]  # two processes, not one doing both ranks
    # the loop ran as under torchrun: the same steps, losses and evaluations (same gloo reductions)
    losses, reference = train_losses(ray_out), train_losses(torchrun_out)
    assert losses.keys() == reference.keys() == {1, 2, 3, 4}
    assert all(losses[s] == pytest.approx(reference[s], rel=1e-6) for s in reference), (losses, reference)
    evals = lambda o: [r["eval_loss"] for r in read_metrics(o) if "eval_loss" in r]  # noqa: E731
    assert len(evals(ray_out)) == 2 and evals(ray_out) == pytest.approx(evals(torchrun_out), rel=1e-6)
    # written once, by rank 0: one metrics row per step, checkpoints and final as torchrun writes them
    assert [r["step"] for r in read_metrics(ray_out) if "loss" in r] == [1, 2, 3, 4]
    assert sorted(p.name for p in ray_out.iterdir() if p.name.startswith(("checkpoint-", "final", ".tmp"))) == \
        ["checkpoint-2", "checkpoint-4", "final"]
    state = json.loads((ray_out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2

    from safetensors.torch import load_file

    for part in ("checkpoint-2", "final"):
        got, want = load_file(ray_out / part / "model.safetensors"), load_file(torchrun_out / part / "model.safetensors")
        assert got.keys() == want.keys() and all((got[k] - want[k]).abs().max() < 1e-6 for k in want), part


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_under_ray_reaches_ddps_losses(ddp_runs, tmp_path, tiny_llama):
    """FSDP2 on 2 Ray workers (accelerate's plugin over Ray's gloo group): DDP's losses, evaluations and weights,
    as under torchrun (tests/trainer/parallel/test_fsdp_deepspeed.py)."""
    torchrun_out = ddp_runs[0]
    fsdp = {"fsdp_version": 2, "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                               "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                               "fsdp_state_dict_type": "FULL_STATE_DICT"}}
    ray = ray_train(write_config(tmp_path, "fsdp", tiny_llama, use_ray=True, ray_num_workers=2, **fsdp))
    assert ray.returncode == 0, ray.stderr[-4000:]
    assert "sharding: FSDP" in ray.stderr and "ray: 2 worker(s) trained, ranks 0, 1" in ray.stderr
    losses, reference = train_losses(tmp_path / "fsdp"), train_losses(torchrun_out)
    assert losses.keys() == reference.keys() and all(losses[s] == pytest.approx(reference[s], rel=1e-5) for s in reference)
    evals = lambda o: [r["eval_loss"] for r in read_metrics(o) if "eval_loss" in r]  # noqa: E731
    assert evals(tmp_path / "fsdp") == pytest.approx(evals(torchrun_out), rel=1e-5)

    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "fsdp" / "final" / "model.safetensors"), load_file(torchrun_out / "final" / "model.safetensors")
    assert got.keys() == want.keys() and all((got[k] - want[k]).abs().max() < 1e-4 for k in want)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_lora_under_ray_resumes_a_checkpoint_exactly(tmp_path, tiny_llama):
    """Axolotl's lora-1b-ray.yml in small: LoRA, packing, evaluation, DeepSpeed ZeRO-3, Ray. torchrun trains it
    to the end; Ray resumes from its mid-run checkpoint (DeepSpeed's per-rank partitions) and takes exactly the
    later steps."""
    shape = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True,
                 deepspeed=str(DS_CONFIGS / "zero3.json"))
    full = torchrun_train(write_config(tmp_path, "full", tiny_llama, **shape))
    assert full.returncode == 0, full.stderr[-4000:]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed / "checkpoint-2")
    ray = ray_train(write_config(tmp_path, "resumed", tiny_llama, use_ray=True, ray_num_workers=2,
                                 auto_resume_from_checkpoints=True, **shape))
    assert ray.returncode == 0, ray.stderr[-4000:]
    assert "sharding: DEEPSPEED" in ray.stderr and "resumed from" in ray.stderr
    assert "ray: 2 worker(s) trained, ranks 0, 1" in ray.stderr
    before, after = train_losses(tmp_path / "full"), train_losses(resumed)
    assert sorted(after) == [3, 4]
    assert all(after[s] == pytest.approx(before[s], rel=1e-6) for s in after), (before, after)
    assert (resumed / "final" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_the_axolotl_ray_example_validates_and_says_how_it_launches(tmp_path):
    example = Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "llama-3__lora-1b-ray.yml"
    result = run_cli("validate", str(example), "--gpu", "a100", cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "launcher:   Ray Train, 4 worker(s) of 1 GPU on a local Ray cluster (127.0.0.1), nccl" in result.stdout
    cpu = run_cli("validate", str(example), "--gpu", "cpu", cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert cpu.returncode == 0 and "4 worker(s) of 1 CPU" in cpu.stdout and "GPU left out" in cpu.stdout


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    ({"ray_num_workers": -2}, "ray_num_workers"),
    ({"resources_per_worker": {"GPU": -1}}, "resources_per_worker.GPU: -1 is negative"),
    ({"ray_run_name": "../elsewhere"}, "ray_run_name"),
])
def test_nonsense_is_refused_in_one_line(make_config, overrides, message):
    result = run_cli("validate", str(make_config(use_ray=True, **overrides)))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_more_workers_than_cpus_validate(make_config):
    cfg, _ = parse_config(yaml.safe_load(make_config(use_ray=True, ray_num_workers=64).read_text()))
    assert cfg.ray_num_workers == 64 and cfg.resources_per_worker is None


@pytest.mark.slow
def test_without_ray_installed_train_names_the_extra(make_config):
    """`import ray` fails as it does when Ray is not installed (None in sys.modules makes the import raise)."""
    code = ("import sys; sys.modules['ray'] = None; from trainer.cli import main; "
            f"sys.exit(main(['train', {str(make_config(use_ray=True, ray_num_workers=2))!r}]))")
    env = {**{k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: use_ray: Ray Train is not installed in this environment; install the ray extra: "
        "pip install 'envtool-llm[ray]' (ray[train])"]


def test_gpu_workers_beyond_the_machine_are_refused_before_ray_starts():
    """On a GPU run each worker takes resources_per_worker.GPU (Axolotl's default 1); more than the machine has
    would leave Ray waiting forever, so it is an error (a CPU run needs no GPU: the entry is dropped)."""
    from types import SimpleNamespace

    from trainer.errors import HardwareError
    from trainer.ray_launch import scaling

    cfg, _ = parse_config({"base_model": "x", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "use_ray": True,
                        "ray_num_workers": 4})
    gpu, cpu = SimpleNamespace(device="cuda"), SimpleNamespace(device="cpu")
    assert scaling(cfg, gpu, gpus_here=4)[:2] == (True, {"GPU": 1.0})
    with pytest.raises(HardwareError, match="4 workers x 1 GPU need 4 GPUs, and this machine has 2"):
        scaling(cfg, gpu, gpus_here=2)
    half = cfg.model_copy(update={"resources_per_worker": {"GPU": 0.5, "CPU": 2}})
    assert scaling(half, gpu, gpus_here=2)[:2] == (True, {"GPU": 0.5, "CPU": 2.0})
    use_gpu, resources, notes = scaling(cfg, cpu)
    assert (use_gpu, resources) == (False, {}) and "GPU left out" in notes[0]


def test_a_failed_worker_becomes_the_trainers_own_one_line_error():
    """What trainer.fit() raises when workers fail (Ray's own WorkerGroupError, the workers' exceptions by rank,
    as they arrive pickled): the lowest rank's trainer error, with its exit code; anything else is exit 1."""
    import pickle

    from tests.support.oracle import require_extra

    require_extra("ray", "ray")
    from ray.train import ControllerError, WorkerGroupError

    from trainer.errors import DataError, TrainingError
    from trainer.ray_launch import _worker_error

    failures = {1: DataError("180 training rows make 1 micro-batches"), 0: RuntimeError("gloo: connection reset"),
                2: TrainingError("collective timed out")}
    err = pickle.loads(pickle.dumps(WorkerGroupError("snippets", failures)))
    got = _worker_error(err)
    assert type(got) is DataError and got.exit_code == 2 and str(got) == "180 training rows make 1 micro-batches"
    other = _worker_error(WorkerGroupError("snippets", {1: RuntimeError("gloo: connection reset\nmore")}))
    assert type(other) is TrainingError and str(other) == "ray worker 1: RuntimeError: gloo: connection reset"
    controller = _worker_error(ControllerError(ValueError("no resources\nfor the workers")))
    assert type(controller) is TrainingError and str(controller) == "ray: ValueError: no resources"


def test_under_torchrun_a_use_ray_config_is_refused_before_ray_starts(make_config, monkeypatch, capsys):
    """Every torchrun process would start its own Ray cluster and its own workers."""
    from trainer.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", str(make_config(use_ray=True, ray_num_workers=2))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: use_ray: launch this config as one process (python -m trainer train), not with torchrun: "
                   "Ray Train starts its ray_num_workers workers itself"]


def test_the_placement_group_cleaner_failing_beside_another_ray_cluster_prints_no_traceback():
    """Two Ray clusters on one machine (a concurrent run's): Ray Train's placement-group cleaner thread ended with
    "Found multiple active Ray instances" and a traceback on the run's terminal (seen in the extended tier). The
    setup hook every Ray process runs sends that one failure to the cleaner's log; any other thread failure goes to
    the hook that printed it before."""
    import threading

    from trainer.ray_launch import _quiet_ray

    before, printed = threading.excepthook, []
    try:
        threading.excepthook = lambda args: printed.append(args.exc_value)  # what prints a thread's traceback
        _quiet_ray()

        def fail(error):
            thread = threading.Thread(target=lambda: (_ for _ in ()).throw(error))
            thread.start()
            thread.join()

        fail(ConnectionError("Found multiple active Ray instances: {'127.0.0.1:1', '127.0.0.1:2'}."))
        other = ValueError("something else")
        fail(other)
        assert printed == [other]
    finally:
        threading.excepthook = before
