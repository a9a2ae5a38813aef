"""A stage's calls on its state: its weights whole (state dicts, adapters, exports, gradients),
its part of a checkpoint (`checkpoint_io`), and after a node loss its state handed to new actors
from memory (`replica_io`). A part of `StageActor`, over its `Stage`'s model, optimizer state,
executor and names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from raypipe.actors.io import checkpoint_io, replica_io
from raypipe.actors.optim import zero3
from raypipe.checkpoint import storage
from raypipe.core.protocol import HeldState

if TYPE_CHECKING:
    from raypipe.actors.stage import Stage


class StateCalls:
    """Weights, checkpoints and hand-overs of one stage (`completed`, `applied_call` and the
    `applying` lock are the `Stage`'s: `Stage.apply_step` sets them)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def save_tensors(
        self,
        directory: str,
        names: dict[str, str | None],
        layers: int,
        transpose: Sequence[str] = (),
        merge: bool = False,
    ) -> list[tuple[str, dict[str, int]]]:
        """Writes this stage's base weights (LoRA adapters folded in when `merge`) to `directory`, one
        safetensors file per layer (`model-<layer>-of-<layers>.safetensors`: a stage's memory grows by
        one layer's bytes at most) under `names` (global key -> the file's key; None leaves a key out;
        keys in `transpose` transposed), for exports such as `Trainer.save_pretrained`. Returns each
        file's name with the keys it holds and their sizes."""
        import os

        written = []
        for index, state in self.stage.model.export_layers(merge):
            name = f"model-{index + 1:05d}-of-{layers:05d}.safetensors"
            sizes = checkpoint_io.save_tensors(state, names, os.path.join(directory, name), transpose)
            if sizes:
                written.append((name, sizes))
        return written

    def adapters(self) -> dict[str, torch.Tensor]:
        return self.stage.model.adapters()

    def peft_adapters(self) -> dict[str, torch.Tensor]:
        return self.stage.model.peft_adapters()

    def load_peft_adapters(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Loads this stage's adapters from peft's saved names; returns the keys it took."""
        with zero3.whole(self.stage.optim.sharded, loading=True):
            return self.stage.model.load_peft_adapters(state)

    def load_adapters(self, state: dict[str, torch.Tensor]) -> None:
        """Replaces this stage's LoRA adapters (global keys, every one of them)."""
        with zero3.whole(self.stage.optim.sharded, loading=True):
            self.stage.model.load_adapters(state, self.stage.name)

    def hold_weights(self, on: bool, gradients: bool = False) -> None:  # ActorGroup.whole_weights
        zero3.hold(self.stage.optim.sharded, on, gradients)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under global keys (`"<layer index>.<name>"`); this tp rank's shards."""
        return self.stage.model.state_dict()

    def tensor_shards(self) -> dict[str, tuple[int, int]]:
        """Global key -> (dim, chunks) of every tensor split across tp ranks, for merging."""
        return self.stage.model.tensor_shards()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads this stage's full (unsplit) weights from global keys, keeping this rank's shards.

        Every key of the stage must be present.
        """
        with zero3.whole(self.stage.optim.sharded, loading=True):
            self.stage.model.load_state_dict(state, self.stage.name)
        self.stage.optim.sync_masters()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients (as the optimizer used them) under global keys; this rank's shards."""
        return self.stage.model.gradients()

    def hand_over(self) -> tuple[HeldState, dict[str, object]]:
        """This actor's state for new actors after a node loss (`replica_io.take`), as of the step it
        last completed: a step begun and not applied is undone (its RNG, running statistics). The
        driver calls it in the "control" concurrency group, so it answers while a step stuck on a
        lost peer still holds the actor's main thread.

        Returns:
            (what it holds, told to the driver; the state itself, passed on to the new actors).
        """
        with self.stage.applying:
            executor = self.stage.executor
            mid_step = executor.current_call != self.stage.applied_call
            started = executor.began_from if mid_step else replica_io.step_start(executor.running_stats)
            state = replica_io.take(self.stage.model, self.stage.optim, started, self.stage.name)
            held = HeldState(
                self.stage.name,
                self.stage.tp.rank,
                self.stage.ep.rank,
                tuple(self.stage.model.layers),
                self.stage.completed,
                replica_io.nbytes(state),
            )
        return held, state

    def take_over(self, completed: int, *states: dict[str, object]) -> None:
        """Loads its layers from survivors' `hand_over` states (`replica_io.restore`); its weights
        then include `completed` steps."""
        replica_io.restore(self.stage.model, self.stage.optim, list(states), self.stage.name)
        self.stage.completed = completed

    def save_checkpoint(self, directory: str) -> dict[str, object]:
        """Writes this stage's layers, their optimizer state and its RNG state (`checkpoint_io`), and
        a preference run's frozen copy of its starting adapters (`objectives.reference`) where it
        holds whole tensors (tp 1, ep 1); "reference": whether that copy is in the checkpoint."""
        s = self.stage
        saved = checkpoint_io.save_stage(s.model, s.optim, directory, s.index, s.name, s.tp_ranks, s.ep_ranks)
        copy = s.reference is not None and s.reference.adapters is not None
        whole = s.model.tp.size == 1 and s.model.ep.size == 1
        if copy and whole and saved["files"]:
            from raypipe.checkpoint.storage import location
            from raypipe.objectives.reference import save_reference

            saved["files"].update(save_reference(s.reference, list(s.model.layers), location(directory)))
        return {**saved, "reference": not copy or whole}

    def read_text(self, path: str) -> str | None:  # does this node see checkpoint_dir? (checkpoints.check_reachable)
        return storage.read_text(path)

    def check_checkpoint(self, directory: str) -> list[str]:  # why it cannot load (checkpoint_io.check_stage)
        return checkpoint_io.check_stage(self.stage.model, directory, self.stage.name)

    def verify_checkpoint(self, directory: str) -> list[str]:  # its files' corruption (checkpoint_io.verify_stage)
        return checkpoint_io.verify_stage(self.stage.model, directory, self.stage.index, self.stage.name)

    def check_state_dict(self, state: dict[str, torch.Tensor]) -> list[str]:  # likewise for load_state_dict
        return checkpoint_io.check_state(self.stage.model, state)

    def restore_reference(self, directory: str) -> None:
        """Takes the run's frozen copy of its starting adapters, its DPO or GRPO reference policy,
        from the checkpoint at `directory` (`objectives.reference.load_reference`)."""
        import json

        from raypipe.checkpoint import layout as ckpt
        from raypipe.checkpoint.storage import location
        from raypipe.objectives.reference import load_reference

        root = location(directory)
        saved = json.loads((root / ckpt.MANIFEST).read_text())["files"]
        self.stage.reference = load_reference(list(self.stage.model.layers), root, saved)

    def load_checkpoint(
        self, directory: str, loss_scaler: dict, restore_rng: bool, optimizer_state: bool = True, step: int = 0
    ) -> None:
        """Loads this stage's layers and optimizer state (or starts the optimizer afresh) from the
        checkpoint of step `step`."""
        s = self.stage
        checkpoint_io.load_stage(
            s.model, s.optim, directory, s.index, s.name, loss_scaler, restore_rng, optimizer_state
        )
        s.completed = step
