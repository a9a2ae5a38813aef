"""A trained model written in its library's format (`Trainer.save_pretrained`): the model's
exporter says what (each raypipe key's name in the checkpoint, keys stored transposed, the
library's config), the driver has each stage's actor write its own safetensors shard, or merges
tp shards and ep experts itself, and writes the index that maps every tensor to its shard, so
`AutoModelForCausalLM.from_pretrained(dir)` loads it.

An exporter (`models.hf.export.HFExporter`, `models.gpt_export.GPT2Exporter`) has `names(specs)`,
`write_config(directory, dtype)`, and optionally `transposed(names)` (keys stored transposed)
and `check()` (refuses a model its format cannot hold)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from raypipe.actors.io.checkpoint_io import save_tensors
from raypipe.core.errors import RaypipeError
from raypipe.core.layers import LayerSpec
from raypipe.driver.results import gather
from raypipe.driver.whole_weights import merged
from raypipe.models.hf.tensor_files import INDEX


def save_pretrained(
    model: object, stages: Sequence[Sequence[object]], specs: Sequence[LayerSpec], directory: str, tp: int, merge: bool
) -> None:
    """Writes the model held by one replica's actors (per stage, its tp ranks) in its library's
    format, LoRA adapters folded into the base weights when `merge` (else the base alone).

    Raises:
        RaypipeError: the model has no such format (a bare list of layers).
        ConfigError: its exporter's format cannot hold this model (`check`).
    """
    exporter = getattr(model, "exporter", None)
    if exporter is None:
        raise RaypipeError(
            "this model has no pretrained format to save to: save_pretrained works for models from "
            "raypipe.models.hf, and for the reference GPT as raypipe.models.gpt_export.model(cfg); use "
            "save() for a raypipe checkpoint, or state_dict() for the weights."
        )
    if hasattr(exporter, "check"):
        exporter.check()
    names = exporter.names(specs)
    transposed = exporter.transposed(names) if hasattr(exporter, "transposed") else []
    exporter.write_config(directory, save_shards(stages, names, directory, tp, transposed, merge))


def save_shards(
    stages: Sequence[Sequence[Any]],
    names: dict[str, str | None],
    directory: str,
    tp: int,
    transpose: Sequence[str] = (),
    merge: bool = False,
) -> torch.dtype:
    """Writes one replica's weights as safetensors shards under `names` (raypipe key -> checkpoint
    key), with their index; returns the weights' dtype. With tp = 1 each stage's actor writes its
    own layers, a shard each (its memory grows by one layer's bytes at most); tp shards are merged
    through the driver one stage at a time, a shard per stage, and so are the experts of a stage
    whose list holds the actors of several ep ranks (tp each).
    `transpose`: raypipe keys stored transposed in the checkpoint (GPT-2's Conv1D weights)."""
    os.makedirs(directory, exist_ok=True)
    if all(len(stage) == tp == 1 for stage in stages):  # each actor writes its layers, one file each
        layers = 1 + max(int(k.partition(".")[0]) for k in names)
        calls = [stage[0].save_tensors.remote(directory, names, layers, list(transpose), merge) for stage in stages]
        write_index(directory, [file for part in gather(calls, "save_pretrained") for file in part])
    else:
        files = [shard_name(s, len(stages)) for s in range(len(stages))]
        written = []
        for stage, path in zip(stages, [os.path.join(directory, f) for f in files]):
            state: dict[str, torch.Tensor] = {}
            for first in range(0, len(stage), tp):  # each ep rank's actors: its experts
                state.update(merged([stage[first : first + tp]], "state_dict", tp))
            written.append(save_tensors(state, names, path, transpose))
        write_index(directory, list(zip(files, written)))
    return getattr(torch, gather([stages[0][0].info.remote()], "save_pretrained")[0].dtype)


def shard_name(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def write_index(directory: str, written: Sequence[tuple[str, dict[str, int]]]) -> None:
    """The index transformers reads to find each tensor's shard."""
    weight_map = {key: name for name, sizes in written for key in sizes}
    total = sum(size for _, sizes in written for size in sizes.values())
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
