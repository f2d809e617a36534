"""GRPO's completions from a vLLM server with the LoRA adapter synced through the filesystem
(trainer/objectives/grpo_server.py), against a stand-in server captured from TRL's client and Axolotl's sync
(tests/trainer/vllm_standin.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch

from tests.trainer.helpers import REPO, read_metrics
from tests.trainer.objectives.test_grpo import grpo_config  # noqa: F401  (the fixture)
from tests.trainer.vllm_standin import StandInVLLM
from trainer.cli import main

SERVER = {"use_vllm": True, "vllm_lora_sync": True, "vllm_server_host": "127.0.0.1", "vllm_server_timeout": 5}
LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy(model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_path)),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def adapter_tensors(model) -> dict:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("flavour", ["vllm", "axolotl"])
def test_the_server_generates_from_the_adapter_the_trainer_had_at_each_sync(tiny_llama, flavour):
    """vllm_sync_interval 2 over steps 0-4: the server loads the adapter after steps 2 and 4 (not at 0), through vLLM's
    /v1/load_lora_adapter or, on Axolotl's own server (404 there), /set_lora_adapter/ with the version as lora_int_id;
    what it loaded is the trainer's adapter at that step, and every later generation uses it."""
    from trainer.config.grpo import TrlConfig
    from trainer.objectives.grpo_server import LORA_NAME, ServerGeneration

    model, said, at_sync = policy(tiny_llama), [], {}
    with StandInVLLM(tiny_llama, flavour) as server:
        trl = TrlConfig(**SERVER, vllm_server_port=server.port, vllm_sync_interval=2)
        generation = ServerGeneration(types.SimpleNamespace(trl=trl, lora_model_dir=None), 0, said.append)
        for step in range(5):
            generation.maybe_sync(model, step, barrier=lambda: None)
            at_sync[step] = adapter_tensors(model)
            got = generation.generate([[1, 5, 9], [1, 7]], n=2, max_tokens=3, seed=step)
            assert [len(p) for p in got["prompt_ids"]] == [3, 2] and len(got["completion_ids"]) == 4
            assert all(len(lp) == len(ids) for lp, ids in zip(got["logprobs"], got["completion_ids"]))
            with torch.no_grad():  # "an optimizer step": the adapter moves
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.05 * (step + 1))
    assert [load["endpoint"] for load in server.loads] == (
        ["/v1/load_lora_adapter"] * 2 if flavour == "vllm" else ["/set_lora_adapter"] * 2)
    for load, step in zip(server.loads, (2, 4)):
        assert load["tensors"].keys() == at_sync[step].keys()
        assert all(torch.equal(load["tensors"][k], at_sync[step][k]) for k in load["tensors"])
    assert [g["adapter_loads_before"] for g in server.generations] == [0, 0, 1, 1, 2]
    if flavour == "vllm":  # the adapter is served as a model of its own name
        assert [g["model"] for g in server.generations][2:] == [LORA_NAME] * 3
    else:
        posts = [body for method, path, body in server.requests if path == "/set_lora_adapter/"]
        assert [p["lora_int_id"] for p in posts] == [1, 2]
    via = "/v1/load_lora_adapter" if flavour == "vllm" else "/set_lora_adapter/"
    assert said == [f"vllm: adapter v1 loaded by the server via {via} (after step 2)",
                    f"vllm: adapter v2 loaded by the server via {via} (after step 4)"]


def test_trl_generation_kwargs_reach_the_server_in_the_request_as_trls_client_sends_them(tiny_llama):
    """trl.generation_kwargs with the vLLM server: merged into the /v1/completions body over the sampling settings,
    as TRL's VLLMClient.generate(generation_kwargs=...) does (Axolotl's async trainer passes them there); the user's
    seed replaces the step's."""
    from trainer.config.grpo import TrlConfig
    from trainer.objectives.grpo_server import ServerGeneration

    extra = {"frequency_penalty": 0.25, "stop_token_ids": [7], "top_k": 3}
    with StandInVLLM(tiny_llama) as server:
        for given, seed in ((extra, 11), ({**extra, "seed": 5}, 5)):
            trl = TrlConfig(**SERVER, vllm_server_port=server.port, top_k=20, generation_kwargs=given)
            generation = ServerGeneration(types.SimpleNamespace(trl=trl, lora_model_dir=None), 0, lambda *_: None)
            generation.generate([[1, 5, 9]], n=2, max_tokens=3, seed=11)
            body = [b for method, path, b in server.requests if path == "/v1/completions"][-1]
            assert {k: body[k] for k in extra} == extra and body["seed"] == seed  # top_k 3 over trl.top_k 20
            assert (body["n"], body["max_tokens"], body["prompt"]) == (2, 3, [[1, 5, 9]])


def test_a_resumed_run_or_a_loaded_adapter_syncs_before_its_first_generation():
    from trainer.objectives.grpo_server import ServerGeneration

    def syncs(first: int, fresh: bool, interval: int) -> list[int]:
        g = ServerGeneration.__new__(ServerGeneration)
        g.interval, g.fresh_adapter, g.last_synced, g.rank = interval, fresh, None, 1  # rank 1: no HTTP
        g.version, done = 0, []
        for step in range(first, 7):
            before = g.version
            g.maybe_sync(None, step, barrier=lambda: None)
            if g.version > before:
                done.append(step)
        return done

    assert syncs(0, True, 1) == [1, 2, 3, 4, 5, 6]  # Axolotl: never at step 0, then every step
    assert syncs(0, True, 3) == [3, 6]
    assert syncs(4, True, 3) == [4, 6]  # resumed at step 4: the server gets the checkpoint's adapter first
    assert syncs(0, False, 3) == [0, 3, 6]  # lora_model_dir: the adapter is not the base


def test_async_prefetch_trains_each_step_on_completions_generated_one_step_behind(grpo_config, tiny_llama):  # noqa: F811
    """GRPO's server path with async_prefetch, driven as the loop drives it (expand's server_samples per step, the
    loop's Lookahead as `upcoming`): one generation request per step, step s + 1's made right after the sync of step
    s (so from the adapter after s steps, while step s trains), never overlapping a sync; a prefetch for other prompts
    (an out-of-memory back-off) is dropped and the step generates in the foreground."""
    from trainer.config import load_config
    from trainer.objectives.grpo import GRPO
    from trainer.objectives.grpo_server import ServerGeneration
    from trainer.train import Lookahead

    model = policy(tiny_llama)
    batches = [{"examples": [{"index": i, "prompt_ids": [1, 5 + i], "row": "{}"}]} for i in range(5)]
    with StandInVLLM(tiny_llama) as server:
        cfg, _ = load_config(grpo_config("async.yml", rl="grpo", **LORA, micro_batch_size=2, gradient_accumulation_steps=1,
                                         trl={**SERVER, "vllm_server_port": server.port, "async_prefetch": True,
                                              "multi_objective_aggregation": None, "max_completion_length": 3}))
        grpo = GRPO(cfg, types.SimpleNamespace(pad_token_id=0), [], [])
        grpo.eos_ids, grpo.server = [2], ServerGeneration(cfg, 0, lambda line: None)
        loader = Lookahead(iter(batches))
        trained = []
        for step in range(4):
            (batch,) = loader.take(1)
            grpo.upcoming = (lambda: loader.peek(1)) if step < 3 else None
            samples = grpo.server_samples(model, batch["examples"], step)
            trained.append((samples[0]["example"]["index"], len(samples)))
            with torch.no_grad():  # the step trains
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.05)
        assert trained == [(i, 2) for i in range(4)]  # each step's own prompts, num_generations each
        # requests: step 0 in the foreground, then step s + 1's right after step s's sync (loads 0, 0, 1, 2)
        assert [g["adapter_loads_before"] for g in server.generations] == [0, 0, 1, 2]
        assert len(server.loads) == 3  # after steps 1, 2, 3
        grpo.server.prefetch(("other",), lambda: ["stale"])  # a prefetch for other prompts is dropped
        assert grpo.server.take((4, (4,))) is None and grpo.server.pending is None


def test_lookahead_peeks_without_taking_and_ends_with_the_epoch():
    from trainer.train import Lookahead

    batches = Lookahead(iter(range(5)))
    assert batches.take(2) == [0, 1] and batches.peek(2) == [2, 3] and batches.take(1) == [2]
    assert batches.peek(3) is None and batches.take(2) == [3, 4]


def test_importance_ratio_is_axolotls_truncated_or_masked_ratio():
    from trainer.objectives.grpo import importance_ratio

    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    sampling = torch.tensor([[-1.0, -0.5, -4.5]])  # ratios 1, e^-1.5, e^1.5 (e^1.5 = 4.48 > cap 3)
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    assert torch.allclose(importance_ratio(logps, sampling, mask, "token_truncate", 3.0),
                          torch.tensor([[1.0, 1 / 3, 3.0]]))  # e^-1.5 = 0.22 raised to the floor 1/3
    assert torch.allclose(importance_ratio(logps, sampling, mask, "token_mask", 3.0),
                          torch.tensor([[1.0, 1 / 3, 1 / 3]]))  # above cap: 0, then the floor
    assert torch.allclose(importance_ratio(logps, sampling, mask, "sequence_truncate", 3.0), torch.tensor([[1.0]]))
    unknown = torch.tensor([[float("nan"), -0.5, -4.5]])  # no log-prob from the server: ratio 1 there
    assert importance_ratio(logps, unknown, mask, "token_truncate", 3.0)[0, 0] == 1.0
    half = torch.tensor([[1.0, 0.0, 0.0]])  # masked tokens do not count
    assert torch.allclose(importance_ratio(logps, sampling, half, "sequence_mask", 10.0), torch.tensor([[1.0]]))


def test_no_server_is_one_line_and_exit_1_before_the_model_loads(grpo_config, tmp_path, capsys):  # noqa: F811
    config = grpo_config("dead.yml", rl="grpo", output_dir=str(tmp_path / "dead"), **LORA,
                         trl={**SERVER, "vllm_server_port": free_port(), "vllm_server_timeout": 0,
                              "multi_objective_aggregation": None})
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error")] == [err[-1]] and "Traceback" not in "\n".join(err)
    assert "no vLLM server answers at http://127.0.0.1:" in err[-1] and "vllm_server_timeout" in err[-1]
    assert not any("Loading weights" in line for line in err)  # before the model loads
    assert not (tmp_path / "dead" / "metrics.jsonl").exists()  # (only the run's lock file was made)


@pytest.mark.parametrize("trl, extra, message", [
    (SERVER, {}, "trl.vllm_lora_sync: needs adapter: lora or qlora (it sends the LoRA adapter to the vLLM server"),
    ({"use_data_producer": True}, LORA, "here it needs use_vllm: true with vllm_lora_sync: true"),
    ({"async_prefetch": True}, LORA, "here it needs use_vllm: true with vllm_lora_sync: true"),
    ({**SERVER, "async_prefetch": True, "prefetch_depth": 2}, LORA, "prefetch_depth: 2; only 1"),
    ({**SERVER, "vllm_mode": "colocate"}, LORA, "vllm_mode: colocate runs vLLM inside the training process"),
    ({**SERVER, "vllm_importance_sampling_mode": "tis"}, LORA, "vllm_importance_sampling_mode"),
])
def test_what_is_not_done_here_is_refused_in_one_line(grpo_config, tmp_path, capsys, trl, extra, message):  # noqa: F811
    config = grpo_config("bad.yml", trl=trl, output_dir=str(tmp_path / "bad"), **extra)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error")]) == 1 and message in err[-1], err


def test_validate_says_where_completions_come_from_without_asking_the_server(grpo_config, capsys):  # noqa: F811
    config = grpo_config(rl="grpo", **LORA, trl={**SERVER, "vllm_server_port": free_port(), "async_prefetch": True,
                                                  "multi_objective_aggregation": None, "vllm_sync_interval": 2})
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert "completions from the vLLM server at http://127.0.0.1:" in out
    assert "the adapter synced every 2 step(s), the next step prefetched" in out


def test_full_weight_vllm_generates_locally_and_says_why(grpo_config, capsys):  # noqa: F811
    assert main(["validate", str(grpo_config(trl={"use_vllm": True}))]) == 0
    out = capsys.readouterr()
    assert "needs CUDA and vLLM's NCCL weight-transfer engine" in out.out + out.err


@pytest.mark.slow  # one GRPO run in a subprocess through `envtool train` (~30 s)
def test_envtool_trains_grpo_on_the_servers_completions(grpo_config, tiny_llama, tmp_path):  # noqa: F811
    """Three steps against the stand-in: the server loads the adapter twice (after steps 1 and 2), what it loaded after
    step 2 is checkpoint-2's adapter, the run generated on-policy (importance ratio 1), says where completions came
    from, and saves."""
    from safetensors.torch import load_file

    with StandInVLLM(tiny_llama) as server:
        config = grpo_config("server.yml", rl="grpo", output_dir=str(tmp_path / "out"), max_steps=3, save_steps=2,
                             **LORA, trl={**SERVER, "vllm_server_port": server.port, "beta": 0.0, "top_p": 1.0,
                                          "multi_objective_aggregation": None, "use_data_producer": True,
                                          "generation_kwargs": {"frequency_penalty": 0.1},
                                          "off_policy_mask_threshold": 0.5})
        env = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        out = subprocess.run([sys.executable, "-m", "resolver", "train", str(config), "--gpu", "cpu"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stdout + out.stderr
    assert f"grpo: completions from the vLLM server at http://127.0.0.1:{server.port}" in log
    assert [load["endpoint"] for load in server.loads] == ["/v1/load_lora_adapter"] * 2
    assert "adapter v2 loaded by the server via /v1/load_lora_adapter (after step 2)" in log
    saved = load_file(str(tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors"))
    assert saved.keys() == server.loads[1]["tensors"].keys()
    assert all(torch.equal(saved[k], server.loads[1]["tensors"][k]) for k in saved)
    assert [g["adapter_loads_before"] for g in server.generations] == [0, 1, 2]
    bodies = [b for method, path, b in server.requests if path == "/v1/completions"]
    assert len(bodies) == 3 and all(b["frequency_penalty"] == 0.1 for b in bodies)  # trl.generation_kwargs
    rows = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["completions"] == 4 for r in rows)
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in rows)  # on-policy
    completions = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 12 and (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------- servers that misbehave (issue 44 item 3)
def _generating_with(tiny_llama, answer, timeout: int = 2):
    """ServerGeneration against a stand-in whose /v1/completions answers `answer(body, original)`; runs one
    generate() in a thread and returns (what it raised or returned, whether it finished within 60 s)."""
    import threading

    from trainer.config.grpo import TrlConfig
    from trainer.objectives.grpo_server import ServerGeneration

    outcome = {}
    with StandInVLLM(tiny_llama) as server:
        original = server.completions
        server.completions = lambda body: answer(body, original)
        trl = TrlConfig(**{**SERVER, "vllm_server_timeout": timeout}, vllm_server_port=server.port)
        generation = ServerGeneration(types.SimpleNamespace(trl=trl, lora_model_dir=None), 0, lambda s: None)

        def call():
            try:
                outcome["result"] = generation.generate([[1, 5, 9], [1, 7]], n=2, max_tokens=6, seed=0)
            except Exception as err:  # noqa: BLE001  (what the run would print)
                outcome["error"] = err

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(60)
        finished = not worker.is_alive()
        release.set()
    return outcome, finished, server.url


release = __import__("threading").Event()


def test_a_server_that_stops_answering_ends_the_request_at_its_timeout_naming_the_server(tiny_llama):
    """TRL's client gives generation no timeout: a server that takes the request and never answers held the run for
    good. Each request now ends at trl.vllm_server_timeout (not retried), one line naming the server."""
    from trainer.errors import TrainingError

    release.clear()
    outcome, finished, url = _generating_with(tiny_llama, lambda body, original: release.wait(120) or original(body))
    assert finished, "generation still waiting on a silent server after 60 s"
    assert isinstance(outcome.get("error"), TrainingError), outcome
    assert str(outcome["error"]).startswith(f"trl.use_vllm: generation on the vLLM server at {url} failed: ")
    assert "timed out" in str(outcome["error"]).lower()


@pytest.mark.parametrize("answer, says", [
    (lambda body, original: original({**body, "max_tokens": 40}), "a completion of"),  # longer than asked for
    (lambda body, original: (200, "<html><body>502 Bad Gateway</body></html>"), "failed: "),  # a proxy's page
    (lambda body, original: (200, {"choices": []}), "failed: "),  # nothing where 4 were asked for
])
def test_a_server_answer_that_does_not_fit_the_config_is_one_line_naming_the_server(tiny_llama, answer, says):
    from trainer.errors import TrainingError

    outcome, finished, url = _generating_with(tiny_llama, answer)
    assert finished and isinstance(outcome.get("error"), TrainingError), outcome
    line = str(outcome["error"])
    assert f"the vLLM server at {url}" in line and says in line and "\n" not in line


# ------------------------------------------------- a server that stops answering in the middle of a run (issue 44)
def _run_with_a_server_that_hangs_from(grpo_config, tiny_llama, tmp_path, hang_from: int, timeout: int,  # noqa: F811
                                       signal_when_waiting=None):
    """`python -m trainer train` (one process, 4 steps, no save before the end) against a stand-in whose generation request
    number `hang_from` (1-based) and later never answer. With `signal_when_waiting`, that signal is sent once the
    hanging request has arrived. Returns (the finished process, seconds from the hang to the exit)."""
    import signal as signals
    import threading
    import time

    calls, hung = [], threading.Event()
    with StandInVLLM(tiny_llama) as server:
        original = server.completions

        def completions(body):
            calls.append(1)
            if len(calls) >= hang_from:
                hung.set()
                release.wait(120)
            return original(body)

        server.completions = completions
        config = grpo_config("hang.yml", rl="grpo", output_dir=str(tmp_path / "out"), max_steps=4, save_steps=100,
                             **LORA, trl={**SERVER, "vllm_server_port": server.port, "vllm_server_timeout": timeout,
                                          "beta": 0.0, "multi_objective_aggregation": None})
        env = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        release.clear()
        proc = subprocess.Popen([sys.executable, "-m", "trainer", "train", str(config)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 240
            while not hung.wait(0.5):
                assert proc.poll() is None, f"the run ended before the hanging request: {proc.communicate()[1][-2000:]}"
                assert time.monotonic() < deadline, "the run never reached the hanging request"
            started = time.monotonic()
            if signal_when_waiting is not None:
                time.sleep(1.0)
                proc.send_signal(signal_when_waiting)
            out, err = proc.communicate(timeout=timeout + 120)
            took = time.monotonic() - started
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert signals.SIGTERM  # (imported for the callers' signal)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), took, config, server.url


@pytest.mark.slow  # GRPO runs in a subprocess (~40 s)
def test_a_server_that_stops_answering_mid_run_keeps_the_last_finished_step_and_resumes(
        grpo_config, tiny_llama, tmp_path):  # noqa: F811
    """The third step's request is never answered: the run ends at trl.vllm_server_timeout in one line that names the
    server and where the last finished step is kept (checkpoint-2, though save_steps never saved), exit 1; the same
    command with the server back finishes steps 3 and 4 from it."""
    result, took, config, url = _run_with_a_server_that_hangs_from(grpo_config, tiny_llama, tmp_path, hang_from=3,
                                                                  timeout=4)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: trl.use_vllm: generation on the vLLM server at {url} failed: ") and \
        f"{tmp_path / 'out' / 'checkpoint-2'} keeps step 2: run the same command again to resume from it" in last, last
    assert took < 4 + 60  # the request's timeout, then the checkpoint
    assert (tmp_path / "out" / "checkpoint-2").is_dir() and not (tmp_path / "out" / "final").exists()
    with StandInVLLM(tiny_llama) as server:
        import yaml

        raw = yaml.safe_load(config.read_text())
        raw["trl"]["vllm_server_port"] = server.port  # the server came back elsewhere (an address may change)
        config.write_text(yaml.safe_dump(raw))
        env = {k: v for k, v in os.environ.items() if k != "ENVTOOL_PLAN"}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        again = subprocess.run([sys.executable, "-m", "trainer", "train", str(config)], capture_output=True, text=True,
                               env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr + again.stdout
    steps = [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert steps == [1, 2, 3, 4] and (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow  # a GRPO run in a subprocess (~30 s)
def test_a_stop_while_waiting_for_the_server_is_acted_on_at_once_with_the_last_finished_step(
        grpo_config, tiny_llama, tmp_path):  # noqa: F811
    """SIGTERM while the third step waits for a server that does not answer (its timeout 120 s): the run gives the
    step up, keeps step 2 in checkpoint-2 and exits 138 within seconds, not after the request's timeout."""
    import signal

    result, took, _, _ = _run_with_a_server_that_hangs_from(grpo_config, tiny_llama, tmp_path, hang_from=3,
                                                           timeout=120, signal_when_waiting=signal.SIGTERM)
    assert result.returncode == 138, result.stderr[-2000:]
    assert took < 30, took
    last = result.stderr.strip().splitlines()[-1]
    assert "stopped after step 2 of 4 (SIGTERM)" in last and str(tmp_path / "out" / "checkpoint-2") in last, last
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
