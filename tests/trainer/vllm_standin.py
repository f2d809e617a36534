"""A stand-in vLLM server for GRPO's server generation (trainer/objectives/grpo_server.py), where vLLM cannot run (CPU).

It speaks the endpoints and JSON fields the trainer's side uses, as captured from their sources:
- TRL 1.16 `trl/generation/vllm_client.py`, `VLLMClient`: `check_server` (GET /health, 200), `__init__`
  (GET /v1/models -> data[0].id), `generate` (POST /v1/completions with model, prompt (token-id lists), n,
  repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, logprobs, return_token_ids,
  return_tokens_as_token_ids and generation_kwargs such as seed; read back: choices, prompt-major, each with
  prompt_token_ids, token_ids and logprobs {tokens: ["token_id:<id>"], token_logprobs, top_logprobs} as
  `parse_logprobs` reads them), `reset_prefix_cache` (POST /reset_prefix_cache);
- Axolotl 0.19 `core/trainers/grpo/async_trainer.py`, `AsyncGRPOTrainer._sync_lora_adapter`: POST
  /v1/load_lora_adapter {lora_name, lora_path, load_inplace} (vLLM's runtime LoRA endpoint; the adapter is then served
  as a model named lora_name), falling back to POST /set_lora_adapter/ {lora_name, lora_int_id, lora_path} of
  Axolotl's `scripts/vllm_serve_lora.py` (`main`: `set_lora_adapter`, active for every later generation; that server
  answers 404 on /v1/load_lora_adapter, which `flavour="axolotl"` reproduces).

Generation is a tiny local Hugging Face model (+ the peft adapter it was told to load), sampled one token at a time:
logits / temperature, top-k and top-p filtered, log-softmax (vLLM's `--logprobs-mode processed_logprobs`, which TRL's
docs ask for), a torch generator seeded from the request's seed; it stops after the model's end-of-sequence token
(kept in token_ids, finish_reason "stop") or at max_tokens ("length"). What it cannot do (structured outputs) it
answers with HTTP 400. Every request and every adapter load (with a copy of the adapter's tensors) is recorded.
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch


class StandInVLLM:
    def __init__(self, model_path, flavour: str = "vllm", served_name: str | None = None):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.flavour = flavour  # "vllm": /v1/load_lora_adapter; "axolotl": /set_lora_adapter/ only
        self.base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        eos = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else eos or [])
        self.name = served_name or str(model_path)
        self.adapters: dict[str, torch.nn.Module] = {}  # lora_name -> model with that adapter
        self.active = None  # Axolotl's server: the adapter every generation uses
        self.loads: list[dict] = []  # {endpoint, lora_name, lora_path, tensors}
        self.requests: list[tuple[str, str, dict | None]] = []  # (method, path, body)
        self.generations: list[dict] = []  # {model, adapter_loads_before}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # --- the endpoints ------------------------------------------------------------------------------------
    def route(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        self.requests.append((method, path, body))
        path = path.split("?")[0].rstrip("/") or "/"
        if method == "GET" and path == "/health":
            return 200, None
        if method == "GET" and path == "/v1/models":
            names = [self.name, *self.adapters]
            return 200, {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "vllm"} for n in names]}
        if method == "POST" and path == "/v1/completions":
            return self.completions(body)
        if method == "POST" and path == "/reset_prefix_cache":
            return 200, {"success": True}
        if method == "POST" and path == "/v1/load_lora_adapter" and self.flavour == "vllm":
            self.load(body["lora_name"], body["lora_path"], path)
            return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if method == "POST" and path == "/set_lora_adapter" and self.flavour == "axolotl":
            self.active = self.load(body["lora_name"], body["lora_path"], path)
            return 200, {"status": "ok"}
        return 404, {"detail": "Not Found"}

    def load(self, name: str, lora_path: str, endpoint: str):
        from peft import PeftModel
        from safetensors.torch import load_file

        with self.lock:
            model = PeftModel.from_pretrained(copy.deepcopy(self.base), lora_path).eval()
            self.adapters[name] = model
            tensors = load_file(str(Path(lora_path) / "adapter_model.safetensors"))
            self.loads.append({"endpoint": endpoint, "lora_name": name, "lora_path": lora_path, "tensors": tensors})
        return model

    def completions(self, body: dict) -> tuple[int, object]:
        if body.get("structured_outputs"):
            return 400, {"error": {"message": "structured outputs: not in this stand-in", "type": "BadRequestError"}}
        model_name = body.get("model")
        if self.active is not None:
            model = self.active
        elif model_name in self.adapters:
            model = self.adapters[model_name]
        elif model_name == self.name:
            model = self.base
        else:
            return 404, {"error": {"message": f"The model `{model_name}` does not exist.", "type": "NotFoundError"}}
        prompts = body["prompt"]
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        n = body.get("n", 1)
        generator = torch.Generator().manual_seed(int(body.get("seed") or 0))
        choices = []
        with self.lock, torch.no_grad():
            self.generations.append({"model": model_name, "adapter_loads_before": len(self.loads)})
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    ids, lps, reason = self.sample(model, prompt, body, generator)
                    logprobs = None if body.get("logprobs") is None else {
                        "tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps,
                        "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, lps)]}
                    choices.append({"index": i * n + j, "text": "", "logprobs": logprobs, "finish_reason": reason,
                                    "stop_reason": None, "prompt_token_ids": list(prompt), "token_ids": ids})
        return 200, {"id": "cmpl-standin", "object": "text_completion", "model": model_name, "choices": choices,
                     "usage": {"prompt_tokens": sum(map(len, prompts)),
                               "completion_tokens": sum(len(c["token_ids"]) for c in choices)}}

    def sample(self, model, prompt: list[int], body: dict, generator) -> tuple[list[int], list[float], str]:
        temperature, top_k, top_p = body.get("temperature", 1.0), body.get("top_k", 0) or 0, body.get("top_p", 1.0)
        ids, lps = [], []
        for _ in range(body.get("max_tokens", 16)):
            logits = model(input_ids=torch.tensor([list(prompt) + ids])).logits[0, -1].float() / temperature
            if 0 < top_k < logits.shape[-1]:
                logits[logits < torch.topk(logits, top_k).values[-1]] = -float("inf")
            if top_p < 1.0:
                order = torch.argsort(logits, descending=True)
                cumulative = torch.softmax(logits[order], -1).cumsum(-1)
                logits[order[(cumulative - torch.softmax(logits[order], -1)) > top_p]] = -float("inf")
            logp = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            ids.append(token)
            lps.append(float(logp[token]))
            if token in self.eos:
                return ids, lps, "stop"
        return ids, lps, "length"

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null") if length else None
                status, payload = standin.route(method, self.path, body)
                data = b"" if payload is None else (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if not isinstance(payload, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.answer("GET")

            def do_POST(self):
                self.answer("POST")

        return Handler


if __name__ == "__main__":  # python -m tests.trainer.vllm_standin MODEL [vllm|axolotl]: serve until Ctrl-C
    import sys

    with StandInVLLM(sys.argv[1], *sys.argv[2:3]) as standin:
        print(standin.url, flush=True)
        try:
            standin.thread.join()
        except KeyboardInterrupt:
            pass
