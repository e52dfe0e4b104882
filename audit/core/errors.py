"""Errors that reach the user: each message names what went wrong and how to fix it.

The CLI prints a :class:`GiaError` as one line (no traceback); Python users can catch the
specific subclasses.
"""
from audit.core.reasons import Reason


class GiaError(Exception):
    """Base class of every error the toolkit raises on purpose."""


class ConfigError(GiaError, ValueError):
    """A bad name, parameter or option (unknown defense, ratio out of range, ...)."""


class DataError(GiaError):
    """A data set that is missing, truncated or in the wrong format."""


class DefenseError(GiaError):
    """A defense that raised, returned the wrong number / shapes of tensors, or NaN."""


class NonFiniteUpdate(DefenseError):
    """A defense's shared update holds NaN/inf (training diverged, or the defense is broken)."""


class StoreError(GiaError, OSError):
    """A file of the output folder that cannot be read or written (truncated, corrupt, a
    read-only folder, a full disk); the message names the file and the fix. It is an OSError
    too, for callers that catch those."""


class NotApplicable(GiaError):
    """An attack that cannot run on this observation (e.g. analytic inversion, no FC bias).
    ``reason``: a :class:`~audit.core.reasons.Reason` (a code and its values, which the report
    words); a sentence given instead is kept as one."""

    def __init__(self, reason):
        self.reason = Reason.of(reason)
        super().__init__(self.reason)  # str(err): the code and its values; pickles whole
