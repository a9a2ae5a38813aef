"""Objects exchanged between ranks as plain data: nothing a peer sends is unpickled.

torch.distributed's object collectives (`all_gather_object`, `gather_object`) pickle what they
send and unpickle what arrives, so whoever reaches a rank's collective connection could run code
in it. `all_gather` and `gather` here send a tree of dicts, lists, tuples, strings, numbers,
booleans, None and tensors as one byte tensor: a JSON header that describes the tree (each tensor
by its dtype's name, its shape and its place in the bytes that follow) and the tensors' bytes.
Decoding parses JSON and builds tensors of a fixed list of dtypes; anything else is refused with
an error that names the rank it came from.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from raypipe.core.errors import RaypipeError

#: the dtypes a peer may send, by name
DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}
LENGTH_BYTES = 8  # the header's length, little-endian, before it


class PeerDataError(RaypipeError):
    """What a peer rank sent is not a plain-data message (`raypipe.transport.plain`)."""


def encode(obj: object) -> torch.Tensor:
    """`obj` as one uint8 tensor: its header's length, the JSON header, the tensors' bytes.

    Raises:
        TypeError: `obj` holds something that is not plain data (names its type).
    """
    tensors: list[torch.Tensor] = []

    def tree(x: object) -> object:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if torch.is_tensor(x):
            t = x.detach().to("cpu").contiguous()
            if str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise TypeError(f"a tensor of dtype {t.dtype} cannot be sent as plain data")
            tensors.append(t)
            return {"t": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if isinstance(x, dict):
            return {"d": [[tree(k), tree(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"u": [tree(v) for v in x]}
        if isinstance(x, list):
            return [tree(v) for v in x]
        raise TypeError(
            f"{type(x).__name__} cannot be sent as plain data (dicts, lists, tuples, numbers, text, tensors)"
        )

    header = json.dumps(tree(obj), separators=(",", ":")).encode()
    parts = [torch.tensor(list(len(header).to_bytes(LENGTH_BYTES, "little")), dtype=torch.uint8)]
    parts.append(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    parts += [t.reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def decode(data: torch.Tensor, peer: int | str = "?") -> object:
    """The object `encode` wrote, from `data` (uint8, on any device) that rank `peer` sent.

    Raises:
        PeerDataError: `data` is not such a message (its length, JSON, a dtype or the tensors'
            bytes do not add up); names `peer`.
    """
    raw = data.to("cpu").numpy().tobytes()

    def refuse(why: str) -> PeerDataError:
        return PeerDataError(f"rank {peer} sent {len(raw)} bytes that are not a plain-data message: {why}")

    if len(raw) < LENGTH_BYTES:
        raise refuse("shorter than its header's length")
    length = int.from_bytes(raw[:LENGTH_BYTES], "little")
    if length > len(raw) - LENGTH_BYTES:
        raise refuse(f"a header of {length} bytes does not fit")
    try:
        header = json.loads(raw[LENGTH_BYTES : LENGTH_BYTES + length].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise refuse(f"its header is not JSON ({error})") from None
    at = LENGTH_BYTES + length

    def tree(x: object) -> object:
        nonlocal at
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [tree(v) for v in x]
        if isinstance(x, dict) and set(x) == {"d"} and isinstance(x["d"], list):
            if not all(isinstance(kv, list) and len(kv) == 2 for kv in x["d"]):
                raise refuse("a dict's entries are not key-value pairs")
            return {_key(tree(k)): tree(v) for k, v in x["d"]}
        if isinstance(x, dict) and set(x) == {"u"} and isinstance(x["u"], list):
            return tuple(tree(v) for v in x["u"])
        if isinstance(x, dict) and set(x) == {"t", "shape"}:
            dtype, shape = DTYPES.get(x["t"]), x["shape"]
            if dtype is None:
                raise refuse(f"dtype {x['t']!r} is not one a peer may send")
            if not (
                isinstance(shape, list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            ):
                raise refuse(f"shape {shape!r} is not a list of sizes")
            count = 1
            for n in shape:
                count *= n
            size = count * torch.empty((), dtype=dtype).element_size()
            if at + size > len(raw):
                raise refuse(f"a tensor of {size} bytes runs past the end")
            tensor = torch.frombuffer(bytearray(raw[at : at + size]), dtype=torch.uint8) if size else torch.empty(0)
            at += size
            return tensor.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)
        raise refuse(f"an entry {str(x)[:60]!r} is none of the plain kinds")

    def _key(k: object) -> object:
        if isinstance(k, (list, dict)):
            raise refuse("a dict key is a list or dict")
        return k

    try:
        obj = tree(header)
    except RecursionError:
        raise refuse("nested too deep") from None
    if at != len(raw):
        raise refuse(f"{len(raw) - at} bytes follow the last tensor")
    return obj


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` of the group, in rank order (`dist.all_gather_object` without pickle)."""
    data, sizes = _sized(obj, group)
    longest = max(sizes)
    out = [torch.empty(longest, dtype=torch.uint8, device=data.device) for _ in sizes]
    dist.all_gather(out, _padded(data, longest), group=group)
    return [decode(o[:n], _global(group, r)) for r, (o, n) in enumerate(zip(out, sizes))]


def gather(obj: Any, dst: int, group: Any = None) -> list[Any] | None:
    """On global rank `dst`, every rank's `obj` of the group in rank order; None on the others
    (`dist.gather_object` without pickle)."""
    data, sizes = _sized(obj, group)
    longest = max(sizes)
    here = dist.get_rank() == dst
    out = [torch.empty(longest, dtype=torch.uint8, device=data.device) for _ in sizes] if here else None
    dist.gather(_padded(data, longest), out, dst=dst, group=group)
    return [decode(o[:n], _global(group, r)) for r, (o, n) in enumerate(zip(out, sizes))] if here else None


def _sized(obj: Any, group: Any) -> tuple[torch.Tensor, list[int]]:
    """`obj` encoded, on the device the group's backend sends from, and every rank's length."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    data = encode(obj).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    return data, [int(s) for s in sizes]


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    if data.numel() == length:
        return data
    return torch.cat([data, torch.zeros(length - data.numel(), dtype=torch.uint8, device=data.device)])


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
