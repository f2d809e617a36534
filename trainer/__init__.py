"""envtool's bundled trainer: hardware-adaptive supervised fine-tuning (``python -m trainer``)."""

__version__ = "0.1.0"
