"""Boundary tensors sent straight from one stage actor to the next, over the trainer's world.

The "p2p" engine gives every actor its whole action list for a step in one call;
activations and gradients then go actor to actor with torch.distributed point to
point (gloo, through host memory), never through the driver or the object store.

A stream is one direction between two neighbours within a step (activations
forward, or gradients back), carrying one message per microbatch, each on its own
tag. Its first message starts with a header (dtype and shape); every later message
of the step has that shape (microbatches are equal splits), so the receiver posts
those receives ahead (`Inbox`) and a message lands as soon as it is sent, with no
rendezvous: gloo moves a message only once its receive is posted. Each later
message is a one-word flag and then the payload.

A failed stage keeps the communication pattern: it still makes every receive and
every send its action list calls for, sending poison (a poison header, or a poison
flag with a dummy payload) instead of a tensor, so no neighbour waits forever; a
neighbour that receives poison fails the same way.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch
import torch.distributed as dist

HEADER = 8  # int64 slots: dtype code, ndim, up to 6 dimensions
OK, POISON = 0, -1
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
CODES = {dtype: i for i, dtype in enumerate(DTYPES)}
LOOKAHEAD = 2  # receives posted ahead per stream
_FLAGS = {OK: torch.tensor([OK], dtype=torch.int64), POISON: torch.tensor([POISON], dtype=torch.int64)}  # only read


class PeerFailed(RuntimeError):
    """A neighbouring stage failed earlier in this step (it sent poison instead of a tensor)."""


class Outbox:
    """The sending end of one stream: a header before the first message, a flag before the others."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.like: torch.Tensor | None = None  # the first message's shape and dtype
        self.handles: list[Any] = []

    def send(self, t: torch.Tensor | None, tag: int) -> None:
        """Starts sending `t` (a host tensor; None sends poison)."""
        if self.like is None:
            if t is None:
                self._post(_header(None), tag)
                return
            if t.dim() > HEADER - 2:
                raise ValueError(f"a boundary tensor has {t.dim()} dimensions; at most {HEADER - 2} can be sent")
            self.like = torch.empty_like(t, device="cpu")
            self._post(_header(t), tag)
            self._post(t.contiguous(), tag)
            return
        if t is not None and (t.shape != self.like.shape or t.dtype != self.like.dtype):
            raise ValueError(
                f"boundary tensor {tuple(t.shape)} {t.dtype} differs from this step's first microbatch "
                f"({tuple(self.like.shape)} {self.like.dtype}); engine='p2p' needs equal shapes within a step, "
                f"engine='refs' does not."
            )
        self._post(_FLAGS[OK if t is not None else POISON], tag)
        self._post(t.contiguous() if t is not None else self.like, tag)

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles.clear()

    def _post(self, t: torch.Tensor, tag: int) -> None:
        self.handles.append(dist.isend(t, self.dst, tag=tag))


class Inbox:
    """The receiving end of one stream, taking its messages in `tags` order."""

    def __init__(self, src: int, tags: Sequence[int]) -> None:
        self.src = src
        self.tags = deque(tags)
        self.like: torch.Tensor | None = None
        self.posted: deque[tuple[torch.Tensor, Any, torch.Tensor, Any]] = deque()
        self.header = torch.empty(HEADER, dtype=torch.int64)
        self.header_work = dist.irecv(self.header, src, tag=self.tags[0]) if self.tags else None

    def take(self) -> torch.Tensor:
        """The next message's tensor.

        Raises:
            PeerFailed: the sender failed and sent poison.
        """
        if self.like is None:
            tag = self.tags.popleft()
            if self.header_work is None:  # the first header was poison: so are the following ones
                self.header_work = dist.irecv(self.header, self.src, tag=tag)
            self.header_work.wait()
            self.header_work = None
            header = self.header
            code, ndim = int(header[0]), int(header[1])
            if code == POISON:
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            t = torch.empty([int(v) for v in header[2 : 2 + ndim]], dtype=DTYPES[code])
            dist.recv(t, self.src, tag=tag)
            self.like = t
            self._post_ahead()
            return t
        flag, flag_work, t, work = self.posted.popleft()
        flag_work.wait()
        work.wait()
        self._post_ahead()
        if int(flag[0]) == POISON:
            raise PeerFailed(f"world rank {self.src} failed earlier in this step")
        return t

    def _post_ahead(self) -> None:
        while self.tags and len(self.posted) < LOOKAHEAD:
            tag = self.tags.popleft()
            flag = torch.empty(1, dtype=torch.int64)
            flag_work = dist.irecv(flag, self.src, tag=tag)
            t = torch.empty_like(self.like)
            self.posted.append((flag, flag_work, t, dist.irecv(t, self.src, tag=tag)))


def _header(t: torch.Tensor | None) -> torch.Tensor:
    if t is None:
        return torch.tensor([POISON] + [0] * (HEADER - 1), dtype=torch.int64)
    return torch.tensor([CODES[t.dtype], t.dim(), *t.shape] + [0] * (HEADER - 2 - t.dim()), dtype=torch.int64)
