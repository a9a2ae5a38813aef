"""Boundary values as one byte message: any pytree of tensors (a tensor, or tuples, lists
and dicts of them, with `None` leaves) flattened into a `Layout` and a payload.

What one stage hands the next may be hidden states alone, or a dict with an attention
mask and position ids beside them. Every transport moves one byte buffer per message:
the `Layout` (the tree's structure and each leaf's dtype and shape) describes how the
leaves lie in it, each at an offset aligned to 64 bytes so a view of any dtype is
aligned. A stream sends its layout once, in its header, while every microbatch shares
it; when shapes differ between microbatches (packed or unpadded sequences) each
message carries its own (`stream`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from raypipe.core.layers import Boundary

ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """A boundary tree's structure and its leaves' dtypes and shapes (None for a None leaf)."""

    spec: pytree.TreeSpec
    leaves: tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...]

    @property
    def offsets(self) -> list[int]:
        """Each leaf's byte offset in the payload (None leaves take no bytes)."""
        offsets, at = [], 0
        for leaf in self.leaves:
            offsets.append(at)
            if leaf is not None:
                at += _aligned(_nbytes(leaf))
        return offsets

    @property
    def nbytes(self) -> int:
        """The payload's size."""
        return sum(_aligned(_nbytes(leaf)) for leaf in self.leaves if leaf is not None)

    def encode(self) -> bytes:
        """The layout as JSON bytes: the tree's structure as torch's JSON, each leaf as its dtype's
        name and shape. Nothing that decodes it can run code (a pickle could: anyone who reaches a
        link's port could then run code in the actor, not only send it tensors).

        Raises:
            ValueError: a container torch's JSON cannot describe (a user's namedtuple); checked
                before sending.
        """
        try:
            spec = pytree.treespec_dumps(self.spec)
        except Exception as error:  # noqa: BLE001 - types torch's JSON does not know
            raise ValueError(
                f"a boundary value's structure ({self.spec}) cannot be described without pickle "
                f"({type(error).__name__}: {error}): hand tuples, lists or dicts of tensors between stages."
            ) from None
        leaves = [
            None if leaf is None else [str(leaf[0]).removeprefix("torch."), list(leaf[1])] for leaf in self.leaves
        ]
        return json.dumps({"spec": spec, "leaves": leaves}, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> Layout:
        """The layout `encode` wrote. Raises ValueError for anything else (a dtype torch lacks)."""
        message = json.loads(data)
        leaves = tuple(
            None if leaf is None else (_dtype(leaf[0]), tuple(int(n) for n in leaf[1])) for leaf in message["leaves"]
        )
        return Layout(pytree.treespec_loads(message["spec"]), leaves)

    def views(self, payload: torch.Tensor) -> list[torch.Tensor | None]:
        """The leaves as views of `payload` (uint8 bytes laid out by this layout), no copy."""
        out: list[torch.Tensor | None] = []
        for leaf, at in zip(self.leaves, self.offsets):
            if leaf is None:
                out.append(None)
            else:
                dtype, shape = leaf
                out.append(payload[at : at + _nbytes(leaf)].view(dtype).view(shape))
        return out

    def tree(self, leaves: list[torch.Tensor | None]) -> Boundary:
        return pytree.tree_unflatten(leaves, self.spec)

    def describes(self, leaves: list[torch.Tensor | None]) -> bool:
        """Whether `leaves` have exactly this layout's dtypes and shapes."""
        return len(leaves) == len(self.leaves) and all(
            (t is None and m is None)
            or (t is not None and m is not None and t.dtype == m[0] and tuple(t.shape) == m[1])
            for t, m in zip(leaves, self.leaves)
        )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a boundary header names dtype {name!r}, which torch does not have")
    return dtype


def flatten(value: Boundary) -> tuple[Layout, list[torch.Tensor | None]]:
    """A boundary value's layout and its leaves.

    Raises:
        ValueError: a leaf is neither a tensor nor None (checked before anything is sent).
    """
    leaves, spec = pytree.tree_flatten(value)
    for leaf in leaves:
        if leaf is not None and not torch.is_tensor(leaf):
            raise ValueError(
                f"a stage returned a {type(leaf).__name__} ({leaf!r:.40}) inside its output; boundary values "
                f"may hold only tensors and None (in tuples, lists and dicts): make it a tensor."
            )
    return Layout(spec, tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in leaves)), leaves


def pack_into(
    payload: torch.Tensor, layout: Layout, leaves: list[torch.Tensor | None], non_blocking: bool = False
) -> None:
    """Copies `leaves` (on any device) into `payload` at `layout`'s offsets; `non_blocking`: from
    a GPU into pinned memory, the copies are only queued (the caller waits before reading)."""
    for view, leaf in zip(layout.views(payload), leaves):
        if view is not None:
            view.copy_(leaf, non_blocking=non_blocking)


def leaves(value: Boundary) -> list[torch.Tensor | None]:
    """A boundary value's leaves in flattening order (a gradient tree's align with its value's)."""
    return pytree.tree_leaves(value)


def tensors(value: Boundary) -> list[torch.Tensor]:
    """The tensor leaves of a boundary value, in flattening order."""
    return [t for t in pytree.tree_leaves(value) if torch.is_tensor(t)]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Boundary) -> Boundary:
    """`value` with `fn` applied to every tensor leaf (other leaves unchanged)."""
    return pytree.tree_map(lambda t: fn(t) if torch.is_tensor(t) else t, value)


def _nbytes(leaf: tuple[torch.dtype, tuple[int, ...]]) -> int:
    dtype, shape = leaf
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def to_host(value: Boundary) -> Boundary:
    """Boundary values cross to other stages (maybe another kind of device) through host
    memory; anything but a device tensor (a loss as a float, None) passes unchanged."""
    return map_tensors(lambda t: t.cpu() if t.device.type != "cpu" else t, value)
