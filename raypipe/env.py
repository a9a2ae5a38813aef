"""Every environment variable raypipe reads, in one place, with its default."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """RAYPIPE_CACHE_DIR: where built corpora are cached (default ~/.cache/raypipe)."""
    return Path(os.environ.get("RAYPIPE_CACHE_DIR", Path.home() / ".cache" / "raypipe"))


def ray_address() -> str | None:
    """RAY_ADDRESS: the cluster to join; unset means start an embedded local Ray."""
    return os.environ.get("RAY_ADDRESS") or None

