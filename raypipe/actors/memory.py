"""How much activation memory a microbatch keeps alive until its backward.

Autograd's saved-tensor hooks see every tensor the forward keeps for backward;
summing their sizes gives the bytes a stashed microbatch holds. A saved tensor counts
its own elements, not its whole storage: a microbatch's input is a row slice of the
step's stacked batch, and a boundary received through shared memory is a view of the
transport's slot file; counting those storages whole charged every microbatch with the
whole batch or file (activation checkpointing then seemed to keep more than it saved).
Several views of one storage (q, k and v split from one projection, a transpose) add
up to at most the storage's size, and a view seen twice counts once. The stage actor tracks the peak number and bytes of
stashed microbatches per step: the quantity GPipe and 1F1B differ in. The hooks
run on every saved tensor (about 7 % of a GPT block's forward and backward on CPU),
so they are on only when `TrainConfig.measure_activations` asks for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SavedBytes:
    def __init__(self) -> None:
        self.bytes: int | None = 0
        self._seen: set[tuple[int, int, int]] = set()  # (storage, offset, elements) of each tensor counted
        self._per_storage: dict[int, int] = {}  # storage -> bytes counted in it, at most its size

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.storage_offset(), t.numel())
        except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
            return t
        if key not in self._seen:
            self._seen.add(key)
            before = self._per_storage.get(key[0], 0)
            after = min(storage.nbytes(), before + t.numel() * t.element_size())
            self._per_storage[key[0]] = after
            self.bytes += after - before
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
