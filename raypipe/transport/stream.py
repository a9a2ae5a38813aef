"""One stream's wire format, shared by every transport: a header before its first message,
and a flag (OK or POISON) with each message.

A stream is one direction between two neighbours within a step (activations
forward, or gradients back), carrying one message per microbatch, each on its own
tag. A message is a boundary value (any pytree of tensors, `tree.Layout`) as one
byte payload. The header holds the stream's layout when every microbatch of the step
has the same shapes (the common case: the receiver then posts receives ahead and
reads each message as views of its buffer), or says the stream is *varying*: then
each message brings its own header (packed or unpadded sequences, sequences cut into
unequal chunks): over gloo one more small message per microbatch, in shared memory a
header before its payload in the same file (`shm_files`).

A failed stage keeps the communication pattern: it still makes every send its action
list calls for, sending poison instead of a value, so no neighbour waits forever; a
neighbour that receives poison fails the same way (`PeerFailed`).
"""

from __future__ import annotations

from typing import Any

import torch

from raypipe.transport.tree import Boundary, Layout, flatten, pack_into

HEADER_BYTES = 2048  # flag, varying, layout length, payload bound (int64s), then the pickled layout
OK, POISON = 0, -1
FLAG_BYTES = 8  # an int64 flag (OK or POISON) at the start of every fixed-layout message
_FIELDS = 4 * 8


class PeerFailed(RuntimeError):
    """A neighbouring stage failed earlier in this step (it sent poison instead of a value)."""


def header(layout: Layout | None, varying: bool = False, bound: int = 0) -> torch.Tensor:
    """A stream's (or, when varying, a message's) header: poison for `layout=None` unless
    `varying`, where the stream's header holds no layout; a varying stream's header may say how
    many payload bytes the receiver is to post ahead for each message (`bound`, `read_bound`).

    Raises:
        ValueError: the layout does not fit (a tree of hundreds of leaves); checked before sending.
    """
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    encoded = b"" if layout is None else layout.encode()
    if len(encoded) > HEADER_BYTES - _FIELDS:
        raise ValueError(
            f"a boundary value with {len(layout.leaves)} leaves needs a {len(encoded)}-byte description, "
            f"more than a stream header holds ({HEADER_BYTES - _FIELDS}): hand fewer tensors between stages "
            f"(stack them into one)."
        )
    flag = POISON if layout is None and not varying else OK
    out[:_FIELDS].view(torch.int64).copy_(torch.tensor([flag, int(varying), len(encoded), bound]))
    if encoded:
        out[_FIELDS : _FIELDS + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return out


def read_header(data: torch.Tensor) -> tuple[int, bool, Layout | None]:
    """(flag, varying, layout or None) from a header's bytes."""
    flag, varying, length, _ = data[:_FIELDS].view(torch.int64).tolist()
    layout = Layout.decode(data[_FIELDS : _FIELDS + length].numpy().tobytes()) if length else None
    return flag, bool(varying), layout


def read_bound(data: torch.Tensor) -> int:
    """The payload bytes a varying stream's header asks the receiver to post ahead per message (0: none)."""
    return int(data[:_FIELDS].view(torch.int64)[3])


def check_like(stream: Layout, message: Layout) -> None:
    """Refuses a message whose tree, dtypes or shapes differ from its stream's first one."""
    if message != stream:
        raise ValueError(
            f"a boundary value {_describe(message)} differs from this step's first microbatch "
            f"({_describe(stream)}); microbatches of one step had equal shapes, so the stream was "
            f"fixed: a stage whose output shapes vary between microbatches of equal-shaped inputs "
            f"needs engine='refs'."
        )


def _describe(layout: Layout) -> str:
    return "[" + ", ".join("None" if m is None else f"{tuple(m[1])} {m[0]}" for m in layout.leaves) + "]"


class Outbox:
    """The sending end of one stream in this format, for a transport that moves one byte buffer
    per message: a header before the stream's first message, then flagged messages; a varying
    stream sends each message's header, then its payload. A transport says where buffers live
    (`_buffer`, `_header`) and how they go (`_post`)."""

    def __init__(self, varying: bool = False) -> None:
        self.varying = varying
        self.layout: Layout | None = None  # a fixed stream's layout, from its first message
        self.started = False  # the stream's header went out (poison before it goes as poison headers)
        self.handles: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it sends), until `wait`

    def send(self, value: Boundary, tag: int = 0) -> None:
        """Starts sending `value` (a pytree of tensors on any device), as the message on `tag`.

        Raises:
            ValueError: `value` cannot be sent in this stream (nothing went out).
        """
        layout, leaves = flatten(value)
        if not self.started:
            self.varying = self.varying or not self._fits(layout)
            self._post(self._header(self._stream_header(layout)), tag)
            self.layout, self.started = layout, True
        elif not self.varying:
            check_like(self.layout, layout)
        if self.varying:
            self._post(self._header(header(layout)), tag)
            self._payload(layout, leaves, tag)
            return
        self._post(self._packed(layout, leaves, OK), tag)

    def _stream_header(self, layout: Layout) -> torch.Tensor:
        """The stream's header, sent before its first message (`layout`'s)."""
        return header(None, varying=True) if self.varying else header(layout)

    def _payload(self, layout: Layout, leaves: list[torch.Tensor | None], tag: int) -> None:
        """A varying stream's message after its header: its payload, on its own tag."""
        if layout.nbytes:
            self._post(self._packed(layout, leaves, None), tag, payload=1)

    def poison(self, tag: int = 0) -> None:
        """Tells the receiver this stage failed, in place of the message on `tag`."""
        if not self.started or self.varying:
            self._post(self._header(header(None)), tag)
            return
        message = self._buffer(FLAG_BYTES + self.layout.nbytes, [])
        message[:FLAG_BYTES].view(torch.int64).fill_(POISON)
        self._post(message, tag)

    def wait(self) -> None:
        """Waits for (on a GPU transport: orders later work after) every send of the step."""
        for work, _ in self.handles:
            work.wait()
        self.handles.clear()

    def _packed(self, layout: Layout, leaves: list[torch.Tensor | None], flag: int | None) -> torch.Tensor:
        """A message holding `leaves`: the flag, then the payload (the payload alone for None)."""
        at = 0 if flag is None else FLAG_BYTES
        buffer = self._buffer(at + layout.nbytes, leaves)
        if flag is not None:
            buffer[:FLAG_BYTES].view(torch.int64).fill_(flag)
        pinned = buffer.is_pinned()  # a GPU value bound for host memory: copied out without waiting per leaf
        pack_into(buffer[at:], layout, leaves, non_blocking=pinned)
        if pinned:  # a transport may read the buffer at once: the copies out of the GPU must be done
            torch.cuda.current_stream().synchronize()
        return buffer

    def _fits(self, layout: Layout) -> bool:
        """Whether a stream of `layout` may go fixed (else it goes varying, each message described)."""
        return True

    def _buffer(self, nbytes: int, leaves: list[torch.Tensor | None]) -> torch.Tensor:
        """An uninitialised buffer of `nbytes` for a message of `leaves`."""
        raise NotImplementedError

    def _header(self, data: torch.Tensor) -> torch.Tensor:
        """A header's bytes (made in host memory) where this transport sends from."""
        return data

    def _post(self, buffer: torch.Tensor, tag: int, payload: int = 0) -> None:
        """Starts sending `buffer`, keeping it in `handles` until `wait`; `payload` 1: a varying
        message's payload (on a tag of its own), 2: the part of it beyond the receiver's bound."""
        raise NotImplementedError
