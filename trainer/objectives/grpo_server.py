"""GRPO's completions from a vLLM server, the policy's LoRA adapter synced to it through the filesystem
(`trl.use_vllm: true`, `vllm_mode: server`, `vllm_lora_sync: true`), as Axolotl 0.19's async GRPO trainer does it.

The protocol is TRL 1.16's `trl.generation.vllm_client.VLLMClient` (generation: `POST /v1/completions` with token-id
prompts, `n`, the sampling settings, `return_token_ids`, and trl.generation_kwargs merged into the body over them, as
`VLLMClient.generate(generation_kwargs=...)` does: the request's seed is the user's where they give one; `GET /v1/models`; `POST /reset_prefix_cache`) -- the library's
own methods are used -- plus the two adapter endpoints of Axolotl's `AsyncGRPOTrainer._sync_lora_adapter`
(core/trainers/grpo/async_trainer.py): vLLM's `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`, and,
when that does not answer 200, Axolotl's own server's `POST /set_lora_adapter/ {lora_name, lora_int_id, lora_path}`
(scripts/vllm_serve_lora.py).

What differs from the library, and why:
- the client is built without `VLLMClient.__init__`, which refuses to start unless the `vllm` package is installed in
  the *trainer's* environment (it needs it only for the NCCL weight transfer, which this path never uses);
- the wait for the server is bounded here: `VLLMClient.check_server` asks `/health` without a timeout and retries a
  server that answers anything but 200 forever. Here every request has a timeout and the whole wait is
  `trl.vllm_server_timeout` seconds (TRL's default 240); then one error line (exit 1), before the data and the
  model load (GRPO.check_services).

Waiting for the server: each request runs in a daemon thread while the loop's thread waits for it in short slices, so
that (one process) a stop request (SIGTERM, SIGUSR1, Ctrl-C) is acted on at once: the step is given up before it
changed anything (StepAbandoned) and the run stops with a checkpoint of the last finished step; a request that fails or
times out (trl.vllm_server_timeout) ends the run in one line naming the server (ServerFailed), a checkpoint of the
last finished step kept first. A request left running never holds the process at exit (a daemon thread; the
standard library's thread pools are joined at exit). Several processes wait the request out (bounded by its timeout)
and stop at the step's end together, as for any stop request (trainer/runtime/stop.py).

async_prefetch (Axolotl's AsyncGRPOTrainer, prefetch_depth 1): once step s's completions are in hand and the adapter
synced, the completions of step s + 1's prompts (the loop's `Objective.upcoming`) are requested in a background thread
while step s trains: they come from the adapter after s steps and train step s + 1, one step stale, as Axolotl's; the
importance-sampling correction weighs them. Step s + 1 first waits for them, then syncs, then prefetches s + 2, so a
sync never overlaps a generation. A prefetch whose prompts are not the step's (an out-of-memory back-off re-batched
the epoch) is dropped and the step generates in the foreground; the first step, and a resumed run's, generate in the
foreground too (a resumed async run is therefore not bit-identical to the uninterrupted one).

Sync rule (Axolotl's `_maybe_sync_vllm_weights`): before generating for step s (s optimizer steps done), the adapter is
saved to `<tmp>/v<N>` and loaded by the server when s % vllm_sync_interval == 0, except at s = 0 (nothing trained
yet: the fresh adapter is the base). A run resumed from a checkpoint, or started from `lora_model_dir`, syncs before
its first generation too (the server holds no adapter, or another one). Only rank 0 talks to the adapter endpoints;
the other ranks wait at a barrier, then every rank generates its own prompts over HTTP.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import shutil
import tempfile
import threading
import time
from pathlib import Path

from trainer.errors import ServerFailed, StepAbandoned, TrainingError

LORA_NAME = "envtool-policy"  # the name the adapter is loaded under (vLLM serves it as a model of that name)
HEALTH_REQUEST_S = 5.0  # one /health request's own timeout (the whole wait is vllm_server_timeout)
DEFAULT_TIMEOUT_S = 240  # TRL 1.16 GRPOConfig.vllm_server_timeout


def base_url(trl) -> str:
    host = trl.vllm_server_host or "0.0.0.0"  # Axolotl's defaults (utils/schemas/trl.py)
    return f"http://{host}:{trl.vllm_server_port or 8000}"


def server_timeout(trl) -> float:
    return trl.vllm_server_timeout if trl.vllm_server_timeout is not None else DEFAULT_TIMEOUT_S


def wait_for_server(url: str, timeout_s: float, sleep=time.sleep) -> None:
    """Return once `url`/health answers 200; TrainingError (one line) after timeout_s seconds."""
    # heavy: requests loads only when this runs
    import requests

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            response = requests.get(f"{url}/health", timeout=max(min(HEALTH_REQUEST_S, left), 0.5))
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code} from /health"
        except requests.exceptions.RequestException as err:
            last = type(err).__name__
        if time.monotonic() + 1.0 > deadline:
            raise TrainingError(f"trl.use_vllm: no vLLM server answers at {url} ({last}) after {timeout_s:g} s "
                                "(trl.vllm_server_host/vllm_server_port/vllm_server_timeout); start one with "
                                "`vllm serve MODEL --enable-lora` (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) or Axolotl's "
                                "`axolotl vllm-serve` before training")
        sleep(1.0)


def make_client(url: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """TRL's VLLMClient for `url`, without the vllm package (see the module's docstring). Every request it makes is
    bounded: TRL's client gives generation no timeout, so a server that stops answering would hold the run (and a
    stop request) for good; here each request has `timeout_s` (trl.vllm_server_timeout), and a request the server
    took but did not answer in time is not sent again."""
    # heavy: trl and requests load only when this runs
    import requests
    from requests.adapters import HTTPAdapter
    from trl.generation.vllm_client import VLLMClient
    from urllib3.util.retry import Retry

    class Bounded(HTTPAdapter):
        def send(self, request, **kwargs):
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = timeout_s
            return super().send(request, **kwargs)

    client = VLLMClient.__new__(VLLMClient)
    client.session = requests.Session()
    # transient failures retried as TRL's client does (connection, 500/502/503, exponential back-off); a read that
    # timed out is not (read=0): the whole request stays within its timeout, not six times it
    retry = Retry(total=5, connect=5, read=0, status=3, status_forcelist=[500, 502, 503], backoff_factor=2,
                  allowed_methods=["POST", "GET"])
    client.session.mount("http://", Bounded(max_retries=retry))
    client.session.mount("https://", Bounded(max_retries=retry))
    client.base_url, client.host, client.group_port, client.communicator = url, None, None, None
    client._updating_weights = False
    client.model = client._get(f"{url}/v1/models")["data"][0]["id"]
    return client


WAIT_SLICE_S = 0.25  # how often a wait for the server looks for a stop request


def in_background(work, name: str) -> concurrent.futures.Future:
    """work() in a daemon thread (never joined at exit, unlike a ThreadPoolExecutor's), its result in a Future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as err:  # noqa: BLE001 (handed to the waiting thread, which re-raises it)
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class ServerGeneration:
    """The client, the sync counter and the adapter folder of one run (rank 0 syncs; every rank generates)."""

    def __init__(self, cfg, rank: int, say=print):
        trl = cfg.trl
        self.trl, self.rank, self.say = trl, rank, say
        self.url = base_url(trl)
        self.interval = trl.vllm_sync_interval or 1  # Axolotl: `self.args.vllm_sync_interval or 1`
        self.timeout = server_timeout(trl)
        self.fresh_adapter = not cfg.lora_model_dir
        self.version, self.last_synced, self.folder = 0, None, None
        self.pending = None  # (key, future) of the prefetched generation (async_prefetch)
        self.stopping = lambda: False  # set by the loop (one process): a stop request gives up the wait
        wait_for_server(self.url, self.timeout)
        self.client = make_client(self.url, self.timeout)
        self.base_model = self.client.model

    def describe(self) -> str:
        return (f"completions from the vLLM server at {self.url} (model {self.base_model}); the LoRA adapter is "
                f"loaded by the server every {self.interval} step(s) (trl.vllm_lora_sync)")

    def prefetch(self, key, generate) -> None:
        """Start generate() in a background thread; `take(key)` collects it."""
        self.pending = (key, in_background(generate, "vllm-prefetch"))

    def take(self, key):
        """The prefetched result for `key` (waits for it; re-raises its error), else None (none, or another key's)."""
        if self.pending is None:
            return None
        (wanted, future), self.pending = self.pending, None
        result = self.wait(future)
        return result if wanted == key else None

    def settle(self) -> None:
        """Wait for a prefetch in flight, keeping it (nothing else talks to the server meanwhile)."""
        if self.pending is not None:
            concurrent.futures.wait([self.pending[1]])

    def wait(self, future):
        """The request's result, waited for in slices: StepAbandoned as soon as a stop is requested (one process)."""
        while True:
            try:
                return future.result(timeout=WAIT_SLICE_S)
            except concurrent.futures.TimeoutError:
                if self.stopping():
                    raise StepAbandoned(f"a stop request arrived while waiting for the vLLM server at {self.url}") \
                        from None

    def due(self, step: int) -> bool:
        if step == self.last_synced:
            return False
        if self.last_synced is None and (step > 0 or not self.fresh_adapter):
            return True  # a resumed run, or an adapter from lora_model_dir: the server must get it first
        return step > 0 and step % self.interval == 0

    def maybe_sync(self, model, step: int, barrier) -> None:
        if not self.due(step):
            if step == 0:
                self.last_synced = 0  # Axolotl: "Skipping vLLM weight sync at step 0 (no training yet)"
            return
        self.last_synced = step
        self.version += 1
        if self.rank == 0:
            self.sync(model, step)
        barrier()

    def sync(self, model, step: int) -> None:
        """Save the adapter to <tmp>/v<N> and have the server load it (Axolotl's endpoints, in its order)."""
        # heavy: requests loads only when this runs
        import requests

        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="envtool_lora_sync_"))
            atexit.register(shutil.rmtree, self.folder, True)
        path = self.folder / f"v{self.version}"
        model.save_pretrained(str(path))
        try:
            response = requests.post(f"{self.url}/v1/load_lora_adapter",
                                     json={"lora_name": LORA_NAME, "lora_path": str(path), "load_inplace": True},
                                     timeout=self.timeout)
            via = "/v1/load_lora_adapter"
            if response.status_code == 200:
                self.client.model = LORA_NAME  # vLLM serves a runtime-loaded adapter as a model of its name
            else:
                response = requests.post(f"{self.url}/set_lora_adapter/",
                                         json={"lora_name": "active_lora", "lora_int_id": self.version,
                                               "lora_path": str(path)}, timeout=self.timeout)
                via = "/set_lora_adapter/"
        except requests.exceptions.RequestException as err:
            raise TrainingError(f"trl.vllm_lora_sync: the vLLM server at {self.url} did not take the adapter at step "
                                f"{step}: {type(err).__name__}") from None
        if response.status_code != 200:
            raise TrainingError(f"trl.vllm_lora_sync: the vLLM server at {self.url} refused the adapter at step {step} "
                                f"(HTTP {response.status_code} from /v1/load_lora_adapter and /set_lora_adapter/: "
                                f"{response.text[:200]})")
        try:
            self.client.reset_prefix_cache()
        except Exception as err:  # as Axolotl: a server without the endpoint still generates correctly
            self.say(f"note: trl.vllm_lora_sync: /reset_prefix_cache failed ({err}); continuing")
        previous = self.folder / f"v{self.version - 1}"
        if previous.is_dir():
            shutil.rmtree(previous, ignore_errors=True)
        self.say(f"vllm: adapter v{self.version} loaded by the server via {via} (after step {step})")

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> dict:
        """TRL's VLLMClient.generate: prompt-major completion ids and the sampled tokens' log-probs, checked
        (checked_completions)."""
        got = self.wait(in_background(lambda: self._generate(prompts, n, max_tokens, seed), "vllm-generate"))
        return checked_completions(got, len(prompts) * n, max_tokens, self.url)

    def _generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> dict:
        trl = self.trl
        try:
            return self.client.generate(prompts=prompts, n=n, repetition_penalty=trl.repetition_penalty or 1.0,
                                        temperature=trl.temperature or 1.0, top_p=trl.top_p or 1.0,
                                        top_k=trl.top_k or 0, min_p=trl.min_p or 0.0, max_tokens=max_tokens,
                                        logprobs=0, structured_outputs_regex=trl.vllm_guided_decoding_regex,
                                        generation_kwargs={"seed": seed, **(trl.generation_kwargs or {})})
        except Exception as err:  # requests' errors and TRL's "Request failed: <code>, <text>"
            raise ServerFailed(f"trl.use_vllm: generation on the vLLM server at {self.url} failed: "
                               f"{str(err).splitlines()[0][:300]}") from None


def checked_completions(got, count: int, max_tokens: int, url: str) -> dict:
    """The server's answer as the loss may use it: `count` completions of token ids (ints >= 0), none longer than
    `max_tokens` (trl.max_completion_length), log-probs one per token where given. Anything else is a TrainingError
    naming the server: training on 3,000-token completions for max_completion_length 6 would change the run."""
    where = f"trl.use_vllm: the vLLM server at {url}"
    ids = got.get("completion_ids") if isinstance(got, dict) else None
    if not isinstance(ids, list) or len(ids) != count:
        raise ServerFailed(f"{where} returned {len(ids) if isinstance(ids, list) else 'no'} completions where "
                            f"{count} were asked for")
    for k, completion in enumerate(ids):
        if not isinstance(completion, list) or not all(isinstance(t, int) and t >= 0 for t in completion):
            raise ServerFailed(f"{where} returned completion {k} with something other than token ids")
        if len(completion) > max_tokens:
            raise ServerFailed(f"{where} returned a completion of {len(completion)} tokens for max_tokens "
                                f"{max_tokens} (trl.max_completion_length): is it serving another configuration?")
    logprobs = got.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != count
                                 or any(len(lp) != len(c) for lp, c in zip(logprobs, ids))):
        raise ServerFailed(f"{where} returned log-probs that do not match its completions token for token")
    return got
