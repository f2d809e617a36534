"""The one exception family for errors a user can cause, each with its documented exit code.

The CLI turns any of these into a single stderr line and `exit_code`; tracebacks only with --debug.
"""

from __future__ import annotations


class EnvtoolError(Exception):
    """Base class; exit code 1 = failure while doing the work."""

    exit_code = 1


class BadInput(EnvtoolError):
    """Exit code 2: the user asked for something malformed or unknown (a GPU, a version, a file)."""

    exit_code = 2


class Unsatisfiable(EnvtoolError):
    """Exit code 2: well-formed pins that no combination in the matrix satisfies."""

    exit_code = 2


class MatrixError(EnvtoolError):
    """Exit code 1: a matrix file is malformed (names the file and the row)."""

    exit_code = 1
