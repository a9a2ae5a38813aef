"""What a run deletes or moves in its checkpoint root, and only its own: the old checkpoints
beyond `keep_checkpoints` (`prune`), the debris of its saves cut short (`clean_partials`), and
the future a resume abandons (`set_aside`). Nothing here follows a symbolic link or touches
another run's files; a checkpoint is retired so that no reader ever sees it half deleted."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from raypipe.checkpoint.layout import (
    DELETING,
    PARTIAL,
    REPLACED,
    StoragePath,
    checkpoint_name,
    inventory,
    location,
    manifest_of,
    move,
    refuse_link,
    remove,
    run_of,
    step_of,
)


def retire(path: Path | StoragePath) -> None:
    """Deletes a complete checkpoint so that no reader ever sees it half gone: locally it is
    renamed `.step-N.deleting-...` first (a delete cut short leaves debris the run's next save
    sweeps, not a `step-N` that fails to verify); in an object store its manifest goes first."""
    if isinstance(path, StoragePath) or path.is_symlink():
        remove(path)
        return
    doomed = path.with_name(f".{checkpoint_name(step_of(path))}.deleting-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    remove(doomed)


def prune(newest: Path | StoragePath, run_id: str, keep: int) -> None:
    """Deletes run `run_id`'s complete checkpoints beyond the `keep` newest (never `newest`, the
    one just written), and its saves cut short before `newest`. Other runs' checkpoints stay."""
    own = [(p, manifest) for p, manifest, run in inventory(newest.parent) if run == run_id]
    complete = [p for p, manifest in own if p != newest and manifest is not None]
    cut_short = [p for p, manifest in own if manifest is None and step_of(p) < step_of(newest)]
    for old in complete[: max(0, len(complete) - (keep - 1))] + cut_short:
        retire(old)


def clean_partials(root: str | Path, run_id: str) -> list[str]:
    """Deletes the debris of run `run_id`'s saves cut short in a local `root`: its `step-N.partial`
    directories (and those no run named: the run holds the root, so their writer is dead), a
    complete one only where `step-N` is in place; the old copies a same-step re-save moved aside,
    once `step-N` is in place; prunes cut short. Never another run's, never through a link.
    Returns their names."""
    root = location(root)
    if isinstance(root, StoragePath) or not root.is_dir():
        return []
    removed = []
    for path in root.iterdir():
        step = _debris_step(path.name)
        if step is None or path.is_symlink():
            continue
        owner, done = run_of(path), manifest_of(root / checkpoint_name(step)) is not None
        mine = owner in (run_id, None)  # nobody named: its writer is dead (the run holds the root)
        if PARTIAL.match(path.name):
            doomed = mine and (manifest_of(path) is None or done)
        elif REPLACED.match(path.name):
            doomed = owner == run_id and done
        else:
            doomed = mine
        if doomed:
            remove(path)
            removed.append(path.name)
    return removed


def _debris_step(name: str) -> int | None:
    """The step of a partial, set-aside copy or retired checkpoint's name; None for other names."""
    match = PARTIAL.match(name) or REPLACED.match(name) or DELETING.match(name)
    return int(match.group(1)) if match else None


def set_aside(root: str | Path, run_id: str, after: int) -> list[str]:
    """Moves run `run_id`'s checkpoints of steps after `after` (the future a resume from `after`
    abandons) into `<root>/set-aside/<time>/`, where no reader looks: a later recovery of the run
    cannot restore them, and nothing complete is deleted (the run's own saves cut short are: they
    hold nothing to keep). Returns the names moved. Each call shelves into a folder of its own
    (its time to the microsecond): two resumes within one second once collided there."""
    from datetime import datetime

    later = [(p, manifest) for p, manifest, run in inventory(root) if step_of(p) > after and run == run_id]
    for path, _ in [(p, m) for p, m in later if m is None]:
        remove(path)
    later = [p for p, manifest in later if manifest is not None]
    if not later:
        return []
    shelf_root = location(root) / "set-aside"
    if not isinstance(shelf_root, StoragePath):
        refuse_link(shelf_root)
    shelf = shelf_root / datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    for path in later:
        move(path, shelf / checkpoint_name(step_of(path)), manifest_first=True)
    return [p.name for p in later]
