"""Axolotl's own config validation, as an oracle for tests (tests/trainer/config/test_axolotl_oracle.py).

Runs in the oracle environment that .ci/setup builds: the `axolotl` wheel from PyPI (AXOLOTL_VERSION below) installed
with --no-deps into .ci-cache/axolotl-oracle/ with the one pure-Python module its config code imports that envtool's
.venv lacks (addict); everything else (torch CPU, transformers, pydantic, accelerate, PIL) is the .venv's own. Run it
with the .venv's python and PYTHONPATH=.ci-cache/axolotl-oracle, so envtool's own process never imports axolotl.

The entry point is Axolotl's own `axolotl.utils.config.validate_config` (what `axolotl train` calls on a config after
loading the YAML): the datasets are converted to SFTDataset/DPODataset/KTODataset, then AxolotlInputConfig (pydantic,
with every validator of axolotl/utils/schemas/validation.py) validates the whole config. No capabilities are passed, so
GPU checks are not made (as `axolotl preprocess` on a CPU machine).

Usage:  python scripts/axolotl_oracle.py verdicts < configs.json   -> [{"ok": bool, "error": str}, ...]
        python scripts/axolotl_oracle.py schema                    -> {field: {"kind": ..., "choices": [...]}}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import typing
import warnings

AXOLOTL_VERSION = "0.19.0"
ADDICT_VERSION = "2.4.0"


def verdicts(configs: list) -> list[dict]:
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    out = []
    for raw in configs:
        try:
            validate_config(DictDefault(raw))
            out.append({"ok": True, "error": ""})
        except Exception as err:  # noqa: BLE001  (the oracle's refusal, whatever its type)
            out.append({"ok": False, "error": f"{type(err).__name__}: {' '.join(str(err).split())}"[:400]})
    return out


def _kind(ann) -> dict:
    """A field's annotation reduced to what a generator draws from: bool, int, float, str or a set of literals."""
    args = [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else [ann]
    kinds = []
    for a in args:
        origin = typing.get_origin(a)
        if origin is typing.Literal:
            return {"kind": "choice", "choices": [v for v in typing.get_args(a) if isinstance(v, (str, int, float, bool))]}
        if origin is typing.Annotated:
            return _kind(typing.get_args(a)[0])
        if isinstance(a, type):
            import enum
            if issubclass(a, enum.Enum):
                return {"kind": "choice", "choices": [m.value for m in a if isinstance(m.value, (str, int, float))]}
            if a is bool:
                kinds.append("bool")
            elif a is int:
                kinds.append("int")
            elif a is float:
                kinds.append("float")
            elif a is str:
                kinds.append("str")
    for k in ("bool", "int", "float", "str"):
        if k in kinds:
            return {"kind": k}
    return {"kind": "other"}


def schema() -> dict:
    from axolotl.utils.schemas.config import AxolotlInputConfig

    return {name: _kind(field.annotation) for name, field in AxolotlInputConfig.model_fields.items()}


def main() -> None:
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # (Axolotl's import-time prints stay out of the JSON)
    result = verdicts(json.load(sys.stdin)) if sys.argv[1:] == ["verdicts"] else schema()
    real_stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
