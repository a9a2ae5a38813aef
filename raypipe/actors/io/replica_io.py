"""What one actor hands a new one after a node loss (issue 38), instead of a checkpoint: its
layers' weights, optimizer state and fp32 masters, with the RNG state and the normalisation
layers' running statistics as they stood when the failed step began. A new actor of the same
tp rank (and ep rank) in another replica, or in a topology split otherwise, takes the layers it
holds from it and goes on from the failed step exactly as the survivor would have.

A survivor's weights are consistent: the step's closing agreement comes before any optimizer
step, so an actor either applied a step or did not (`completed` says which), and the driver
takes only survivors at the step it retries. Under ZeRO a replica holds a share of its stage's
state only; none is handed over (the driver falls back to the checkpoint). Plain torch, no Ray.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raypipe.actors.io.checkpoint_io import load_layer, saved_state
from raypipe.actors.optim.optimizer import OptimizerState
from raypipe.actors.stage_model import StageModel
from raypipe.core.errors import StageError

# the buffers a training forward changes: BatchNorm's (and its kin's) running statistics
_NORM = nn.modules.batchnorm._NormBase


def running_stats(model: StageModel) -> list[tuple[int, str, torch.Tensor]]:
    """The buffers a training forward changes in place, as (layer index, key in the layer's state,
    tensor): normalisation layers' running statistics (none in most LLMs). Found once per actor."""
    found = []
    for index, layer in zip(model.layers, model.module):
        for prefix, module in layer.named_modules():
            if isinstance(module, _NORM) and module.track_running_stats:
                for name, value in module.named_buffers(recurse=False):
                    if value is not None:
                        found.append((index, f"{prefix}.{name}" if prefix else name, value))
    return found


def step_start(stats: list[tuple[int, str, torch.Tensor]]) -> dict[str, Any]:
    """What a step changes before its optimizer step, as it begins: the RNG state (dropout) and
    the running statistics `stats` (`running_stats`); microseconds a step."""
    return {"rng": torch.get_rng_state(), "buffers": {(i, key): v.detach().clone() for i, key, v in stats}}


def rewind_running_stats(stats: list[tuple[int, str, torch.Tensor]], started: dict[str, Any] | None) -> None:
    """Puts the running statistics `stats` back as the step `started` (`step_start`) found them: a
    step whose update is not applied (skipped as non-finite, failed) leaves every buffer as it was,
    so a NaN batch cannot poison a BatchNorm's statistics (and through them evaluation and checkpoints)."""
    if started is None:
        return
    with torch.no_grad():
        for index, key, value in stats:
            value.copy_(started["buffers"][(index, key)])


def take(model: StageModel, optim: OptimizerState, started: dict[str, Any], name: str) -> dict[str, Any]:
    """This actor's state for another to load (`restore`), on the host: per layer its weights (in a
    LoRA run its adapters: the base is rebuilt from the model), optimizer state and masters, with
    the RNG and running statistics of `started` (`step_start`: of a step begun and not applied,
    or of now).

    Raises:
        StageError: the stage holds a ZeRO share of its state, not all of it.
    """
    if optim.zero_active() or optim.sharded is not None:
        raise StageError(f"{name} holds a ZeRO share of its stage's state: restore from a checkpoint")
    layers = {}
    for index, layer in zip(model.layers, model.module):
        weights = {k: v.detach().cpu().clone() for k, v in saved_state(layer, model.lora).items()}
        weights |= {key: value.cpu() for (i, key), value in started["buffers"].items() if i == index}
        optimizer, masters = {}, {}
        for param_name, p in layer.named_parameters():
            stepped = optim.stepped(p)
            if optim.optimizer is not None and stepped in optim.optimizer.state:
                optimizer[param_name] = {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for k, v in optim.optimizer.state[stepped].items()
                }
            if p in optim.masters:
                masters[param_name] = optim.masters[p].detach().cpu().clone()
        layers[index] = {"weights": weights, "optimizer": optimizer, "masters": masters}
    return {"layers": layers, "rng": started["rng"].clone(), "scaler": optim.scaler_state()}


def nbytes(state: dict[str, Any]) -> int:
    """The bytes of tensors in what `take` returned."""
    total = 0
    for layer in state["layers"].values():
        values = [*layer["weights"].values(), *layer["masters"].values()]
        values += [v for entry in layer["optimizer"].values() for v in entry.values()]
        total += sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))
    return total


def restore(model: StageModel, optim: OptimizerState, states: list[dict[str, Any]], name: str) -> None:
    """Loads this actor's layers from `states` (`take`'s, of survivors with its tp and ep rank;
    each layer from the first that holds it), and the RNG state and loss scale of the one holding
    its first layer.

    Raises:
        StageError: a layer is in none of `states`, or does not fit.
    """
    by_layer: dict[int, dict[str, Any]] = {}
    for state in states:
        for index, entry in state["layers"].items():
            by_layer.setdefault(index, entry)
    missing = [index for index in model.layers if index not in by_layer]
    if missing:
        raise StageError(f"{name}: no surviving replica handed over layers {missing}")
    try:
        for index, layer in zip(model.layers, model.module):
            entry = by_layer[index]
            load_layer(layer, entry["weights"], model.lora)
            for param_name, p in layer.named_parameters():
                stepped = optim.stepped(p)
                if p in optim.masters:  # a bf16 weight's fp32 master: exact, where a checkpoint's is not
                    with torch.no_grad():
                        optim.masters[p].copy_(entry["masters"].get(param_name, p))
                if optim.optimizer is None:
                    continue
                saved = entry["optimizer"].get(param_name)
                if saved is None:
                    optim.optimizer.state.pop(stepped, None)
                else:
                    optim.optimizer.state[stepped] = {
                        k: v.to(stepped.device) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in saved.items()
                    }
    except Exception as error:
        raise StageError(
            f"{name} could not load a surviving replica's state: {type(error).__name__}: {error}"
        ) from error
    first = next(state for state in states if model.layers[0] in state["layers"])
    torch.set_rng_state(first["rng"])
    optim.restore_scaler(first["scaler"])
