"""The LayerProfiler: measures each layer's forward+backward time and memory on one device kind.

`partition="profile"` starts one per accelerator kind in the run, placed exactly
like a stage of that kind, so each measures the device its stages will run on.
Layers are built and profiled one at a time (the previous one freed), so a model
too big for the device can still be profiled; each layer sees the activation the
layers before it produce on a real microbatch. A layer that says what its cost depends
on (`cost_key`: transformers' decoder layers do) and costs what an earlier one costs
(the same key, parameters and buffers) takes that layer's figures untimed: a model's
decoder layers are mostly alike, so a 24-layer model times a handful.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raypipe.actors.stage_model import resolve_device
from raypipe.actors.step.memory import count_saved_bytes, weight_storages
from raypipe.core.devices import SERVING_ENV, detect, usable_cores
from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec, LossFunction, build_layer, layer_seed
from raypipe.transport.tree import map_tensors, tensors


class LayerProfiler:
    """Times layers on the device a stage of `device_kind` gets.

    Args:
        device_kind: "cpu", "cuda", "rocm" or "mps".
        allow_cpu_fallback: as in `TrainConfig`; the report says when it happened.
        clock: what "seconds" are read from (`time.perf_counter` by default). A test in one
            process may pass another: `models.simulated.SimulatedClock`, which only simulated
            layers move, makes every figure exact; a FLOP counter's total makes them counts
            of work, the same on a busy machine as on a quiet one.
    """

    def __init__(
        self, device_kind: str, allow_cpu_fallback: bool, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        os.environ[SERVING_ENV] = device_kind
        self.kind, self.clock = device_kind, clock
        self.device, self.fallback = resolve_device(f"profiler for {device_kind}", device_kind, allow_cpu_fallback)

    def node_id(self) -> str:
        """The node it was placed on (where its threads are counted)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def cores(self) -> int:
        """The cores its node lets it run on (`devices.usable_cores`), which bound its threads."""
        return usable_cores()

    def profile(
        self,
        specs: Sequence[LayerSpec],
        seed: int,
        x: torch.Tensor,
        target: Any,
        loss_fn: LossFunction,
        threads: int = 1,
        warmup: int = 2,
        repeats: int = 5,
        codecs: tuple[str, str] = ("none", "none"),
        split: bool = False,
        lora: dict | None = None,
        sequence_chunks: int | None = None,
    ) -> dict[str, Any]:
        """Per layer: median forward and backward seconds, parameter bytes, the bytes autograd
        saves for backward on this microbatch (what a stashed microbatch costs), and its output's
        size (what crosses a link when a stage ends there: floating leaves both ways, as the
        activation and its gradient, the others forward only), timed with `threads` torch
        threads, as a stage actor on this node would compute; with `codecs` (the config's
        `compress_activations`, `compress_gradients`), the seconds compressing and restoring its
        output takes each way (`codec_forward_s`, `codec_backward_s`: what a boundary there costs
        the stages beyond their layers). With `split`, the backward split as the zero-bubble
        schedules split it, each half timed: `input_s` (I, the input gradient) and `weight_s`
        (W, the weight gradients); with `lora` (`TrainConfig.lora`) the layers carry adapters
        and a frozen base, as a stage's do, so B, I and W are what a LoRA run computes. On a CPU
        device, `cpu_s`: the process's CPU seconds of each layer's forward and backward (a layer
        that waits, on I/O or a sleep, takes less CPU than time: what the node's cores bound).
        With `sequence_chunks` k (`TrainConfig.sequence_chunks="auto"`), `x` and `target` are one
        microbatch's k units (`data.sequence_units.cut_microbatch`; any pytrees): each layer runs
        them as a stage does (forwards in order, backwards in reverse, each attending to the units
        before it) and every figure is per unit, its mean over the k. An `x` that is not one tensor
        (transformers' boundary dicts, any pytree) is timed the same way, as one unit."""
        torch.set_num_threads(threads)
        forward_s, backward_s, parameter_bytes, activation_bytes = [], [], [], []
        boundary: list[tuple[int, int, int]] = []  # per layer, its output's (float bytes, float elements, other bytes)
        codec_s: list[tuple[float, float]] = []  # per layer, compressing and restoring its output, each way
        if sequence_chunks is not None or not torch.is_tensor(x):  # units, or a pytree (transformers' dicts)
            units, targets = (x, target) if sequence_chunks is not None else ([x], [target])
            return self._profile_units(
                specs, seed, units, targets, loss_fn, threads, warmup, repeats, lora, split, codecs
            )
        h = x.to(self.device)
        input_s, weight_s, cpu_s = [], [], []
        timed: dict[tuple, int] = {}  # a layer's cost key -> the first layer timed with it
        for index, spec in enumerate(specs):
            layer = self._build(spec, seed, index, lora)
            last = index == len(specs) - 1
            earlier = None if last else _alike(layer, index, timed)
            if earlier is not None:  # costs what that layer costs: its figures again, its input to the next
                lists = [forward_s, backward_s, cpu_s, parameter_bytes, activation_bytes, boundary, codec_s]
                _again([*lists, input_s, weight_s], earlier)
                del layer  # freed before the next is built
                continue
            fwd, bwd, cpu, saved = [], [], [], 0
            for r in range(warmup + repeats):
                inp = _input(h, index)
                started, cpu_started = self._now(), time.process_time()
                with count_saved_bytes(r == 0, weight_storages(layer)) as counter:
                    out = layer(inp)
                    if r == 0:
                        boundary.append((0, 0, 0) if last else _sizes(out))
                    if last:
                        out = self._loss(out, target, loss_fn)
                middle = self._now()
                if out.requires_grad:
                    grad = None if last else torch.randn_like(out)
                    torch.autograd.backward(out, grad)
                ended, cpu_ended = self._now(), time.process_time()
                layer.zero_grad(set_to_none=True)
                if r == 0:
                    saved = counter.bytes or 0
                if r >= warmup:
                    fwd.append(middle - started)
                    bwd.append(ended - middle)
                    cpu.append(cpu_ended - cpu_started)
            cpu_s.append(statistics.median(cpu))
            forward_s.append(statistics.median(fwd))
            backward_s.append(statistics.median(bwd))
            if split:
                halves = [
                    self._split_units(layer, [h], index, last, [target], loss_fn) for _ in range(warmup + repeats)
                ]
                input_s.append(statistics.median(i for i, _ in halves[warmup:]))
                weight_s.append(statistics.median(w for _, w in halves[warmup:]))
            parameter_bytes.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
            activation_bytes.append(saved)
            codec_s.append((0.0, 0.0) if last else tuple(self._codec_seconds(out, c, repeats) for c in codecs))
            if not last:
                with torch.no_grad():
                    h = layer(h.detach())
            del layer
        return {
            **self._device(),
            "forward_s": forward_s,
            "backward_s": backward_s,
            "parameter_bytes": parameter_bytes,
            "activation_bytes": activation_bytes,
            "output_float_bytes": [b[0] for b in boundary],
            "output_float_elements": [b[1] for b in boundary],
            "output_other_bytes": [b[2] for b in boundary],
            "codec_forward_s": [c[0] for c in codec_s],
            "codec_backward_s": [c[1] for c in codec_s],
            **({"input_s": input_s, "weight_s": weight_s} if split else {}),
            **({"cpu_s": cpu_s} if self.device.type == "cpu" else {}),
        }

    def _device(self) -> dict[str, object]:
        accelerator = detect()
        return {
            "kind": self.kind,
            "device": str(self.device),
            "cpu_fallback": self.fallback,
            "threads": torch.get_num_threads(),
            "cores": usable_cores(),
            "model": accelerator.model,
            "memory_bytes": accelerator.memory_bytes,
        }

    def _build(self, spec: LayerSpec, seed: int, index: int, lora: dict | None) -> torch.nn.Module:
        """Layer `index` as a stage builds it (with LoRA's adapters where configured), on the device."""
        layer = build_layer(spec, seed, index)
        if lora is not None:
            from raypipe.nn import lora as lora_

            lora_.apply(torch.nn.Sequential(layer), lora, [layer_seed(seed, index) + 1])
        return layer.to(self.device)

    def _profile_units(
        self,
        specs: Sequence[LayerSpec],
        seed: int,
        units: list,
        targets: list,
        loss_fn: Callable,
        threads: int,
        warmup: int,
        repeats: int,
        lora: dict | None,
        split: bool = False,
        codecs: tuple[str, str] = ("none", "none"),
    ) -> dict[str, object]:
        """`profile` on one microbatch's sequence units, any pytrees, per unit (one unit: the
        microbatch whole); `split`: each unit's backward split as a stage splits it too
        (`_split_units`); `codecs`: compressing and restoring a unit's output, each way."""
        from raypipe.nn.sequence_chunks import Sequence, check_chunkable

        torch.set_num_threads(threads)
        k = len(units)
        figures: dict[str, list] = {key: [] for key in ("forward_s", "backward_s", "cpu_s", "activation_bytes")}
        figures.update(parameter_bytes=[], output_float_bytes=[], output_float_elements=[], output_other_bytes=[])
        figures.update({"input_s": [], "weight_s": []} if split else {}, codec_forward_s=[], codec_backward_s=[])
        hs = [map_tensors(lambda t: t.to(self.device), u) for u in units]
        timed: dict[tuple, int] = {}  # a layer's cost key -> the first layer timed with it
        for index, spec in enumerate(specs):
            layer = self._build(spec, seed, index, lora)
            last = index == len(specs) - 1
            earlier = None if last else _alike(layer, index, timed)
            if earlier is not None:  # costs what that layer costs: its figures again, its units to the next
                _again(list(figures.values()), earlier)
                del layer  # freed before the next is built
                continue
            if k > 1:
                try:
                    check_chunkable([layer], f"the {self.kind} profiler", [index])
                except ConfigError as error:  # no k > 1 runs: "auto" keeps the sequence whole
                    return {"refused": str(error), **self._device()}
            fwd, bwd, cpu, saved = [], [], [], 0
            for r in range(warmup + repeats):
                sequence, inputs = Sequence(k), [_inputs(h, index) for h in hs]
                started, cpu_started = self._now(), time.process_time()
                with count_saved_bytes(r == 0, weight_storages(layer)) as counter:
                    outs = [sequence.forward(u, layer, x) if k > 1 else layer(x) for u, x in enumerate(inputs)]
                if r == 0:
                    saved = counter.bytes or 0
                if last:
                    outs = [self._loss(out, t, loss_fn) for out, t in zip(outs, targets)]
                middle = self._now()
                for u in reversed(range(k)):
                    pairs = [(o, None if last else torch.randn_like(o)) for o in tensors(outs[u]) if o.requires_grad]
                    pairs += sequence.roots(u)
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                ended, cpu_ended = self._now(), time.process_time()
                layer.zero_grad(set_to_none=True)
                if r >= warmup:
                    fwd.append(middle - started)
                    bwd.append(ended - middle)
                    cpu.append(cpu_ended - cpu_started)
            for key, values in (("forward_s", fwd), ("backward_s", bwd), ("cpu_s", cpu)):
                figures[key].append(statistics.median(values) / k)
            figures["activation_bytes"].append(saved / k)
            if split:
                halves = [self._split_units(layer, hs, index, last, targets, loss_fn) for _ in range(warmup + repeats)]
                figures["input_s"].append(statistics.median(i for i, _ in halves[warmup:]) / k)
                figures["weight_s"].append(statistics.median(w for _, w in halves[warmup:]) / k)
            figures["parameter_bytes"].append(sum(p.numel() * p.element_size() for p in layer.parameters()))
            sizes = (0, 0, 0) if last else _sizes(outs[0])
            for key, size in zip(("output_float_bytes", "output_float_elements", "output_other_bytes"), sizes):
                figures[key].append(size)
            for key, codec in zip(("codec_forward_s", "codec_backward_s"), codecs):
                figures[key].append(0.0 if last else self._codec_seconds(outs[0], codec, repeats))
            hs = hs if last else [map_tensors(lambda t: t.detach(), out) for out in outs]
            del layer
        if self.device.type != "cpu":
            del figures["cpu_s"]
        return {**self._device(), **figures, "sequence_chunks": k}

    def _split_units(
        self, layer: torch.nn.Module, hs: list, index: int, last: bool, targets: list, loss_fn: Callable
    ) -> tuple[float, float]:
        """(I, W) seconds of one microbatch's backward through `layer`, split as a stage splits it
        (`actors.split_backward`): a layer whose input needs no gradient (token ids) has it all in
        W, a layer without trainable weights all in I. Over its units (`hs`, one when the sequence
        is not cut), each split as a stage splits a sequence chunk's (`Sequence.split_backward`:
        its keys' gradients in, the earlier units' leaves among the inputs), in reverse, each W
        right after its I."""
        from raypipe.actors.step.split_backward import input_gradients, weight_gradients
        from raypipe.nn.sequence_chunks import Sequence

        k, weights = len(hs), [p for p in layer.parameters() if p.requires_grad]
        sequence, inputs = Sequence(k), [_inputs(h, index) for h in hs]
        outs = [sequence.forward(u, layer, x) if k > 1 else layer(x) for u, x in enumerate(inputs)]
        if last:
            outs = [self._loss(out, t, loss_fn) for out, t in zip(outs, targets)]
        input_s = weight_s = 0.0
        for u in reversed(range(k)):
            outputs = [o for o in tensors(outs[u]) if o.requires_grad]
            grads = None if last else [torch.randn_like(o) for o in outputs]
            given = [t for t in tensors(inputs[u]) if t.requires_grad]
            outputs, grads, given = sequence.split_backward(u, None, outputs, grads, given)
            started = self._now()
            deferred = input_gradients(outputs, grads, given, weights)
            middle = self._now()
            weight_gradients(deferred, weights)
            input_s, weight_s = input_s + middle - started, weight_s + self._now() - middle
        layer.zero_grad(set_to_none=True)
        return input_s, weight_s

    def _loss(self, out: object, target: object, loss_fn: Callable) -> torch.Tensor:
        return loss_fn(out, target.to(self.device) if torch.is_tensor(target) else target)

    def _codec_seconds(self, value: Any, codec: str, repeats: int) -> float:
        """Median seconds to compress `value`'s floating tensors in `codec` and restore them."""
        from raypipe.transport.compress import compress

        leaves = [t.detach() for t in tensors(value) if t.is_floating_point() and t.dim() >= 2]
        if codec == "none" or not leaves:
            return 0.0
        times = []
        for _ in range(repeats):
            started = self._now()
            for t in leaves:
                compress(t, codec).restore()
            times.append(self._now() - started)
        return statistics.median(times)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()
        return self.clock()


def cost_key(layer: torch.nn.Module) -> tuple | None:
    """What a built layer's time and memory depend on, where it says (its `cost_key`: the settings
    that make two layers of one class differ, such as an attention window), with its class and
    its parameters' and buffers' names, shapes, dtypes and whether they train (LoRA's adapters and
    a frozen base): two layers with one key cost the same. None: a layer that does not say, timed
    on its own."""
    own = getattr(layer, "cost_key", None)
    if own is None:
        return None
    tensors_of = [*layer.named_parameters(), *layer.named_buffers()]
    shapes = tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in tensors_of)
    return type(layer).__qualname__, own, shapes


def _alike(layer: torch.nn.Module, index: int, timed: dict[tuple, int]) -> int | None:
    """The earlier layer that layer `index` costs what it costs (`timed`: a cost key -> the first
    layer timed with it), or None: then it is timed, and noted in `timed` where it has a key."""
    key = cost_key(layer)
    if key is None:
        return None
    if key in timed:
        return timed[key]
    timed[key] = index
    return None


def _again(lists: list[list], index: int) -> None:
    """Appends to each list that has one its figure for layer `index` (a layer that costs the same)."""
    for values in lists:
        if len(values) > index:
            values.append(values[index])


def _input(h: torch.Tensor, index: int) -> torch.Tensor:
    """Layer `index`'s input for one timed pass: a leaf that takes a gradient, as a stage's input
    does, except the first layer's (token ids)."""
    return h.detach().requires_grad_(index > 0 and h.is_floating_point())


def _inputs(value: Any, index: int) -> Any:
    """`_input` for each tensor of a pytree: floating ones take a gradient after the first layer."""
    return map_tensors(lambda t: t.detach().requires_grad_(index > 0 and t.is_floating_point()), value)


def _sizes(value: Any) -> tuple[int, int, int]:
    """(bytes, elements) of a value's floating tensors, and bytes of its other tensors."""
    leaves = tensors(value)
    floats = [t for t in leaves if t.is_floating_point()]
    return (
        sum(t.numel() * t.element_size() for t in floats),
        sum(t.numel() for t in floats),
        sum(t.numel() * t.element_size() for t in leaves if not t.is_floating_point()),
    )
