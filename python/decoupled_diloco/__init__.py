"""Decoupled DiLoCo: join any PyTorch training loop to a run of independent learners.

The native runtime (``decoupled_diloco._core``) is loaded on first use, so the pure-Python
tooling of this package (``decoupled_diloco.tools``) works without it.
"""
from __future__ import annotations

__version__ = "0.1.0"
