"""One stream's wire format, shared by every transport: a header before its first message,
and a flag (OK or POISON) with each message.

A stream is one direction between two neighbours within a step (activations
forward, or gradients back), carrying one message per microbatch, each on its own
tag. A message is a boundary value (any pytree of tensors, `tree.Layout`) as one
byte payload. The header holds the stream's layout when every microbatch of the step
has the same shapes (the common case: the receiver then posts receives ahead and
reads each message as views of its buffer), or says the stream is *varying*: then
each message brings its own header (packed or unpadded sequences, at the cost of one
more small message per microbatch).

A failed stage keeps the communication pattern: it still makes every send its action
list calls for, sending poison instead of a value, so no neighbour waits forever; a
neighbour that receives poison fails the same way (`PeerFailed`).
"""

from __future__ import annotations

import torch

from raypipe.runtime.transport.tree import Layout

HEADER_BYTES = 2048  # flag, varying, layout length (int64s), then the pickled layout
OK, POISON = 0, -1
FLAG_BYTES = 8  # an int64 flag (OK or POISON) at the start of every fixed-layout message
_FIELDS = 3 * 8


class PeerFailed(RuntimeError):
    """A neighbouring stage failed earlier in this step (it sent poison instead of a value)."""


def header(layout: Layout | None, varying: bool = False) -> torch.Tensor:
    """A stream's (or, when varying, a message's) header: poison for `layout=None` unless
    `varying`, where the stream's header holds no layout.

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
    out[:_FIELDS].view(torch.int64).copy_(torch.tensor([flag, int(varying), len(encoded)]))
    if encoded:
        out[_FIELDS : _FIELDS + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return out


def read_header(data: torch.Tensor) -> tuple[int, bool, Layout | None]:
    """(flag, varying, layout or None) from a header's bytes."""
    flag, varying, length = data[:_FIELDS].view(torch.int64).tolist()
    layout = Layout.decode(data[_FIELDS : _FIELDS + length].numpy().tobytes()) if length else None
    return flag, bool(varying), layout


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
