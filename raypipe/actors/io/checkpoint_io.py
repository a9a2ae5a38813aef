"""One stage's part of a checkpoint: its layers' weights and optimizer state, one safetensors
file per global layer (whole tensors: tp shards merged, ZeRO shares united, every ep rank's
experts), and its RNG state.

The trainer (`raypipe.trainer`) orchestrates a save or load across the actors and writes
the manifest; `raypipe.checkpoint.layout` owns the file format. Here is what each actor does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from raypipe.actors.optim import zero3
from raypipe.actors.optim.optimizer import OptimizerState
from raypipe.actors.stage_model import StageModel
from raypipe.checkpoint import layout as ckpt
from raypipe.checkpoint.storage import location, redact, scrub
from raypipe.core.errors import StageError
from raypipe.nn import merge, shard
from raypipe.transport import plain


def save_stage(
    model: StageModel,
    optim: OptimizerState,
    directory: str,
    stage: int,
    name: str,
    tp_ranks: list[int],
    ep_ranks: list[int] = (),
) -> dict[str, Any]:
    """Writes this stage's layers, their optimizer state and its RNG state (a collective of the
    stage's dp and tp groups: every replica and rank calls it; under expert parallelism replicas
    1..ep-1 send replica 0 their experts, so each layer's file holds all of them).

    Returns:
        {"files": relative path -> {"sha256", "bytes"}, "loss_scaler": {...}}; files is empty
        on the actors that only contributed (dp rank > 0, tp rank > 0).
    """
    with zero3.whole(optim.sharded):  # ZeRO-3: every weight whole while it is written
        states = optim.state_by_layer()
        if optim.sharded is not None:
            states = _whole_states(model, optim, states)
        if optim.zero_active():  # each replica holds a share: dp rank 0 writes the union
            shares = plain.gather(states, optim.dp_ranks[0], optim.dp_group)
            if optim.dp_rank == 0:
                for share in shares:
                    for index, state in share.items():
                        states[index].update(state)
        nothing = {"files": {}, "loss_scaler": optim.scaler_state()}
        holds_experts = model.ep.size > 1 and optim.dp_rank < model.ep.size
        if optim.dp_rank != 0 and not holds_experts:  # replicas hold the same weights; replica 0 writes them
            return nothing
        models = {index: saved_state(layer, model.lora) for index, layer in zip(model.layers, model.module)}
        if holds_experts:
            models, states = _gather_experts(model, models, states, list(ep_ranks))
            if optim.dp_rank != 0:
                return nothing
        if model.tp.size > 1:  # tp rank 0 merges the shards: checkpoints hold whole tensors
            models, states = _merge_tp_shards(model, models, states, tp_ranks)
            if model.tp.rank != 0:
                return nothing
        root = location(directory)  # a local directory, or a URI every actor writes to (raypipe.checkpoint.storage)
        if isinstance(root, Path) and not root.is_dir():
            import ray

            raise StageError(
                f"{name} on node {ray.get_runtime_context().get_node_id()[:12]} cannot see the "
                f"checkpoint directory {redact(directory)}: multi-node runs need a directory every node shares, or a "
                f"URI of storage every node reaches (checkpoint_dir='s3://bucket/run', raypipe.checkpoint.storage)."
            )
        files = {}
        for index in model.layers:
            files[ckpt.layer_file("model", index)] = ckpt.save_tensors(
                root / ckpt.layer_file("model", index), models[index]
            )
            files[ckpt.layer_file("optim", index)] = ckpt.save_tensors(
                root / ckpt.layer_file("optim", index), states[index]
            )
        rng = ckpt.rng_file(stage)
        files[rng] = ckpt.save_tensors(root / rng, {"torch": torch.get_rng_state()})
        return {"files": files, "loss_scaler": optim.scaler_state()}


Shapes = dict[str, tuple[tuple[int, ...], bool]]  # key -> (full shape, floating point?)


def expected_tensors(
    model: StageModel, j: int, layer: torch.nn.Module, adapters_only: bool
) -> tuple[dict[str, tuple[int, ...] | None], set[str]]:
    """What a checkpoint file (`adapters_only` in a LoRA run: a checkpoint holds the adapters) or a
    state dict must hold for local layer `j`: every tensor of its state with its full shape (tp
    shards put back together), a floating-point one; None for what is not floating point (a
    quantized base's packed storage, whose shape is not the weight's: its presence is checked);
    and the names of the experts other ep ranks hold (present, not checked)."""
    from raypipe.nn.lora import trained_keys

    trained = trained_keys(layer)
    expected = {}
    for key, value in layer.state_dict().items():
        if adapters_only and key not in trained:
            continue
        if not value.is_floating_point():  # packed 4-bit weights, quantization state, counters
            expected[key] = None
            continue
        shape = list(value.shape)
        spec = model.shard_specs.get(f"{j}.{key}")
        if spec is not None and model.tp.size > 1:
            shape[spec.dim] *= model.tp.size
        expected[key] = tuple(shape)
    foreign = {k.partition(".")[2] for k in model.foreign if k.partition(".")[0] == str(j)}
    return expected, foreign


def mismatches(what: str, expected: dict[str, tuple[int, ...] | None], foreign: set[str], got: Shapes) -> list[str]:
    """How `got` (key -> full shape, floating?) fails to fit `expected` (`expected_tensors`), each
    problem in words."""
    problems = [f"{what}: missing {k}" for k in sorted(set(expected) - set(got))]
    problems += [f"{what}: unexpected {k}" for k in sorted(set(got) - set(expected) - foreign)]
    for key in sorted(k for k in set(expected) & set(got) if expected[k] is not None):
        shape, (found, floating) = expected[key], got[key]
        if shape != found:
            problems.append(f"{what}: {key} has shape {list(found)}, the model's is {list(shape)}")
        elif not floating:
            problems.append(f"{what}: {key} is an integer tensor, the model's is a floating-point one")
    return problems


def check_stage(model: StageModel, directory: str, name: str) -> list[str]:
    """What keeps this stage from loading a checkpoint (its files' keys, shapes and kinds of dtype
    against its layers), read from the files' headers; empty when it fits. Nothing changes here:
    the driver loads only when every actor's list is empty, so a load is all or nothing."""
    root = location(directory)
    problems = []
    for j, (index, layer) in enumerate(zip(model.layers, model.module)):
        path = ckpt.existing(root / ckpt.layer_file("model", index))
        try:
            got = ckpt.tensor_shapes(path)
        except Exception as error:  # noqa: BLE001 - missing or unreadable: a problem to report
            problems.append(
                f"{name}: cannot read {ckpt.layer_file('model', index)}: {type(error).__name__}: "
                f"{scrub(str(error), directory)}"
            )
            continue
        problems += mismatches(f"layer {index}", *expected_tensors(model, j, layer, model.lora), got)
    return problems


def verify_stage(model: StageModel, directory: str, stage: int, name: str) -> list[str]:
    """The files of a checkpoint this stage reads (its layers' weights and optimizer state, its
    stage's RNG state) whose size or sha256 differs from the manifest: the check of their
    contents, made where their bytes are rather than on the driver. Empty when all match."""
    root = location(directory)
    try:
        files = json.loads((root / ckpt.MANIFEST).read_text())["files"]
    except Exception as error:  # noqa: BLE001 - the driver read it a moment ago; say what happened
        return [f"{name}: cannot read {ckpt.MANIFEST}: {type(error).__name__}: {scrub(str(error), directory)}"]
    kinds = ("model", "optim", "reference")  # reference: a DPO or GRPO run's starting adapters, when saved
    wanted = [ckpt.layer_file(kind, i) for i in model.layers for kind in kinds] + [ckpt.rng_file(stage)]
    problems = []
    for relative in wanted:
        entry = files.get(relative) or files.get(str(Path(relative).with_suffix(ckpt.LEGACY)))
        if entry is None:  # state it never had: `check_stage` names what is missing
            continue
        path = ckpt.existing(root / relative)
        try:
            problem = ckpt.file_problem(path, int(entry["bytes"]), str(entry["sha256"]))
        except Exception as error:  # noqa: BLE001 - unreadable is as bad as altered
            problem = f"{path}: cannot be read: {type(error).__name__}: {error}"
        if problem:
            problems.append(scrub(problem, directory))
    return problems


def check_state(model: StageModel, state: dict[str, torch.Tensor]) -> list[str]:
    """What keeps this stage from loading `state` (global keys, full tensors): as `check_stage`."""
    problems = []
    for j, (index, layer) in enumerate(zip(model.layers, model.module)):
        prefix = f"{index}."
        got = {
            k[len(prefix) :]: (tuple(v.shape), v.is_floating_point()) for k, v in state.items() if k.startswith(prefix)
        }
        problems += mismatches(f"layer {index}", *expected_tensors(model, j, layer, False), got)
    return problems


def load_stage(
    model: StageModel,
    optim: OptimizerState,
    directory: str,
    stage: int,
    name: str,
    loss_scaler: dict,
    restore_rng: bool,
    optimizer_state: bool = True,
) -> None:
    """Loads this stage's layers and optimizer state from a verified checkpoint, cut to this
    actor's tp shard and (under ZeRO) its share of the optimizer state; `optimizer_state=False`
    (a checkpoint of another optimizer) starts the optimizer afresh instead.

    Raises:
        StageError: a file is missing or does not fit the stage, naming the actor and the directory.
    """
    with zero3.whole(optim.sharded, loading=True):  # ZeRO-3: loaded whole, then cut to slices
        root = location(directory)
        optimizer = optim.optimizer
        try:
            for j, (index, layer) in enumerate(zip(model.layers, model.module)):
                weights = ckpt.load_tensors(ckpt.existing(root / ckpt.layer_file("model", index)))
                local = model.shard_state({f"{j}.{k}": v for k, v in weights.items()})
                load_layer(
                    layer, {k[len(f"{j}.") :]: v for k, v in local.items() if k not in model.foreign}, model.lora
                )
                state = (
                    ckpt.load_tensors(ckpt.existing(root / ckpt.layer_file("optim", index))) if optimizer_state else {}
                )
                if optimizer is not None:
                    _load_layer_state(model, optim, j, layer, state)
            if restore_rng:
                torch.set_rng_state(ckpt.load_tensors(ckpt.existing(root / ckpt.rng_file(stage)))["torch"])
        except StageError:
            raise
        except Exception as error:
            raise StageError(
                f"{name} could not load {redact(directory)}: {type(error).__name__}: {scrub(str(error), directory)}"
            ) from error
    optim.restore_scaler(loss_scaler)
    optim.sync_masters()  # bf16 weights' masters restart from the saved (bf16) weights


def _load_layer_state(
    model: StageModel, optim: OptimizerState, j: int, layer: torch.nn.Module, state: dict[str, dict]
) -> None:
    """Local layer `j`'s optimizer state from its file's whole tensors: this tp rank's shard, and
    under ZeRO-3 this replica's slice of it; parameters without saved state start afresh."""
    tp, optimizer = model.tp, optim.optimizer
    stepped = {p for group in optimizer.param_groups for p in group["params"]}
    for param_name, p in layer.named_parameters():
        if optim.stepped(p) not in stepped or param_name not in state:
            optimizer.state.pop(optim.stepped(p), None)
            continue
        spec = model.shard_specs.get(f"{j}.{param_name}")
        entries = {
            k: shard(v, spec, tp.rank, tp.size) if spec is not None and tp.size > 1 and is_per_element(v) else v
            for k, v in state[param_name].items()
        }
        if optim.sharded is not None:
            entries = {k: optim.sharded.local_state(p, v) for k, v in entries.items()}
        optimizer.state[optim.stepped(p)] = entries


def saved_state(layer: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a layer's checkpoint file holds: its whole state, or in a LoRA run what the run trains
    (the adapters, and the biases and module copies peft trains: `lora.trained_keys`; the frozen
    base is the model directory's, which the manifest identifies)."""
    state = layer.state_dict()
    if not lora:
        return state
    from raypipe.nn.lora import trained_keys

    trained = trained_keys(layer)
    return {k: v for k, v in state.items() if k in trained}


def load_layer(layer: torch.nn.Module, state: dict[str, torch.Tensor], lora: bool) -> None:
    """Loads a layer's checkpoint file: everything, or in a LoRA run exactly what the run trains."""
    if not lora:
        layer.load_state_dict(state)
        return
    from raypipe.nn.lora import trained_keys

    expected = trained_keys(layer)
    if set(state) != expected:
        raise StageError(f"the checkpoint's adapters {sorted(state)[:2]} are not this layer's {sorted(expected)[:2]}")
    layer.load_state_dict(state, strict=False)


def _whole_states(model: StageModel, optim: OptimizerState, states: dict[int, dict]) -> dict[int, dict]:
    """ZeRO-3: dp rank 0 gets every replica's slices of the optimizer state put back together."""
    shares = plain.gather(states, optim.dp_ranks[0], optim.dp_group)
    if optim.dp_rank != 0:
        return states
    for index, layer in zip(model.layers, model.module):
        params = dict(layer.named_parameters())
        for param_name, entry in states[index].items():
            p = params[param_name]
            for key in entry:
                entry[key] = optim.sharded.whole_state(p, [share[index][param_name][key] for share in shares])
    return states


def _gather_experts(
    model: StageModel, models: dict[int, dict], states: dict[int, dict], ep_ranks: list[int]
) -> tuple[dict, dict]:
    """Gathers the experts (weights and optimizer state) of ep ranks 1..ep-1 into ep rank 0's dicts."""
    parts = plain.gather((models, states), ep_ranks[0], model.ep.group)
    if model.ep.rank == 0:
        for other_models, other_states in parts[1:]:
            for index in models:
                models[index].update(other_models[index])
                states[index].update(other_states[index])
    return models, states


def _merge_tp_shards(
    model: StageModel, models: dict[int, dict], states: dict[int, dict], tp_ranks: list[int]
) -> tuple[dict, dict]:
    """Gathers every tp rank's layer weights and optimizer state; rank 0 gets them merged."""
    tp = model.tp
    parts = plain.gather((models, states), tp_ranks[0], tp.group)
    if tp.rank != 0:
        return models, states
    for index in models:
        j = model.local[index]
        for param_name in models[index]:
            spec = model.shard_specs.get(f"{j}.{param_name}")
            if spec is not None:
                models[index][param_name] = merge([p[0][index][param_name] for p in parts], spec)
        for param_name, state in states[index].items():
            spec = model.shard_specs.get(f"{j}.{param_name}")
            for key, value in state.items():
                if spec is not None and is_per_element(value):
                    state[key] = merge([p[1][index][param_name][key] for p in parts], spec)
    return models, states


def is_per_element(value: object) -> bool:
    """Optimizer state shaped like its parameter (momentum, Adam moments), not a scalar like `step`."""
    return torch.is_tensor(value) and value.dim() > 0


def save_tensors(
    state: dict[str, torch.Tensor], names: dict[str, str | None], path: str, transpose: Any = ()
) -> dict[str, int]:
    """Writes the tensors of `state` under their `names` (those named None are left out; those
    in `transpose` transposed) to one safetensors file; returns the names written and their
    sizes in bytes."""
    from safetensors.torch import save_file

    flip = set(transpose)
    tensors = {
        names[k]: (v.t() if k in flip else v).detach().cpu().contiguous() for k, v in state.items() if names.get(k)
    }
    # a new file put in place, never the old one rewritten: stages may map the old one's pages
    # (frozen weights read from the directory written to: `tensor_files`), which stay theirs
    partial = f"{path}.partial-{os.getpid()}"
    save_file(tensors, partial, metadata={"format": "pt"})
    os.replace(partial, path)
    return {k: v.numel() * v.element_size() for k, v in tensors.items()}
