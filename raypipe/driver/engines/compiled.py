"""engine="compiled": the p2p engine's step, issued through a Ray Compiled Graph.

The graph is compiled once per set of actors: its input goes to every actor's
`run_compiled`, whose outputs the driver reads back. A step is then one
`execute()`, which writes the step's payload into shared-memory channels the
actors are already waiting on, instead of one `.remote()` task per actor.
Everything else is the p2p engine's: each actor runs its stage's action list,
activations and gradients go actor to actor over torch.distributed
(`raypipe.transport`), and the call ends with the agreed optimizer step. The action
lists travel in the payload, so changing microbatches or schedule needs no new
graph.

Ray runs compiled-graph calls on a background thread of each actor; the trainer's
other calls (configure, state_dict, checkpoints) run between steps on the main
thread, never at the same time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ray

from raypipe.core.errors import ActorDiedError, StageError, StepTimeoutError
from raypipe.core.protocol import CompiledCall
from raypipe.driver.engines.p2p import ActionList
from raypipe.driver.engines.step_io import StepInput
from raypipe.driver.results import cause_message, root_failure

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class CompiledStep:
    """A compiled graph over `actors` (world-rank order), one `run_compiled` node each."""

    def __init__(self, actors: Sequence[ActorHandle]) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as payload:
            graph = MultiOutputNode([actor.run_compiled.bind(payload) for actor in actors])
        self.graph = graph.experimental_compile()

    def run(self, lists: Sequence[ActionList], data: StepInput, what: str) -> list[object]:
        """Executes one step of `lists` (`engine.action_lists`, the graph's actor order);
        returns each actor's `run_actions` result.

        Raises:
            StageError: a stage failed (the root cause, not the neighbours it stopped).
            ActorDiedError: an actor died; StepTimeoutError: a call did not end in `timeout` s.
        """
        packed = data.packed_batches()
        payload = CompiledCall(
            data.call_id,
            data.step,
            {lst.name: (lst.actions, lst.peers) for lst in lists},
            [x for x, _ in packed],
            [y for _, y in packed],
            data.varying,
            data.weights or [None] * len(packed),
        )
        timeout = data.timeout
        refs = self.graph.execute(payload)
        deadline = time.monotonic() + timeout
        values, errors = [], []
        for ref, lst in zip(refs, lists):
            try:
                value = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayChannelTimeoutError:
                raise StepTimeoutError(  # a graph's step is one call per actor: the limit is for the whole step
                    f"{what} did not finish within {timeout:.0f} s (TrainConfig.step_timeout); "
                    f"still waiting for {lst.name}: {lst.label}"
                ) from None
            except (ray.exceptions.RayChannelError, ray.exceptions.RayActorError) as error:
                # the graph raises a death for every output: name the actor that died
                by_id = {other.actor._actor_id.hex(): other.name for other in lists}
                name = by_id.get(getattr(error, "actor_id", None) or "", lst.name)
                cause = str(error).splitlines()[0]
                raise ActorDiedError(f"{name} died during {what}: {cause}", actor=name, cause=cause) from None
            except ray.exceptions.RayTaskError as error:  # not run_actions' own failure: Ray's, or the graph's
                raise StageError(f"{what} failed: {cause_message(error)}") from None
            (errors if isinstance(value, StageError) else values).append(value)
        if errors:
            raise root_failure(errors)
        return values

    def teardown(self) -> None:
        try:
            self.graph.teardown()
        except Exception:  # noqa: BLE001 - actors already dead, or Ray shut down
            pass
