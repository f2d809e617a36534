"""Reading a config: Axolotl-style YAML keys, by the key policy of matrices/axolotl_keys.toml (trainer/config/keys.py).

Reading a config is four passes, and every problem any of them finds is reported together, one line each:
1. retired forms rewritten (trainer/config/migrate.py), each with a note: renamed keys, sharegpt, old paths.
2. keys sorted by the table (each level: the config, a dataset entry, a block such as trl:): a key the trainer reads
   is kept; an Axolotl key it does not act on is named in ONE note line ("ignored: ..."); a refused key is a
   problem, with the table's reason, unless its value is empty or Axolotl's default; a key no Axolotl release knew is
   ignored as Axolotl ignores it (named in the same note), with a "did you mean" warning when it is one edit from a
   key the trainer reads.
3. value check: pydantic validates types and ranges, then each section's rules.
4. named choices: names checked against data tables and each feature's rules against the rest (_named_choices).
When pass 3 fails, the keys it names are set aside and the rest is read again, so the files, the GPU and the model
can still be checked in the same run (trainer/setup.py).

A YAML null (``fp16:``) means "unset", as in Axolotl, so it takes the default; so does an empty string where the key
takes one of a set of names (``adapter: ""``), which Axolotl reads as false.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.config import datasets, diffusion, ebft, grpo, hardware, migrate, model, parallel, qat, rl, sparsity, training, vision
from trainer.config import keys, resume
from trainer.config.datasets import DatasetConfig
from trainer.config.parallel import deepspeed_path
from trainer.config.schema import Config
from trainer.errors import ConfigError, several

IGNORED_HOW = {"inert": "no effect on this run: matrices/axolotl_keys.toml says why",
               "unknown": "not Axolotl keys: Axolotl drops them too"}
# the inert keys that save memory in Axolotl: a line of their own, which `envtool fit` and the dry run show too
MEMORY_REASON = "a memory option this trainer does not implement"
MEMORY_NOTE = "ignored memory options: "


def memory_options_ignored(notes: list[str]) -> list[str]:
    """The keys named by the config reader's MEMORY_NOTE line (none: [])."""
    line = next((n for n in notes if n.startswith(MEMORY_NOTE)), "")
    return line.removeprefix(MEMORY_NOTE).split(" (", 1)[0].split(", ") if line else []


def _model_in(field, value: Any = None) -> tuple[type[BaseModel] | None, bool]:
    """(the pydantic model a field holds, whether in a list), (None, False) for plain values and mappings. Where the
    field may hold one of several models (a dataset's `type:` mapping: an SFT or a preference format of your own),
    the one that reads most of the mapping's keys (the first on a tie)."""
    stack, found, listed = [getattr(field, "annotation", None)], [], False
    while stack:
        ann = stack.pop(0)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found.append(ann)
            continue
        if typing.get_origin(ann) is list:
            inner = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
            if inner:
                return inner[0], True
            continue
        if typing.get_origin(ann) is dict:
            continue
        stack += list(typing.get_args(ann))
    if not found:
        return None, listed
    given = set(map(str, value)) if isinstance(value, dict) else set()
    return max(found, key=lambda m: len(given & set(m.model_fields))), listed


def _is_choice(field) -> bool:
    """Whether a field takes one of a set of names (a Literal): there an empty string means unset, as Axolotl reads
    it (`adapter: ""` is a full fine-tune there, `if cfg.adapter:`), rather than a name that is not in the set."""
    stack = [getattr(field, "annotation", None)]
    while stack:
        ann = stack.pop()
        if typing.get_origin(ann) is typing.Literal:
            return True
        stack += [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) is not dict else []
    return False


class Sift:
    """Pass 2: a config's keys sorted by the table, at every level of the sections' models."""

    def __init__(self) -> None:
        self.ignored: dict[str, list[str]] = {"inert": [], "unknown": []}
        self.warnings: list[str] = []
        self.problems: list[str] = []
        self.reasons: dict[str, str] = {}  # an inert key's reason, from the table

    def mapping(self, raw: dict, model: type[BaseModel], prefix: str, where: str) -> dict:
        """The keys of `raw` that `model` reads (non-null), sorted at every level below."""
        fields = model.model_fields
        kept = {}
        for key, value in raw.items():
            key = str(key)
            if key in fields:
                if value is not None and not (value == "" and _is_choice(fields[key])):
                    kept[key] = self.value(value, fields[key], f"{prefix}{key}", f"{where}{key}")
                continue
            self.other(key, value, set(fields), prefix, where, set(map(str, raw)))
        return kept

    def value(self, value: Any, field, name: str, where: str) -> Any:
        inner, listed = _model_in(field, value)
        if inner is None:
            return value
        if listed and isinstance(value, list):
            return [self.mapping({k: v for k, v in e.items()}, inner, f"{name}[].", f"{where}.{i}.")
                    if isinstance(e, dict) else e for i, e in enumerate(value)]
        if not listed and isinstance(value, dict):
            return self.mapping(value, inner, f"{name}.", f"{where}.")
        return value

    def other(self, key: str, value: Any, fields: set[str], prefix: str, where: str, given: set[str] = frozenset()) -> None:
        """A key the section does not read: by the table's decision."""
        name = f"{prefix}{key}"
        row = keys.decision(name)
        decided = row.get("decision")
        if decided == "refused":
            if not keys.asks_nothing(name, value):
                self.problems.append(f"{where}{key}: {row['reason']}")
            return
        if keys.is_empty(value):
            return
        if decided in ("inert", "migrated"):  # (a migrated key left here was given with a null value)
            self.ignored["inert"].append(f"{where}{key}")
            self.reasons[f"{where}{key}"] = row.get("reason") or IGNORED_HOW["inert"]
        elif decided == "honoured":  # the table says the trainer reads it, and no section does: a bug here
            self.problems.append(f"{where}{key}: matrices/axolotl_keys.toml says this key is read, but no section "
                                 "of the trainer's config reads it (a bug; please report it)")
        else:
            close = sorted(f for f in fields if keys.one_edit(key, f))
            if not prefix and keys.SHORT_FORMS.get(key) in fields:
                close = [keys.SHORT_FORMS[key]]
            if not prefix and keys.TRAINING_ARGUMENTS_NAMES.get(key) in fields:
                close = [keys.TRAINING_ARGUMENTS_NAMES[key]]
            # an error where ignoring it would train with the default instead of this value: the key it resembles
            # changes what is trained (resume.py's one table; a dataset's or section's keys always do), else a warning
            trains = bool(prefix) or resume.CLASSES.get(close[0] if close else "", resume.TRAINS) == resume.TRAINS \
                or bool(close) and close[0] in keys.LENGTH
            if close and close[0] not in given and trains:
                self.problems.append(f"'{where}{key}' is not a key; did you mean '{where}{close[0]}'? (the config does "
                                     f"not set {close[0]}: ignoring {key} would train with its default)")
            elif close:
                self.warnings.append(f"warning: '{where}{key}' is not a key (ignored); did you mean "
                                     f"'{where}{close[0]}'?")
            else:
                self.ignored["unknown"].append(f"{where}{key}")

    def notes(self) -> list[str]:
        by_reason: dict[str, list[str]] = {}  # inert keys grouped by the table's reason, so the user sees why
        memory = []
        for name in self.ignored["inert"]:
            if self.reasons.get(name, "").startswith(MEMORY_REASON):
                memory.append(name)
                continue
            by_reason.setdefault(self.reasons.get(name, IGNORED_HOW["inert"]), []).append(name)
        parts = [f"{_some(names)} ({reason})" for reason, names in by_reason.items()]
        # keys that are in no Axolotl release: one warning line, first, so a key the author meant is not lost among
        # the notes (a near miss of a key the config leaves unset is an error above, not a note)
        unknown = ([f"warning: ignored: {_some(self.ignored['unknown'])} ({IGNORED_HOW['unknown']})"]
                   if self.ignored["unknown"] else [])
        # a memory option Axolotl has and this trainer does not: the run needs more GPU memory than there, said apart
        memory_line = ([f"{MEMORY_NOTE}{_some(memory)} (not implemented here: the run may need more memory than in "
                        "Axolotl; `envtool fit` estimates it without them)"] if memory else [])
        return unknown + self.warnings + memory_line + ([f"ignored: {'; '.join(parts)}"] if parts else [])


def _some(names: list[str], most: int = 30) -> str:
    """Names for a note line: all of them, or the first `most` and how many more."""
    return ", ".join(names) if len(names) <= most else f"{', '.join(names[:most])} and {len(names) - most} more"


def _validation_problems(err: ValidationError) -> list[str]:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "literal_error":
            msg = f"got {e['input']!r}; {msg[0].lower()}{msg[1:]}"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return parts


def _format_validation_error(err: ValidationError) -> str:
    return "; ".join(_validation_problems(err))


def _lenient(kept: dict, err: ValidationError) -> Config | None:
    """The config without the keys pydantic refused and without the cross-key rules, for the checks that can
    still run (files, GPU, model); None when even that cannot be read."""
    bad = {e["loc"][0] for e in err.errors() if e["loc"]}
    rest = {k: v for k, v in kept.items() if k not in bad}
    if "datasets" in bad and "pretraining_dataset" not in rest:
        rest["datasets"] = [DatasetConfig.model_construct(path="")]  # (required; nothing to check in it)
    try:
        cfg = _Unchecked.model_validate(rest)
    except ValidationError:
        return None
    return cfg


class _Unchecked(Config):
    """Config without its cross-key rules (each field still validated): only for _lenient."""

    def _consistent(self):  # replaces the model validator of Config
        return self


def parse_config(raw: Any) -> tuple[Config, list[str]]:
    """Validate a config mapping. Returns the config and the notes about what was rewritten or ignored. Raises a
    ConfigError naming every problem (`.problems`, one line each; `.config`: the config as far as it reads)."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a YAML mapping of keys to values")
    raw = {str(k): v for k, v in raw.items()}
    scalars = _scalar_lists(raw)
    raw, rewrite = migrate.migrate(raw, set(Config.model_fields) | {"model_config"}, set(DatasetConfig.model_fields))
    notes, problems = list(rewrite.notes), list(rewrite.problems) + [line for _, line in scalars]
    if "model_config" in raw:  # Axolotl's model_config: pydantic owns the name
        raw["model_config_overrides"] = raw.pop("model_config")
    if raw.get("micro_batch_size") == "auto":  # the batch per step is micro 1 x gradient_accumulation_steps,
        raw["micro_batch_size"] = 1  # split by the estimate at start (trainer/fit/auto_batch.py)
        raw["auto_find_batch_size"] = True
    sift = Sift()
    kept = sift.mapping(raw, Config, "", "")
    problems += sift.problems
    not_lists = [key for key in ("datasets", "test_datasets") if isinstance(kept.get(key), dict)]
    for key in not_lists:  # the `- ` of the first entry left out or commented out: Axolotl fails on it unexplained
        problems.append(f"{key}: must be a list of dataset entries, each starting with `- ` (`- path: ...`), but is "
                        f"one mapping ({', '.join(map(str, kept.pop(key)))}): is the `- ` of its first line missing or "
                        "commented out?")
    for i, entry in enumerate(kept.get("datasets") or []):
        if not isinstance(entry, dict):
            problems.append(f"datasets.{i}: each dataset must be a mapping with at least path and type")
    kept["datasets"] = [e for e in kept.get("datasets") or [] if isinstance(e, dict)] if "datasets" in kept else []
    if not kept["datasets"]:
        kept.pop("datasets")
    for entry in kept.get("datasets", []):
        if entry.get("type") == "chat_template.default":  # Axolotl's full name of the strategy
            entry["type"] = "chat_template"
    set_aside: set[str] = set()
    try:
        cfg = Config.model_validate(kept)
    except ValidationError as err:  # key and value problems together, so one run shows them all
        named = not_lists + [key for key, _ in scalars]  # (said above: not "Field required" as well)
        problems += [p for p in _validation_problems(err) if not any(p.startswith(f"{key}: Field required")
                                                                      for key in named)]
        cfg = _lenient(kept, err)
        set_aside = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
    if cfg is not None:
        # a rule that reads a key set aside above would only say that the key is missing: not a problem to report
        problems += [p for p in _named_choices(cfg, notes, lenient=bool(problems))
                     if not any(re.search(rf"(?<![\w.]){re.escape(key)}\b", p) for key in set_aside)]
    notes = sift.notes() + notes
    if problems:
        raise several([("config", p) for p in problems], cfg)
    return cfg, notes


def _scalar_lists(raw: dict) -> list[tuple[str, str]]:
    """(key, problem) for each list of entries (datasets, test_datasets, pretraining_dataset) given one plain value
    (`datasets: -1`, `datasets: data.jsonl`): the key is set aside, so that nothing after reads it as a list. (One
    mapping instead of a list has its own line in parse_config: the `- ` left out.)"""
    found = []
    for key in migrate.LISTS:
        value = raw.get(key)
        if value is None or isinstance(value, (list, dict)):
            continue
        raw.pop(key)
        found.append((key, f"{key}: must be a list of dataset entries, each starting with `- ` (`- path: ...`, then "
                           f"`type: ...` below it), not {value!r}"))
    return found


def _named_choices(cfg: Config, notes: list[str], lenient: bool = False) -> list[str]:
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
    checks += [lambda: notes.extend(model.check_mistral_tokenizer(cfg)), lambda: notes.extend(datasets.stream_notes(cfg))]
    checks += [lambda: qat.check_config(cfg)]
    checks += [lambda: notes.extend(sparsity.check(cfg))]
    checks += [lambda: notes.extend(_objective_notes(cfg))]
    checks += [lambda: notes.extend(ebft.check(cfg))]  # rl: ebft (strided mode only)
    checks += [lambda: notes.extend(vision.check(cfg))]  # processor_type (vision-language)
    checks += [lambda: notes.extend(parallel.check_sizes(cfg, parallel.fsdp_enabled(cfg)))]
    checks += [lambda: notes.extend(training.ordering_notes(cfg) + training.eval_table_notes(cfg)
                                    + training.causal_lm_notes(cfg) + training.schedule_notes(cfg))]
    checks += [lambda: training.check_relora_optimizer(cfg)]
    checks += [lambda: training.check_schedule(cfg), lambda: training.check_epochs(cfg)]
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
        except Exception:  # noqa: BLE001  (lenient: a config whose own rules failed; those problems are reported)
            if not lenient:
                raise
    return problems


def _objective_notes(cfg: Config) -> list[str]:
    """use_eaft, rl: grpo / gdpo and the trl: block, cls_model_config, the diffusion plugin."""
    rl.check_eaft(cfg)
    try:
        notes = grpo.check(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model.check_config_class(cfg)
    return notes + diffusion.check(cfg) + rl.preference_notes(cfg)


MAX_CONFIG_BYTES = 1 << 20  # a config is keys and values; data and templates of any size live in files it names
MAX_DEPTH = 100  # nesting levels (Axolotl's deepest configs nest 5)
MAX_NODES = 200_000  # values once every alias is expanded: a 1.5 KB "billion laughs" file expands to 10^9


def read_yaml(path: Path) -> Any:
    """The YAML document at `path`, read with limits that fail in one line before memory or time run out: its
    size, its nesting depth and its size once aliases are expanded (an alias is a reference; what reads the
    config later -- validation, hashing, printing -- expands it). Safe loading: YAML tags construct no objects."""
    # start-up: yaml imported only when this runs
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
        raise ConfigError(yaml_problem(path, err)) from None
    finally:
        loader.dispose()


# PyYAML's wording of the syntax errors people make in a config, in plain words: (its problem, its context or
# None for any) -> (which mark the line points at: the problem's or the context's, what is wrong)
YAML_PROBLEMS = [
    (("found character '\\t'", None), ("problem", "a tab: YAML indents with spaces only")),
    (("found unexpected end of stream", "while scanning a quoted scalar"),
     ("context", "a quoted value opens here and is never closed (a missing \" or ')")),
    (("mapping values are not allowed here", None),
     ("problem", "a ':' YAML cannot read here: quote a value that holds ': ' (key: \"a: b\"), and do not indent a "
                 "key under a line that already has its value")),
    (("could not find expected ':'", None), ("context", "not `key: value` (a ':' and a space missing?)")),
    (("expected <block end>", None), ("problem", "indented differently from the lines above it")),
    (("expected ',' or ']'", None), ("context", "a [list] opens here and is not closed (a missing ']' or ',')")),
    (("expected ',' or '}'", None), ("context", "a {mapping} opens here and is not closed (a missing '}' or ',')")),
]


def yaml_problem(path: Path, err) -> str:
    """One line for a YAML syntax error: `PATH line L column C: what is wrong`, in plain words where PyYAML's
    wording is one a config's author meets (YAML_PROBLEMS), else PyYAML's own."""
    problem, context = str(getattr(err, "problem", None) or err), getattr(err, "context", None) or ""
    marks = {"problem": getattr(err, "problem_mark", None), "context": getattr(err, "context_mark", None)}
    mark, text = marks["problem"], problem + (f" ({context})" if context else "")
    for (said, during), (at, plain) in YAML_PROBLEMS:
        if problem.startswith(said) and (during is None or context == during):
            mark, text = marks[at] or marks["problem"], plain
            break
    where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return f"{path}{where}: {text}"


def _check_expanded_size(root, path: Path) -> None:
    """Refuse a document whose aliases expand it past MAX_NODES values, or that refers to itself."""
    # start-up: yaml imported only when this runs
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
    """Read and check a config file: every problem of the config and of the local files it names, together."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = read_yaml(path)
    try:
        cfg, notes = parse_config(raw)
        problems = []
    except ConfigError as err:
        if err.config is None:
            raise
        cfg, notes, problems = err.config, [], list(err.problems)
    problems += [("config", line) for line in missing_required(raw, problems)]
    # what the config leaves out or misspells of a key that decides what is trained: the line names the file
    problems = [(kind, f"{path}: {line}" if kind == "config" and ("is not a key; did you mean" in line
                                                                   or "(Axolotl requires it" in line) else line)
                for kind, line in problems]
    cfg._config_dir = str(path.resolve().parent)
    problems += [("file", line) for line in missing_local_paths(cfg)]
    if problems:
        raise several(problems, cfg)
    return cfg, notes


def missing_required(raw: dict, problems: list) -> list[str]:
    """The keys Axolotl requires that a config file leaves out (keys.REQUIRED), one line each, except where a near
    miss of the key already says so. (A config file: the dicts tests build in process take the defaults.)"""
    named = " ".join(str(p) for _, p in problems)
    return [f"{key}: missing (Axolotl requires it; this trainer does not guess a value for it)"
            for key in keys.REQUIRED if raw.get(key) is None and f"did you mean '{key}'" not in named
            and f"{key}: Field required" not in named]


def looks_local(path: str) -> bool:
    """A path that is meant to be on disk (not a hub id like 'org/name')."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix in {".json", ".jsonl", ".parquet", ".csv"} or Path(path).exists()


BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' file builders, as a `path`


def missing_local_paths(cfg: Config) -> list[str]:
    """The local files and directories the config names that are not on this machine, one line each."""
    missing = []
    entries = [("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets or []),
               ("pretraining_dataset", cfg.pretraining_dataset or [])]
    for key, i, ds in [(key, i, ds) for key, group in entries for i, ds in enumerate(group)]:
        if ds.path and looks_local(ds.path) and not Path(ds.path).expanduser().exists():
            missing.append(f"{key}.{i}.path: file not found: {ds.path}")
        files = [ds.data_files] if isinstance(ds.data_files, str) else ds.data_files or []
        builder = ds.path in BUILDERS  # `path: json` with data_files: the files are local
        if not ds.path or builder or (looks_local(ds.path) and Path(ds.path).expanduser().is_dir()):
            base = Path("." if not ds.path or builder else ds.path).expanduser()
            missing += [f"{key}.{i}.data_files: file not found: {f}" for f in files
                        if looks_local(f) and not (base / Path(f).expanduser()).exists()]
    for key in ("base_model", "base_model_config", "tokenizer_config", "deepspeed"):
        value = getattr(cfg, key)
        if key == "deepspeed" and value:
            value = str(deepspeed_path(value))
        if value and looks_local(value) and not Path(value).expanduser().exists():
            missing.append(f"{key}: not found: {value}")
    return missing


def check_local_paths(cfg: Config) -> None:
    """Missing local files are bad input: say so before any work starts."""
    missing = missing_local_paths(cfg)
    if missing:
        raise several([("file", line) for line in missing], cfg)
