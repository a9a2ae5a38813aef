"""Lock-step, topology-independent checkpoints.

Layout of one checkpoint, `<root>/step-00000120/`:

    model/layer-00003.safetensors   layer 3's state_dict (its own keys, e.g. "weight")
    optim/layer-00003.safetensors   optimizer state of layer 3's parameters, by parameter name
    rng/stage-1.safetensors         stage 1's torch RNG state (restored when pp matches)
    trainer.json                    step, data position, run id, config (secrets redacted), plan, loss scaler
    RUN                             the id of the run that wrote it (written first)
    MANIFEST.json                   run id, sha256 and size of every file above; written last

Every file is keyed by global layer index, never by stage, so a checkpoint saved at
one pp loads at any other. Each actor writes its own layers straight to the root: a
directory every node sees, or a URI (`s3://bucket/run`, anything `pyarrow.fs` resolves;
`raypipe.checkpoint.storage`). In a directory each file is written atomically (temporary file,
fsync, rename), the checkpoint as `step-N.partial`, renamed to `step-N` after the
manifest, so a directory named `step-N` is always complete. An object store has no
rename: there the manifest, written last, is the commit marker, and a `step-N` without
one (a save cut short) is skipped by readers and pruned. Loading verifies the manifest and
every file's size on the driver (which reads no tensor file), then each actor checks the
sha256 of the files it is about to read, where their bytes are; a checkpoint that fails either
is skipped for the newest valid one before anything is loaded.

A checkpoint belongs to the run that wrote it (`run_id`: made when a run starts, kept when it
is resumed): pruning (`keep`) and recovery see only the run's own, so two runs that share a
directory can never delete or restore each other's (and a new run refuses a used directory:
`raypipe.driver.checkpoints.check_new_run`). Files are written readable by their owner only.
The tensor files' format is `raypipe.checkpoint.files`'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from raypipe.checkpoint.files import (  # noqa: F401 - the file format's names, re-exported
    LEGACY,
    PRIVATE_DIR,
    PRIVATE_FILE,
    TENSORS,
    CheckpointError,
    load_tensors,
    make_private_dir,
    save_tensors,
    sha256_file,
    tensor_shapes,
    write_atomic,
)
from raypipe.checkpoint.storage import StoragePath, location, redact  # noqa: F401 - location: for callers

FORMAT = 1
MANIFEST = "MANIFEST.json"
META = "trainer.json"
RUN = "RUN"  # in a checkpoint being written: the id of the run writing it, before any other file
_NAME = re.compile(r"^step-(\d{8})$")
PARTIAL = re.compile(r"^step-(\d{8})\.partial$")
# a same-step re-save's old copy, moved aside until the new one is in place; a checkpoint being pruned
REPLACED = re.compile(r"^\.step-(\d{8})\.replaced-[\w-]+$")
DELETING = re.compile(r"^\.step-(\d{8})\.deleting-[\w-]+$")
_STEP = re.compile(r"step-(\d{8})")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def layer_file(kind: str, index: int) -> str:
    return f"{kind}/layer-{index:05d}{TENSORS}"


def rng_file(stage: int) -> str:
    return f"rng/stage-{stage}{TENSORS}"


def existing(path: Path) -> Path:
    """`path`, or its legacy `.pt` twin when only that exists (a checkpoint from before safetensors)."""
    legacy = path.with_suffix(LEGACY)
    return legacy if not path.exists() and legacy.exists() else path


def partial_dir(root: Path | StoragePath, step: int) -> Path | StoragePath:
    return root / f"{checkpoint_name(step)}.partial"


def begin(root: str | Path, step: int, run_id: str) -> Path | StoragePath:
    """Where the actors write checkpoint `step` of run `run_id`: an empty `step-N.partial` directory;
    in an object store `step-N` itself, cleared of what a save cut short left there, or
    `step-N.partial` when `step-N` is complete (`commit` swaps it in once the new one is complete).
    Its first file names the run, so that pruning and clean-up touch only the run's own debris.

    Raises:
        CheckpointError: the directory is another run's (nothing of it is deleted), or a symbolic
            link (never followed: whoever can write the root could point a save at their files).
    """
    root = location(root)
    path = partial_dir(root, step)
    if isinstance(root, StoragePath):
        if not (root / checkpoint_name(step) / MANIFEST).exists():
            path = root / checkpoint_name(step)
        _clear_own(path, run_id)
        path.mkdir(parents=True, exist_ok=True)
    else:
        refuse_link(path)
        _clear_own(path, run_id)
        make_private_dir(root)
        try:
            os.mkdir(path, PRIVATE_DIR)
        except FileExistsError:
            raise CheckpointError(
                f"{path} appeared while this save began: another process writes under {root}"
            ) from None
    write_atomic(path / RUN, run_id.encode())
    return path


def refuse_link(path: Path) -> None:
    """Raises CheckpointError when `path` (inside a checkpoint root) is a symbolic link."""
    if os.path.islink(path):
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}): raypipe follows no link inside a checkpoint "
            f"root, where anyone who can write the root could point a save or a load at other files. Remove it."
        )


def _clear_own(path: Path | StoragePath, run_id: str) -> None:
    """Deletes a save cut short at `path` when this run wrote it, or nobody named (a save killed
    before its first file, or an actor's late writes after its save was aborted: the run holds
    the root, `raypipe.checkpoint.lock`, so no live writer is behind it).

    Raises:
        CheckpointError: another run's: left as it is.
    """
    if not path.exists():
        return
    owner = run_of(path)
    if owner in (run_id, None):
        remove(path)
        return
    raise CheckpointError(
        f"{path} was left by run {owner}, not this run ({run_id}), which deletes only what it wrote: "
        f"remove it, or save to a directory of this run's own."
    )


def abort(partial: Path | StoragePath) -> None:
    """Deletes a save that did not commit (`begin`'s directory without a manifest). A partial with
    a manifest is a complete checkpoint: kept (a local one is swept by the run's next save)."""
    if manifest_of(partial) is None:
        remove(partial)


def remove_file(path: Path | StoragePath) -> None:
    """Deletes one file or object (nothing when it is absent)."""
    try:
        path.delete() if isinstance(path, StoragePath) else path.unlink(missing_ok=True)
    except OSError:
        pass


def remove(path: Path | StoragePath) -> None:
    """Deletes a checkpoint directory (nothing when it is absent or a symbolic link: a link is never
    followed). In an object store the manifest goes first, so a delete cut short leaves a save
    without one, which the run's next prune finishes."""
    if isinstance(path, StoragePath):
        if (path / MANIFEST).exists():
            remove_file(path / MANIFEST)
        path.rmtree()
    elif path.exists() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)


def commit(partial: Path | StoragePath, files: dict[str, dict[str, Any]], meta: dict[str, Any]) -> Path | StoragePath:
    """Writes trainer.json and the manifest and moves the directory into place (in an object store
    the manifest is the commit); `raypipe.checkpoint.tidy.prune` then prunes the run's old ones.

    A complete checkpoint of the same step is replaced only once the new one is complete (locally:
    moved aside, the new one renamed in, then deleted; in an object store: deleted, then the new
    one's objects moved in, its manifest last, so until then `step-N.partial` holds it whole).

    Args:
        partial: the directory `begin` returned, with the actors' files in it.
        files: relative path -> {"sha256", "bytes"} for every file the actors wrote.
        meta: what trainer.json holds; its `run_id` is the run's, which pruning keeps to.
    """
    files = dict(files)
    files[META] = write_atomic(partial / META, json.dumps(meta, indent=2, sort_keys=True).encode())
    manifest = {"format": FORMAT, "step": meta["step"], "run_id": meta["run_id"], "files": files}
    write_atomic(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    final = partial.with_name(checkpoint_name(meta["step"]))
    if not isinstance(partial, StoragePath):
        replaced = final.with_name(f".{final.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        if final.exists():
            os.replace(final, replaced)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        remove(replaced)
    elif partial != final:  # the new one is complete beside the old: the old goes, the new moves in
        remove(final)
        move(partial, final, manifest_first=False)
    return final


def step_of(path: Path | StoragePath) -> int:
    """The step of a checkpoint's directory: `step-N`, or what stands in for a missing one."""
    return int(_STEP.search(path.name).group(1))


def inventory(root: str | Path) -> list[tuple[Path | StoragePath, dict[str, Any] | None, str | None]]:
    """Every checkpoint directory under root, oldest first, with its manifest (None: none readable)
    and the run that wrote it: each manifest read once."""
    found = []
    for path in list_checkpoints(root):
        manifest = manifest_of(path)
        found.append((path, manifest, run_of(path, manifest)))
    return found


def run_of(path: Path | StoragePath, manifest: dict[str, Any] | None = None) -> str | None:
    """The run that wrote a checkpoint (complete or being written): its manifest's run id (pass the
    manifest when read already), else its RUN file; None when neither says (a checkpoint from
    before run ids, or a save killed at once)."""
    manifest = manifest if manifest is not None else manifest_of(path)
    if manifest is not None and isinstance(manifest.get("run_id"), str):
        return manifest["run_id"]
    try:
        return (path / RUN).read_text().strip() or None
    except Exception:  # noqa: BLE001 - missing or unreadable: nobody's
        return None


def manifest_of(path: Path | StoragePath) -> dict[str, Any] | None:
    """A checkpoint's manifest if it has a readable one (not verified), else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except Exception:  # noqa: BLE001 - absent, unreadable, not JSON: no manifest
        return None
    return manifest if isinstance(manifest, dict) else None


def runs_in(root: str | Path) -> dict[str, int]:
    """Run id -> newest step of every run with a complete checkpoint under root ("unknown" for
    checkpoints written before run ids)."""
    return {run or "unknown": step_of(path) for path, manifest, run in inventory(root) if manifest is not None}


def move(source: Path | StoragePath, target: Path | StoragePath, manifest_first: bool) -> None:
    """Moves a checkpoint directory; in an object store object by object, its manifest first (the
    source stops being a checkpoint before any of its files goes) or last (the target becomes one
    only when all its files are there)."""
    if not isinstance(source, StoragePath):
        make_private_dir(target.parent)
        os.replace(source, target)
        return
    for name in sorted(source.files(), key=lambda n: (n == MANIFEST) != manifest_first):
        (source / name).move(target / name)
    source.rmtree()


def list_checkpoints(root: str | Path) -> list[Path | StoragePath]:
    """Checkpoint directories under root, oldest first: complete ones (in an object store also
    those a save left without a manifest, which `verify` refuses). Where a same-step re-save was
    cut short between its two renames, leaving no `step-N`, the complete `step-N.partial` (the new
    one) stands in for it, else the complete old copy it moved aside. Links are never followed."""
    root = location(root)
    if not root.is_dir():
        return []
    if isinstance(root, StoragePath):
        found = {step_of(p): p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()}
        return [found[k] for k in sorted(found)]
    entries = [p for p in root.iterdir() if not p.is_symlink() and p.is_dir()]
    found = {step_of(p): p for p in entries if _NAME.match(p.name)}
    stand_ins = sorted(
        (p for p in entries if PARTIAL.match(p.name) or REPLACED.match(p.name)),
        key=lambda p: (step_of(p), not PARTIAL.match(p.name), p.name),
    )
    for path in stand_ins:
        if step_of(path) not in found and manifest_of(path) is not None:
            found[step_of(path)] = path
    return [found[k] for k in sorted(found)]


def verify(path: str | Path, contents: bool = False) -> dict[str, Any]:
    """Checks the manifest, trainer.json's sha256 and every file's size, and with `contents`
    every file's sha256 too (reading every byte: the actors check their own files'
    contents when they load, so the driver need not); returns trainer.json's content.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file, or a manifest or
            trainer.json of any wrong shape (missing fields, wrong types, not JSON).
    """
    path = location(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the checkpoint was not completed)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        entries = sorted((str(name), int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items())
    except Exception as error:  # noqa: BLE001 - any shape but the right one
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({type(error).__name__}: {error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this raypipe reads format {FORMAT}")
    if META not in files:
        raise CheckpointError(f"{manifest_path}: lists no {META}")
    for name, size_expected, sha in entries:
        problem = file_problem(path / name, size_expected, sha, contents or name == META)
        if problem:
            raise CheckpointError(problem)
    try:
        meta = json.loads((path / META).read_text())
        missing = [k for k in META_FIELDS if k not in meta]
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"{path / META}: unreadable ({type(error).__name__}: {error})") from None
    if missing or not isinstance(meta.get("step"), int) or not isinstance(meta.get("plan"), list):
        raise CheckpointError(f"{path / META}: lacks {missing or 'a whole step and plan'}")
    return meta


META_FIELDS = ("step", "num_layers", "plan", "loss_scaler")  # what a load reads from trainer.json


def file_problem(file: Path | StoragePath, size_expected: int, sha: str, contents: bool = True) -> str | None:
    """What is wrong with one file of a checkpoint against its manifest entry (missing, another
    size, and with `contents` another sha256), or None."""
    if not file.is_file():
        return f"{file}: missing"
    size = file.size() if isinstance(file, StoragePath) else file.stat().st_size
    if size != size_expected:
        return f"{file}: {size} bytes, the manifest says {size_expected} (truncated?)"
    if contents and sha256_file(file) != sha:
        return f"{file}: sha256 does not match the manifest (corrupt)"
    return None


def find_valid(
    root: str | Path,
    step: int | None = None,
    warn: Callable[[str], None] = print,
    run_id: str | None = None,
    contents: bool = False,
    skip: Collection[str] = (),
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint under root that verifies (`verify`, with `contents` as given), or
    the one of `step`; with `run_id`, the newest of that run only (a recovery never restores
    another run's). Checkpoints named in `skip` (found corrupt by the actors) are passed over.

    Invalid checkpoints met on the way are reported through `warn` and skipped.

    Raises:
        CheckpointError: no valid checkpoint (or the asked-for step is invalid or absent).
    """
    candidates = list_checkpoints(root) if run_id is None else [p for p, _, run in inventory(root) if run == run_id]
    if step is not None:
        found = sorted(step_of(p) for p in candidates)
        candidates = [p for p in candidates if step_of(p) == step]
        if not candidates:
            held = f"it holds steps {found}" if found else "it holds no checkpoint"
            raise CheckpointError(f"no checkpoint for step {step} under {redact(str(root))}: {held}")
    for path in reversed([p for p in candidates if p.name not in skip]):
        try:
            return path, verify(path, contents)
        except CheckpointError as error:
            if step is not None:
                raise
            warn(f"raypipe: skipping invalid checkpoint: {error}")
    raise CheckpointError(f"no valid checkpoint under {redact(str(root))}{f' of run {run_id}' if run_id else ''}")


def resolve(
    path: str | Path, warn: Callable[[str], None] = print, skip: Collection[str] = ()
) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory as given, or the newest valid one when given their root (passing
    over those named in `skip`)."""
    path = location(path)
    if is_checkpoint(path):
        return path, verify(path)
    return find_valid(path, warn=warn, skip=skip)


def is_checkpoint(path: Path | StoragePath) -> bool:
    """Whether `path` names one checkpoint (rather than a root holding them)."""
    return (path / MANIFEST).exists() or bool(_NAME.match(path.name))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
