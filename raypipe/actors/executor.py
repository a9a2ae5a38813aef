"""Where an action runs: one stage's forward and backward per microbatch, against a stash
that keeps each microbatch's activations exactly until its backward, and a whole step's
action list with its neighbours' links handed in (the p2p and compiled engines).

Plain Python and torch: the links are anything with `send`/`take`/`refill`/`wait`
(`raypipe.runtime.transport`), so a test can drive an Executor with queues.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from raypipe.actors.memory import count_saved_bytes
from raypipe.actors.model import StageModel
from raypipe.actors.settings import StageSettings
from raypipe.errors import StageError
from raypipe.runtime.transport.tree import leaves, map_tensors, tensors

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Executor:
    """Runs the actions of stage `stage` on `model`.

    Args:
        loss_fn: `loss_fn(output, target)`, on the last stage only.
        loss_scale: what each microbatch's loss is multiplied by before backward (fp16's
            dynamic scale, else 1), read at every last-stage forward.
        name: the actor's name, for error messages.
    """

    def __init__(self, model: StageModel, stage: int, is_last: bool, loss_fn: Callable[[Any, Any], Any] | None,
                 loss_scale: Callable[[], float], name: str) -> None:
        self.model, self.module, self.device = model, model.module, model.device
        self.stage, self.is_last, self.loss_fn, self.loss_scale, self.name = stage, is_last, loss_fn, loss_scale, name
        self.settings: StageSettings | None = None
        self.current_call = -1
        self.losses_finite = True
        self.timing: dict[str, float] = {}
        self.events: list[tuple[str, int, float, float]] = []
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stash_bytes: dict[int, int] = {}  # per stashed microbatch, bytes autograd saved for backward

    def begin(self, call_id: int) -> None:
        """Starts a new step when `call_id` is new: fresh timings and stash, gradients zeroed."""
        if call_id != self.current_call:
            self.current_call = call_id
            self.losses_finite = True
            self.timing = {"forward_s": 0.0, "backward_s": 0.0, "first_start": math.inf, "last_end": 0.0,
                           "peak_stashed": 0, "sent_bytes": 0}
            if self.settings.measure_activations:
                self.timing["peak_stashed_bytes"] = 0
            self.events = []
            self.clear_stash()
            self.model.zero_grad()

    def clear_stash(self) -> None:
        self.stash.clear()
        self.stash_bytes.clear()

    def forward(self, microbatch: int, x: Any, target: Any, weight: float = 1.0) -> Any:
        """Runs the stage on one microbatch and stashes what its backward needs.

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
        try:
            x = self.received(x)
            if self.stage > 0:
                for t in tensors(x):
                    if t.is_floating_point():
                        t.requires_grad_(True)
            with self.autocast(), count_saved_bytes(self.settings.measure_activations) as saved:
                if self.settings.activation_checkpointing and torch.is_grad_enabled():
                    out = checkpoint(self.module, x, use_reentrant=False)
                else:
                    out = self.module(x)
                if not self.is_last:
                    self._stash(microbatch, (x, out), saved.bytes)
                    self._timed("forward_s", started, microbatch)
                    return self.send(out)
                loss = self.loss_fn(out, map_tensors(lambda t: t.to(self.device), target))
            scale = self.loss_scale() * weight / self.settings.microbatches
            self._stash(microbatch, (x, loss.float() * scale), saved.bytes)
            value = float(loss.detach())
            self.losses_finite = self.losses_finite and math.isfinite(value)
            self._timed("forward_s", started, microbatch)
            return value
        except Exception as error:
            raise self.error("F", microbatch, error) from error

    def backward(self, microbatch: int, grad: Any) -> Any:
        """Back-propagates one microbatch and frees its activations; returns the input gradient
        for the previous stage: the input's tree with each leaf's gradient, None where a leaf
        has none (integer tensors, or on the first stage)."""
        started = time.time()
        try:
            x, out = self.stash.pop(microbatch)
            self.stash_bytes.pop(microbatch, None)
            if self.is_last:
                if out.requires_grad:
                    torch.autograd.backward(out)
            else:
                pairs = [(o, g.to(o.device, o.dtype)) for o, g in zip(leaves(out), leaves(grad))
                         if torch.is_tensor(o) and o.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            self._timed("backward_s", started, microbatch)
            grads = map_tensors(lambda t: t.grad if t.requires_grad else None, x)
            return None if self.stage == 0 else self.send(grads)
        except Exception as error:
            raise self.error("B", microbatch, error) from error

    def run_list(self, actions: Sequence[tuple[str, int]], inputs: Any, targets: Any, activations: Any,
                 gradients: Any, to_next: Any, to_prev: Any,
                 weights: Sequence[float] | None = None) -> tuple[list[Any], Exception | None]:
        """Runs a step's action list in order, taking boundaries from the inboxes (None on the
        first stage's `activations`, the last stage's `gradients`) and sending results to the
        outboxes. After a failure it still makes every send and receive of the list, sending
        poison, so no neighbour waits forever.

        Returns:
            (the last stage's microbatch losses, else []; the first failure or None).

        `weights`: on the last stage, each microbatch's loss weight (`forward`), else None.
        """
        losses, failure = [], None
        for kind, m in actions:
            if kind == "F":
                out = None
                try:
                    x = inputs[m] if activations is None else activations.take()
                    if failure is None:
                        out = self.forward(m, x, targets[m] if self.is_last else None,
                                           weights[m] if weights is not None else 1.0)
                except Exception as error:  # noqa: BLE001 - kept, raised after the list is done
                    failure = failure or error
                if to_next is None:
                    losses.append(out)
                else:
                    failure = send_or_poison(to_next, out, 2 * m, failure)
                if activations is not None:
                    activations.refill()
            else:
                grad_in = None
                try:
                    grad = None if gradients is None else gradients.take()
                    if failure is None:
                        grad_in = self.backward(m, grad)
                except Exception as error:  # noqa: BLE001
                    failure = failure or error
                if to_prev is not None:
                    failure = send_or_poison(to_prev, grad_in, 2 * m + 1, failure)
                if gradients is not None:
                    gradients.refill()
        for box in (to_next, to_prev):
            if box is not None:
                box.wait()
        return losses, failure

    @torch.no_grad()
    def forward_only(self, x: Any, target: Any = None) -> Any:
        """Inference through this stage (eval mode, nothing stashed): the output, or on the
        last stage the loss as a float when a target is given."""
        self.module.eval()
        try:
            with self.autocast():
                out = self.module(self.received(x))
                if self.is_last and target is not None:
                    return float(self.loss_fn(out, map_tensors(lambda t: t.to(self.device), target)))
            return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out) if self.is_last else out
        except Exception as error:
            raise self.error("F", -1, error) from error
        finally:
            self.module.train()

    @torch.no_grad()
    def generate(self, x: Any, start: bool, cached: bool) -> Any:
        """One generation forward (eval mode, nothing stashed): the output, or on the last stage
        the logits of the last position. `start` begins a new sequence; with `cached`, the
        layers that keep a KV cache (`begin_cache`) share a fresh one for this stage."""
        if start:
            self.end_generation()
            shared: dict[str, Any] = {}
            for layer in self.module if cached else []:
                if hasattr(layer, "begin_cache"):
                    layer.begin_cache(shared)
        self.module.eval()
        try:
            with self.autocast():
                out = self.module(self.received(x))
            return out[:, -1].float() if self.is_last else out
        except Exception as error:
            raise self.error("F", -1, error) from error
        finally:
            self.module.train()

    def end_generation(self) -> None:
        """Drops the layers' KV caches."""
        for layer in self.module:
            if hasattr(layer, "end_cache"):
                layer.end_cache()

    def send(self, value: Any) -> Any:
        """A boundary value as it leaves for another stage: its tensors detached, floating ones in
        `boundary_dtype`, counted in this step's `sent_bytes`. They stay on this stage's device:
        the p2p engine copies them straight into its host message buffer, the refs engine
        moves them to host."""
        dtype = AUTOCAST_DTYPES.get(self.settings.boundary_dtype)

        def leaving(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            self.timing["sent_bytes"] = self.timing.get("sent_bytes", 0) + t.numel() * t.element_size()
            return t

        return map_tensors(leaving, value)

    def received(self, x: Any) -> Any:
        """A boundary value's tensors on this stage's device; those sent in a narrower
        `boundary_dtype` are computed on in float32 again."""
        narrow = AUTOCAST_DTYPES.get(self.settings.boundary_dtype)

        def arriving(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self.device)
            return t.float() if narrow is not None and t.dtype == narrow else t

        return map_tensors(arriving, x)

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.settings.precision)
        if dtype is None:  # building a disabled torch.autocast costs ~25 us per action on a slow core
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def error(self, kind: str, microbatch: int, error: Exception) -> StageError:
        if isinstance(error, StageError):
            return error
        return StageError(f"{self.name} failed at {self.stage}{kind}{microbatch}: {type(error).__name__}: {error}")

    def _stash(self, microbatch: int, entry: tuple, saved_bytes: int | None) -> None:
        """Keeps a microbatch for its backward and updates this step's peak count (and bytes, when measured)."""
        self.stash[microbatch] = entry
        self.timing["peak_stashed"] = max(self.timing["peak_stashed"], len(self.stash))
        if saved_bytes is not None:
            self.stash_bytes[microbatch] = saved_bytes
            self.timing["peak_stashed_bytes"] = max(self.timing["peak_stashed_bytes"], sum(self.stash_bytes.values()))

    def _timed(self, kind: str, started: float, microbatch: int) -> None:
        """Records one action: its duration in this step's totals, and (kind, microbatch,
        start, end) in wall-clock seconds since the epoch for the step's timeline."""
        ended = time.time()
        self.events.append(("F" if kind == "forward_s" else "B", microbatch, started, ended))
        self.timing[kind] += ended - started
        self.timing["first_start"] = min(self.timing["first_start"], started)
        self.timing["last_end"] = ended


def send_or_poison(box: Any, value: Any, tag: int, failure: Exception | None) -> Exception | None:
    """Sends `value`, or poison once this step failed (also when `value` cannot be sent);
    returns the failure."""
    if failure is None:
        try:
            box.send(value, tag)
            return None
        except ValueError as error:  # checked before anything went out
            failure = error
    box.poison(tag)
    return failure

