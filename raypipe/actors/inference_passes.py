"""Inference and generation through a stage's model chunk: forwards in eval mode that keep
nothing for a backward. `InferenceCalls` is the part of `StageActor` that answers them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from raypipe.actors.executor import Executor
from raypipe.errors import StageError
from raypipe.nn.sampling import pick
from raypipe.schedules.actions import FORWARD
from raypipe.transport.tree import map_tensors, to_host
from raypipe.transport.wire import pack, unpack

if TYPE_CHECKING:
    from raypipe.actors.stage import Stage


@torch.no_grad()
def forward_only(
    executor: Executor, x: Any, target: Any = None, v: int | None = None, reduce: Callable | None = None
) -> Any:
    """Inference through this stage's chunk `v` (eval mode, nothing stashed): the output, or on
    the last stage when a target is given the loss as a float (or what `reduce(output, target)`
    makes of them)."""
    v, module, _, last = executor.part(v)
    executor.module.eval()
    try:
        with executor.autocast():
            out = module(executor.received(x))
            if last and target is not None:
                target = map_tensors(lambda t: t.to(executor.device), target)
                return reduce(out, target) if reduce is not None else float(executor.loss_fn(out, target))
        return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out) if last else out
    except Exception as error:
        raise executor.error(FORWARD, -1, error, v) from error
    finally:
        executor.module.train()


@torch.no_grad()
def generate(executor: Executor, x: Any, start: bool, cached: bool, v: int | None = None) -> Any:
    """One generation forward through chunk `v` (eval mode, nothing stashed): the output, or on
    the last stage the logits of the last position. `start` begins a new sequence; with
    `cached`, the chunk's layers that keep a KV cache (`begin_cache`) share a fresh one."""
    v, module, _, last = executor.part(v)
    if start:
        shared: dict[str, Any] = {}
        for layer in module:
            if hasattr(layer, "end_cache"):
                layer.end_cache()
            if cached and hasattr(layer, "begin_cache"):
                layer.begin_cache(shared)
    executor.module.eval()
    try:
        with executor.autocast():
            out = module(executor.received(x))
        return out[:, -1].float() if last else out
    except Exception as error:
        raise executor.error(FORWARD, -1, error, v) from error
    finally:
        executor.module.train()


def end_generation(executor: Executor) -> None:
    """Drops the layers' KV caches."""
    for layer in executor.module:
        if hasattr(layer, "end_cache"):
            layer.end_cache()


class InferenceCalls:
    """A stage's inference calls (`raypipe.driver.inference`): boundaries as packed host values,
    like the refs engine's."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.generator: torch.Generator | None = None  # a generation's sampler (`generate_forward`)

    def forward_only(self, x: Any, target: Any = None, v: int | None = None, reference: str | None = None) -> Any:
        """Inference through this stage's chunk `v` (eval mode, no activations kept).

        Returns the output, or on the last stage the loss as a float when a target is given;
        None on tp ranks other than 0 (their output is rank 0's). With `reference` ("adapters_off"
        or "frozen_copy", `capture_reference`'s kind), the forward runs as the run's reference policy
        (`raypipe.objectives.reference`) and the last stage answers the loss function's
        `reference(output, target)`; with "policy", that answer of the weights as they are.

        Raises:
            StageError: a frozen copy is asked for and this actor holds none (it replaced a lost one).
        """
        stage, executor = self.stage, self.stage.executor
        if reference is None:
            out = forward_only(executor, unpack(x), unpack(target), v)
        elif reference == "policy":  # the policy's own per-token log-probs (GRPO's old policy)
            out = forward_only(executor, unpack(x), unpack(target), v, executor.loss_fn and executor.loss_fn.reference)
        else:
            from raypipe.objectives.reference import ReferencePolicy

            policy = ReferencePolicy(None) if reference == "adapters_off" else stage.reference
            if policy is None:
                raise StageError(
                    f"{stage.name} holds no copy of the run's starting adapters, the DPO reference policy: it was "
                    f"started after the run began (a lost actor replaced). Start the run again from its adapter."
                )
            reduce = executor.loss_fn.reference if executor.loss_fn is not None else None
            with policy.applied(stage.model.module):
                out = forward_only(executor, unpack(x), unpack(target), v, reduce)
        if isinstance(out, float):  # the loss
            return out
        return pack(to_host(out)) if stage.tp.rank == 0 else None

    def capture_reference(self) -> str:
        """Keeps this stage's weights as they are now as the run's reference policy; its kind:
        "adapters_off" when its adapters are new (every LoRA B zero, or none here), "frozen_copy"."""
        from raypipe.objectives.reference import ReferencePolicy

        self.stage.reference = ReferencePolicy.capture(self.stage.model.module)
        return "adapters_off" if self.stage.reference.adapters is None else "frozen_copy"

    def generate_forward(
        self, x: Any, start: bool, cached: bool, v: int | None = None, sampling: tuple | None = None
    ) -> Any:
        """One forward of generation through chunk `v` (`raypipe.driver.inference.generation`): the output
        (rank 0 of tp only), or on the last stage the last position's logits; with `sampling`
        ((temperature, top_k, top_p, seed), the last stage), the next token of each row picked here
        from a generator seeded at `start`, so that a token, not a row of logits, travels back."""
        out = generate(self.stage.executor, unpack(x), start, cached, v)
        if sampling is not None:
            temperature, top_k, top_p, seed = sampling
            if start:
                self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
            out = pick(out.cpu(), temperature, top_k, self.generator, top_p)
        return pack(to_host(out)) if self.stage.tp.rank == 0 else None

    def end_generation(self) -> None:
        end_generation(self.stage.executor)
