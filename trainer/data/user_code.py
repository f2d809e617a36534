"""The user's own Python that a config names as `module.function`, found and called as Axolotl does.

- Where: a file `module.py` (or package `module/`) in the config's directory, then in the working directory
  (Axolotl's examples keep `rwd.py`, `ebft_pretrain.py` beside the config), loaded fresh from that file so an
  edited transform is never a stale `sys.modules` entry; else an installed module of that name; else a built-in
  the caller offers. A missing module or function is one ConfigError line naming the key (exit 2).
- Dataset transforms (`datasets[i].type: module.function`, prompt_strategies/base.py's convention):
  `function(cfg, **kw)` returns a row function, or `(row function, map kwargs)`; `remove_columns: "__all__"`
  means every original column; a row function taking `tokenizer` gets it.

Used by GRPO/GDPO (reward functions, prompt transforms: trainer/objectives/grpo_data.py) and EBFT (trainer/objectives/ebft_data.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from functools import partial
from pathlib import Path
from typing import Callable

from trainer.errors import ConfigError, DataError


def search_path(config_dir: str | None) -> list[str]:
    return [d for d in (config_dir, str(Path.cwd())) if d]


def _from_file(module_name: str, dirs: list[str]):
    rel = Path(*module_name.split("."))
    for d in dirs:
        for path in (Path(d) / rel.with_suffix(".py"), Path(d) / rel / "__init__.py"):
            if path.is_file():
                spec = importlib.util.spec_from_file_location(f"_envtool_user_{module_name}", path)
                module = importlib.util.module_from_spec(spec)
                if d not in sys.path:  # its own imports of modules beside it work, as when Python runs a script
                    sys.path.append(d)
                try:
                    spec.loader.exec_module(module)
                except Exception as err:  # the user's code failing on import is bad input too
                    raise ConfigError(f"importing {path} failed: {type(err).__name__}: {err}") from None
                return module
    return None


def find(name: str, key: str, config_dir: str | None, builtin: dict[str, Callable] | None = None
         ) -> tuple[Callable, str | None]:
    """(the function `name` = module.function, the file it came from or None for a built-in)."""
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}: {name!r} is not module.function")
    dirs = search_path(config_dir)
    module = _from_file(module_name, dirs)
    if module is None and name not in (builtin or {}):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name not in (module_name, module_name.split(".")[0]):
                raise ConfigError(f"{key}: importing {module_name} failed: {err}") from None
        except Exception as err:
            raise ConfigError(f"{key}: importing {module_name} failed: {type(err).__name__}: {err}") from None
    if module is not None:
        func = getattr(module, attr, None)
        if not callable(func):
            raise ConfigError(f"{key}: {getattr(module, '__file__', module_name)} has no function {attr}")
        return func, getattr(module, "__file__", None)
    if name in (builtin or {}):
        return builtin[name], None
    offered = f" and no built-in one (built-in: {', '.join(builtin)})" if builtin else ""
    raise ConfigError(f"{key}: cannot import {name}: no module {module_name}.py in {' or '.join(dirs)}{offered}")


def transform(made, raw, tokenizer, key: str, desc: str):
    """Map `raw` (a datasets.Dataset) through what a transform factory returned (see the module docstring)."""
    row_fn, kwargs = made if isinstance(made, tuple) else (made, {})
    if not callable(row_fn):
        raise ConfigError(f"{key}: returned {type(row_fn).__name__}, not a row transform")
    kwargs = dict(kwargs or {})
    if "remove_columns" in kwargs:  # as Axolotl: "__all__", or only the columns that exist
        drop = kwargs["remove_columns"]
        kwargs["remove_columns"] = list(raw.column_names) if drop == "__all__" else [c for c in drop if c in raw.column_names]
    try:
        if "tokenizer" in inspect.signature(row_fn).parameters:
            row_fn = partial(row_fn, tokenizer=tokenizer)
    except (TypeError, ValueError):
        pass
    try:
        return raw.map(row_fn, desc=desc, **kwargs)
    except Exception as err:
        raise DataError(f"{key}: the transform failed: {type(err).__name__}: {err}") from None
