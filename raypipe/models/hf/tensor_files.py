"""Reading a model directory's tensors by key, and only those, so a stage actor reads its own
layers and nothing else, from a single `model.safetensors` or the shards a
`model.safetensors.index.json` lists.

Each tensor is read with plain file reads straight into the tensor that becomes the parameter
(the layer is built on the meta device and takes it by `load_state_dict(assign=True)`): no
memory map whose touched pages would count in the process's resident memory beside the copy,
no second copy, and a dtype conversion or a move to the accelerator one tensor at a time. A
stage's peak memory while loading is then its parameters plus its largest tensor.

A weight that stays frozen on the host (a LoRA base on a CPU stage) can instead be the file itself:
`read(mapped=True)` maps a tensor stored in the dtype asked for, copy-on-write, rather than reading
it. Its pages are the page cache's, one copy on the machine however many processes map them (a
tied embedding and its head on two stages; the replicas of a stage), resident in a process once
it touches them (the kernel maps a file's folios whole, up to 2 MB: an embedding's lookups soon
touch all of it), clean, so the kernel may drop them under pressure and read them again. A
write to such a tensor (a trained bias) copies the page it touches into the process, so nothing
ever writes to the file. The file must then stay as it is while the stages run: raypipe's own
writers replace a file (a new inode) rather than rewrite it (`checkpoint_io.save_tensors`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from raypipe.core.layers import loading

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FILE_DTYPES = {  # safetensors' dtype names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

last_read: dict[str, int] = {}  # key -> bytes of the last `read` in this process


def files_by_key(directory: str) -> dict[str, str]:
    """Checkpoint key -> the safetensors file (a path) holding it.

    Raises:
        FileNotFoundError: the directory has neither an index nor a single safetensors file.
    """
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return {key: os.path.join(directory, name) for key, name in json.load(f)["weight_map"].items()}
    single = os.path.join(directory, SINGLE)
    if not os.path.exists(single):
        raise FileNotFoundError(
            f"{directory} holds neither {SINGLE} nor {INDEX}: save the model with "
            f"transformers' save_pretrained (safetensors), or Trainer.save_pretrained."
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {key: single for key in f.keys()}


def check_files(directory: str) -> None:
    """Every safetensors file of a model directory is whole: its header parses and its tensors'
    bytes are all there. Read from the headers alone, on the driver, before any actor starts.

    Raises:
        ConfigError: naming the first malformed or truncated file (or a malformed index).
    """
    from raypipe.core.errors import ConfigError

    index = os.path.join(directory, INDEX)
    try:
        if os.path.exists(index):
            with open(index) as f:
                paths = sorted({os.path.join(directory, name) for name in json.load(f)["weight_map"].values()})
        else:
            paths = [os.path.join(directory, SINGLE)] if os.path.exists(os.path.join(directory, SINGLE)) else []
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"{index} is malformed ({type(error).__name__}: {error}): save the model again") from None
    for path in paths:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
            if not isinstance(header, dict):
                raise ValueError("no safetensors header")
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            raise ConfigError(
                f"{path} is not a readable safetensors file ({type(error).__name__}: {error}): save the model again"
            ) from None
        if 8 + length + end > size:
            raise ConfigError(
                f"{path} is truncated: its header promises {8 + length + end} bytes, the file has "
                f"{size}. Copy or save the model again."
            )


def header(path: str) -> tuple[int, dict]:
    """A safetensors file's data offset and its header (key -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return 8 + length, json.loads(f.read(length))


def read(
    directory: str,
    keys: Iterable[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    mapped: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors under `keys`, read from their files and nothing else (`last_read` says what),
    floating ones converted to `dtype` and every one moved to `device` as it is read. Inside
    `raypipe.core.layers.loading_to`, a tensor of the same key read earlier and still alive is
    returned, not read. With `mapped`, a host tensor the file holds in `dtype` is mapped from
    the file rather than read (see the module's docstring).

    Raises:
        KeyError: a key is in no file of the directory; the message names it.
    """
    where, keys = files_by_key(directory), list(keys)
    held = loading().held
    out: dict[str, torch.Tensor] = {k: t for k in keys if (t := held.get(k)) is not None}
    by_file: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for k in keys if k not in out):
        if key not in where:
            raise KeyError(f"{directory} has no tensor {key!r} (it has e.g. {sorted(where)[:3]})")
        by_file.setdefault(where[key], []).append(key)
    last_read.clear()
    on_host = device is None or torch.device(device).type == "cpu"
    for path, wanted in by_file.items():
        offset, entries = header(path)
        storage: torch.UntypedStorage | None = None
        with open(path, "rb", buffering=0) as f:
            size, mapping = os.fstat(f.fileno()).st_size, mapped and on_host  # mapping: still worth a try
            for key in wanted:
                entry, tensor = entries[key], None
                if mapping and _mappable(entry, dtype, offset, size):
                    storage = storage if storage is not None else _mapping(path)
                    mapping = storage is not None  # a file that will not map is read, not tried again
                    tensor = None if storage is None else _mapped_tensor(storage, offset, entry)
                if tensor is None:
                    tensor = _read_tensor(f, offset, entry)
                last_read[key] = tensor.numel() * tensor.element_size()
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                out[key] = tensor if device is None else tensor.to(device)
    return out


def _mappable(entry: dict, dtype: torch.dtype | None, offset: int, size: int) -> bool:
    """Whether a tensor can be the file's own bytes: stored in the dtype wanted (or not floating,
    which keeps its dtype), aligned to its element, wholly inside the file, and not empty."""
    stored = FILE_DTYPES.get(entry["dtype"])
    if stored is None or (dtype is not None and stored.is_floating_point and stored != dtype):
        return False
    start, end = entry["data_offsets"]
    element = torch.empty((), dtype=stored).element_size()
    return end > start and (offset + start) % element == 0 and offset + end <= size


def _mapping(path: str) -> torch.UntypedStorage | None:
    """The whole file mapped copy-on-write (`shared=False`: private pages once written), noted in
    `loading().mapped` (such a storage does not know its file); None where the file system will
    not map it, and its tensors are read instead."""
    try:
        storage = torch.UntypedStorage.from_file(path, False, os.path.getsize(path))
    except (RuntimeError, OSError):
        return None
    loading().mapped[storage.data_ptr()] = (path, storage)
    return storage


def _mapped_tensor(storage: torch.UntypedStorage, offset: int, entry: dict) -> torch.Tensor:
    """One tensor of a mapped safetensors file: a view of the mapping's bytes, nothing read."""
    stored = FILE_DTYPES[entry["dtype"]]
    tensor = torch.empty(0, dtype=stored)
    start = offset + entry["data_offsets"][0]
    return tensor.set_(storage, start // tensor.element_size(), entry["shape"])


def _read_tensor(f: Any, offset: int, entry: dict) -> torch.Tensor:
    """One tensor of an open safetensors file (`offset`: where its data starts)."""
    start, end = entry["data_offsets"]
    tensor = torch.empty(entry["shape"], dtype=FILE_DTYPES[entry["dtype"]])
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    if view.nbytes != end - start:
        raise ValueError(f"{f.name}: a tensor of {entry} should hold {view.nbytes} bytes, not {end - start}")
    f.seek(offset + start)
    done = 0
    while done < view.nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{f.name} ends {view.nbytes - done} bytes early: copy or save the model again")
        done += got
    return tensor
