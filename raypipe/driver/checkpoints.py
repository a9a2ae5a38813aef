"""Checkpoint orchestration across a trainer's actors: every actor saves or loads its own
layers in lock-step (`raypipe.actors.io.checkpoint_io`), the driver writes the manifest that
commits a save and picks the checkpoint a load or a recovery restores
(`raypipe.checkpoint.layout` owns the format)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.checkpoint import layout as ckpt
from raypipe.checkpoint import tidy
from raypipe.checkpoint.storage import StoragePath, location, redact, scrub
from raypipe.core.env import call_timeout
from raypipe.driver.results import gather
from raypipe.driver.run_state import RunState

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from raypipe.config import TrainConfig


def run_meta(
    step: int,
    num_layers: int,
    plan: Sequence[Sequence[int]],
    run: str,
    run_id: str,
    config: TrainConfig,
    base: object = None,
) -> dict[str, object]:
    """What a checkpoint's manifest says about the run beside the files; `run_id`: the run's
    identity (kept across its resumes), which pruning and recovery keep to; `base`: in a LoRA
    run, the identity of the frozen base model its adapters belong to (`raypipe.models.model.Model.identity`)."""
    return {
        "base": base,
        "step": step,
        "data_position": step,  # batches are a function of the step
        "num_layers": num_layers,
        "pp": config.pp,
        "plan": [list(r) for r in plan],
        "run": run,
        "run_id": run_id,
        "config": config.to_dict(),  # secrets redacted
    }


def save(
    actors: Sequence[ActorHandle], names: Sequence[str], root: str, step: int, meta: dict[str, Any], keep: int
) -> Path:
    """Saves checkpoint `<root>/step-<step>`: every actor writes its files, then the manifest
    (with `meta`, the loss scaler and every file's checksum) commits it; the run's `keep` newest
    stay. A failure at any point leaves no partial checkpoint and every complete one intact.

    Raises:
        CheckpointError: `step-<step>` is another run's complete checkpoint.
    """
    import ray

    partial = begin_saves(root, meta["run_id"], [step])[step]
    refs: list[ray.ObjectRef] = []
    try:
        # every actor takes part: under ZeRO-1 each replica holds a share of the optimizer state
        refs = [a.save_checkpoint.remote(address(partial)) for a in actors]
        parts = gather(refs, "save", actors, names)
        return commit_save(partial, parts, meta, keep)
    except BaseException:
        # ray.get raises at the first actor's error while the others may still write: the partial
        # directory goes only once they are done, or a retry's `begin` finds it made again
        ray.wait(refs, num_returns=len(refs), timeout=call_timeout(), fetch_local=False)
        ckpt.abort(partial)
        raise


#: a checkpoint an actor-driven run's actors wrote: where, and each actor's answer (rank order)
Written = tuple[Path | StoragePath, list[dict[str, Any]]]


def begin_saves(root: str, run_id: str, steps: Sequence[int]) -> dict[int, Path | StoragePath]:
    """The directories the actors write the checkpoints of `steps` to (their own saves, or an
    actor-driven run's), after the debris of this run's earlier saves is swept.

    Raises:
        CheckpointError: one of them is another run's complete checkpoint.
    """
    for step in steps:
        final = location(root) / ckpt.checkpoint_name(step)
        manifest = ckpt.manifest_of(final)
        owner = ckpt.run_of(final, manifest) if manifest is not None else run_id
        if owner != run_id:
            raise ckpt.CheckpointError(
                f"{final} belongs to run {owner or 'unknown (written before run ids)'}; this is run {run_id}, "
                f"which never replaces another run's checkpoint: save to a directory of its own."
            )
    tidy.clean_partials(root, run_id)  # a killed driver's debris (`begin` clears its own directory anyway)
    return {step: ckpt.begin(root, step, run_id) for step in steps}


def commit_save(partial: Path | StoragePath, parts: Sequence[dict[str, Any]], meta: dict[str, Any], keep: int) -> Path:
    """Commits the checkpoint the actors wrote to `partial` (`parts`: each actor's answer, in rank
    order) with `meta`; returns where it is.

    Raises:
        CheckpointError: an actor could not write its part (its error).
    """
    failed = [part["error"] for part in parts if "error" in part]
    if failed:
        raise ckpt.CheckpointError("; ".join(failed[:4]))
    files = {name: entry for part in parts for name, entry in part["files"].items()}
    if "reference" in meta:  # a DPO or GRPO run's: is its reference's frozen copy in the files too?
        meta = {**meta, "reference_saved": all(part.get("reference", True) for part in parts)}
    final = ckpt.commit(partial, files, {**meta, "loss_scaler": parts[0]["loss_scaler"]})
    if keep:
        tidy.prune(final, meta["run_id"], keep)
    return final


def load(
    actors: Sequence[ActorHandle],
    names: Sequence[str],
    path: str | Path,
    step: int | None,
    num_layers: int,
    plan: Sequence[tuple[int, int]],
    log: Callable[[str], None],
    base: object = None,
    optimizer: str | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Restores a checkpoint saved by any topology into every actor, all or nothing: the driver
    checks the manifest and the files' sizes (it reads no tensor file), every actor the sha256 of
    the files it will read and their keys and shapes, and none loads unless all pass. Given a
    root (no `step`), a checkpoint whose files the actors find corrupt is reported through `log`
    and passed over for the next newest.

    Returns:
        (the checkpoint directory, its trainer.json: step, run_id, ...).

    Raises:
        CheckpointError: nothing valid to restore, a model of another size or shape, or (`base`: a
            LoRA run's base identity) adapters that belong to another base, or none where some are due.
    """
    where, meta = verified(actors, names, path, step, log)
    if meta["num_layers"] != num_layers:
        raise ckpt.CheckpointError(
            f"{where} holds a {meta['num_layers']}-layer model; this trainer has {num_layers} layers."
        )
    if meta.get("base") != base:
        raise ckpt.CheckpointError(
            f"{where} was saved by a run on base {meta.get('base')}, but this trainer's is {base}: a LoRA "
            f"checkpoint holds adapters only, which fit only the base they were trained on (and a full "
            f"checkpoint does not load into a LoRA run). Load it with that base model and TrainConfig.lora."
        )
    problems = sorted(
        {
            p
            for found in gather(
                [a.check_checkpoint.remote(address(where)) for a in actors], "load check", actors, names
            )
            for p in found
        }
    )
    if problems:
        raise ckpt.CheckpointError(
            f"{where} does not fit this model, nothing was loaded (the trainer keeps its weights): "
            f"{'; '.join(problems[:6])}{f'; and {len(problems) - 6} more' if len(problems) > 6 else ''}"
        )
    saved_with = (meta.get("config") or {}).get("optimizer", {}).get("name")
    same_optimizer = saved_with is None or optimizer is None or saved_with == optimizer
    if not same_optimizer:
        log(
            f"raypipe: {where} holds {saved_with} optimizer state; this run uses {optimizer}: its weights are "
            f"loaded and the optimizer starts afresh"
        )
    same_split = meta["plan"] == [list(r) for r in plan]
    gather(
        [
            a.load_checkpoint.remote(address(where), meta["loss_scaler"], same_split, same_optimizer, meta["step"])
            for a in actors
        ],
        "load",
        actors,
        names,
    )
    return where, meta


def verified(
    actors: Sequence[ActorHandle], names: Sequence[str], path: str | Path, step: int | None, log: Callable[[str], None]
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to load from `path` (the one of `step`, the one `path` names, or the newest
    under it) whose files every actor found intact.

    Raises:
        CheckpointError: no such checkpoint, or the one asked for is corrupt (naming its files).
    """
    corrupt: list[str] = []
    while True:
        if step is not None:
            where, meta = ckpt.find_valid(path, step=step, warn=log)
        else:
            where, meta = ckpt.resolve(path, warn=log, skip=corrupt)
        found = gather([a.verify_checkpoint.remote(address(where)) for a in actors], "checkpoint check", actors, names)
        problems = sorted({p for part in found for p in part})
        if not problems:
            return where, meta
        error = f"{where}: {'; '.join(problems[:4])}{f'; and {len(problems) - 4} more' if len(problems) > 4 else ''}"
        if step is not None or ckpt.is_checkpoint(location(path)):
            raise ckpt.CheckpointError(f"{error}; nothing was loaded")
        log(f"raypipe: skipping invalid checkpoint: {error}")
        corrupt.append(where.name)


def set_aside_future(checkpoint_dir: str | None, run_id: str, step: int, log: Callable[[str], None]) -> None:
    """After a run is resumed at `step`: its checkpoints in `checkpoint_dir` after that step (a
    future now abandoned) move under `set-aside/`, where no recovery restores them."""
    moved = tidy.set_aside(checkpoint_dir, run_id, step) if checkpoint_dir is not None else []
    if moved:
        log(
            f"raypipe: resumed at step {step}; set aside the run's later checkpoints {', '.join(moved)} "
            f"under set-aside/ (not restored, not deleted)"
        )


def check_new_run(root: str | None, resume: bool | int) -> None:
    """Before any actor starts: a new run (not `resume`) refuses a checkpoint_dir holding another
    run's complete checkpoints, which it would mix with its own.

    Raises:
        CheckpointError: naming the run found there, its newest step, and the two fixes.
    """
    if root is None or resume is not False:
        return
    try:
        runs = ckpt.runs_in(root)
    except Exception as error:  # noqa: BLE001 - a bucket it cannot list: named, its secret unshown
        raise ckpt.CheckpointError(
            f"checkpoint_dir {redact(root)} cannot be listed: {type(error).__name__}: {scrub(str(error), root)}"
        ) from None
    if runs:
        run_id, newest = max(runs.items(), key=lambda r: r[1])
        others = f" (and {len(runs) - 1} other runs)" if len(runs) > 1 else ""
        raise ckpt.CheckpointError(
            f"checkpoint_dir {redact(root)} holds run {run_id}'s checkpoints up to step {newest}{others}. A new run "
            f"there would mix its checkpoints with them: give this run a checkpoint_dir of its own, or continue "
            f"that run with TrainConfig(resume=True) (raypipe train --resume; resume=N or --resume-step N for "
            f"step N). Nothing was started."
        )


def check_reachable(actors: Sequence[ActorHandle], names: Sequence[str], root: str) -> None:
    """Before training: every actor reads a marker the driver wrote under `root` (the driver commits
    what the actors write there). A local directory some node does not share, or a bucket its
    credentials do not reach, is an error now rather than at the first save.

    Raises:
        CheckpointError: naming the actors (and their nodes) that cannot read it, and the fixes.
    """
    import uuid

    import ray

    marker, token = location(root) / f".raypipe-reachable-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
    try:
        ckpt.write_atomic(marker, token.encode())
    except OSError as error:
        raise ckpt.CheckpointError(
            f"the driver cannot write to checkpoint_dir {redact(root)}: {scrub(str(error), root)}"
        ) from None
    try:
        seen = gather([a.read_text.remote(address(marker)) for a in actors], "checkpoint_dir check", actors, names)
    finally:
        ckpt.remove_file(marker)
    blind = [(a, n) for a, n, text in zip(actors, names, seen) if text != token]
    if blind:
        infos = gather([a.info.remote() for a, _ in blind[:6]], "stage_info")
        who = ", ".join(f"{name} (node {info.node_id[:12]})" for (_, name), info in zip(blind, infos))
        here = ray.get_runtime_context().get_node_id()[:12]
        raise ckpt.CheckpointError(
            f"{who} cannot read checkpoint_dir {redact(root)}, which the driver (node {here}) writes to: nodes that do not share a filesystem need one mounted at the same path on every node, or "  # noqa: E501
            f"checkpoint_dir a URI of storage every node reaches (s3://bucket/run, with credentials on every node). "
            f"Found before training: nothing was lost."
        )


def address(path: object) -> str:
    """What an actor opens a checkpoint location by: a local path, or the full URI (`StoragePath.uri`)."""
    return getattr(path, "uri", None) or str(path)


def last_valid(checkpoint_dir: str | None, run_id: str, skip: Sequence[str] = ()) -> tuple[Path, int] | None:
    """The newest valid checkpoint of run `run_id` under `checkpoint_dir` and its step, or None:
    what a recovery restores (never another run's, nor one named in `skip`)."""
    if checkpoint_dir is None:
        return None
    try:
        where, meta = ckpt.find_valid(checkpoint_dir, warn=lambda _: None, run_id=run_id, skip=skip)
    except ckpt.CheckpointError:
        return None
    return where, meta["step"]


def restore_point(checkpoint_dir: str | None, run: RunState, skip: Sequence[str] = ()) -> tuple[Path, int] | None:
    """What a recovery restores: the newest of the run's own valid checkpoints in `checkpoint_dir`
    and the checkpoint the run was last loaded from (a resume from elsewhere), or None (the initial
    weights); never one named in `skip` (found corrupt), never another run's, whatever its step."""
    found = [
        p for p in (last_valid(checkpoint_dir, run.run_id, skip), run.restored_from) if p and p[0].name not in skip
    ]
    return max(found, key=lambda p: p[1]) if found else None
