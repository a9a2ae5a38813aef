"""Inference and generation through a stage's model chunk: forwards in eval mode that keep
nothing for a backward. `InferenceCalls` is the part of `StageActor` that answers them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from raypipe.actors.step.executor import Executor
from raypipe.core.errors import StageError
from raypipe.nn.decoding import Feed, Picker
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
def generate(executor: Executor, x: Any, v: int | None, caches: dict | None, start: bool) -> Any:
    """One generation forward through chunk `v` (nothing stashed; the caller sets eval mode): the output, or on
    the last stage the logits of the last position. `caches` (None: no KV cache) holds the KV
    caches of the microbatch being decoded, per chunk: the chunk's layers that keep one
    (`begin_cache`) share a fresh one at `start`, and take the microbatch's back (`cache`) for
    each later forward; between forwards no layer holds one."""
    v, module, _, last = executor.part(v)
    layers = [layer for layer in module if hasattr(layer, "begin_cache")]
    if caches is not None:
        if start:
            shared: dict[str, object] = {}
            for layer in layers:
                layer.begin_cache(shared)
            caches[v] = [layer.cache for layer in layers]
        else:
            for layer, cache in zip(layers, caches[v]):
                layer.cache = cache
    try:
        with executor.autocast():
            out = module(executor.received(x))
        return out[:, -1].float() if last else out
    except Exception as error:
        raise executor.error(FORWARD, -1, error, v) from error
    finally:
        for layer in layers:
            layer.end_cache()


class InferenceCalls:
    """A stage's inference calls (`raypipe.driver.inference`): boundaries as packed host values,
    like the refs engine's."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.decoding: dict[int, dict[str, Any]] = {}  # per microbatch being generated: its feed, caches, picker

    def forward_only(
        self, x: object, target: object = None, v: int | None = None, reference: str | None = None
    ) -> object:
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

    def decode(
        self,
        x: Any,
        slot: int,
        start: bool,
        cached: bool,
        v: int | None = None,
        feeds: bool = False,
        sampling: tuple | None = None,
        tokens: int = 1,
    ) -> object:
        """Generation forwards of microbatch `slot` through chunk `v` (`raypipe.driver.inference.generation`).

        `feeds`: this call starts the model, so `x` is the prompt ({"input_ids", "attention_mask"})
        at `start`, after it the tokens the last stage picked, made into the next input here
        (`Feed`); else `x` is the previous stage's output. `cached`: the layers keep a KV cache per
        microbatch and chunk. With `sampling` ((rows, temperature, top_k, top_p, seed,
        eos_token_id), the last stage) each row's next token is picked here (`Picker`, seeded at
        `start`), so that a token, not a row of logits, travels back. A stage that both feeds and
        samples decodes up to `tokens` tokens in this one call, stopping once every row has ended.

        Returns:
            The output (tp rank 0 only); on the last stage the tokens picked (rows, n).
        """
        stage = self.stage
        state = self.decoding.setdefault(slot, {"caches": {} if cached else None})
        x = unpack(x)
        if feeds:
            if start:
                state["feed"] = Feed(x["input_ids"], x.get("attention_mask"), cached)
                x = state["feed"].prompt()
            else:
                x = state["feed"].next(x[:, -1])
        picked: list[torch.Tensor] = []
        stage.executor.module.eval()
        try:
            for step in range(tokens if feeds and sampling is not None else 1):
                out = generate(stage.executor, x, v, state["caches"], start and step == 0)
                if sampling is None:
                    break
                if start and step == 0:
                    state["picker"] = Picker(*sampling)
                picked.append(state["picker"](out.cpu()))
                if state["picker"].finished or step == tokens - 1:
                    break
                x = state["feed"].next(picked[-1])
        finally:
            stage.executor.module.train()
        if sampling is not None:
            out = torch.stack(picked, dim=1)
        return pack(to_host(out)) if stage.tp.rank == 0 else None

    def end_generation(self) -> None:
        """Drops every microbatch's decoding state (KV caches included)."""
        self.decoding.clear()
