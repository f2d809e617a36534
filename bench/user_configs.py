"""How many users' own Axolotl configs `python -m trainer validate` takes unchanged, for their GPU and for a T4.

The corpus is tests/trainer/fixtures/user_configs/: whole config files from public repositories of fine-tuned models,
courses and cloud recipes (none from Axolotl's examples/), read through the search index (SOURCES.md there), each with
a first line `# source: URL (date)` (no date where it is not known) and, where the author named the GPU it ran on,
`# gpu: NAME`. Each config is validated by the real CLI, in this process, with no
network (validate loads no tokenizer or model; HF_HUB_OFFLINE=1 makes sure), twice: for the author's GPU (else an
A100) and for a T4.

`validate` reports every problem of a config in one run, each with its kind (config, file, hardware, model); a
refusal is counted by them: only real hardware limits of that GPU, only local files the config names that are not on
this machine (the authors' data and models), both, or anything else (a key or value the trainer does not take: these
are what the corpus is for). Prints the figure per GPU, the refusals grouped by the
key they name, and any config that failed with something other than a one-line refusal (a bug). Usage:

    python bench/user_configs.py [--dir tests/trainer/fixtures/user_configs] [-v]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from axolotl_examples import refused_keys, validate  # noqa: E402  (the same CLI call and refusal parsing)

CORPUS = ROOT / "tests" / "trainer" / "fixtures" / "user_configs"


def author_gpu(text: str) -> str | None:
    m = re.search(r"^# gpu: (\S+)", text, re.M)
    return m.group(1) if m else None


def cause(path: Path, gpu: str) -> str:
    """hardware | missing file | hardware and missing file | config: why `validate` refused, by the kinds of the
    problems it found (the trainer's errors carry them: config, file, hardware, model)."""
    from trainer.errors import HardwareError, TrainerError
    from trainer.setup import start

    try:
        start(path, gpu)
    except TrainerError as err:
        kinds = {kind for kind, _ in err.problems} or {"hardware" if isinstance(err, HardwareError) else "config"}
        if kinds <= {"hardware", "file"}:
            return {frozenset({"hardware"}): "hardware", frozenset({"file"}): "missing file"}.get(
                frozenset(kinds), "hardware and missing file")
        return "config"
    return "ok"


ACCEPTED = ("ok", "hardware", "missing file", "hardware and missing file")  # what counts toward the figure


def results(configs: list[Path], which: str) -> dict[Path, tuple[str, int, str, str]]:
    """path -> (gpu, exit code, stderr, cause: ok | hardware | missing file | hardware and missing file | config |
    crash) for `validate --gpu` the author's GPU (which: author; else an A100) or `which`.
    (tests/trainer/config/test_user_configs.py asserts the figure with this.)"""
    out = {}
    for path in configs:
        gpu = (author_gpu(path.read_text()) or "a100") if which == "author" else which
        code, err = validate(path, gpu)
        if code == 0:
            out[path] = (gpu, 0, "", "ok")
        elif "(run with --debug for the traceback)" in err or code not in (1, 2):
            out[path] = (gpu, code, err, "crash")
        else:
            out[path] = (gpu, code, err, cause(path, gpu))
    return out


def run(configs: list[Path], which: str, verbose: bool) -> bool:
    results_ = results(configs, which)
    total = len(results_)
    counts = Counter(r[3] for r in results_.values())
    label = "the author's GPU (else a100)" if which == "author" else which
    accepted = sum(counts[c] for c in ACCEPTED)
    print(f"--gpu {label}: {counts['ok']}/{total} validate; {counts['hardware']} refused only for a hardware limit, "
          f"{counts['missing file']} only for a missing local file, {counts['hardware and missing file']} for both; "
          f"{counts['config']} refused for the config, "
          f"{counts['crash']} crashed -> {accepted}/{total} ({100 * accepted / max(total, 1):.1f}%) validate or are "
          "refused only for hardware or a missing file")
    by_key: dict[str, list[str]] = defaultdict(list)
    for path, (_, _, message, why) in results_.items():
        if why == "config":
            for key in refused_keys(message):
                by_key[key].append(path.name)
    if by_key:
        print("  config refusals by key (a config may name several):")
        for key, names in sorted(by_key.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            print(f"    {len(names):4d}  {key}: e.g. {names[0]}")
    for path, (gpu, _, message, why) in sorted(results_.items()):
        if why == "crash" or (verbose and why != "ok"):
            lines = "; ".join(line.removeprefix("error: ") for line in message.splitlines())
            print(f"  {why.upper() if why == 'crash' else why}: {path.name} (--gpu {gpu}): {lines}")
    return counts["crash"] == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(CORPUS))
    ap.add_argument("-v", "--verbose", action="store_true", help="print every refusal")
    args = ap.parse_args(argv)
    configs = sorted(p for p in Path(args.dir).iterdir() if p.suffix in (".yml", ".yaml"))
    years = Counter(m.group(1) for p in configs if (m := re.search(r"^# source: \S+ \((\d{4})", p.read_text(), re.M)))
    undated = len(configs) - sum(years.values())
    print(f"{len(configs)} users' configs from {len({p.name.split('__')[0] + p.name.split('__')[1] for p in configs})} "
          f"repositories ({', '.join(f'{y}: {n}' for y, n in sorted(years.items()))}"
          f"{f', undated: {undated}' if undated else ''})")
    ok = True
    for which in ("author", "t4"):
        ok &= run(configs, which, args.verbose)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
