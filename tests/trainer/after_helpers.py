"""Helpers for the after-training tests and bench/bench_merge_memory.py: a model written in several shards, and the
peak memory a command adds to a process that has already imported everything it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: import what the command will import, reset the kernel's peak-RSS mark (writing 5 to
# /proc/self/clear_refs sets VmHWM to the current RSS, so a transient peak while importing does not hide what
# follows), run the command (or, for the control, load the whole model and read every weight), and print how far
# the peak rose above the RSS it started from.
HARNESS = r"""
import json, sys
import torch, transformers, peft, safetensors, safetensors.torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import trainer.cli, trainer.setup, trainer.runtime.hardware, trainer.outputs.merge, trainer.outputs.chat_check
import peft.utils.other

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

mode, arg = sys.argv[1], sys.argv[2:]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
if mode == "merge":
    rc = trainer.cli.main(["merge-lora", *arg])
else:  # the control: the whole model in memory at once, as a non-streaming merge holds it
    model = AutoModelForCausalLM.from_pretrained(arg[0], dtype=torch.float32)
    total = sum(float(p.sum()) for p in model.parameters())  # every weight read: all of it resident
    rc = 0
print(json.dumps({"rc": rc, "peak_rise_bytes": status("VmHWM") - before}))
"""


def write_sharded_model(out: Path, hidden: int = 512, layers: int = 12, shard: str = "30MB") -> int:
    """A llama with the tiny tokenizer, hidden size `hidden`, written in shards of at most `shard`; returns the
    bytes of its weights."""
    from trainer.model.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, "llama", seed=0, hidden_size=hidden, layers=layers)
    model.save_pretrained(out, max_shard_size=shard)
    tokenizer.save_pretrained(out)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_rise(mode: str, *args: str) -> dict:
    """{"rc", "peak_rise_bytes"} of `merge-lora ARGS` (mode "merge") or of loading the model at ARGS[0] whole
    (mode "load"), in a subprocess that imported the libraries first."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ENVTOOL_PLAN", None)
    result = subprocess.run([sys.executable, "-c", HARNESS, mode, *args], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
