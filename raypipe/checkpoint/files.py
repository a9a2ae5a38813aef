"""One checkpoint file: written atomically (temporary file, fsync, rename; an object in one put)
and privately (0600 files in 0700 directories), tensors as safetensors.

A tensor file holds any tree of dicts, lists, tensors and plain values (an optimizer's state:
tensors and step counts): the tensors under their path in the tree ("weight", "bias/exp_avg"),
the tree itself with its plain values as JSON in the file's metadata. Nothing is unpickled on
load; files written before safetensors (`.pt`, from `torch.save`) load through
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from raypipe.checkpoint.storage import StoragePath, location
from raypipe.core.errors import RaypipeError

TENSORS = ".safetensors"
LEGACY = ".pt"  # checkpoints written before safetensors: torch.save pickles
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700


class CheckpointError(RaypipeError):
    """A checkpoint is missing, incomplete, corrupt, or cannot be written."""


def sha256_file(path: Path | StoragePath) -> str:
    if isinstance(path, StoragePath):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path | StoragePath, data: bytes) -> dict[str, object]:
    """Writes bytes via a temporary file, fsync and rename (an object: in one put). Returns its
    sha256 and size."""
    if isinstance(path, StoragePath):
        path.write_bytes(data)
        return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    make_private_dir(path.parent)
    # a name nobody can guess, created afresh (O_EXCL) and never through a link (O_NOFOLLOW): a link
    # planted at a predictable temporary name would have this write land in its target
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(tmp, flags, PRIVATE_FILE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no temporary file behind
        raise
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def make_private_dir(path: Path) -> None:
    """`mkdir -p` with the directories it makes readable by their owner alone: a checkpoint holds the
    model, and on a shared machine the default umask would let every user read it."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)


def save_tensors(path: Path | StoragePath, obj: object) -> dict[str, object]:
    """`obj` (dicts, lists, tensors, plain values) as a safetensors file, written atomically."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(obj, "", tensors, set())
    return write_atomic(path, save(tensors, metadata={"raypipe.tree": json.dumps(tree)}))


def load_tensors(path: str | Path | StoragePath) -> Any:
    """What `save_tensors` wrote (a safetensors file: nothing unpickled), or a legacy `.pt` file
    through torch.load that refuses anything but tensors and plain containers."""
    path = location(path)
    if isinstance(path, StoragePath):
        return _load_bytes(path.read_bytes(), path.suffix == LEGACY)
    if path.suffix == LEGACY:
        return torch.load(path, map_location="cpu", weights_only=True)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        if "raypipe.tree" not in metadata:  # a plain safetensors file: its tensors by name
            return {key: f.get_tensor(key) for key in f.keys()}
        return _unflatten(json.loads(metadata["raypipe.tree"]), f)


def tensor_shapes(path: Path | StoragePath) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Key -> (shape, floating point?) of every tensor in a tensor file, from its header alone (a
    legacy `.pt` file is read whole): what a load checks before it changes any weight."""
    if path.suffix == LEGACY:
        flat: dict[str, torch.Tensor] = {}
        _flatten(load_tensors(path), "", flat, set())
        return {k: (tuple(v.shape), v.is_floating_point()) for k, v in flat.items()}
    if isinstance(path, StoragePath):
        size = int.from_bytes(path.read_range(0, 8), "little")
        header = json.loads(path.read_range(8, size))
    else:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {
        k: (tuple(v["shape"]), v["dtype"].startswith(("F", "BF"))) for k, v in header.items() if k != "__metadata__"
    }


def _load_bytes(data: bytes, legacy: bool) -> object:
    """`load_tensors` of a file read whole (from an object store)."""
    if legacy:
        import io

        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    from safetensors.torch import load

    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    tensors = load(data)
    tree = (header.get("__metadata__") or {}).get("raypipe.tree")
    return tensors if tree is None else _unflatten(json.loads(tree), tensors)


def _flatten(obj: object, path: str, tensors: dict[str, torch.Tensor], storages: set[int]) -> object:
    """The JSON tree of `obj`, its tensors moved into `tensors` under their path (copied where
    they share storage with another or view part of one: safetensors stores whole storages)."""
    if torch.is_tensor(obj):
        key, t = path or ".", obj.detach().cpu().contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[key] = t
        return {"tensor": key}
    if isinstance(obj, dict):
        return {
            "dict": [[k, _flatten(v, f"{path}/{k}" if path else str(k), tensors, storages)] for k, v in obj.items()]
        }
    if isinstance(obj, (list, tuple)):
        return {
            "tuple" if isinstance(obj, tuple) else "list": [
                _flatten(v, f"{path}/{i}" if path else str(i), tensors, storages) for i, v in enumerate(obj)
            ]
        }
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise CheckpointError(
        f"cannot store a {type(obj).__name__} at {path!r} in a checkpoint: only tensors, "
        f"numbers, strings, None, and dicts and lists of them"
    )


def _unflatten(tree: dict[str, Any], f: Any) -> Any:
    """The object `_flatten` described, its tensors from `f` (a safetensors file, or a dict of them)."""
    ((kind, value),) = tree.items()
    if kind == "tensor":
        return f[value] if isinstance(f, dict) else f.get_tensor(value)
    if kind == "dict":
        return {k: _unflatten(v, f) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_unflatten(v, f) for v in value]
        return items if kind == "list" else tuple(items)
    return value
