"""Checkpoint orchestration across a trainer's actors: every actor saves or loads its own
layers in lock-step (`raypipe.actors.checkpoint_io`), the driver writes the manifest that
commits a save and picks the checkpoint a load or a recovery restores
(`raypipe.checkpoint` owns the format)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from raypipe import checkpoint as ckpt
from raypipe.storage import location
from raypipe.runtime.results import gather


def run_meta(step: int, num_layers: int, plan: Sequence[Sequence[int]], run: str, config: Any,
             base: Any = None) -> dict[str, Any]:
    """What a checkpoint's manifest says about the run beside the files; `base`: in a LoRA run,
    the identity of the frozen base model its adapters belong to (`raypipe.model.Model.identity`)."""
    return {
        "base": base,
        "step": step,
        "data_position": step,  # batches are a function of the step
        "num_layers": num_layers,
        "pp": config.pp,
        "plan": [list(r) for r in plan],
        "run": run,
        "config": config.to_dict(),
    }


def save(actors: Sequence[Any], names: Sequence[str], root: str, step: int, meta: dict[str, Any],
         keep: int) -> Path:
    """Saves checkpoint `<root>/step-<step>`: every actor writes its files, then the manifest
    (with `meta`, the loss scaler and every file's checksum) commits it; `keep` newest stay."""
    partial = ckpt.begin(root, step)
    try:
        # every actor takes part: under ZeRO-1 each replica holds a share of the optimizer state
        parts = gather([a.save_checkpoint.remote(address(partial)) for a in actors], "save", actors, names)
    except BaseException:
        ckpt.remove(partial)
        raise
    files = {name: entry for part in parts for name, entry in part["files"].items()}
    return ckpt.commit(partial, files, {**meta, "loss_scaler": parts[0]["loss_scaler"]}, keep)


def load(actors: Sequence[Any], names: Sequence[str], path: str, step: int | None, num_layers: int,
         plan: Sequence[tuple[int, int]], log: Callable[[str], None], base: Any = None) -> tuple[Path, int]:
    """Restores a checkpoint saved by any topology into every actor.

    Returns:
        (the checkpoint directory, the step it holds).

    Raises:
        CheckpointError: nothing valid to restore, a model of another size, or (`base`: a LoRA
            run's base identity) adapters that belong to another base, or none where some are due.
    """
    if step is not None:
        where, meta = ckpt.find_valid(path, step=step, warn=log)
    else:
        where, meta = ckpt.resolve(path, warn=log)
    if meta["num_layers"] != num_layers:
        raise ckpt.CheckpointError(f"{where} holds a {meta['num_layers']}-layer model; this trainer has {num_layers} layers.")
    if meta.get("base") != base:
        raise ckpt.CheckpointError(
            f"{where} was saved by a run on base {meta.get('base')}, but this trainer's is {base}: a LoRA "
            f"checkpoint holds adapters only, which fit only the base they were trained on (and a full "
            f"checkpoint does not load into a LoRA run). Load it with that base model and TrainConfig.lora."
        )
    same_split = meta["plan"] == [list(r) for r in plan]
    gather([a.load_checkpoint.remote(address(where), meta["loss_scaler"], same_split) for a in actors],
           "load", actors, names)
    return where, meta["step"]


def check_reachable(actors: Sequence[Any], names: Sequence[str], root: str) -> None:
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
        raise ckpt.CheckpointError(f"the driver cannot write to checkpoint_dir {root}: {error}") from None
    try:
        seen = gather([a.read_text.remote(address(marker)) for a in actors], "checkpoint_dir check", actors, names)
    finally:
        ckpt.remove_file(marker)
    blind = [(a, n) for a, n, text in zip(actors, names, seen) if text != token]
    if blind:
        infos = gather([a.info.remote() for a, _ in blind[:6]], "stage_info")
        who = ", ".join(f"{name} (node {info['node_id'][:12]})" for (_, name), info in zip(blind, infos))
        here = ray.get_runtime_context().get_node_id()[:12]
        raise ckpt.CheckpointError(
            f"{who} cannot read checkpoint_dir {root}, which the driver (node {here}) writes to: nodes that do not share a filesystem need one mounted at the same path on every node, or "
            f"checkpoint_dir a URI of storage every node reaches (s3://bucket/run, with credentials on every node). "
            f"Found before training: nothing was lost.")


def address(path: Any) -> str:
    """What an actor opens a checkpoint location by: a local path, or the full URI (`StoragePath.uri`)."""
    return getattr(path, "uri", None) or str(path)


def last_valid(checkpoint_dir: str | None) -> Path | None:
    """The newest valid checkpoint under `checkpoint_dir`, or None."""
    if checkpoint_dir is None:
        return None
    try:
        return ckpt.find_valid(checkpoint_dir, warn=lambda _: None)[0]
    except ckpt.CheckpointError:
        return None
