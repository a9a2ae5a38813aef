"""Reading a model directory's tensors by key, and only those: `safetensors.safe_open` maps each
file and copies out just the tensors asked for, so a stage actor reads its own layers and
nothing else, from a single `model.safetensors` or the shards a `model.safetensors.index.json`
lists."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
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
    from raypipe.errors import ConfigError

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


def read(directory: str, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors under `keys`, read from their files and nothing else (`last_read` says what).

    Raises:
        KeyError: a key is in no file of the directory; the message names it.
    """
    from safetensors import safe_open

    where = files_by_key(directory)
    by_file: dict[str, list[str]] = {}
    for key in dict.fromkeys(keys):
        if key not in where:
            raise KeyError(f"{directory} has no tensor {key!r} (it has e.g. {sorted(where)[:3]})")
        by_file.setdefault(where[key], []).append(key)
    out: dict[str, torch.Tensor] = {}
    last_read.clear()
    for path, wanted in by_file.items():
        with safe_open(path, framework="pt") as f:
            for key in wanted:
                out[key] = f.get_tensor(key)
                last_read[key] = out[key].numel() * out[key].element_size()
    return out
