"""The dataset reader: a Ray actor that reads a `ray.data.Dataset` in a fixed order (or calls a
function of the step), one batch per step, and cuts each batch into the step's parts for the
stage actors.

The parts go into Ray's object store and the driver receives only references to them, which it
hands to the first and last stages' calls: the batches never pass through the driver process.
Batch k is the k-th `batch_size` rows of the dataset read in order (`preserve_order`), epoch
after epoch, so the data position of a run is its step: a resumed run, or steps replayed after
a recovery, read the same batches (`batch(step)` re-reads from the start when asked for a step
it has passed). In an actor-driven run (`TrainConfig.actor_steps`) the stage actors ask it
themselves, several for one step: the newest batches are kept, each read once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from raypipe.core.errors import BatchError
from raypipe.core.layers import LossFunction
from raypipe.data.batches import Prepared, prepare

if TYPE_CHECKING:
    from ray.data import Dataset


def default_collate(batch: dict[str, np.ndarray]) -> tuple[object, object]:
    """A batch of rows as `(x, y)`: the columns `x` and `y`, or `input_ids` and `labels`, or
    `input_ids` alone as language-model sequences (inputs all but the last token, targets all
    but the first)."""
    columns = set(batch)
    tensor = lambda name: torch.from_numpy(np.require(batch[name], requirements=["C", "W"]))  # noqa: E731
    if {"x", "y"} <= columns:
        return tensor("x"), tensor("y")
    if {"input_ids", "labels"} <= columns:
        return tensor("input_ids"), tensor("labels")
    if "input_ids" in columns:
        ids = tensor("input_ids")
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    raise BatchError(
        f"the dataset's columns are {sorted(columns)}: name them x and y, or input_ids (and labels), "
        f"or give collate=fn(batch of numpy columns) -> (x, y)"
    )


KEPT = 16  # batches kept for the other actors asking for the same steps
INLINE_BYTES = 64 * 1024  # a part this small travels inside the answer, not through the object store


class DatasetReader:
    """Reads `dataset` in order, `batch_size` rows per step, each batch `collate`d into `(x, y)`
    and cut for `dp` replicas x `microbatches` (`raypipe.data.batches.prepare`); or, with
    `function` and no dataset, takes step k's `(x, y)` from `function(k)`. `cpus`: the CPUs Ray
    Data may use where the dataset sets no limit of its own (those free beside the trainer's actors):
    its executor then neither queues tasks no CPU is left for nor asks an autoscaler for more, which
    Ray's status would show as pending demands while training is healthy."""

    def __init__(
        self,
        dataset: Dataset | None,
        batch_size: int,
        collate: Callable[[dict[str, np.ndarray]], tuple[object, object]] | None,
        dp: int,
        microbatches: int,
        loss_fn: LossFunction,
        function: Callable[[int], tuple[object, object]] | None = None,
        cpus: float | None = None,
    ) -> None:
        self.function, self.kept = function, {}  # (step, cut) -> Prepared, the newest KEPT
        self.dp, self.microbatches, self.loss_fn = dp, microbatches, loss_fn
        self.rows: Iterator[dict] | None = None
        self.position = 0  # the step whose batch comes next
        if dataset is None:  # a function's reader (`use` may set the function later)
            return
        context = dataset.context
        context.execution_options.preserve_order = True  # the same batches in the same order, every read
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        limits = context.execution_options.resource_limits
        if cpus is not None and limits.cpu == float("inf"):
            context.execution_options.resource_limits = limits.copy(cpu=max(1.0, cpus))
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate or default_collate

    def use(
        self, function: Callable[[int], tuple[object, object]], dp: int, microbatches: int, loss_fn: LossFunction
    ) -> None:
        """From now on step k's `(x, y)` is `function(k)`, cut for `dp` x `microbatches`: a function
        reader kept for the next `fit` of the same trainer, which forgets the batches it made."""
        self.function, self.dp, self.microbatches, self.loss_fn = function, dp, microbatches, loss_fn
        self.forget()

    def forget(self) -> None:
        """Drops the batches kept for the actors (a fit ended: their stored parts are freed)."""
        self.kept = {}

    def stop(self) -> None:
        """Ends the read (Ray Data's executor shut down in order) and then this actor, so that it
        never dies in the middle of Ray Data's work, whose threads would then report a Ray gone
        (or, racing its shutdown, start a Ray of their own)."""
        import ray

        if self.rows is not None:
            self.rows.close()  # the generator's end shuts the dataset's streaming executor down
            self.rows = None
        self.kept = {}
        ray.actor.exit_actor()

    def __repr__(self) -> str:  # the Ray dashboard and its log lines show it; Ray reads it once, as it starts
        what = (
            "a function's batches"
            if self.function is not None
            else f"a Dataset, {getattr(self, 'batch_size', '?')} rows a step"
        )
        return f"DatasetReader({what})"

    def _epochs(self) -> Iterator[dict]:
        while True:
            count = 0
            for batch in self.dataset.iter_batches(batch_size=self.batch_size, batch_format="numpy", drop_last=True):
                count += 1
                yield batch
            if count == 0:
                raise BatchError(f"the dataset holds fewer than batch_size={self.batch_size} rows: not one batch")

    def batch(self, step: int, cut_for: tuple[int, int] | None = None, inline: bool = False) -> Prepared:
        """Step `step`'s batch, cut and stored: `Prepared.packed` holds the references (with
        `inline`, small parts themselves: for the actors, never for the driver).
        `cut_for`: (dp, microbatches) from now on (an elastic run's new topology)."""
        if cut_for is not None:
            self.dp, self.microbatches = cut_for
        key = (step, (self.dp, self.microbatches), inline)
        if key not in self.kept:
            self.kept[key] = self._read(step, inline)
            for old in sorted(self.kept)[:-KEPT]:
                del self.kept[old]
        return self.kept[key]

    def batches(self, first: int, count: int, cut_for: tuple[int, int] | None = None) -> list[object]:
        """The batches of `count` steps from `first` (`batch`), for an actor-driven run's actors,
        which ask a few steps at a time; where one cannot be made, its error ends the list."""
        made: list[object] = []
        for step in range(first, first + count):
            try:
                made.append(self.batch(step, cut_for, inline=True))
            except Exception as error:  # noqa: BLE001 - raised by every actor at that step
                made.append(error)
                break
        return made

    def _read(self, step: int, inline: bool) -> Prepared:
        import ray

        from raypipe.transport.wire import pack_microbatches

        if self.function is not None:
            x, y = self.function(step)
        else:
            x, y = self._next_rows(step)
        cut = prepare(x, y, self.dp, self.microbatches, self.loss_fn)
        packed = [
            (_stored(ray, pack_microbatches(list(xs)), inline), _stored(ray, pack_microbatches(list(ys)), inline))
            for xs, ys in zip(cut.inputs, cut.targets)
        ]
        return Prepared(None, None, cut.weights, cut.samples, cut.tokens, cut.varying, packed)

    def _next_rows(self, step: int) -> tuple[object, object]:
        if self.rows is None or step < self.position:
            self.rows, self.position = self._epochs(), 0
        while self.position < step:
            next(self.rows)
            self.position += 1
        rows = next(self.rows)
        self.position += 1
        return self.collate(rows)


def _stored(ray: ModuleType, part: object, inline: bool) -> object:
    """A batch's part as it is handed on: stored once in Ray's object store and handed on by
    reference; with `inline`, by value when small (one fetch less for each actor that takes it)."""
    return part if inline and _nbytes(part) < INLINE_BYTES else ray.put(part)


def _nbytes(part: object) -> int:
    """The bytes of a packed part's arrays (`pack_microbatches`: a `Packed`, or a tree of them);
    INLINE_BYTES for anything else, which then goes through the object store."""
    from raypipe.transport.wire import Packed

    if isinstance(part, Packed):
        return part.array.nbytes
    if torch.is_tensor(part) or isinstance(part, np.ndarray):
        return part.nbytes
    if isinstance(part, (list, tuple)):
        return sum(_nbytes(item) for item in part)
    if isinstance(part, dict):
        return sum(_nbytes(item) for item in part.values())
    return INLINE_BYTES
