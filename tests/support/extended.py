"""The extended tier (tests/extended.txt) in CI: a slice of it each run, so that every extended test runs again within
every SLICES runs of CI instead of never.

The listed tests are grouped by file (a file's marked tests often share one module fixture that trains once for all
of them, test_ray.py's above all) and the files dealt into SLICES slices of about equal measured seconds (largest
first, each into the lightest slice so far: deterministic for one extended.txt). `bash .ci/run` takes slice
`git rev-list --count HEAD` mod SLICES and sets ENVTOOL_EXTENDED_SLICE to it; tests/conftest.py then leaves that
slice's tests out of the `extended` marker, so they run in their own tier (slow, distributed or docker) with the rest.

    python -m tests.support.extended SLICE     prints the slice's files and seconds (what .ci/run shows)
"""

from __future__ import annotations

import sys
from pathlib import Path

SLICES = 4
LIST = Path(__file__).resolve().parents[1] / "extended.txt"


def listed(text: str | None = None) -> dict[str, float]:
    """{node id: measured seconds} from extended.txt (a line without a figure counts 60 s)."""
    out = {}
    for line in (LIST.read_text() if text is None else text).splitlines():
        node, _, comment = line.partition("#")
        node = node.strip()
        if node:
            figure = comment.strip().split(" ")[0]
            out[node] = float(figure) if figure.replace(".", "", 1).isdigit() else 60.0
    return out


def slices(tests: dict[str, float], count: int = SLICES) -> list[dict[str, float]]:
    """The listed files dealt into `count` slices: [{file: seconds}], each file in exactly one."""
    files: dict[str, float] = {}
    for node, seconds in tests.items():
        files[node.split("::")[0]] = files.get(node.split("::")[0], 0.0) + seconds
    dealt: list[dict[str, float]] = [{} for _ in range(count)]
    for name, seconds in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])):
        min(dealt, key=lambda s: (sum(s.values()), dealt.index(s)))[name] = seconds
    return dealt


def in_slice(nodeid: str, index: int, tests: dict[str, float] | None = None) -> bool:
    return nodeid.split("::")[0] in slices(listed() if tests is None else tests)[index % SLICES]


def main(argv: list[str]) -> int:
    index = int(argv[0]) % SLICES
    chosen = slices(listed())[index]
    print(f"extended slice {index + 1} of {SLICES}: {len(chosen)} files, {sum(chosen.values()):.0f} s measured")
    for name, seconds in sorted(chosen.items()):
        print(f"  {name}  ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
