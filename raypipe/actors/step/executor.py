"""Where an action runs: one stage's forward and backward (whole, or split into input and weight
gradients) per microbatch and model chunk, against a stash that keeps each microbatch's
activations exactly until its backward is done. A whole step's list runs in `step_list`;
inference and generation through a chunk in `inference_passes`. Plain Python and torch, no Ray."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raypipe.actors.io.replica_io import running_stats, step_start
from raypipe.actors.optim.zero3 import ShardedStage
from raypipe.actors.stage_model import StageModel
from raypipe.actors.step.hand_on import HandOnChoice
from raypipe.actors.step.memory import count_saved_bytes, weight_storages
from raypipe.actors.step.split_backward import Deferred, covers_every_weight, input_gradients, weight_gradients
from raypipe.core.errors import StageError
from raypipe.core.layers import Boundary
from raypipe.core.protocol import StageSettings, StepTimings
from raypipe.nn.moe import RECORDER, reset_recorder
from raypipe.nn.sequence_chunks import Sequence, unit_loss
from raypipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD
from raypipe.schedules.early_gradients import hand_on_mode
from raypipe.transport.compress import Compressed, compress, restore
from raypipe.transport.stream import PeerFailed
from raypipe.transport.tree import leaves, map_tensors, tensors

# a step's counters as its typed record starts them (`StepTimings`: a feature's own stay out until it runs)
STARTING_TIMING = {k: v for k, v in dataclasses.asdict(StepTimings()).items() if v is not None}
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Executor:
    """Runs the actions of stage `stage` on `model`.

    Args:
        loss_fn: `loss_fn(output, target)`, on the last stage only.
        loss_scale: what each microbatch's loss is multiplied by before backward (fp16's
            dynamic scale, else 1), read at every last-stage forward.
        name: the actor's name, for error messages.
    """

    def __init__(
        self,
        model: StageModel,
        stage: int,
        is_last: bool,
        loss_fn: Callable[[Any, Any], Any] | None,
        loss_scale: Callable[[], float],
        name: str,
        chunks: dict[int, tuple[int, int]] | None = None,
        num_virtual: int | None = None,
    ) -> None:
        self.model, self.module, self.device = model, model.module, model.device
        self.stage, self.is_last, self.loss_fn, self.loss_scale, self.name = stage, is_last, loss_fn, loss_scale, name
        # virtual stage -> (its layers as a module, is it the first, is it the last); one without chunks
        if chunks is None:
            self.parts = {stage: (self.module, stage == 0, is_last)}
        else:
            self.parts = {
                v: (nn.Sequential(*self.module[lo:hi]), v == 0, v == num_virtual - 1) for v, (lo, hi) in chunks.items()
            }
        self.only = next(iter(self.parts)) if len(self.parts) == 1 else None
        self.settings: StageSettings | None = None
        self.current_call = -1
        self.losses_finite = True
        self.timing: dict[str, float] = {}
        self.objective: list[dict[str, float]] = []  # the step's per-microbatch metric sums (`DPOLoss.take_metrics`)
        self.take_metrics = getattr(loss_fn, "take_metrics", None)  # an objective's, once per microbatch
        self.events: list[tuple] = []  # (kind, microbatch, start, end[, handed after]) (`_timed`)
        self.stash: dict[tuple[int, int], tuple[Any, Any]] = {}  # (virtual stage, microbatch) -> (input, output)
        self.stash_bytes: dict[tuple[int, int], int] = {}  # per stashed microbatch, bytes autograd saved for backward
        self.deferred: dict[tuple[int, int], Deferred] = {}  # what each pending W needs from its I
        # a whole backward handed on early (`may_hand_on_early`): its start, its input half's compute; and
        # the last recorded action's compute (`_timed`; such a backward's halves, not the send between)
        self.began_whole, self.input_part_s, self.last_action_s = 0.0, 0.0, 0.0
        self.hand_on = HandOnChoice()  # per chunk: does a whole backward hand on early (measured)
        self.split_covers: dict[int, bool] = {}  # per chunk: its split backward leaves no weight out
        self.weight_share: dict[int, float] = {}  # per chunk: the share of its weights' elements it trains
        self.saved_per_microbatch: dict[int, int] = {}  # per model chunk, its first microbatch's saved bytes
        # the parameters' storages (saved for backward, but not activations); loading copies into
        # the same parameters, so they are found once
        self.weights = weight_storages(model.module)
        self.sequence = Sequence(1)  # a step's sequence chunks (`TrainConfig.sequence_chunks`)
        self.sharding: ShardedStage | None = None  # ZeRO-3's gathering of the layers (`OptimizerState.sharded`)
        self.running_stats, self.began_from = running_stats(model), None  # what a step began from (`replica_io`)

    def configure(self, settings: StageSettings, sharding: ShardedStage | None) -> None:
        if sharding is not None and self.sharding is None:  # ZeRO-3 gave the weights new storages
            self.weights = weight_storages(self.model.module)
        self.settings, self.sharding = settings, sharding
        self.sequence = Sequence.of(settings.sequence_chunks, self.module, self.name, self.model.indices)
        self.hand_on = HandOnChoice(hand_on_mode(settings.gradient_hand_on, self.model.tp.size), settings.schedule_spec)

    def begin(self, call_id: int) -> None:
        """Starts a new step when `call_id` is new: fresh timings and stash, gradients zeroed."""
        if call_id != self.current_call:
            self.current_call, self.began_from = call_id, step_start(self.running_stats)  # a survivor hands it over
            self.losses_finite = True
            self.timing = dict(STARTING_TIMING)
            if self.settings.measure_activations:
                self.timing["peak_stashed_bytes"] = 0
            self.events = []
            self.objective = []
            self.hand_on.begin_step()
            reset_recorder()  # all-to-all of inference since the last step is not this step's
            self.clear_stash()
            self.model.zero_grad()
            if self.sharding is not None:
                self.sharding.begin_step()

    def clear_stash(self) -> None:
        self.stash.clear()
        self.stash_bytes.clear()
        self.deferred.clear()
        self.sequence.clear()

    def part(self, v: int | None) -> tuple[int, nn.Module, bool, bool]:
        """(virtual stage, its module, first?, last?) for `v`, or this actor's only chunk when None."""
        v = self.only if v is None else v
        module, first, last = self.parts[v]
        return v, module, first, last

    def forward(self, microbatch: int, x: Any, target: Any, weight: float = 1.0, v: int | None = None) -> Any:
        """Runs the stage (model chunk `v`: a virtual stage this actor holds) on one microbatch
        and stashes what its backward needs.

        Args:
            x: the microbatch's input, or the previous stage's output: a tensor or any pytree
                of them; its floating-point tensors get gradients in backward.
            weight: the microbatch's share of the step's loss relative to an equal share
                (a loss counting tokens weighs microbatches by their tokens).

        Returns:
            The boundary value for the next stage (`send`); on the last stage the
            microbatch's unscaled loss as a float.
        """
        started = time.time()
        v, module, first, last = self.part(v)
        try:
            x = self.received(x)
            for t in [] if first else [t for t in tensors(x) if t.is_floating_point()]:
                t.requires_grad_(True)
            measure = self.settings.measure_activations or v not in self.saved_per_microbatch
            with self.autocast(), count_saved_bytes(measure and torch.is_grad_enabled(), self.weights) as saved:
                recompute = self.settings.activation_checkpointing and torch.is_grad_enabled()
                if self.sequence.chunks > 1 and torch.is_grad_enabled():  # unit = (microbatch, chunk)
                    out = self.sequence.forward(microbatch, module, x, v, recompute)
                    for kept in self.sequence.made(microbatch, v) if recompute and measure else ():
                        saved.pack(kept)  # recomputed: its input was counted, the keys it keeps were not
                elif recompute:
                    out = checkpoint(module, x, use_reentrant=False)
                else:
                    out = module(x)
                if not last:
                    self._stash((v, microbatch), (x, out), saved.bytes)
                    self._timed(FORWARD, started, microbatch)
                    return self.send(out, self.settings.compress_activations)
                loss = unit_loss(self.loss_fn, out, target, self.device, weight, self.sequence.chunks > 1)
                if self.take_metrics is not None and (metrics := self.take_metrics()) is not None:
                    self.objective.append(metrics)
            scale = self.loss_scale() * weight / self.settings.microbatches
            self._stash((v, microbatch), (x, loss.float() * scale), saved.bytes)
            value = float(loss.detach())
            self.losses_finite = self.losses_finite and math.isfinite(value)
            self._timed(FORWARD, started, microbatch)
            return value
        except Exception as error:
            raise self.error(FORWARD, microbatch, error, v) from error

    def backward(self, microbatch: int, grad: Any, v: int | None = None) -> Any:
        """Back-propagates one microbatch and frees its activations; returns the input gradient
        for the previous stage: the input's tree with each leaf's gradient, None where a leaf
        has none (integer tensors, or on the first stage)."""
        started = time.time()
        v, _, first, last = self.part(v)
        try:
            x, out = self.stash.pop((v, microbatch))
            self.stash_bytes.pop((v, microbatch), None)
            pairs = ([(out, None)] if out.requires_grad else []) if last else self._pairs(out, grad)
            pairs += self.sequence.roots(microbatch, v)  # a sequence chunk's keys and values, and their gradients
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            self._timed(BACKWARD, started, microbatch)
            return None if first else self.send(input_grads(x), self.settings.compress_gradients)
        except Exception as error:
            raise self.error(BACKWARD, microbatch, error, v) from error

    def may_hand_on_early(self, v: int) -> bool:
        """Whether a whole backward (B) of chunk `v` may run as its input gradient, handed on at once,
        then its weight gradients (`backward_input`, the send, `backward_weight`, each `whole=True`),
        so the previous stage waits for the input half only; whether it does is `hand_on`'s measured
        choice. Not on the first stage (nothing waits for its gradient), a compiled one (its backward
        does not split), a chunk whose split would leave a weight without its gradient
        (`split_backward.covers_every_weight`), nor one that trains few of its weights (LoRA)."""
        return (
            self.hand_on.mode != "late"
            and not self.part(v)[2]
            and not self.settings.compile
            and self.split_covers.get(v, True)
            and self._trains_its_weights(v)
        )

    def _trains_its_weights(self, v: int) -> bool:
        """Whether chunk `v` trains most of its weights' elements: not LoRA's adapters over a frozen
        base, whose weight gradients are nearly free, so that sending before them gains nothing
        while the split's walk of the graph costs CPU (a transformers Llama under LoRA stepped
        1.07x slower split on 2 cores)."""
        if v not in self.weight_share:
            params = list(self.parts[v][0].parameters())
            total = sum(p.numel() for p in params)
            self.weight_share[v] = sum(p.numel() for p in params if p.requires_grad) / total if total else 0.0
        return self.weight_share[v] >= 0.5

    def backward_input(self, microbatch: int, grad: object, v: int | None = None, whole: bool = False) -> object:
        """The first half of a split backward (I): only the input gradient, returned as
        `backward` returns it; what the weight gradient needs is kept for `backward_weight`.
        `whole`: the half of a whole backward handed on early (`may_hand_on_early`): recorded with
        its W as one B."""
        started = time.time()
        v, _, first, last = self.part(v)
        try:
            x, out = self.stash[(v, microbatch)]
            if last:
                outputs, grads = ([out], None) if out.requires_grad else ([], None)
            else:
                pairs = self._pairs(out, grad)
                outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
            inputs = [] if first else [t for t in tensors(x) if t.requires_grad]
            outputs, grads, inputs = self.sequence.split_backward(microbatch, v, outputs, grads, inputs)  # its keys
            weights, compiled = self.model.trainable(), self.settings.compile  # compiled: W's work done at I
            if v not in self.split_covers and not compiled:
                self.split_covers[v] = covers_every_weight(outputs, inputs, weights)
            # none where the split would drop a gradient, or fail: a first stage's chunk (its inputs, the keys)
            unsplit = compiled or not self.split_covers[v] or (first and self.sequence.chunks > 1)
            self.deferred[(v, microbatch)] = input_gradients(outputs, grads, inputs, weights, unsplit)
            leaving = None if first else self.send(input_grads(x), self.settings.compress_gradients)
            if whole:
                self.began_whole, self.input_part_s = started, time.time() - started
            else:
                self.timing["peak_awaiting_weight"] = max(self.timing["peak_awaiting_weight"], len(self.deferred))
                self._timed(INPUT_GRAD, started, microbatch)
            return leaving
        except Exception as error:
            raise self.error(BACKWARD if whole else INPUT_GRAD, microbatch, error, v) from error

    def backward_weight(self, microbatch: int, v: int | None = None, whole: bool = False) -> None:
        """The second half of a split backward (W): the weight gradients; frees the microbatch.
        `whole`: it ends a whole backward handed on early, recorded as one B from its I's start."""
        started = time.time()
        v, module, _, _ = self.part(v)
        try:
            if self.sharding is not None:  # the weight gradients' graph may read the chunk's weights
                self.sharding.acquire(p for p in module.parameters())
            deferred = self.deferred.pop((v, microbatch))
            weight_gradients(deferred, self.model.trainable())
            self.stash.pop((v, microbatch))
            self.stash_bytes.pop((v, microbatch), None)
            if whole:  # computed: both halves, not the send between them (it left after the first)
                self._timed(BACKWARD, self.began_whole, microbatch, self.input_part_s + time.time() - started, True)
            else:
                self._timed(WEIGHT_GRAD, started, microbatch)
        except Exception as error:
            raise self.error(BACKWARD if whole else WEIGHT_GRAD, microbatch, error, v) from error

    def _pairs(self, out: Any, grad: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output leaf, its gradient) for the leaves that need one (the others get None back), a
        compressed gradient restored."""
        grad = restore(grad) if self.settings.compress_gradients != "none" else grad
        return [
            (o, g.to(o.device, o.dtype))
            for o, g in zip(leaves(out), leaves(grad))
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]

    def send(self, value: Any, codec: str = "none") -> Any:
        """A boundary value as it leaves for another stage: its tensors detached, floating
        activations (2 dimensions or more) in `boundary_dtype`, or compressed by `codec`
        (`transport.compress`: the config's for activations or for gradients), counted (`count_sent`).
        Scalars and vectors keep their dtype: they are few bytes, and a loss carried along or a
        MoE's routing counts (exact integers up to 2^24 in float32, 256 in bf16) must not round.
        They stay on this stage's device: the p2p engine copies them straight into its host
        message buffer, the refs engine moves them to host."""
        dtype = AUTOCAST_DTYPES.get(self.settings.boundary_dtype)

        def leaving(t: torch.Tensor) -> torch.Tensor | Compressed:
            t = t.detach()
            if codec != "none" and t.is_floating_point() and t.dim() >= 2:
                packed = compress(t, codec)
                self.timing["sent_bytes"] = self.timing.get("sent_bytes", 0) + packed.nbytes
                return packed
            if dtype is not None and t.is_floating_point() and t.dim() >= 2:
                t = t.to(dtype)
            count_sent(self.timing, t)
            return t

        return map_tensors(leaving, value)

    def received(self, x: Any) -> Any:
        """A boundary value's tensors on this stage's device; those sent narrower (`boundary_dtype`:
        in its weights' dtype again; compressed: in the sender's, restored on the device)."""
        narrow = AUTOCAST_DTYPES.get(self.settings.boundary_dtype)

        def arriving(t: torch.Tensor) -> torch.Tensor:
            # to a GPU, torch returns once a pageable source is staged (the buffer may be reused)
            # and the copy to the device runs behind the host; MPS copies only blocking (its
            # non-blocking copies from host memory can read freed buffers: pytorch#189690)
            t = t.to(self.device, non_blocking=self.device.type == "cuda")
            return t.to(self.model.compute_dtype) if narrow is not None and t.dtype == narrow else t

        arrived = map_tensors(arriving, x)
        return restore(arrived) if self.settings.compress_activations != "none" else arrived

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.settings.precision)
        if dtype is None:  # building a disabled torch.autocast costs ~25 us per action on a slow core
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def error(self, kind: str, microbatch: int, error: Exception, v: int | None = None) -> StageError:
        if isinstance(error, (StageError, PeerFailed)):  # PeerFailed: another actor's failure, not this one's
            return error
        where = self.stage if v is None else v
        return StageError(f"{self.name} failed at {where}{kind}{microbatch}: {type(error).__name__}: {error}")

    def _stash(self, key: tuple[int, int], entry: tuple, saved_bytes: int | None) -> None:
        """Keeps a (virtual stage, microbatch) for its backward and updates this step's peak count
        and bytes (measured for this microbatch, else as its chunk's first microbatch measured)."""
        self.stash[key] = entry
        self.timing["peak_stashed"] = max(self.timing["peak_stashed"], len(self.stash))
        if saved_bytes is not None:
            self.saved_per_microbatch.setdefault(key[0], saved_bytes)
        self.stash_bytes[key] = saved_bytes if saved_bytes is not None else self.saved_per_microbatch.get(key[0], 0)
        held = sum(self.stash_bytes.values())
        self.timing["peak_activation_bytes"] = max(self.timing["peak_activation_bytes"], held)
        if self.settings.measure_activations:
            self.timing["peak_stashed_bytes"] = max(self.timing["peak_stashed_bytes"], held)

    def _timed(self, kind: str, started: float, microbatch: int, computed_s: float | None = None, handed=False) -> None:
        """Records one action: its duration in this step's totals (a split backward's I and W both count
        as backward), (kind, microbatch, start, end) in epoch seconds for the step's timeline (`handed`: a
        whole backward that handed its gradient on early adds when, `input_part_s` after its start), then
        an "A" event per all-to-all inside it. `last_action_s`: `computed_s` if less than the span, else it."""
        ended = time.time()
        self.events.append((kind, microbatch, started, ended, *([self.input_part_s] if handed else [])))
        self.last_action_s = ended - started if computed_s is None else computed_s
        for a, b in RECORDER.take_intervals():  # a MoE layer's all-to-all inside this action
            self.events.append(("A", microbatch, a, b))
            self.timing["all_to_all_s"] += b - a
        self.timing["forward_s" if kind == FORWARD else "backward_s"] += ended - started
        self.timing["first_start"] = min(self.timing["first_start"], started)
        self.timing["last_end"] = ended


def input_grads(x: Boundary) -> Boundary:
    """The input's tree with each leaf's gradient, None where a leaf has none: what a backward
    sends the previous stage."""
    return map_tensors(lambda t: t.grad if t.requires_grad else None, x)


def count_sent(timing: dict, t: torch.Tensor) -> None:
    """Adds tensor `t`, as it leaves, to a step's `sent_bytes`, and to its `fp32_sent_bytes` where it
    is a float32 activation or gradient: what `boundary_dtype="auto"` would halve (`driver.links.advice`)."""
    nbytes = t.numel() * t.element_size()
    timing["sent_bytes"] = timing.get("sent_bytes", 0) + nbytes
    if t.dtype == torch.float32 and t.dim() >= 2:
        timing["fp32_sent_bytes"] = timing.get("fp32_sent_bytes", 0) + nbytes
