"""How much activation memory a microbatch keeps alive until its backward.

Autograd's saved-tensor hooks see every tensor the forward keeps for backward;
summing their sizes gives the bytes a stashed microbatch holds (tensors that share
storage are counted once). The stage actor tracks the peak number and bytes of
stashed microbatches per step: the quantity GPipe and 1F1B differ in. The hooks
run on every saved tensor (about 7 % of a GPT block's forward and backward on CPU),
so they are on only when `TrainConfig.measure_activations` asks for them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class SavedBytes:
    def __init__(self) -> None:
        self.bytes: int | None = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
            return t
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t


@contextlib.contextmanager
def count_saved_bytes(enabled: bool = True) -> Iterator[SavedBytes]:
    """Counts the bytes of tensors saved for backward inside the block (`.bytes` is None when off)."""
    counter = SavedBytes()
    if not enabled:
        counter.bytes = None
        yield counter
        return
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter


def max_rss_bytes(ru_maxrss: int, platform: str) -> int:
    """`getrusage().ru_maxrss` in bytes: macOS reports bytes, Linux (and the BSDs) KiB."""
    return int(ru_maxrss) if platform == "darwin" else int(ru_maxrss) * 1024
