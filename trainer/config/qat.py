"""The `qat:` block (Axolotl's QATConfig) and fp8's keys, with their rules; QAT itself (torchao's fake
quantization, its floors on each GPU) is trainer/model/qat.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.errors import ConfigError

QatDtype = Literal["int4", "int8", "float8_e4m3fn", "nvfp4", "mxfp4"]
ALIASES = {"fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}  # Axolotl's validate_ao_dtype


class QatConfig(BaseModel):
    """Axolotl's QATConfig (src/axolotl/utils/schemas/quantization.py): the same keys and defaults."""

    model_config = ConfigDict(extra="forbid")

    weight_dtype: QatDtype = "int8"
    activation_dtype: QatDtype | None = None
    quantize_embedding: bool = False
    group_size: int | None = Field(32, ge=1)
    fake_quant_after_n_steps: int | None = Field(None, ge=0)

    @field_validator("weight_dtype", "activation_dtype", mode="before")
    @classmethod
    def _alias(cls, value):
        return ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _supported_pair(self) -> QatConfig:
        w, a = self.weight_dtype, self.activation_dtype
        if w == "nvfp4":
            if self.group_size not in (None, 16):
                raise ValueError("qat.group_size: NVFP4 quantizes blocks of 16; set group_size: 16")
            if a != "nvfp4":
                raise ValueError("qat: weight_dtype nvfp4 needs activation_dtype: nvfp4 (torchao has no weight-only "
                                 "NVFP4 QAT)")
        elif w == "mxfp4":
            if self.group_size not in (None, 32):
                raise ValueError("qat.group_size: MXFP4 quantizes blocks of 32; set group_size: 32")
        elif (a, w) not in (("int8", "int4"), (None, "int4"), ("float8_e4m3fn", "float8_e4m3fn"),
                            ("float8_e4m3fn", "int4")):
            raise ValueError(f"qat: activation_dtype {a} with weight_dtype {w} has no torchao QAT scheme (as in "
                             "Axolotl); use int8/int4, none/int4, float8/float8, float8/int4, mxfp4 or nvfp4")
        if self.fake_quant_after_n_steps is not None and w in ("nvfp4", "mxfp4"):
            raise ValueError(f"qat.fake_quant_after_n_steps: torchao's {w.upper()} fake-quantized linears cannot "
                             "switch fake quantization off (Axolotl's QATCallback skips them too); remove it")
        if self.quantize_embedding and w in ("nvfp4", "mxfp4"):
            raise ValueError(f"qat.quantize_embedding: torchao has no {w.upper()} fake-quantized embedding")
        return self

    @property
    def feature(self) -> str:
        """The packages.toml [[feature]] row whose floor applies."""
        return "torchao_qat_nvfp4" if self.weight_dtype == "nvfp4" else "torchao_qat_fake_quant"

    def describe(self) -> str:
        act = self.activation_dtype or "none"
        group = f", group_size {self.group_size}" if self.weight_dtype == "int4" else ""
        return f"activations {act}, weights {self.weight_dtype}{group}"


def check_config(cfg) -> None:
    """What cannot go with qat (Axolotl refuses the same, or it is not built here)."""
    if cfg.qat is None:
        return
    problems = []
    for key in ("load_in_4bit", "load_in_8bit"):
        if getattr(cfg, key):
            problems.append(f"qat and {key} cannot be used together (as in Axolotl)")
    if cfg.adapter:
        problems.append("qat with adapter: QAT here trains the full weights; LoRA over fake-quantized layers is not "
                        "supported (remove adapter, or qat)")
    if cfg.deepspeed:
        problems.append("qat with deepspeed is not supported (use FSDP or DDP)")
    if cfg.rl:
        problems.append(f"qat with rl: {cfg.rl} is not supported (QAT here is SFT: whether the reference log-probs "
                        "should see fake quantization is not settled)")
    if problems:
        raise ConfigError("; ".join(problems))


class QatKeys(BaseModel):
    qat: QatConfig | None = None  # torchao fake quantization while training (Axolotl's QATConfig)
    fp8: bool = False  # torchao float8 training: refused with its hardware floor (trainer.model.qat.hardware_notes)
    fp8_enable_fsdp_float8_all_gather: bool = False
