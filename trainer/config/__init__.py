"""The training config: Axolotl-style YAML keys, validated up front, without torch or transformers (the resolver's
`envtool train` reads configs with it too, through trainer.setup.start).

    load.py        reading: the key check, pydantic's value check, then the named choices (load_config)
    schema.py      Config: every section's keys, and the order the sections' rules run in
    keys.py        Axolotl keys that are inert, off here, or unsupported; legacy spellings
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

from trainer.config.datasets import DatasetConfig, PretrainingDatasetConfig, PromptFormat
from trainer.config.hardware import Attention
from trainer.config.keys import INERT_KEYS, LEGACY_DTYPE_KEYS, PERFORMANCE_KEYS, UNSUPPORTED_KEYS
from trainer.config.load import check_local_paths, load_config, looks_local, parse_config
from trainer.config.schema import Config

__all__ = ["INERT_KEYS", "LEGACY_DTYPE_KEYS", "PERFORMANCE_KEYS", "UNSUPPORTED_KEYS", "Attention", "Config",
           "DatasetConfig", "PretrainingDatasetConfig", "PromptFormat", "check_local_paths", "load_config",
           "looks_local", "parse_config"]
