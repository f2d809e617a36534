"""How close `envtool fit`'s estimate comes to peak memories others measured on real GPUs.

    PYTHONPATH=. python bench/bench_fit.py [--all] [--json]

Each [[peak]] of bench/data/published_peaks.toml is a run someone published with its settings (source cited in the
file). For each, the model's config.json (bench/data/model_configs.toml) is written to a directory and read by the
estimate's own reader, the settings become a trainer config read by the trainer's own reader, and the estimate is
compared with what was measured, in the same metric:

- allocated (torch.cuda.max_memory_allocated): the estimate's allocated peak and its band;
- reserved (max_memory_reserved): that plus the caching allocator's slack;
- nvidia-smi, max_context (the longest sequence that fit a GPU: the peak is just under its memory): the whole peak.

Printed: per run the measured and estimated figures and the error; then how many estimates fall within 15% and 20%,
the median error, whether every fits / out-of-memory verdict agrees (runs at a searched maximum are at the edge by
construction and are not counted there), and how often high_gb is above the measured peak. --all also counts the
runs on stacks not comparable to this one (none are in the data today).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = ROOT / "bench" / "data"
GB = 2 ** 30


def load() -> tuple[list[dict], dict]:
    peaks = tomllib.loads((DATA / "published_peaks.toml").read_text())["peak"]
    models = tomllib.loads((DATA / "model_configs.toml").read_text())["models"]
    return peaks, models


def model_dir(name: str, models: dict, tmp: Path) -> Path:
    folder = tmp / name.replace("/", "--")
    if not folder.exists():
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(models[name]["config"]))
    return folder


def trainer_config(entry: dict, model: Path, tmp: Path) -> dict:
    """The run's settings in this trainer's (Axolotl's) keys."""
    raw = {"base_model": str(model), "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
           "sequence_len": entry["sequence_len"], "micro_batch_size": entry["micro_batch"],
           "gradient_accumulation_steps": entry.get("grad_accum", 1), "sample_packing": entry.get("packing", False),
           "gradient_checkpointing": entry.get("checkpointing", False), "optimizer": entry.get("optimizer", "adamw_torch"),
           "attn_implementation": entry.get("attention", "sdpa"),
           "bf16": entry.get("precision", "bf16") == "bf16", "fp16": entry.get("precision") == "fp16"}
    adapter = entry.get("adapter", "none")
    if adapter == "none" and entry.get("full_weights") == "fp32":  # the trainer's rule decides the regime
        raw["fp32_master_weights"] = True
    if adapter != "none":
        raw.update(adapter=adapter, lora_r=entry.get("lora_r", 8), lora_alpha=2 * entry.get("lora_r", 8),
                   lora_dropout=entry.get("lora_dropout", 0.0))
        targets = entry.get("lora_targets", "all-linear")
        if targets == "all-linear":
            raw["lora_target_linear"] = True
        else:
            raw["lora_target_modules"] = targets.split(",")
        if adapter == "qlora":
            raw["load_in_4bit"] = True
    if entry.get("zero_stage"):
        ds = {"zero_optimization": {"stage": entry["zero_stage"]}}
        if entry.get("offload_optimizer"):
            ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        path = tmp / f"ds-{entry['id']}.json"
        path.write_text(json.dumps(ds))
        raw["deepspeed"] = str(path)
    return raw


def estimate(entry: dict, models: dict, tmp: Path):
    from trainer.config import parse_config
    from trainer.fit import memory, memory_model
    from trainer.runtime.hardware import Gpu as TrainerGpu
    from trainer.runtime.hardware import Runtime

    folder = model_dir(entry["model"], models, tmp)
    cfg, _ = parse_config(trainer_config(entry, folder, tmp))
    runtime = Runtime(gpu=TrainerGpu(name="gpu", compute_capability="8.0", source="--gpu"),
                      attention=entry.get("attention", "sdpa"), precision=entry.get("precision", "bf16"), tf32=True)
    setup = memory.setup_from(cfg, runtime, entry.get("processes", 1))  # full_weights: the trainer's full_weights()
    shape = memory_model.model_shape(str(folder))
    gpu = memory.Gpu(f"{entry['gpu_memory_gb']:g} GB GPU", entry["gpu_memory_gb"], entry.get("processes", 1))
    return memory.estimate(shape, setup, gpu)


def in_metric(entry: dict, est) -> tuple[float, float, float]:
    """(point, low, high) in GB in the metric the run was measured in."""
    from trainer.fit.memory import ALLOCATOR_SLACK

    metric = entry.get("metric", "nvidia-smi")
    if entry["outcome"] == "max_context" or metric == "nvidia-smi":
        return est.peak / GB, est.low / GB, est.high / GB
    if metric == "allocated":
        return est.allocated / GB, est.allocated_low / GB, est.allocated_high / GB
    if metric == "reserved":
        return (est.allocated * (1 + ALLOCATOR_SLACK[1]) / GB, est.allocated_low * (1 + ALLOCATOR_SLACK[0]) / GB,
                est.allocated_high * (1 + ALLOCATOR_SLACK[2]) / GB)
    raise ValueError(f"{entry['id']}: unknown metric {metric}")


def run(include_all: bool) -> dict:
    peaks, models = load()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fit-") as tmp:
        for entry in peaks:
            if not entry.get("comparable", True) and not include_all:
                continue
            est = estimate(entry, models, Path(tmp))
            point, low, high = in_metric(entry, est)
            row = {"id": entry["id"], "outcome": entry["outcome"], "metric": entry.get("metric", entry["outcome"]),
                   "estimate_gb": round(point, 2), "low_gb": round(low, 2), "high_gb": round(high, 2),
                   "fits": est.fits, "verdict": est.verdict, "peak_at": est.peak_moment.name}
            if "measured_gb" in entry:
                measured = entry["measured_gb"]
                row.update(measured_gb=measured, error=round((point - measured) / measured, 4),
                           high_above=high >= measured)
            if entry["outcome"] in ("oom", "fits", "measured"):
                row["verdict_ok"] = est.fits is (entry["outcome"] != "oom")
            rows.append(row)
    errors = [abs(r["error"]) for r in rows if "error" in r]
    verdicts = [r["verdict_ok"] for r in rows if "verdict_ok" in r]
    highs = [r["high_above"] for r in rows if "high_above" in r]
    summary = {
        "runs": len(rows), "with_figures": len(errors),
        "within_15pct": sum(e <= 0.15 for e in errors), "within_20pct": sum(e <= 0.20 for e in errors),
        "median_error": round(statistics.median(errors), 4) if errors else None,
        "verdicts_right": sum(verdicts), "verdicts": len(verdicts),
        "high_above_peak": sum(highs), "highs": len(highs),
    }
    return {"rows": rows, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also runs on stacks not comparable to this one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.all)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for r in result["rows"]:
        measured = f"{r['measured_gb']:7.2f}" if "measured_gb" in r else "    " + ("OOM" if r["outcome"] == "oom" else "fit")
        err = f"{100 * r['error']:+6.1f}%" if "error" in r else "       "
        verdict = "" if "verdict_ok" not in r else ("  verdict ok" if r["verdict_ok"] else "  VERDICT WRONG")
        print(f"{r['id']:48s} {r['metric']:11s} measured {measured}  est {r['estimate_gb']:7.2f} "
              f"[{r['low_gb']:6.2f}-{r['high_gb']:6.2f}] {err} ({r['verdict']}, peak at {r['peak_at']}){verdict}")
    s = result["summary"]
    n = s["with_figures"]
    print(f"\n{s['runs']} runs, {n} with a measured figure:")
    print(f"  within 15%: {s['within_15pct']}/{n} ({100 * s['within_15pct'] / n:.0f}%)")
    print(f"  within 20%: {s['within_20pct']}/{n} ({100 * s['within_20pct'] / n:.0f}%)")
    print(f"  median error: {100 * s['median_error']:.1f}%")
    print(f"  fits/OOM verdicts right: {s['verdicts_right']}/{s['verdicts']}")
    print(f"  high_gb above the measured peak: {s['high_above_peak']}/{s['highs']} "
          f"({100 * s['high_above_peak'] / max(1, s['highs']):.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
