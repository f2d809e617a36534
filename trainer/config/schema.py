"""The training config: every section's keys in one pydantic model, and the order its rules run in.

Each section (a file of trainer/config/) owns its keys and their rules; a rule may read keys of other sections,
so the sections are only ever validated together, as this Config. A section's rules raise ValueError, which
pydantic reports with the failing keys; the first broken rule, in the order below, is the one reported.

The keys a feature declares on its entry of the feature list (trainer/config/features.py `config`) are one more
section, FeatureKeys, composed from that list: a feature adds its keys without an edit here.
"""

from __future__ import annotations

from pydantic import ConfigDict, PrivateAttr, create_model, model_validator

from trainer.config.datasets import DataKeys
from trainer.config.diffusion import DiffusionKeys
from trainer.config.ebft import EbftKeys
from trainer.config.features import keys as feature_keys
from trainer.config.grpo import TrlKeys
from trainer.config.hardware import HardwareKeys
from trainer.config.logging import LoggingKeys
from trainer.config.model import ModelKeys
from trainer.config.parallel import ParallelKeys
from trainer.config.qat import QatKeys
from trainer.config.rl import RlKeys
from trainer.config.sparsity import SparsityKeys
from trainer.config.speed import SpeedKeys
from trainer.config.training import TrainingKeys
from trainer.config.vision import VisionKeys

# the features' own keys (trainer/config/features.py), in the list's order
FeatureKeys = create_model("FeatureKeys", **{name: (key.annotation, key.field)
                                             for name, key in feature_keys().items()})


# (pydantic lists the fields of the last base first: a dump reads model, data, training, ... as written below, and
# the features' own keys last)
class Config(FeatureKeys, VisionKeys, SpeedKeys, SparsityKeys, QatKeys, EbftKeys, TrlKeys, DiffusionKeys, LoggingKeys,
             RlKeys, ParallelKeys, HardwareKeys, TrainingKeys, DataKeys, ModelKeys):
    model_config = ConfigDict(extra="forbid")

    # set by load_config: user modules (ebft and trl.reward_funcs transforms, `module.function` dataset types)
    # import from the config's directory
    _config_dir: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        self._check_streaming()  # datasets
        self._check_pose()  # datasets (PoSE)
        self._check_train_on_eot()  # datasets
        self._check_dataset_shard()  # datasets
        self._check_lr_groups()  # training (LoRA+, embedding and module learning rates)
        self._check_preference()  # rl (dataset types follow what is trained)
        self._check_training()  # LISA, early stopping, ReLoRA, evaluation keys
        self._check_launch()  # parallel (Ray Train)
        self._check_model()  # reinit_weights, LoftQ, model_quantization_config
        self._check_schedule()  # warmup, min_sample_len
        self._check_precision()  # hardware
        self._check_cadence()  # eval/save steps
        self._check_adapter()  # model (quantized loading, LoRA)
        self._check_experts_implementation()  # model
        self._check_attention()  # hardware
        self._check_speed()  # activation offloading, selective checkpointing, tiled MLP, torch.compile
        return self
