"""Peak memory of `python -m trainer merge-lora` against the model's size and against loading the model whole.

Writes a llama (tiny tokenizer, random weights) of the given size in shards, a LoRA adapter on every linear layer
(peft, non-zero B so every delta is real) in output_dir/final, then measures in fresh subprocesses, each with the
libraries imported and the kernel's peak-RSS mark reset first (tests/trainer/after_helpers.py):
  - merge:   `merge-lora CONFIG` (streams one shard at a time)
  - control: AutoModelForCausalLM.from_pretrained(base) with every weight read (the whole model resident, as a
             merge that loads the model holds it)
and prints the rises and their ratios to the model's size. Usage:

    python bench/bench_merge_memory.py [--hidden 1024] [--layers 16] [--shard 50MB] [--dir /tmp/merge-bench]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.trainer.after_helpers import peak_rise, write_sharded_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shard", default="50MB")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="merge-bench-"))
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = work / "base"
        size = write_sharded_model(base, hidden=args.hidden, layers=args.layers, shard=args.shard)
        shards = sorted(base.glob("*.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(base)
        get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                         init_lora_weights=False)).save_pretrained(work / "run" / "final")
        AutoTokenizer.from_pretrained(base).save_pretrained(work / "run" / "final")
        del model
        config = work / "run.yml"
        config.write_text(yaml.safe_dump({"base_model": str(base), "output_dir": str(work / "run"),
                                          "adapter": "lora", "datasets": [{"path": str(work / "none.jsonl")}]}))
        (work / "none.jsonl").write_text("")
        merge = peak_rise("merge", str(config), "--dtype", "fp32")
        control = peak_rise("load", str(base))
        mib = 2 ** 20
        adapter = (work / "run" / "final" / "adapter_model.safetensors").stat().st_size
        print(f"model {size / mib:.0f} MiB in {len(shards)} shards (largest {max(s.stat().st_size for s in shards) / mib:.0f}"
              f" MiB), adapter {adapter / mib:.1f} MiB")
        print(f"merge-lora peak RSS rise   {merge['peak_rise_bytes'] / mib:8.1f} MiB  "
              f"({merge['peak_rise_bytes'] / size:.2f} x the model)")
        print(f"whole-model load (control) {control['peak_rise_bytes'] / mib:8.1f} MiB  "
              f"({control['peak_rise_bytes'] / size:.2f} x the model)")
        print(f"ratio merge / control: {merge['peak_rise_bytes'] / control['peak_rise_bytes']:.2f}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
