"""Reading a config: Axolotl-style YAML keys, validated up front.

Reading a config is three passes:
1. key check: every key is a supported key (a field of a section, trainer/config/schema.py), an inert Axolotl key
   (accepted, with a note), or an Axolotl key we do not support (an error unless its value is empty;
   trainer/config/keys.py). Anything else is an unknown key, and the error names the closest valid key.
2. value check: pydantic validates types and ranges of the supported keys, then each section's rules.
3. named choices: names checked against data tables and each feature's rules against the rest (_named_choices).
Every problem found is reported together, in one line.

A YAML null (``fp16:``) means "unset", as in Axolotl, so it takes the default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer.config import datasets, diffusion, ebft, grpo, hardware, model, parallel, qat, rl, sparsity, training
from trainer.config.datasets import DatasetConfig
from trainer.config.keys import INERT_KEYS, LEGACY_DTYPE_KEYS, PERFORMANCE_KEYS, TORCH_DTYPES, UNSUPPORTED_KEYS
from trainer.config.parallel import deepspeed_path
from trainer.config.schema import Config
from trainer.errors import ConfigError


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _check_keys(raw: dict, fields: set[str], where: str, notes: list[str], allow_axolotl: bool) -> tuple[dict, list[str]]:
    """Return the supported keys with non-null values, and the problems found."""
    kept, problems = {}, []
    known = sorted(fields | (set(INERT_KEYS) | set(PERFORMANCE_KEYS) | set(UNSUPPORTED_KEYS) if allow_axolotl else set()))
    for key, value in raw.items():
        key = str(key)
        if key in fields:
            if value is not None:
                kept[key] = value
        elif allow_axolotl and key in INERT_KEYS:
            if not _is_empty(value):
                notes.append(f"{where}{key}: ignored ({INERT_KEYS[key]})")
        elif allow_axolotl and key in PERFORMANCE_KEYS:
            if not _is_empty(value):
                notes.append(f"{where}{key}: off ({PERFORMANCE_KEYS[key]})")
        elif allow_axolotl and key in UNSUPPORTED_KEYS:
            if _is_empty(value):
                notes.append(f"{where}{key}: empty, ignored")
            else:
                problems.append(f"{where}{key} is an Axolotl key this trainer does not support ({UNSUPPORTED_KEYS[key]}); remove it")
        else:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(f"unknown key '{where}{key}'{hint}")
    return kept, problems


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "literal_error":
            msg = f"got {e['input']!r}; {msg[0].lower()}{msg[1:]}"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _legacy_keys(raw: dict, notes: list[str]) -> dict:
    """Axolotl's older spellings of the precision: bfloat16/float16/float32: true and torch_dtype."""
    if "model_config" in raw:
        raw["model_config_overrides"] = raw.pop("model_config")
    for key, (target, value) in LEGACY_DTYPE_KEYS.items():
        if key in raw:
            given = raw.pop(key)
            if given and raw.get(target) is None:
                raw[target] = value
                notes.append(f"{key}: true is the legacy spelling of {target}: {str(value).lower()}")
    if "torch_dtype" in raw:
        given = raw.pop("torch_dtype")
        precision = TORCH_DTYPES.get(str(given).removeprefix("torch."))
        if given is not None and precision is None:
            raise ConfigError(f"torch_dtype: unknown dtype {given!r}; use bfloat16, float16 or float32")
        if precision and raw.get("bf16") is None and raw.get("fp16") is None:
            raw["bf16" if precision != "fp16" else "fp16"] = precision == "bf16" or (True if precision == "fp16" else False)
            notes.append(f"torch_dtype: {given} is read as {precision}")
    return raw


def parse_config(raw: Any) -> tuple[Config, list[str]]:
    """Validate a config mapping. Returns the config and notes about keys that were accepted but do nothing."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a YAML mapping of keys to values")
    notes: list[str] = []
    assert not any("; " in r for r in UNSUPPORTED_KEYS.values())  # refusals are '; '-joined
    raw = _legacy_keys(dict(raw), notes)
    kept, problems = _check_keys(raw, set(Config.model_fields), "", notes, allow_axolotl=True)
    datasets = kept.get("datasets")
    if isinstance(datasets, list):
        cleaned = []
        for i, entry in enumerate(datasets):
            if not isinstance(entry, dict):
                problems.append(f"datasets.{i}: each dataset must be a mapping with at least path and type")
                continue
            if entry.get("type") == "chat_template.default":  # Axolotl's full name of the same strategy
                entry = {**entry, "type": "chat_template"}
            if isinstance(entry.get("type"), dict):
                problems.append(f"datasets.{i}.type: custom prompt formats are not supported; use alpaca, chat_template, completion or input_output")
                continue
            d, p = _check_keys(entry, set(DatasetConfig.model_fields), f"datasets.{i}.", notes, allow_axolotl=False)
            cleaned.append(d)
            problems += p
        kept["datasets"] = cleaned
    if isinstance(kept.get("pretraining_dataset"), list):  # a YAML null in an entry means unset, as above
        kept["pretraining_dataset"] = [{k: v for k, v in e.items() if v is not None} if isinstance(e, dict) else e
                                       for e in kept["pretraining_dataset"]]
    try:
        cfg = Config.model_validate(kept)
    except ValidationError as err:  # report key and value problems together, so one run shows them all
        problems.append(_format_validation_error(err))
    else:
        problems += _named_choices(cfg, notes)
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg, notes


def _named_choices(cfg: Config, notes: list[str]) -> list[str]:
    """The rules that read more than one key's type and range: names checked against data tables (optimizer,
    chat templates, plugins), each feature against the rest of the config. Every problem is collected, so one
    run names them all."""
    problems = []
    notes.extend(model.notes(cfg))
    checks = [lambda: training.check_optimizer(cfg.optimizer),
              lambda: datasets.check_chat_template(cfg.chat_template, cfg.chat_template_jinja),
              lambda: training.check_muon(cfg)]
    checks += [lambda ds=ds: datasets.check_chat_template(ds.chat_template, ds.chat_template_jinja)
               for ds in cfg.datasets if ds.chat_template]
    checks += [lambda: notes.extend(hardware.check_plugins(cfg)), lambda: notes.extend(parallel.check_backend(cfg))]
    checks += [lambda: notes.extend(model.check_mistral_tokenizer(cfg))]
    checks += [lambda: qat.check_config(cfg)]
    checks += [lambda: notes.extend(sparsity.check(cfg))]
    checks += [lambda: notes.extend(_objective_notes(cfg))]
    checks += [lambda: notes.extend(ebft.check(cfg))]  # rl: ebft (strided mode only)
    checks += [lambda: notes.extend(parallel.check_sizes(cfg, parallel.fsdp_enabled(cfg)))]
    checks += [lambda: notes.extend(training.ordering_notes(cfg) + training.eval_table_notes(cfg)
                                    + training.schedule_notes(cfg))]
    checks += [lambda: training.check_relora_optimizer(cfg)]
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    return problems


def _objective_notes(cfg: Config) -> list[str]:
    """use_eaft, rl: grpo / gdpo and the trl: block, cls_model_config, the diffusion plugin."""
    rl.check_eaft(cfg)
    try:
        notes = grpo.check(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model.check_config_class(cfg)
    return notes + diffusion.check(cfg)


MAX_CONFIG_BYTES = 1 << 20  # a config is keys and values; data and templates of any size live in files it names
MAX_DEPTH = 100  # nesting levels (Axolotl's deepest configs nest 5)
MAX_NODES = 200_000  # values once every alias is expanded: a 1.5 KB "billion laughs" file expands to 10^9


def read_yaml(path: Path) -> Any:
    """The YAML document at `path`, read with limits that fail in one line before memory or time run out: its
    size, its nesting depth and its size once aliases are expanded (an alias is a reference; what reads the
    config later -- validation, hashing, printing -- expands it). Safe loading: YAML tags construct no objects."""
    import yaml

    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is {size} bytes; a config is at most {MAX_CONFIG_BYTES} bytes (keep data and "
                          "long templates in the files it names)")
    text = path.read_text(errors="replace")

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            Loader.depth += 1
            try:
                if Loader.depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise ConfigError(f"{path} nests deeper than {MAX_DEPTH} levels (at line {mark.line + 1})")
                return super().compose_node(parent, index)
            finally:
                Loader.depth -= 1

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    finally:
        loader.dispose()


def _check_expanded_size(root, path: Path) -> None:
    """Refuse a document whose aliases expand it past MAX_NODES values, or that refers to itself."""
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(f"{path}: an alias refers to the value that contains it (line {node.start_mark.line + 1})")
        if isinstance(node, yaml.ScalarNode):
            return 1
        open_nodes.add(key)
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_NODES:
                raise ConfigError(f"{path}: its aliases expand it to more than {MAX_NODES} values (a config that "
                                  "repeats itself through anchors, as a 'billion laughs' file does); write it out")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


def load_config(path: str | Path) -> tuple[Config, list[str]]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = read_yaml(path)
    cfg, notes = parse_config(raw)
    cfg._config_dir = str(path.resolve().parent)
    check_local_paths(cfg)
    return cfg, notes


def looks_local(path: str) -> bool:
    """A path that is meant to be on disk (not a hub id like 'org/name')."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix in {".json", ".jsonl", ".parquet", ".csv"} or Path(path).exists()


def check_local_paths(cfg: Config) -> None:
    """Missing local files are bad input: say so before any work starts."""
    missing = []
    entries = [("datasets", cfg.datasets), ("pretraining_dataset", cfg.pretraining_dataset or [])]
    for key, i, ds in [(key, i, ds) for key, group in entries for i, ds in enumerate(group)]:
        if looks_local(ds.path) and not Path(ds.path).expanduser().exists():
            missing.append(f"{key}.{i}.path: file not found: {ds.path}")
    for key in ("base_model", "tokenizer_config", "deepspeed"):
        value = getattr(cfg, key)
        if key == "deepspeed" and value:
            value = str(deepspeed_path(value))
        if value and looks_local(value) and not Path(value).expanduser().exists():
            missing.append(f"{key}: not found: {value}")
    if missing:
        raise ConfigError("; ".join(missing))
