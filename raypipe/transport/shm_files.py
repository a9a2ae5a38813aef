"""The data files of `transport.shm`: making one (its pages reserved), mapping a neighbour's, and
where a stream's messages lie in it.

A fixed stream's file (every message of the step one layout) holds that layout once, in its
header, then a slot per message for each half. A varying stream's file (shapes differ between
the step's microbatches: microbatches of any sizes, sequences cut into unequal chunks) says
so in its header; each half holds the step's messages one after another, each its own header
(`stream.header`: the message's layout) and then its payload, at an offset its record names.
"""

from __future__ import annotations

import mmap
import os

import torch

from raypipe.transport.stream import HEADER_BYTES, read_header
from raypipe.transport.tree import Layout, pack_into

SLOT_ALIGN = 64
FILE_HEADER = HEADER_BYTES  # bytes before the first slot: the stream's `stream.header` (its layout)


def create(path: str, size: int) -> torch.Tensor | None:
    """A new file of `size` bytes at `path`, its pages reserved and mapped: its bytes (the tensor
    keeps the mapping alive); None where it cannot be made (the name taken, /dev/shm full)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        try:  # reserve the pages now: a full tmpfs fails here, not with SIGBUS on a later write
            os.posix_fallocate(fd, 0, size)
        except AttributeError:  # macOS has no posix_fallocate
            os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def open_mapped(path: str) -> tuple[Layout | None, torch.Tensor]:
    """A neighbour's file, mapped and unlinked (its maker announced it; nobody opens it again):
    its stream's layout (None: a varying stream's file) and its bytes."""
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    os.unlink(path)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    return read_header(data[:FILE_HEADER])[2], data


def slot_views(data: torch.Tensor, layout: Layout) -> list[list[torch.Tensor | None]]:
    """Every slot of a fixed stream's file (`data`, all its bytes) as views of its leaves, made
    once per file: slicing and viewing costs a few torch calls, which ran at 30-100 us per hop on
    a vCPU just back from a pipeline bubble."""
    step = slot_bytes(layout.nbytes)
    starts = range(FILE_HEADER, len(data) - layout.nbytes + 1, step)
    return [layout.views(data[start : start + layout.nbytes]) for start in starts]


def slot_bytes(nbytes: int) -> int:
    """A slot's size for a message of `nbytes`: rounded up to SLOT_ALIGN, so every dtype's view is aligned."""
    return max(SLOT_ALIGN, -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)


def message_bytes(layout: Layout) -> int:
    """What one message of a varying stream takes in its file: its header and its payload's slot."""
    return HEADER_BYTES + slot_bytes(layout.nbytes)


def write_message(data: torch.Tensor, offset: int, layout: Layout, described: torch.Tensor, leaves: list) -> None:
    """A varying stream's message at `offset` of its file: its header (`described`, `layout`'s
    `stream.header`), then its leaves where `layout` puts them."""
    data[offset : offset + HEADER_BYTES].copy_(described)
    start = offset + HEADER_BYTES
    pack_into(data[start : start + layout.nbytes], layout, leaves)


def read_message(data: torch.Tensor, offset: int) -> tuple[Layout, list[torch.Tensor | None]]:
    """The message a varying stream's file holds at `offset`: its layout and its leaves, as views."""
    layout = read_header(data[offset : offset + HEADER_BYTES])[2]
    start = offset + HEADER_BYTES
    return layout, layout.views(data[start : start + layout.nbytes])
