"""Lock-step, topology-independent checkpoints.

Layout of one checkpoint, `<root>/step-00000120/`:

    model/layer-00003.safetensors   layer 3's state_dict (its own keys, e.g. "weight")
    optim/layer-00003.safetensors   optimizer state of layer 3's parameters, by parameter name
    rng/stage-1.safetensors         stage 1's torch RNG state (restored when pp matches)
    trainer.json                    step, data position, config, plan, loss scaler
    MANIFEST.json                   sha256 and size of every file above; written last

Every file is keyed by global layer index, never by stage, so a checkpoint saved at
one pp loads at any other. Each actor writes its own layers straight to the root: a
directory every node sees, or a URI (`s3://bucket/run`, anything `pyarrow.fs` resolves;
`raypipe.storage`). In a directory each file is written atomically (temporary file,
fsync, rename), the checkpoint as `step-N.partial`, renamed to `step-N` after the
manifest, so a directory named `step-N` is always complete. An object store has no
rename: there the manifest, written last, is the commit marker, and a `step-N` without
one (a save cut short) is skipped by readers and pruned. Loading verifies every checksum
first, and falls back past invalid checkpoints to the newest valid one.

The tensor files are safetensors: nothing is unpickled on load. A file holds any tree of
dicts, lists, tensors and plain values (an optimizer's state: tensors and step counts): the
tensors under their path in the tree ("weight", "bias/exp_avg"), the tree itself with its
plain values as JSON in the file's metadata. Checkpoints written before (`.pt` files, from
`torch.save`) still load, through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from raypipe.errors import RaypipeError
from raypipe.storage import StoragePath, location

FORMAT = 1
MANIFEST = "MANIFEST.json"
META = "trainer.json"
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(RaypipeError):
    """A checkpoint is missing, incomplete, corrupt, or cannot be written."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


TENSORS = ".safetensors"
LEGACY = ".pt"  # checkpoints written before safetensors: torch.save pickles


def layer_file(kind: str, index: int) -> str:
    return f"{kind}/layer-{index:05d}{TENSORS}"


def rng_file(stage: int) -> str:
    return f"rng/stage-{stage}{TENSORS}"


def existing(path: Path) -> Path:
    """`path`, or its legacy `.pt` twin when only that exists (a checkpoint from before safetensors)."""
    legacy = path.with_suffix(LEGACY)
    return legacy if not path.exists() and legacy.exists() else path


def sha256_file(path: Path | StoragePath) -> str:
    if isinstance(path, StoragePath):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path | StoragePath, data: bytes) -> dict[str, Any]:
    """Writes bytes via a temporary file, fsync and rename (an object: in one put). Returns its
    sha256 and size."""
    if isinstance(path, StoragePath):
        path.write_bytes(data)
        return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def save_tensors(path: Path | StoragePath, obj: Any) -> dict[str, Any]:
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


def _load_bytes(data: bytes, legacy: bool) -> Any:
    """`load_tensors` of a file read whole (from an object store)."""
    if legacy:
        import io

        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    from safetensors.torch import load

    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    tensors = load(data)
    tree = (header.get("__metadata__") or {}).get("raypipe.tree")
    return tensors if tree is None else _unflatten(json.loads(tree), tensors)


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor], storages: set[int]) -> Any:
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
        return {"dict": [[k, _flatten(v, f"{path}/{k}" if path else str(k), tensors, storages)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"tuple" if isinstance(obj, tuple) else "list":
                [_flatten(v, f"{path}/{i}" if path else str(i), tensors, storages) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise CheckpointError(f"cannot store a {type(obj).__name__} at {path!r} in a checkpoint: only tensors, "
                          f"numbers, strings, None, and dicts and lists of them")


def _unflatten(tree: dict[str, Any], f: Any) -> Any:
    """The object `_flatten` described, its tensors from `f` (a safetensors file, or a dict of them)."""
    (kind, value), = tree.items()
    if kind == "tensor":
        return f[value] if isinstance(f, dict) else f.get_tensor(value)
    if kind == "dict":
        return {k: _unflatten(v, f) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_unflatten(v, f) for v in value]
        return items if kind == "list" else tuple(items)
    return value


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{checkpoint_name(step)}.partial"


def begin(root: str | Path, step: int) -> Path | StoragePath:
    """Where the actors write checkpoint `step`: an empty `step-N.partial` directory; in an object
    store `step-N` itself, cleared of anything an earlier save left there."""
    root = location(root)
    path = root / checkpoint_name(step) if isinstance(root, StoragePath) else partial_dir(root, step)
    remove(path)
    path.mkdir(parents=True)
    return path


def remove_file(path: Path | StoragePath) -> None:
    """Deletes one file or object (nothing when it is absent)."""
    try:
        path.delete() if isinstance(path, StoragePath) else path.unlink(missing_ok=True)
    except OSError:
        pass


def remove(path: Path | StoragePath) -> None:
    """Deletes a checkpoint directory (nothing when it is absent)."""
    if isinstance(path, StoragePath):
        path.rmtree()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def commit(partial: Path | StoragePath, files: dict[str, dict[str, Any]], meta: dict[str, Any],
           keep: int) -> Path | StoragePath:
    """Writes trainer.json and the manifest, renames the directory into place (in an object store
    the manifest is the commit), prunes old ones.

    Args:
        partial: the directory `begin` returned, with the actors' files in it.
        files: relative path -> {"sha256", "bytes"} for every file the actors wrote.
        meta: what trainer.json holds.
        keep: how many complete checkpoints to keep (newest first); 0 keeps all.
    """
    files = dict(files)
    files[META] = write_atomic(partial / META, json.dumps(meta, indent=2, sort_keys=True).encode())
    manifest = {"format": FORMAT, "step": meta["step"], "files": files}
    write_atomic(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    final = partial.with_name(checkpoint_name(meta["step"]))
    if not isinstance(partial, StoragePath):
        remove(final)
        os.replace(partial, final)
        _fsync_dir(final.parent)
    if keep:
        found = list_checkpoints(final.parent)
        complete = [p for p in found if not isinstance(p, StoragePath) or (p / MANIFEST).exists()]
        newest = int(_NAME.match(final.name).group(1))
        cut_short = [p for p in found if p not in complete and int(_NAME.match(p.name).group(1)) < newest]
        for old in complete[:-keep] + cut_short:
            remove(old)
    return final


def list_checkpoints(root: str | Path) -> list[Path | StoragePath]:
    """Checkpoint directories under root, oldest first: complete ones (in an object store also
    those a save left without a manifest, which `verify` refuses)."""
    root = location(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def verify(path: str | Path) -> dict[str, Any]:
    """Checks the manifest and every file's size and sha256; returns trainer.json's content.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    path = location(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the checkpoint was not completed)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this raypipe reads format {FORMAT}")
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        size = file.size() if isinstance(file, StoragePath) else file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        if sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 does not match the manifest (corrupt)")
    return json.loads((path / META).read_text())


def find_valid(
    root: str | Path, step: int | None = None, warn: Callable[[str], None] = print
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint under root that verifies (or the one of `step`).

    Invalid checkpoints met on the way are reported through `warn` and skipped.

    Raises:
        CheckpointError: no valid checkpoint (or the asked-for step is invalid or absent).
    """
    candidates = list_checkpoints(root)
    if step is not None:
        candidates = [p for p in candidates if p.name == checkpoint_name(step)]
        if not candidates:
            raise CheckpointError(f"no checkpoint for step {step} under {root}")
    for path in reversed(candidates):
        try:
            return path, verify(path)
        except CheckpointError as error:
            if step is not None:
                raise
            warn(f"raypipe: skipping invalid checkpoint: {error}")
    raise CheckpointError(f"no valid checkpoint under {root}")


def resolve(path: str | Path, warn: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory as given, or the newest valid one when given their root."""
    path = location(path)
    if (path / MANIFEST).exists() or _NAME.match(path.name):
        return path, verify(path)
    return find_valid(path, warn=warn)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
