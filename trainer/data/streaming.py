"""Streamed training data: Axolotl's `pretraining_dataset` and `streaming: true`, and pre-tokenized rows.

A stream is read while training, never prepared up front (so it has no length: runs need max_steps):

    rows of every dataset, in order (datasets' streaming reader: local files, dirs or hub ids)
    -> a seeded shuffle buffer of streaming_multipack_buffer_size rows (shuffle_merged_datasets)
    -> row i goes to rank i % world_size (each rank tokenizes and trains on its own rows only)
    -> tokenized: pretraining_dataset text is cut into windows as Axolotl's `pretrain` type does
       (sequence_len - 1 tokens with a stride of overlap, then EOS; every token is trained); without
       sample_packing, as Axolotl's encode_streaming, each text is one example of its first sequence_len - 2 tokens;
       `datasets` entries by their prompt format, exactly as prepared data (trainer.data.prepare.tokenize_example)
    -> buffers of streaming_multipack_buffer_size examples, packed into bins of sequence_len
       (sample_packing; packed documents are isolated unless pretrain_multipack_attn: false) and shuffled
    -> micro-batches of micro_batch_size rows.

When a rank's rows run out the stream starts again (a new pass, shuffled with another seed), so every rank
has a next micro-batch for as long as max_steps asks: all ranks take the same number of steps with no
collective. The stream is a pure function of (config, rank, world size): resuming from a checkpoint replays
it and skips the micro-batches already trained, so the run continues with the next unseen rows (replaying
costs re-reading and re-tokenizing what was skipped, not training on it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainer.config import Config, PretrainingDatasetConfig, looks_local
from trainer.errors import DataError, TrainerError


def pretrain_windows(text: str, tokenizer, sequence_len: int) -> list[dict]:
    """Axolotl's `pretrain` type (prompt_strategies/pretrain.py): windows of sequence_len - 1 tokens that
    overlap by min(256, (sequence_len - 1) // 2), each followed by EOS; labels are the input_ids."""
    if not getattr(tokenizer, "is_fast", False):  # slow tokenizers return overflow differently
        raise DataError("pretraining_dataset needs a fast (Rust) tokenizer to cut text into windows")
    stride = min(256, (sequence_len - 1) // 2)
    enc = tokenizer(text, truncation=True, max_length=sequence_len - 1, add_special_tokens=True,
                    return_overflowing_tokens=True, stride=stride)
    windows = enc["input_ids"]
    return [{"input_ids": w + [tokenizer.eos_token_id], "labels": w + [tokenizer.eos_token_id]} for w in windows]


def _open(entry) -> object:
    """One dataset as a datasets.IterableDataset (local file, local directory or hub id)."""
    # heavy: datasets loads only when this runs
    import datasets

    from trainer.data.prepare import FILE_BUILDERS

    path = Path(entry.path).expanduser()
    try:
        if path.is_file():
            builder = entry.ds_type or FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"dataset {entry.path}: unknown file type '{path.suffix}'; set ds_type")
            stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
        elif looks_local(entry.path) and not path.exists():
            raise DataError(f"dataset file not found: {entry.path}")
        elif path.is_dir():
            stream = datasets.load_dataset(str(path), data_files=entry.data_files, split=entry.split, streaming=True)
        else:
            stream = datasets.load_dataset(entry.path, entry.name, data_files=entry.data_files, split=entry.split,
                                           streaming=True)
    except (DataError, TrainerError):
        raise
    except Exception as err:  # hub and reader errors come in many types; the first line says what happened
        raise TrainerError(f"cannot stream dataset {entry.path} (split {entry.split}): "
                           f"{str(err).splitlines()[0]}") from None
    skip = getattr(entry, "skip", None)
    return stream.skip(skip) if skip else stream


def _shuffled(rows, buffer_size: int, rng: np.random.Generator):
    """A shuffle buffer: fill it, then emit a random element and put the next row in its place."""
    buffer = []
    for row in rows:
        if len(buffer) < buffer_size:
            buffer.append(row)
            continue
        j = int(rng.integers(buffer_size))
        yield buffer[j]
        buffer[j] = row
    for j in rng.permutation(len(buffer)):
        yield buffer[int(j)]


class Stream:
    """The micro-batches of one rank: an endless iterator of lists of rows, each row a list of examples."""

    def __init__(self, cfg: Config, tokenizer, rank: int = 0, world_size: int = 1):
        self.cfg, self.tokenizer, self.rank, self.world = cfg, tokenizer, rank, world_size
        self.entries = list(cfg.pretraining_dataset or cfg.datasets)

    def examples(self, pass_index: int) -> Iterator[dict]:
        """This rank's tokenized examples of one pass over the data, each with an `index` unique to (pass, row,
        piece of the row): what keys per-example randomness (the diffusion objective's masks) on resume too."""
        for i, j, example in self._examples(pass_index):
            yield {**example, "index": (pass_index << 48) | (i << 16) | j}

    def _examples(self, pass_index: int) -> Iterator[tuple[int, int, dict]]:
        # start-up: trainer.data.prepare imported only when this runs
        from trainer.data.prepare import refuse_too_long, tokenize_example

        cfg = self.cfg
        rows = itertools.chain.from_iterable(((k, row) for row in _open(entry)) for k, entry in enumerate(self.entries))
        if cfg.shuffle_merged_datasets:
            rows = _shuffled(rows, cfg.stream_buffer_size, np.random.default_rng([cfg.seed, pass_index]))
        for i, (k, row) in enumerate(rows):
            if i % self.world != self.rank:
                continue
            entry = self.entries[k]
            if isinstance(entry, PretrainingDatasetConfig) and entry.type == "pretrain":
                text = row.get(entry.text_column)
                if not isinstance(text, str):
                    raise DataError(f"pretraining_dataset {entry.path}: rows need a text column "
                                    f"'{entry.text_column}' (columns: {', '.join(sorted(row))}); set text_column")
                if cfg.sample_packing:
                    yield from ((i, j, w) for j, w in enumerate(pretrain_windows(text, self.tokenizer, cfg.sequence_len)))
                else:  # Axolotl's unpacked path (encode_streaming): the text's start only, sequence_len - 2 tokens
                    ids = self.tokenizer(text, truncation=True, max_length=cfg.sequence_len - 2)["input_ids"]
                    yield i, 0, {"input_ids": ids, "labels": list(ids)}
                continue
            ds = entry.as_dataset() if isinstance(entry, PretrainingDatasetConfig) else entry
            out = tokenize_example(row, ds, cfg, self.tokenizer)
            refuse_too_long(cfg, int(out["too_long"]), 1, f"streamed rows (row {i})")
            too_short = cfg.min_sample_len is not None and out["length"] < cfg.min_sample_len
            if out["targets"] > 0 and not too_short and not (out["too_long"] and cfg.excess_length_strategy == "drop"):
                yield i, 0, {"input_ids": out["input_ids"], "labels": out["labels"]}

    def _rows(self, examples: list[dict], rng: np.random.Generator) -> list[list[dict]]:
        """One buffer of examples -> rows: packed bins (sample_packing) or one example per row."""
        cfg = self.cfg
        if not cfg.sample_packing:
            return [[e] for e in examples]
        # heavy: numpy loads only when this runs
        from trainer.batch.packing import pack

        lengths = np.array([len(e["input_ids"]) for e in examples])
        bins = pack(lengths, cfg.sequence_len, rng.permutation(len(examples)))
        rows = [[examples[int(i)] for i in bins[int(b)]] for b in rng.permutation(len(bins))]
        if not cfg.pretrain_multipack_attn and cfg.pretraining_dataset:
            # one document run: the packed texts attend to each other, as one concatenated sequence
            rows = [[{"input_ids": sum((e["input_ids"] for e in row), []),
                      "labels": sum((e["labels"] for e in row), [])}] for row in rows]
        return rows

    def __iter__(self) -> Iterator[list[list[dict]]]:
        cfg = self.cfg
        pending: list[list[dict]] = []
        for pass_index in itertools.count():
            buffer, seen = [], 0
            for part, example in enumerate(itertools.chain(self.examples(pass_index), [None])):
                if example is not None:
                    buffer.append(example)
                    seen += 1
                if len(buffer) == cfg.stream_buffer_size or (example is None and buffer):
                    pending += self._rows(buffer, np.random.default_rng([cfg.seed, pass_index, part]))
                    buffer = []
                    while len(pending) >= cfg.micro_batch_size:
                        yield pending[:cfg.micro_batch_size]
                        pending = pending[cfg.micro_batch_size:]
            if seen == 0:
                raise DataError(f"the stream has no rows to train on for rank {self.rank} of {self.world} "
                                "(too few rows, or every row was too long or had nothing to train on)")


class StreamSampler:
    """The loop's batch sampler for a stream: max_steps x accumulation micro-batches, resumable."""

    def __init__(self, cfg: Config, tokenizer, rank: int = 0, world_size: int = 1):
        self.stream = Stream(cfg, tokenizer, rank, world_size)
        self.total = cfg.max_steps * cfg.gradient_accumulation_steps
        self.seed, self.world_size = cfg.seed, world_size
        self.epoch = 0
        self.skip = 0  # micro-batches already trained (set when resuming)

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.stream), skip, self.total)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self, consumed: int) -> dict:
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed, "world_size": self.world_size,
                "stream": True}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("stream"):
            raise DataError("resume_from_checkpoint: the checkpoint was not trained on streamed data")
        self.epoch, self.skip = state["epoch"], state["consumed"]


class StreamRows(torch.utils.data.Dataset):
    """For DataLoader(batch_sampler=StreamSampler): the sampler yields the rows themselves."""

    def __getitem__(self, row: list[dict]) -> list[dict]:
        return row

    def __len__(self) -> int:
        raise TypeError("a stream has no length")


def check_stream(cfg: Config, tokenizer, world_size: int = 1) -> None:
    """Before the model loads, on every rank alike: every dataset opens and has a row, and there are at least
    as many rows as processes (row i goes to rank i mod world size), so no rank starts with nothing."""
    stream = Stream(cfg, tokenizer)
    total = 0
    for entry in stream.entries:
        rows = sum(1 for _ in itertools.islice(iter(_open(entry)), world_size))
        if rows == 0:
            raise DataError(f"dataset {entry.path} is empty")
        total += rows
    if total < world_size:
        raise DataError(f"the stream has {total} row(s) for {world_size} processes; each process needs its own rows")


def describe(cfg: Config) -> str:
    """validate's one line about streamed data."""
    what = ("pretraining_dataset: raw text in windows of sequence_len" if cfg.pretraining_dataset
            else "streaming: datasets tokenized while training")
    attn = "" if not (cfg.pretraining_dataset and cfg.sample_packing) else (
        ", packed documents isolated" if cfg.pretrain_multipack_attn else ", packed documents attend to each other")
    return (f"streamed ({what}; buffer {cfg.stream_buffer_size} rows, "
            f"{'shuffled' if cfg.shuffle_merged_datasets else 'in order'}{attn}; {cfg.max_steps} steps)")
