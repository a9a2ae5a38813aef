"""A step's action list on one actor (the p2p and compiled engines): the streams to and from the
actors holding the neighbouring virtual stages (`links_for`), and the list run against them
(`run_list`), sending poison after a failure so no neighbour waits forever.

Plain Python and torch: the links are anything with `send`/`poison`/`take`/`refill`/`wait`
(`raypipe.transport`), so a test can drive an Executor with queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raypipe.actors.step.executor import Executor
from raypipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD


@dataclass
class StepLinks:
    """One step's streams to other actors, per virtual stage held: where its activations come
    from and go to, where its gradients come from and go to (absent: the first or last stage,
    or a neighbour held by this actor)."""

    activations: dict[int, Any] = field(default_factory=dict)
    gradients: dict[int, Any] = field(default_factory=dict)
    to_next: dict[int, object] = field(default_factory=dict)
    to_prev: dict[int, Any] = field(default_factory=dict)
    microbatches: int = 1

    def tag(self, v: int, m: int, what: str) -> int:
        """The tag of the message virtual stage v sends for microbatch m: "F" its activation,
        "G" its input gradient (one tag per message of the step; both ends compute it)."""
        return 2 * (v * self.microbatches + m) + (what == "G")


def links_for(
    executor: Executor,
    actions: Sequence[tuple[str, int, int]],
    peers: Sequence[int],
    varying: bool,
    num_virtual: int,
    streams: dict[tuple[int, str], object] | None = None,
) -> StepLinks:
    """This step's streams: for each virtual stage held, from and to the actors holding its
    neighbours (`peers`: the world rank holding each virtual stage, for this replica and tp
    rank). With model chunks two actors may exchange several streams: each is a channel of
    their link of its own (`transport.outbox`), its messages tagged by stage and microbatch.
    `streams`: (sending virtual stage, "F" or "G") -> (group, device) for streams on a group of
    their own (device links, `transport.ordered`); the others go through host memory."""
    from raypipe import transport

    held, streams = executor.parts, streams or {}
    last = num_virtual - 1
    links = StepLinks(microbatches=1 + max(m for _, m, _ in actions))
    for v in held:
        forwards = [m for kind, m, u in actions if u == v and kind == FORWARD]
        backwards = [m for kind, m, u in actions if u == v and kind in (BACKWARD, INPUT_GRAD)]
        if v > 0 and v - 1 not in held:
            links.activations[v] = transport.inbox(
                peers[v - 1], [links.tag(v - 1, m, "F") for m in forwards], streams.get((v - 1, "F")), 2 * (v - 1)
            )
            links.to_prev[v] = transport.outbox(peers[v - 1], len(backwards), varying, 2 * v + 1, streams.get((v, "G")))
        if v < last and v + 1 not in held:
            links.gradients[v] = transport.inbox(
                peers[v + 1], [links.tag(v + 1, m, "G") for m in backwards], streams.get((v + 1, "G")), 2 * (v + 1) + 1
            )
            links.to_next[v] = transport.outbox(peers[v + 1], len(forwards), varying, 2 * v, streams.get((v, "F")))
    return links


def run_list(
    executor: Executor,
    actions: Sequence[tuple[str, int, int]],
    inputs: Any,
    targets: Any,
    links: StepLinks,
    weights: Sequence[float] | None = None,
) -> tuple[list[Any], Exception | None]:
    """Runs a step's action list, (kind, microbatch, virtual stage) in order, taking boundaries
    from `links`' inboxes and sending results to its outboxes; a boundary between two virtual
    stages this actor holds (the turn of a V) is handed over in place. After a failure it
    still makes every send and receive of the list, sending poison, so no neighbour waits
    forever.

    Returns:
        (the last stage's microbatch losses, else []; the first failure or None).

    `weights`: where the last virtual stage is held, each microbatch's loss weight (`forward`).
    """
    losses, failure = [], None
    handed: dict[tuple[str, int, int], object] = {}  # hand-overs inside this actor
    for kind, m, v in actions:
        _, _, first, last = executor.part(v)
        if kind == FORWARD:
            out, box = None, links.activations.get(v)
            try:
                x = inputs[m] if first else box.take() if box is not None else handed.pop(("F", v, m))
                if failure is None:
                    out = executor.forward(
                        m, x, targets[m] if last else None, weights[m] if weights is not None and last else 1.0, v
                    )
            except Exception as error:  # noqa: BLE001 - kept, raised after the list is done
                failure = failure or error
            if failure is None:
                executor.hand_on.forward(v, executor.last_action_s)
            if last:
                losses.append(out)
            elif v + 1 in executor.parts:
                handed[("F", v + 1, m)] = out
            else:
                failure = send_or_poison(links.to_next[v], out, links.tag(v, m, "F"), failure)
            if box is not None:
                box.refill()
        elif kind in (BACKWARD, INPUT_GRAD):
            grad_in, box = None, links.gradients.get(v)
            eligible = kind == BACKWARD and v in links.to_prev and executor.may_hand_on_early(v)
            early = eligible and executor.hand_on.early(v)
            try:
                grad = None if last else box.take() if box is not None else handed.pop(("G", v, m))
                if failure is None:
                    if kind == BACKWARD and not early:
                        grad_in = executor.backward(m, grad, v)
                    else:
                        grad_in = executor.backward_input(m, grad, v, whole=early)
            except Exception as error:  # noqa: BLE001
                failure = failure or error
            if first:
                pass
            elif v - 1 in executor.parts:
                handed[("G", v - 1, m)] = grad_in
            else:
                failure = send_or_poison(links.to_prev[v], grad_in, links.tag(v, m, "G"), failure)
            if box is not None:
                box.refill()
            if early and failure is None:  # the weight gradients, once the input gradient is on its way
                try:
                    executor.backward_weight(m, v, whole=True)
                except Exception as error:  # noqa: BLE001
                    failure = error
            if eligible and failure is None:  # what this B computed, whole or split (`hand_on`)
                executor.hand_on.record(v, early, executor.last_action_s, executor.input_part_s)
        elif failure is None:  # WEIGHT_GRAD: nothing crosses to another actor
            try:
                executor.backward_weight(m, v)
            except Exception as error:  # noqa: BLE001
                failure = error
        if executor.sharding is not None:  # ZeRO-3: free what the action left gathered; after a
            executor.sharding.settle()  # failure, tell the other replicas at once (not at a gather)
            if failure is not None:
                executor.sharding.announce(True)
    for box in (*links.to_next.values(), *links.to_prev.values()):
        box.wait()
    return losses, failure


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
