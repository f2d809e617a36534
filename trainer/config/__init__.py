"""The training config: Axolotl-style YAML keys, validated up front, without torch or transformers (the resolver's
`envtool train` reads configs with it too, through trainer.setup.start).

    load.py        reading: the key check, pydantic's value check, then the named choices (load_config)
    schema.py      Config: every section's keys, and the order the sections' rules run in
    keys.py        the key policy: matrices/axolotl_keys.toml's decision for every key of Axolotl's history
    migrate.py     retired and renamed Axolotl forms rewritten before the config is read, each with a note
    features.py    the one feature list: each feature's config keys (composed into Config and the resume table)
                   and its behaviour above the config, by name (trainer/features.py calls it)
    model.py       model, tokenizer, adapter (LoRA, QLoRA, LoftQ), quantized loading
    datasets.py    datasets, pretraining_dataset and streaming, chat templates by name
    training.py    batching, optimizer, schedule, cadence, checkpoints, evaluation, LISA, ReLoRA, early stopping
    hardware.py    precision, attention, kernels and plugins
    parallel.py    FSDP/DeepSpeed, the N-D mesh sizes, context parallelism, Ray Train
    logging.py     trackers and the Hub
    rl.py          preference methods, reward models, EAFT
    diffusion.py, ebft.py, grpo.py, qat.py, sparsity.py: each feature's block and its rules

Each section owns its keys and their rules; no section imports a feature's runtime module.
"""

from trainer.config.datasets import DatasetConfig, PretrainingDatasetConfig, PromptFormat, UserDefinedFormat
from trainer.config.hardware import Attention
from trainer.config.keys import LEGACY_DTYPE_KEYS
from trainer.config.load import check_local_paths, load_config, looks_local, missing_local_paths, parse_config
from trainer.config.schema import Config

__all__ = ["LEGACY_DTYPE_KEYS", "Attention", "Config", "DatasetConfig", "PretrainingDatasetConfig", "PromptFormat",
           "UserDefinedFormat", "check_local_paths", "load_config", "looks_local", "missing_local_paths",
           "parse_config"]
