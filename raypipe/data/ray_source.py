"""A token dataset's training batches as a Ray Dataset, so that a job on a cluster reads its data
through Ray Data (`fit(dataset, ...)`: made in Ray Data's tasks, cut by the reader actor, never
through the driver) and still sees exactly the batches the driver would make.

Rows `k * batch_size ... (k + 1) * batch_size - 1` are `TokenDataset.batch(k, batch_size, seed)`,
so the dataset read in order is the driver's `batch(step)` step by step, and a run is the same
whichever way its data travels.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def token_batches(data: Any, batch_size: int, seed: int, steps: int, labels_are_inputs: bool = False) -> Any:
    """`steps` batches of `data` (a `TokenDataset`) as a `ray.data.Dataset` with columns
    `input_ids` and `labels` (the next tokens, or the inputs themselves for a loss that shifts
    them: `labels_are_inputs`). The tokens are stored once in Ray's object store."""
    import ray

    stored = ray.put(data)

    def make(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens, ids = ray.get(stored), rows["id"]
        inputs, labels = [], []
        for k in np.unique(ids // batch_size):
            x, y = tokens.batch(int(k), batch_size, seed)
            chosen = ids[ids // batch_size == k] % batch_size
            inputs.append(x.numpy()[chosen])
            labels.append((x if labels_are_inputs else y).numpy()[chosen])
        return {"input_ids": np.concatenate(inputs), "labels": np.concatenate(labels)}

    return ray.data.range(steps * batch_size, override_num_blocks=max(1, min(steps, 200))).map_batches(
        make, batch_size=batch_size, batch_format="numpy"
    )
