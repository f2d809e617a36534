"""Datasets: load, tokenize with the prompt format, filter by length, split, cache.

The tokenized result is cached under dataset_prepared_path/<key>, where the key hashes the data (file
contents, or the hub dataset's fingerprint), the tokenizer, and every config key that changes the tokens.
With several processes, rank 0 prepares (under a file lock, so a concurrent `preprocess` or a second job
does not prepare the same cache twice) and the other ranks wait for the finished cache directory, which
appears atomically (temp dir + rename).

Damage is detected, never trained on: the cache carries `manifest.json` (every file's size and sha256, written
last), checked before each load (sizes always, hashes too up to HASH_LIMIT bytes); a cache that fails the check
(bytes changed, a file missing, no manifest) is said so in one line and prepared again. Temp directories a killed
run left for this key are removed under the key's lock; a failed write removes its own; a full disk or a
read-only dataset_prepared_path is one line (TrainerError, exit 1; DataError, exit 2).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.batch.labels import IGNORE
from trainer.config import Config, DatasetConfig, looks_local
from trainer.config.datasets import SYNTHETIC
from trainer.data import files as local_files
from trainer.data.formats.prompts import tokenize_row
from trainer.errors import ConfigError, DataError, TrainerError
from trainer.runtime import digest
from trainer.runtime.digest import sha256_file

CACHE_FORMAT = 2  # bump when tokenization changes, so old caches are not reused
MANIFEST = "manifest.json"
HASH_LIMIT = 1 << 30  # caches up to 1 GiB are hashed at every load (~1 s/GB); larger ones are checked by size
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
                 ".txt": "text"}  # (Axolotl's EXTENSIONS_TO_DATASET_TYPES, and json)


def default_workers(cfg: Config) -> int:
    """Worker processes for preprocessing: dataset_processes, else min(CPU count, 8)."""
    return cfg.dataset_processes or min(os.cpu_count() or 1, 8)


def load_tokenizer(cfg: Config):
    # heavy: transformers loads only when this runs
    from transformers import AutoTokenizer

    if cfg.tokenizer_use_mistral_common:
        from trainer.data.formats import mistral_tokenizer

        return mistral_tokenizer.load(cfg)
    source = cfg.tokenizer_config or cfg.base_model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except OSError as err:
        raise ConfigError(f"cannot load the tokenizer from {source}: {str(err).splitlines()[0]}") from None
    if cfg.added_tokens_overrides:
        tokenizer = override_added_tokens(tokenizer, cfg.added_tokens_overrides, cfg.trust_remote_code)
    if cfg.special_tokens:
        tokenizer.add_special_tokens(dict(cfg.special_tokens))
    if cfg.tokens:
        tokenizer.add_tokens(list(cfg.tokens))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of attention and loss
    if cfg.diffusion is not None:  # the diffusion plugin's mask token (may add one; trainer/config/diffusion.py)
        prepare_diffusion_tokenizer(cfg, tokenizer)
    from trainer.data.formats.chat_templates import resolve

    tokenizer.chat_template = resolve(cfg.chat_template, cfg.chat_template_jinja, tokenizer)
    return tokenizer


def override_added_tokens(tokenizer, overrides: dict[int, str], trust_remote_code: bool = False):
    """added_tokens_overrides {id: text}: the tokenizer with those added tokens renamed, as Axolotl's
    modify_tokenizer_files does it: the tokenizer saved, the token's `content` rewritten in tokenizer_config.json's
    added_tokens_decoder and tokenizer.json's added_tokens (and its entry in the model's vocab, where it has one),
    then loaded again. An id that is not an added token is refused (Axolotl raises the same). A token the tokenizer
    also names as a special token (bos/eos/pad, additional_special_tokens) is added back under its old name when the
    files load, at a new id, as it is in Axolotl: the renaming is for reserved tokens (Llama 3's
    <|reserved_special_token_N|>)."""
    import tempfile  # start-up: only runs with added_tokens_overrides

    from transformers import AutoTokenizer

    known = {int(i) for i in tokenizer.added_tokens_decoder}
    missing = sorted(int(i) for i in overrides if int(i) not in known)
    if missing:
        raise ConfigError(f"added_tokens_overrides: token id(s) {missing} are not added tokens of this tokenizer "
                          f"(only added tokens can be renamed; its added tokens: {sorted(known)[:20]})")
    renames = {int(i): str(text) for i, text in overrides.items()}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        config_path, tokenizer_path = Path(tmp) / "tokenizer_config.json", Path(tmp) / "tokenizer.json"
        if config_path.exists():
            data = json.loads(config_path.read_text(encoding="utf-8"))
            for i, text in renames.items():
                if str(i) in data.get("added_tokens_decoder", {}):
                    data["added_tokens_decoder"][str(i)]["content"] = text
            config_path.write_text(json.dumps(data, indent=2), encoding="utf-8")
        if tokenizer_path.exists():
            data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
            for entry in data.get("added_tokens", []):
                if entry.get("id") in renames:
                    entry["content"] = renames[entry["id"]]
            vocab = (data.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                for i, text in renames.items():
                    old = next((k for k, v in vocab.items() if v == i), None)
                    if old is not None:
                        del vocab[old]
                        vocab[text] = i
            tokenizer_path.write_text(json.dumps(data, indent=2), encoding="utf-8")
        return AutoTokenizer.from_pretrained(tmp, trust_remote_code=trust_remote_code)


DEFAULT_MASK_TOKEN = "<|diffusion_mask|>"  # Axolotl's resolve_mask_token_id default


def resolve_mask_token(cfg, tokenizer) -> int:
    """Axolotl's resolve_mask_token_id(allow_add=True): mask_token_id if below tokenizer.vocab_size, else
    mask_token_str or <|diffusion_mask|> if already a special token, else that token is added (the embeddings
    grow with the tokenizer when the model loads). Stores the id in cfg.diffusion.mask_token_id."""
    d = cfg.diffusion
    vocab = getattr(tokenizer, "vocab_size", None)
    if d.mask_token_id is not None and d.mask_token_id >= 0 and (vocab is None or d.mask_token_id < vocab):
        return d.mask_token_id
    specials = set(tokenizer.all_special_tokens or [])
    for candidate in (d.mask_token_str, DEFAULT_MASK_TOKEN):
        if not candidate or candidate not in specials:
            continue
        token_id = tokenizer.convert_tokens_to_ids(candidate)
        if isinstance(token_id, int) and token_id >= 0 and token_id != tokenizer.unk_token_id and (
                vocab is None or token_id < vocab):
            d.mask_token_id = token_id
            return token_id
    token = d.mask_token_str or DEFAULT_MASK_TOKEN
    tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
    d.mask_token_id = int(tokenizer.convert_tokens_to_ids(token))
    return d.mask_token_id


def prepare_diffusion_tokenizer(cfg, tokenizer) -> None:
    """Resolve the mask token (maybe adding it) and record the tokens never masked: BOS, EOS and pad (Axolotl's
    _cache_special_token_ids)."""
    resolve_mask_token(cfg, tokenizer)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    cfg.diffusion._special_ids = sorted({i for i in ids if i is not None})




def _files(ds: DatasetConfig) -> list[str]:
    return [ds.data_files] if isinstance(ds.data_files, str) else list(ds.data_files or [])


def _data_identity(ds: DatasetConfig) -> str:
    if not ds.path or ds.path in FILE_BUILDERS.values():  # local files given by data_files
        return hashlib.sha256("".join(sha256_file(Path(f).expanduser()) if Path(f).expanduser().is_file() else f
                                      for f in _files(ds)).encode()).hexdigest()
    path = Path(ds.path).expanduser()
    if path.is_file():
        return sha256_file(path)
    if path.is_dir():
        return hashlib.sha256("".join(sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()).encode()).hexdigest()
    return ""  # hub dataset: identified by its fingerprint once loaded (see load_raw)


def tokenizer_identity(tokenizer) -> str:
    # start-up: trainer.data.formats.mistral_tokenizer imported only when this runs
    from trainer.data.formats import mistral_tokenizer

    if mistral_tokenizer.is_mistral(tokenizer):
        return mistral_tokenizer.identity(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([type(tokenizer).__name__, tokenizer.chat_template, str(tokenizer.special_tokens_map)])
    return hashlib.sha256((vocab + extra).encode()).hexdigest()


def cache_key(cfg: Config, tokenizer, hub_fingerprints: list[str], kind: dict | None = None) -> str:
    """kind: what the builder adds to the key ({"kind": "sft"} for SFT's rows; each objective names its own)."""
    relevant = {
        "format": CACHE_FORMAT,
        "datasets": [d.model_dump() for d in cfg.datasets],
        "data": [_data_identity(d) for d in cfg.datasets] + hub_fingerprints,
        **({"test_datasets": [d.model_dump() for d in cfg.test_datasets],
            "test_data": [_data_identity(d) for d in cfg.test_datasets]} if cfg.test_datasets else {}),
        "tokenizer": tokenizer_identity(tokenizer),
        **(kind or {"kind": "sft"}),
        **{k: getattr(cfg, k) for k in ("sequence_len", "excess_length_strategy", "train_on_inputs", "val_set_size",
                                       "seed", "shuffle_merged_datasets", "shuffle_before_merging_datasets",
                                       "dataset_shard_num", "dataset_shard_idx", "chat_template", "chat_template_jinja",
                                       "chat_template_kwargs",
                                       "eot_tokens", "dataset_exact_deduplication", "min_sample_len",
                                       "curriculum_sampling")},
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_raw(ds: DatasetConfig, seed: int | None = None):
    """A local file or directory, local files given by data_files (no path, or path: json|csv|parquet|...), or a
    hub dataset (needs the network; at `revision` where given); with `shards`, the one shard Axolotl trains on (its
    rows shuffled by `seed`, then shard `shards_idx` of `shards`). type: _synthetic loads nothing (its rows are
    generated: synthetic_rows)."""
    if ds.type == SYNTHETIC:
        # heavy: datasets loads only when this runs
        import datasets

        return datasets.Dataset.from_dict({"text": [""]})  # Axolotl's placeholder
    rows = _load_rows(ds)
    if ds.shards and seed is not None:
        rows = rows.shuffle(seed=seed).shard(num_shards=ds.shards, index=ds.shards_idx or 0)
    return rows


def _load_rows(ds: DatasetConfig):
    # heavy: datasets loads only when this runs
    import datasets

    if not ds.path:
        files = _files(ds)
        builder = ds.ds_type or FILE_BUILDERS.get(Path(files[0]).suffix.lower())
        if builder is None:
            raise DataError(f"dataset {ds.source}: unknown file type; set ds_type: json, parquet or csv")
        return datasets.load_dataset(builder, data_files=files, split="train")
    path = Path(ds.path).expanduser()
    if path.is_file():
        builder = ds.ds_type or FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"dataset {ds.path}: unknown file type '{path.suffix}'; set ds_type: json, parquet or csv")
        return local_files.load_file(path, builder, ds.path)  # a malformed row: the file and line, exit 2
    if looks_local(ds.path) and not path.exists():
        raise DataError(f"dataset file not found: {ds.path}")
    if path.is_dir() and not ds.data_files:  # a folder datasets' save_to_disk wrote, as Axolotl tries it first
        saved = _saved_to_disk(path, ds)
        if saved is not None:
            return saved
    if path.is_dir():
        try:
            with local_files.quiet_datasets():
                return datasets.load_dataset(str(path), data_files=ds.data_files, split=ds.split)
        except Exception as err:
            raise DataError(f"dataset {ds.path}{local_files.directory_problem(path, err)}") from None
    try:
        return datasets.load_dataset(ds.path, ds.name, data_files=ds.data_files, split=ds.split, revision=ds.revision)
    except Exception as err:  # hub errors come in many types; the first line says what happened
        raise TrainerError(f"cannot load dataset {ds.path} (split {ds.split}): {str(err).splitlines()[0]}") from None


def _saved_to_disk(path: Path, ds: DatasetConfig):
    """datasets.load_from_disk of a folder save_to_disk wrote (a Dataset, or a DatasetDict: its `split`); None for a
    folder it did not write (Axolotl's _load_from_local_path falls back to load_dataset on FileNotFoundError)."""
    # heavy: datasets loads only when this runs
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        return None
    if isinstance(saved, datasets.DatasetDict):
        if ds.split not in saved:
            raise DataError(f"dataset {ds.path}: the saved dataset has no split '{ds.split}' (splits: "
                            f"{', '.join(saved)}); set split")
        return saved[ds.split]
    return saved


@dataclass
class Prepared:
    train: object  # datasets.Dataset with input_ids, labels, length
    validation: object | None
    stats: dict
    path: Path | None  # None with skip_prepare_dataset (nothing cached)


def workers_for(cfg: Config, rows: int) -> int:
    return min(default_workers(cfg), max(1, rows // 1000))  # processes only pay off on bigger data


def pretokenized_row(row: dict, ds: DatasetConfig) -> dict:
    """A dataset entry with no `type`: rows carry input_ids, and optionally labels and attention_mask
    (Axolotl's pre-tokenized datasets). Positions with attention_mask 0 (padding) are dropped; labels
    default to the input_ids (train on every token)."""
    ids = row.get("input_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise DataError(f"dataset {ds.path}: no `type` means pre-tokenized rows, which need an `input_ids` list of "
                        f"token ids (columns: {', '.join(sorted(row)) or 'none'}); or set the dataset's type")
    labels = row.get("labels")
    labels = list(ids) if labels is None else list(labels)
    mask = row.get("attention_mask")
    if len(labels) != len(ids) or (mask is not None and len(mask) != len(ids)):
        raise DataError(f"dataset {ds.path}: input_ids, labels and attention_mask of a row differ in length")
    if mask is not None:
        keep = [i for i, m in enumerate(mask) if m]
        ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    return {"input_ids": list(ids), "labels": labels}


def tokenize_example(row: dict, ds: DatasetConfig, cfg: Config, tokenizer) -> dict:
    """One row -> input_ids, labels, too_long, length, targets (shared by prepared and streamed data)."""
    if ds.type is None:  # no type: the row is already tokenized
        out = pretokenized_row(row, ds)
    else:
        out = tokenize_row(row, ds, tokenizer, cfg.train_on_inputs, cfg.eot_tokens, cfg.chat_template_kwargs)
    limit = cfg.sequence_len
    n = len(out["input_ids"])
    out["too_long"] = n > limit
    if n > limit and cfg.excess_length_strategy == "truncate":
        out = {"input_ids": out["input_ids"][:limit], "labels": out["labels"][:limit], "too_long": True}
    out["length"] = len(out["input_ids"])
    out["targets"] = sum(1 for t in out["labels"][1:] if t != IGNORE)
    return out


def synthetic_rows(ds: DatasetConfig, cfg: Config, tokenizer):
    """type: _synthetic: Axolotl's SyntheticDatasetStrategy (prompt_strategies/_synthetic.py), the same draw:
    numpy's default_rng(seed).integers(min_input_id, max_input_id, (length, sequence_length)), labels the input_ids.
    Returned as pre-tokenized rows, so sequence_len and excess_length_strategy apply as to any other rows."""
    # heavy: datasets and numpy load only when this runs
    import datasets
    import numpy as np

    low = 100 if ds.min_input_id is None else ds.min_input_id
    high = tokenizer.vocab_size if ds.max_input_id is None else ds.max_input_id
    if high <= low:
        raise DataError(f"dataset {ds.path}: max_input_id {high} must be above min_input_id {low} (type: _synthetic)")
    ids = np.random.default_rng(ds.seed).integers(low=low, high=high, size=(ds.length or 1000,
                                                                           ds.sequence_length or cfg.sequence_len))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _tokenize(raw, ds: DatasetConfig, cfg: Config, tokenizer):
    if ds.type == SYNTHETIC:  # generated, whatever the source (Axolotl's wrap_dataset ignores it)
        raw, ds = synthetic_rows(ds, cfg, tokenizer), ds.model_copy(update={"type": None})
    workers = workers_for(cfg, len(raw))
    return raw.map(lambda row: tokenize_example(row, ds, cfg, tokenizer), remove_columns=raw.column_names,
                   num_proc=workers if workers > 1 else None, desc=f"tokenizing {ds.source}")


def build(cfg: Config, tokenizer) -> tuple[object, object | None, dict]:
    """SFT's rows: every dataset tokenized by its prompt format (trainer/data/formats/), filtered and split."""
    parts = [_tokenize(load_raw(ds, cfg.seed), ds, cfg, tokenizer) for ds in cfg.datasets]
    data, validation, stats = filter_and_split(cfg, merged(cfg, parts))
    if cfg.test_datasets:
        validation = held_out(cfg, [_tokenize(load_raw(ds, cfg.seed), ds, cfg, tokenizer) for ds in cfg.test_datasets])
    stats.update(train_rows=len(data), train_tokens=int(sum(data["length"])),
                 validation_rows=len(validation) if validation is not None else 0)
    return data, validation, stats


def build_held_out(cfg: Config, tokenizer) -> tuple[None, object, dict]:
    """The validation rows alone, from test_datasets, for a run whose training rows are streamed
    (pretraining_dataset, streaming: true): prepared and cached as SFT's, with no training rows (Axolotl prepares a
    streamed run's test_datasets the same way, up front)."""
    validation = held_out(cfg, [_tokenize(load_raw(ds), ds, cfg, tokenizer) for ds in cfg.test_datasets])
    stats = {"rows": 0, "too_long": 0, "train_rows": "streamed", "validation_rows": len(validation)}
    return None, validation, stats


def tokenize_and_split(cfg: Config, tokenizer, tokenize):
    """Each dataset tokenized by tokenize(raw, ds, cfg, tokenizer, workers), concatenated, then filter_and_split
    (the shared tail of the preference and reward data paths)."""
    def each(entries):
        parts = []
        for ds in entries:
            raw = load_raw(ds, cfg.seed)
            parts.append(tokenize(raw, ds, cfg, tokenizer, workers_for(cfg, len(raw))))
        return parts

    data, validation, stats = filter_and_split(cfg, merged(cfg, each(cfg.datasets)))
    if cfg.test_datasets:
        validation = held_out(cfg, each(cfg.test_datasets))
    return data, validation, stats


def merged(cfg: Config, parts: list):
    """The datasets' rows as one, as Axolotl's merge_datasets: with shuffle_before_merging_datasets and more than one
    dataset, each shuffled by the seed first (shuffle_merged_datasets shuffles the whole after filtering)."""
    # heavy: datasets loads only when this runs
    import datasets

    if cfg.shuffle_before_merging_datasets and len(parts) > 1:
        parts = [part.shuffle(seed=cfg.seed) for part in parts]
    return datasets.concatenate_datasets(parts)


def refuse_too_long(cfg: Config, too_long: int, rows: int, what: str = "rows") -> None:
    """excess_length_strategy: raise (Axolotl's): the data is refused, in one line, where any row is longer than
    sequence_len (Axolotl raises at the first; this line counts them)."""
    if too_long and cfg.excess_length_strategy == "raise":
        raise DataError(f"{too_long} of {rows} {what} are longer than sequence_len {cfg.sequence_len} "
                        "(excess_length_strategy: raise); set excess_length_strategy: drop or truncate, or a larger "
                        "sequence_len")


def held_out(cfg: Config, parts: list):
    """test_datasets' rows (tokenized like the training rows) as the validation set, with the rows filter_and_split
    drops from training dropped here too (too long under drop, nothing to train on)."""
    data = merged(cfg, parts)
    refuse_too_long(cfg, sum(data["too_long"]), len(data), "test_datasets rows")
    drop = cfg.excess_length_strategy == "drop"
    keep = [i for i, (long, targets) in enumerate(zip(data["too_long"], data["targets"]))
            if targets > 0 and not (long and drop)]
    if not keep:
        raise DataError("test_datasets: no rows left to evaluate on after filtering (too long or nothing to train on)")
    return data.select(keep).remove_columns(["too_long"])


def filter_and_split(cfg: Config, data) -> tuple[object, object | None, dict]:
    """What SFT and preference data share after tokenising: drop or count over-long rows and rows with
    nothing to train on, drop exact duplicates (dataset_exact_deduplication), shuffle, split off validation."""
    too_long = sum(data["too_long"])
    refuse_too_long(cfg, too_long, len(data))
    drop = cfg.excess_length_strategy == "drop"
    stats = {"rows": len(data), "too_long": too_long, "excess_length_strategy": cfg.excess_length_strategy,
             "dropped_too_long": too_long if drop else 0, "truncated": 0 if drop else too_long}
    keep = [i for i, (long, targets) in enumerate(zip(data["too_long"], data["targets"]))
            if targets > 0 and not (long and drop)]
    stats["dropped_no_targets"] = len(data) - len(keep) - stats["dropped_too_long"]
    data = data.select(keep).remove_columns(["too_long"])
    if cfg.min_sample_len:  # Axolotl's lower bound on a row's tokens (SFT only: checked by Config)
        long_enough = [i for i, n in enumerate(data["length"]) if n >= cfg.min_sample_len]
        stats["dropped_too_short"] = len(data) - len(long_enough)
        data = data.select(long_enough)
    if cfg.dataset_exact_deduplication:
        seen, unique = set(), []
        for i, row in enumerate(data):
            key = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).digest()
            if key not in seen:
                seen.add(key)
                unique.append(i)
        stats["dropped_duplicates"] = len(data) - len(unique)
        data = data.select(unique)
    if len(data) == 0:
        raise DataError(f"no rows left to train on after filtering ({json.dumps(stats)}); raise sequence_len "
                        "or use excess_length_strategy: truncate")
    # curriculum_sampling keeps a single dataset's order (merged datasets follow shuffle_merged_datasets), as Axolotl
    if cfg.shuffle_merged_datasets and not (cfg.curriculum_sampling and len(cfg.datasets) == 1):
        data = data.shuffle(seed=cfg.seed)
    if cfg.dataset_shard_num:  # Axolotl's _apply_dataset_sharding, before the validation split (SFT: Config checks)
        data = data.shard(num_shards=cfg.dataset_shard_num, index=cfg.dataset_shard_idx)
        stats["dataset_shard"] = f"{cfg.dataset_shard_idx} of {cfg.dataset_shard_num}"
    validation = None
    if cfg.val_set_size:
        size = cfg.val_set_size if cfg.val_set_size < 1 else int(cfg.val_set_size)
        if isinstance(size, int) and size >= len(data):
            raise ConfigError(f"val_set_size {size} leaves no training rows (dataset has {len(data)})")
        split = data.train_test_split(test_size=size, seed=cfg.seed, shuffle=not cfg.curriculum_sampling)
        data, validation = split["train"], split["test"]
    return data, validation, stats


def _save(path: Path, train, validation, stats: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if train is not None:  # (None: a streamed run's validation rows alone, build_held_out)
            train.save_to_disk(str(tmp / "train"))
        if validation is not None:
            validation.save_to_disk(str(tmp / "validation"))
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2))
        digest.write(tmp, MANIFEST, DERIVED)  # last: a cache with one is whole (trainer/runtime/digest.py)
        os.replace(tmp, path)  # the cache is complete or absent
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _no_space(e):
            raise TrainerError(f"no space left on the device of dataset_prepared_path {path.parent} while writing the "
                            f"dataset cache (nothing was left behind): free space there or point "
                            f"dataset_prepared_path at a larger disk") from None
        raise


def _no_space(e: BaseException) -> bool:
    """ENOSPC however it arrives: an OSError, or pyarrow's / datasets' error that carries its text."""
    while e is not None:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


# Folders the objectives add to a prepared cache later, each keyed and checked on its own (trainer/objectives/
# reference.py: reference-<key>/ holds the reference model's log-probs): not the cache's files.
DERIVED = ("reference-",)


def damage(path: Path) -> str | None:
    """Why the cache at `path` cannot be trusted, or None: checked against its manifest (sizes, and hashes up to
    HASH_LIMIT bytes in all)."""
    try:
        manifest = digest.load(path, MANIFEST)
    except FileNotFoundError:
        return f"it has no {MANIFEST} (an interrupted or older cache)"
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    return digest.damage(path, manifest, MANIFEST, hash_limit=HASH_LIMIT, derived=DERIVED)


def _discard(path: Path) -> None:
    """Remove a damaged cache: renamed aside first, so no reader meets it half-deleted."""
    aside = path.with_name(f".{path.name}.damaged-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _clean_leftovers(path: Path) -> None:
    """Temp and set-aside directories of this cache key: only a dead writer leaves them while the key's lock is
    held by this process."""
    for leftover in path.parent.glob(f".{path.name}.*-*"):
        if leftover.is_dir() and leftover.name.rsplit("-", 1)[-1].isdigit():
            shutil.rmtree(leftover, ignore_errors=True)


def _load(path: Path) -> Prepared:
    # heavy: datasets loads only when this runs
    import datasets

    validation = datasets.load_from_disk(str(path / "validation")) if (path / "validation").exists() else None
    stats = json.loads((path / "stats.json").read_text())
    train = datasets.load_from_disk(str(path / "train")) if (path / "train").exists() else None
    return Prepared(train, validation, stats, path)


def _hub_fingerprints(cfg: Config) -> list[str]:
    entries = list(cfg.datasets) + list(cfg.test_datasets or [])
    return [load_raw(d)._fingerprint for d in entries
            if d.path and d.path not in FILE_BUILDERS.values() and not looks_local(d.path)]


def prepare(cfg: Config, tokenizer, rank: int = 0, log=print, builder=None, kind: dict | None = None) -> Prepared:
    """The tokenized train/validation data, from the cache or prepared now (by rank 0 only).

    builder(cfg, tokenizer) -> (train, validation, stats) makes the rows: SFT's (`build`) unless an objective
    passes its own (trainer/objectives/: Objective.prepare_data), with `kind` naming them in the cache key."""
    # optional: filelock is imported only where it is used
    from filelock import FileLock, Timeout

    if cfg.skip_prepare_dataset:  # tokenized in memory by every process; no cache written or read (as Axolotl)
        train, validation, stats = (builder or build)(cfg, tokenizer)
        if rank == 0 and stats["too_long"]:
            log(f"{stats['too_long']} of {stats['rows']} rows are longer than sequence_len {cfg.sequence_len}")
        return Prepared(train, validation, stats, None)
    root = Path(cfg.dataset_prepared_path)
    path = root / cache_key(cfg, tokenizer, _hub_fingerprints(cfg), kind)
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(root / f"{path.name}.lock"), timeout=cfg.dataset_prepare_timeout)
            lock.acquire()
        except Timeout:
            raise TrainerError(f"another process has held the lock on {path} for {cfg.dataset_prepare_timeout}s; "
                               "if none is running, delete the .lock file") from None
        except OSError as e:  # read-only, full, or not a directory: before anything is tokenized
            raise DataError(f"dataset_prepared_path {root}: cannot write the dataset cache there "
                            f"({e.strerror or e})") from None
        try:
            _clean_leftovers(path)
            why = damage(path) if path.exists() else None
            if why:
                log(f"the dataset cache {path} is damaged ({why}): preparing it again")
                _discard(path)
            if not path.exists():
                log(f"preparing dataset into {path}")
                _save(path, *(builder or build)(cfg, tokenizer))
        finally:
            lock.release()
    else:
        deadline = time.monotonic() + cfg.dataset_prepare_timeout
        while not (path / MANIFEST).exists() or damage(path):
            if time.monotonic() > deadline:
                raise TrainerError(f"rank {rank} waited {cfg.dataset_prepare_timeout}s for rank 0 to prepare the "
                                   f"dataset cache {path}; run `python -m trainer preprocess` first or raise "
                                   "dataset_prepare_timeout")
            time.sleep(0.5)
    prepared = _load(path)
    stats = prepared.stats
    if rank == 0 and stats["too_long"]:
        verb = "dropped" if stats["dropped_too_long"] else "truncated"
        log(f"{stats['too_long']} of {stats['rows']} rows are longer than sequence_len {cfg.sequence_len}: {verb}")
    return prepared
