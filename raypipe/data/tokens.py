"""nanoGPT-style token files: a flat array of uint16 token ids, read back by memory map."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def write_tokens(path: str | Path, ids) -> Path:
    """Writes token ids as little-endian uint16, atomically (temporary file, then rename)."""
    array = np.asarray(ids)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"token ids must lie in 0..65535 to fit uint16, got {array.min()}..{array.max()}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    array.astype("<u2").tofile(tmp)
    os.replace(tmp, path)
    return path


def read_tokens(path: str | Path) -> np.memmap:
    """Maps a token file read-only; nothing is loaded until it is indexed."""
    return np.memmap(path, dtype="<u2", mode="r")
