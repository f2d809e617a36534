"""envtool: resolve, lock, containerize and run LLM fine-tuning environments."""
__version__ = "0.1.0"
