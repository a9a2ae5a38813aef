"""Compressed boundary values (issue 36, opt-in): activations and, separately, their gradients sent
between stages in 8 bits per element with a float32 scale, a quarter of fp32's bytes, for links
too slow for even bf16 boundaries (`TrainConfig.compress_activations`, `compress_gradients`).

Codecs, each for floating tensors of two dimensions or more (scalars and vectors, a loss or
routing counts, stay exact):
- "fp8": float8 e4m3 with one scale per tensor (its largest magnitude maps to e4m3's 448);
- "fp8-row": float8 e4m3 with one scale per row (the last dimension's vector: a token's hidden
  state), so one outlier token does not flatten every other token's values;
- "int8": 8-bit integers with one scale per row, rounded to nearest.
The receiver restores float values of the sender's dtype. Every transport carries a
`Compressed` as the two tensors it holds (a registered pytree node: the byte-message layout of
`transport.tree` and Ray's pickling both see `q` and `scale`).

Where it changes the numbers: every value crossing a boundary is rounded to 8 bits (e4m3 keeps 3
mantissa bits: about 6 % relative error per element; int8 per row about 0.4 % of the row's
largest value), so the run is no longer exactly the one-process run. What that costs in loss is
measured in `benchmarks/boundary_dtype.py` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.utils._pytree as pytree

Codec = Literal["none", "fp8", "fp8-row", "int8"]
CODECS = get_args(Codec)
FP8 = torch.float8_e4m3fn
_LIMIT = {"fp8": torch.finfo(FP8).max, "fp8-row": torch.finfo(FP8).max, "int8": 127.0}


@dataclass
class Compressed:
    """A tensor in 8 bits: `q` (float8 e4m3 or int8), `scale` (float32: one, or one per row),
    what made it (`codec`) and the dtype to restore."""

    q: torch.Tensor
    scale: torch.Tensor
    codec: str
    dtype: torch.dtype

    def restore(self) -> torch.Tensor:
        return (self.q.float() * self.scale).to(self.dtype)

    def __reduce__(self) -> tuple:
        # float8 as its bytes: Ray's serializer (the refs engine's object references) cannot rebuild
        # a float8 tensor's storage
        raw = self.q.view(torch.uint8) if self.q.dtype == FP8 else self.q
        return _rebuild, (raw, self.scale, self.codec, str(self.dtype).removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def _rebuild(raw: torch.Tensor, scale: torch.Tensor, codec: str, dtype: str) -> Compressed:
    return Compressed(raw.view(FP8) if codec != "int8" else raw, scale, codec, getattr(torch, dtype))


def compress(t: torch.Tensor, codec: str) -> Compressed:
    """`t` (floating, 2 dimensions or more) in `codec` (one of `CODECS` but "none")."""
    x = t.detach().float()
    amax = x.abs().amax().reshape(1) if codec == "fp8" else x.abs().amax(dim=-1, keepdim=True)
    scale = (amax / _LIMIT[codec]).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = x / scale
    q = scaled.to(FP8) if codec != "int8" else scaled.round_().clamp_(-127, 127).to(torch.int8)
    return Compressed(q, scale, codec, t.dtype)


def restore(value: object) -> object:
    """`value` with every `Compressed` in it restored to a float tensor (on the device it is on)."""
    return pytree.tree_map(
        lambda n: n.restore() if isinstance(n, Compressed) else n, value, is_leaf=lambda n: isinstance(n, Compressed)
    )


def _flatten(c: Compressed) -> tuple[list[torch.Tensor], str]:
    return [c.q, c.scale], f"{c.codec}:{str(c.dtype).removeprefix('torch.')}"


def _unflatten(children: Any, context: str) -> Compressed:
    codec, dtype = context.split(":")
    return Compressed(children[0], children[1], codec, getattr(torch, dtype))


pytree.register_pytree_node(
    Compressed,
    _flatten,
    _unflatten,
    serialized_type_name="raypipe.transport.compress.Compressed",
)
