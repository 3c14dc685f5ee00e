"""The package's errors. Every message names the problem and, where there is one, the way out."""
from __future__ import annotations

__all__ = ["DilocoError", "InvalidInputError", "UnavailableError", "StorageError", "SessionClosedError"]


class DilocoError(RuntimeError):
    """Base of every error the package raises."""


class InvalidInputError(DilocoError, ValueError):
    """The caller's input is wrong: a config, a tensor (name, shape, dtype, layout), a model that
    differs from the run's, a learner id another live process holds, corrupt saved state."""


class UnavailableError(DilocoError, ConnectionError):
    """Something the session needs did not answer in time: the Kafka broker, or the run's mergers
    (no version 0 within the genesis timeout)."""


class StorageError(DilocoError, OSError):
    """The operating system refused a file or socket (a metrics file, a model file)."""


class SessionClosedError(DilocoError):
    """A call on a session after close()."""
