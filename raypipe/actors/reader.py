"""The dataset reader: a Ray actor that reads a `ray.data.Dataset` in a fixed order, one batch
per step, and cuts each batch into the step's parts for the stage actors.

The parts go into Ray's object store and the driver receives only references to them, which it
hands to the first and last stages' calls: the batches never pass through the driver process.
Batch k is the k-th `batch_size` rows of the dataset read in order (`preserve_order`), epoch
after epoch, so the data position of a run is its step: a resumed run, or steps replayed after
a recovery, read the same batches (`batch(step)` re-reads from the start when asked for a step
it has passed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from raypipe.data.batches import Prepared, prepare
from raypipe.errors import BatchError


def default_collate(batch: dict[str, np.ndarray]) -> tuple[Any, Any]:
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


class DatasetReader:
    """Reads `dataset` in order, `batch_size` rows per step, each batch `collate`d into `(x, y)`
    and cut for `dp` replicas x `microbatches` (`raypipe.data.batches.prepare`)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate: Callable[[dict], tuple[Any, Any]] | None,
        dp: int,
        microbatches: int,
        loss_fn: Any,
    ) -> None:
        context = dataset.context
        context.execution_options.preserve_order = True  # the same batches in the same order, every read
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate or default_collate
        self.dp, self.microbatches, self.loss_fn = dp, microbatches, loss_fn
        self.rows: Iterator[dict] | None = None
        self.position = 0  # the step whose batch comes next

    def _epochs(self) -> Iterator[dict]:
        while True:
            count = 0
            for batch in self.dataset.iter_batches(batch_size=self.batch_size, batch_format="numpy", drop_last=True):
                count += 1
                yield batch
            if count == 0:
                raise BatchError(f"the dataset holds fewer than batch_size={self.batch_size} rows: not one batch")

    def batch(self, step: int, cut_for: tuple[int, int] | None = None) -> Prepared:
        """Step `step`'s batch, cut and stored: `Prepared.packed` holds the references.
        `cut_for`: (dp, microbatches) from now on (an elastic run's new topology)."""
        if cut_for is not None:
            self.dp, self.microbatches = cut_for
        import ray

        from raypipe.transport.wire import pack_microbatches

        if self.rows is None or step < self.position:
            self.rows, self.position = self._epochs(), 0
        while self.position < step:
            next(self.rows)
            self.position += 1
        x, y = self.collate(next(self.rows))
        self.position += 1
        cut = prepare(x, y, self.dp, self.microbatches, self.loss_fn)
        packed = [
            (ray.put(pack_microbatches(list(xs))), ray.put(pack_microbatches(list(ys))))
            for xs, ys in zip(cut.inputs, cut.targets)
        ]
        return Prepared(None, None, cut.weights, cut.samples, cut.tokens, cut.varying, packed)
