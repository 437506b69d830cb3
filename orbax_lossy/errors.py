"""Exception hierarchy of orbax_lossy.

Every error raised by the library derives from :class:`LossyError`, so callers can catch
one type. Messages name the leaf key path, the step and/or the file involved.
"""

from __future__ import annotations


class LossyError(Exception):
    """Base class of every orbax_lossy error."""


class InvalidArgumentError(LossyError, ValueError):
    """Bad user input detected before any work starts (wrong tree, dtype, option...)."""


class FormatError(LossyError):
    """Stored bytes do not form a valid orbax_lossy checkpoint."""


class ChecksumError(FormatError):
    """A checksum over stored bytes does not match: the data is corrupted."""


class TruncatedError(FormatError):
    """A file or stream ended before the size recorded for it."""


class UnsupportedVersionError(FormatError):
    """The checkpoint was written with a format version this library cannot read."""


class CodecError(LossyError):
    """A codec was given data it cannot encode or decode (unknown id, bad parameters)."""


class ChainError(LossyError):
    """A delta checkpoint cannot be restored because a step it depends on is unusable."""


class MissingStepError(ChainError):
    """A step that a delta checkpoint depends on is missing on disk."""

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class RootLockedError(LossyError):
    """Another writer holds the checkpoint root (see ``orbax_lossy.format.lock``)."""
