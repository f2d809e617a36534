"""The one exception family users can cause, each with its documented exit code.

2 = bad input (config, hardware request, missing file); 1 = failure while doing the work.
The CLI turns these into one stderr line; ``--debug`` shows the traceback.
"""


class TrainerError(Exception):
    exit_code = 1


class ConfigError(TrainerError):
    """The YAML config is invalid: unknown or unsupported key, bad value."""

    exit_code = 2


class HardwareError(TrainerError):
    """The config asks for something the GPU cannot do (e.g. bf16 on Turing)."""

    exit_code = 2


class DataError(TrainerError):
    """A dataset file is missing or a row does not fit its prompt format."""

    exit_code = 2


class TrainingError(TrainerError):
    """Training itself failed: NaN/inf loss, a collective timed out, a checkpoint cannot be read."""

    exit_code = 1
