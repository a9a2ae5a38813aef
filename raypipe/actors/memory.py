"""How much activation memory a microbatch keeps alive until its backward.

Autograd's saved-tensor hooks see every tensor the forward keeps for backward;
summing their sizes gives the bytes a stashed microbatch holds. A saved tensor counts
the bytes it spans in its storage, not the whole storage: a microbatch's input is a row
slice of the step's stacked batch, and a boundary received through shared memory is a
view of the transport's slot file; counting those storages whole charged every
microbatch with the whole batch or file (activation checkpointing then seemed to keep
more than it saved). Views that start at the same place are counted once. The stage actor tracks the peak number and bytes of
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
        self._seen: set[tuple[int, int]] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
        except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
            return t
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += span_bytes(t)
        return t


def span_bytes(t: torch.Tensor) -> int:
    """Bytes of storage from a tensor's first element to its last (its size when contiguous)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return min(t.untyped_storage().nbytes() - t.storage_offset() * t.element_size(), span * t.element_size())


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
