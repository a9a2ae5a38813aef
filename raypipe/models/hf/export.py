"""A trained raypipe model back in transformers' format: `config.json`, one safetensors shard
per stage (each written by that stage's actor from its own weights) and the index that maps
every tensor to its shard, so `AutoModelForCausalLM.from_pretrained(dir)` loads it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from raypipe.layers import LayerSpec
from raypipe.models.hf.causal_lm_layers import checkpoint_keys
from raypipe.models.hf.skeleton import Plan, causal_lm_class
from raypipe.models.hf.tensor_files import INDEX


class HFExporter:
    """How a model's raypipe keys (`"<layer>.<name>"`) map onto its transformers checkpoint."""

    def __init__(self, config: Any, plan: Plan) -> None:
        self.config, self.plan = config, plan

    def names(self, specs: Sequence[LayerSpec]) -> dict[str, str | None]:
        """raypipe key -> checkpoint key, None for a tied head (transformers ties it on load).
        The layers are built on the meta device: nothing is allocated."""
        tied = set(self.plan.tied) if getattr(self.config, "tie_word_embeddings", False) else set()
        names: dict[str, str | None] = {}
        for i, spec in enumerate(specs):
            with torch.device("meta"):
                module = spec.build()
            for local, key in checkpoint_keys(module).items():
                names[f"{i}.{local}"] = None if key in tied else key
        return names

    def save(
        self, stages: Sequence[Sequence[Any]], specs: Sequence[LayerSpec], directory: str, tp: int, merge: bool = False
    ) -> None:
        """Writes the model of one replica's actors (per stage, its tp ranks) to `directory`, LoRA
        adapters folded into the base weights when `merge` (else the base alone)."""
        self.write_config(directory, save_shards(stages, self.names(specs), directory, tp, merge=merge))

    def prefixes(self, specs: Sequence[LayerSpec]) -> list[list[tuple[str, str]]]:
        """Per layer, its (local prefix, checkpoint prefix) pairs (built on the meta device)."""
        out = []
        for spec in specs:
            with torch.device("meta"):
                out.append(list(spec.build().prefixes))
        return out

    def write_config(self, directory: str, dtype: torch.dtype) -> None:
        config = self.config
        config.architectures = config.architectures or [_causal_lm_class(config)]
        config.dtype = dtype
        config.save_pretrained(directory)


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
    from raypipe.actors.io.checkpoint_io import save_tensors
    from raypipe.driver.results import gather
    from raypipe.driver.whole_weights import merged

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


def _causal_lm_class(config: Any) -> str:
    return causal_lm_class(config).__name__
