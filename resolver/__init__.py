"""envtool: resolve, lock, containerize and run LLM fine-tuning environments."""
__version__ = "0.1.0"
# The distribution name (pyproject.toml [project].name): what pip installs and importlib.metadata knows; the
# command is `envtool`. PyPI's `envtool` is someone else's project.
DISTRIBUTION = "envtool-llm"
