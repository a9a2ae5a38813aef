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
so they are on only when `TrainConfig.measure_activations` asks for them; without it, each
model chunk's first microbatch is measured once and every stashed microbatch counted at that
size (`peak_activation_bytes`, exact while the microbatches' shapes do not change).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch


class SavedBytes:
    """Bytes of the tensors autograd saves, each storage counted at most once; the storages in
    `weights` (the layers' parameters, which a linear saves to compute its input's gradient) are
    memory the stage holds anyway and are not counted."""

    def __init__(self, weights: frozenset[int] = frozenset()) -> None:
        self.weights = weights
        self.bytes: int | None = 0
        self._seen: set[tuple[int, int, int]] = set()  # (storage, offset, elements) of each tensor counted
        self._per_storage: dict[int, int] = {}  # storage -> bytes counted in it, at most its size

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.storage_offset(), t.numel())
        except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
            return t
        if key not in self._seen and storage._cdata not in self.weights:
            self._seen.add(key)
            before = self._per_storage.get(key[0], 0)
            after = min(storage.nbytes(), before + t.numel() * t.element_size())
            self._per_storage[key[0]] = after
            self.bytes += after - before
        return t


@contextlib.contextmanager
def count_saved_bytes(enabled: bool = True, weights: frozenset[int] = frozenset()) -> Iterator[SavedBytes]:
    """Counts the bytes of tensors saved for backward inside the block (`.bytes` is None when off),
    leaving out those in the storages `weights` (`weight_storages`)."""
    counter = SavedBytes(weights)
    if not enabled:
        counter.bytes = None
        yield counter
        return
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter


def max_rss_bytes(ru_maxrss: int, platform: str) -> int:
    """`getrusage().ru_maxrss` in bytes: macOS reports bytes, Linux (and the BSDs) KiB."""
    return int(ru_maxrss) if platform == "darwin" else int(ru_maxrss) * 1024


def memory_split(peak: int, model: Any, optim: Any, activations: int) -> dict[str, int]:
    """A stage's peak memory (`peak`) split into what it holds: its `StageModel`'s parameters (those
    it holds itself; frozen ones mapped from the model's files under `mapped_parameters`, counted
    as far as they are resident in the process now) and gradients, its `OptimizerState`'s state
    (fp32 masters included), the step's peak of stashed `activations`, and the rest, `other`: the
    runtime (Python, torch, Ray's worker; a CPU stage's resident set counts them) and transients.
    Bytes; `other` is never negative."""
    sharded = getattr(optim, "sharded", None)
    mapped = model.mapped_bytes() if sharded is None else 0
    known = {
        # ZeRO-3: the slices and the largest layer gathered; the step's gradients were whole
        "parameters": model.parameter_bytes() - mapped if sharded is None else sharded.resident_bytes(),
        "mapped_parameters": resident_bytes_of(model.mapped_files(), max_age=1.0) if mapped else 0,
        "gradients": model.gradient_bytes() if sharded is None else sharded.gradient_bytes(),
        "optimizer_state": optim.state_bytes(),
        "activations": activations,
    }
    return {"peak": peak, **known, "other": max(0, peak - sum(known.values()))}


_measured: dict[frozenset[str], tuple[float, int]] = {}  # files -> (when, bytes): this process's last count


def resident_bytes_of(files: set[str], max_age: float = 0.0) -> int:
    """Bytes of this process's mappings of `files` that are resident in it now (Linux's
    /proc/self/smaps; 0 where there is none): the pages of mapped weights it has touched. A
    count at most `max_age` seconds old is reused: reading smaps takes 5-10 ms in a stage actor,
    which a step of a few milliseconds should not pay each time."""
    key, now = frozenset(files), time.monotonic()
    if key in _measured and now - _measured[key][0] <= max_age:
        return _measured[key][1]
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return 0
    total, counting = 0, False
    for line in text.splitlines():
        if not line[:1].isupper():  # a mapping's first line: "start-end perms offset dev inode path"
            fields = line.split(maxsplit=5)
            counting = len(fields) == 6 and fields[5] in files
        elif counting and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    _measured[key] = (now, total)
    return total


def weight_storages(module: torch.nn.Module) -> frozenset[int]:
    """The storages of a module's parameters and buffers, which saved-tensor counting leaves out:
    a linear saves its weight for backward, but the weight is held anyway. Storages by identity,
    not address: ZeRO-3 frees and refills them, moving their memory."""
    return frozenset(t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers()))
