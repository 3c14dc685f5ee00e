"""Decoupled DiLoCo: join any PyTorch (or NumPy) training loop to a run of independent learners.

``Session`` is one learner of a run around a user's own model, optimizer and loop;
``load_version`` / ``read_version`` rebuild any version of the global model from the run's logs;
``decoupled_diloco.safetensors`` reads the model files the project's tools write; and
``decoupled_diloco.tools`` holds the project's command-line tooling (the local cluster, reports,
chaos, benchmarks). The native runtime (``decoupled_diloco._core``) is loaded on first use, so
the tooling works without it. No torch is linked or imported by the package.
"""
from __future__ import annotations

from .errors import DilocoError, InvalidInputError, SessionClosedError, StorageError, UnavailableError
from .session import Session, load_version, read_version

__version__ = "0.1.0"

__all__ = ["Session", "load_version", "read_version", "DilocoError", "InvalidInputError", "UnavailableError",
           "StorageError", "SessionClosedError"]
