"""Actions, the unit of a pipeline schedule, with the validator, the simulators and the grid printer.

A schedule is plain data: one ordered list of `Action`s per actor. An action names a
*virtual* stage: without model chunks virtual stage s is actor s; with chunks an actor
holds several non-contiguous virtual stages (interleaved: c * p + s; V-shaped: s and
2p - 1 - s), and which actor runs a virtual stage is read from the lists themselves.
Each actor runs its list in order; an action may start once the actions it depends on
have finished. The engines, the validator below and the timeline plots all read the
same object.

Kinds, as torch.distributed.pipelining prints them: `F` forward, `B` the whole backward,
or the backward split in two for zero-bubble schedules: `I` the input gradient (what the
previous stage waits for) and `W` the weight gradient (which nothing waits for).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from raypipe.core.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"
WEIGHT_GRAD = "W"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
GRADIENT_KINDS = (BACKWARD, INPUT_GRAD)  # the kinds that send a gradient to the previous stage
FREEING_KINDS = (BACKWARD, WEIGHT_GRAD)  # the kinds after which a microbatch's activations are gone
OVERLAPPED = "F&B"  # the cost of an overlapped forward-and-backward pair (DualPipe), for `timed`


@dataclass(frozen=True, order=True)
class Action:
    """One forward or backward (part) of one microbatch on one virtual stage, printed as `1F3`."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__


Schedule = list[list[Action]]


def virtual_stages(schedule: Schedule) -> list[list[int]]:
    """Per actor, the virtual stages it runs, in ascending order (its model chunks, chunk 0 first)."""
    return [sorted({a.stage for a in actions}) for actions in schedule]


def owners(schedule: Schedule) -> dict[int, int]:
    """Virtual stage -> the actor that runs it."""
    return {v: actor for actor, stages in enumerate(virtual_stages(schedule)) for v in stages}


def dependencies(action: Action, num_virtual: int) -> list[tuple[str, int, int]]:
    """What must have finished before `action` starts, as (event, virtual stage, microbatch):
    event "F" is a forward, "G" the gradient a `B` or `I` produced, "I" an input gradient."""
    v, m = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [("F", v - 1, m)] if v > 0 else []
    if action.kind == WEIGHT_GRAD:
        return [("I", v, m)]
    return [("G", v + 1, m)] if v < num_virtual - 1 else [("F", v, m)]


def events(action: Action) -> list[tuple[str, int, int]]:
    """What finishing `action` makes available (the keys `dependencies` waits on)."""
    key = (action.stage, action.microbatch)
    return {FORWARD: [("F", *key)], BACKWARD: [("G", *key)], INPUT_GRAD: [("G", *key), ("I", *key)], WEIGHT_GRAD: []}[
        action.kind
    ]


def simulate(schedule: Schedule, num_stages: int) -> list[list[Action | None]]:
    """Runs the schedule with every action taking one tick.

    Returns:
        The grid: one row per tick, one column per actor, `None` where an actor idles.

    Raises:
        ScheduleError: when no actor can make progress before all actions ran
            (a deadlock); the message shows the grid so far and the stuck actions.
    """
    num_virtual = len(owners(schedule))
    done: set[tuple[str, int, int]] = set()
    position = [0] * num_stages
    grid: list[list[Action | None]] = []
    total = sum(len(actions) for actions in schedule)
    ran = 0
    while ran < total:
        row: list[Action | None] = []
        for actor, actions in enumerate(schedule):
            nxt = actions[position[actor]] if position[actor] < len(actions) else None
            ready = nxt is not None and all(d in done for d in dependencies(nxt, num_virtual))
            row.append(nxt if ready else None)
        if not any(row):
            stuck = {s: actions[position[s]] for s, actions in enumerate(schedule) if position[s] < len(actions)}
            names = {e: str(a) for actions in reversed(schedule) for a in reversed(actions) for e in events(a)}
            waits = "; ".join(
                f"actor {s} waits at {a} for "
                + ", ".join(names.get(d, "{1}{0}{2}".format(*d)) for d in dependencies(a, num_virtual) if d not in done)
                for s, a in stuck.items()
            )
            raise ScheduleError(
                f"schedule deadlocks after {len(grid)} ticks: {waits}\n" + format_grid(grid, num_stages, stuck=stuck)
            )
        for actor, action in enumerate(row):
            if action is not None:
                done.update(events(action))
                position[actor] += 1
                ran += 1
        grid.append(row)
    return grid


def timed(
    schedule: Schedule,
    costs: Mapping[str, float] | Sequence[Mapping[str, float]] | Callable[[Action], float],
    transfer: Callable[[int, int, str, int], float] | None = None,
    early_gradients: bool = False,
) -> list[list[tuple[Action, float, float]]]:
    """Runs the schedule with each action taking `costs[kind]` (one mapping, or one per actor;
    per chunk; `B` defaults to I + W), or `costs(action)`: per actor, (action, start, end) in order.

    With an `OVERLAPPED` ("F&B") cost, each of an actor's overlapped pairs (`overlapped_pairs`:
    a forward directly followed by a whole backward of its other chunk) runs as one block of that
    cost, as DualPipe's two streams run it: it starts once both halves' inputs are there, and both
    halves' outputs leave when it ends. Without one the pair's halves run one after the other, as
    the engines run them on a CPU: the forward's send leaves while the backward computes.

    `transfer(sender, receiver, what, v)`: seconds a boundary value takes from actor `sender` to
    actor `receiver` ("F": virtual stage v's activation, "G": its input gradient). Each direction
    of a link carries one message at a time, in the order its sender makes them, as a TCP stream
    does; the receiver's action waits for its message's arrival. Without it messages are free.

    `early_gradients`: a whole backward whose gradient goes to another actor hands it on once
    its input-gradient part is done (`I`'s cost), its weight gradients after, as the p2p engine
    runs it (`Executor.may_hand_on_early`); without an `I` cost, or False (the textbook model), the
    gradient leaves when the backward ends.

    Raises:
        ScheduleError: on a deadlock (see `simulate`).
    """
    owner = owners(schedule)
    overlapped: list[float | None] = [None] * len(schedule)
    input_part: Callable[[Action], float | None]
    if callable(costs):
        cost = costs

        def input_part(action: Action) -> float | None:
            return costs(Action(action.stage, INPUT_GRAD, action.microbatch))
    else:
        per_actor = [costs] * len(schedule) if isinstance(costs, Mapping) else list(costs)
        per_actor = [{BACKWARD: c.get(INPUT_GRAD, 0) + c.get(WEIGHT_GRAD, 0), **c} for c in per_actor]
        overlapped = [c.get(OVERLAPPED) for c in per_actor]

        def cost(action: Action) -> float:
            return per_actor[owner[action.stage]][action.kind]

        def input_part(action: Action) -> float | None:
            return per_actor[owner[action.stage]].get(INPUT_GRAD)

    def handed_on(action: Action, actor: int) -> float | None:  # after how long B's gradient leaves early
        v = action.stage
        if not early_gradients or action.kind != BACKWARD or v == 0 or owner[v - 1] == actor:
            return None
        return input_part(action)

    simulate(schedule, len(schedule))  # the deadlock check, with its message
    units = [_units(actions, pair_cost is not None) for actions, pair_cost in zip(schedule, overlapped)]
    num_virtual = len(owner)
    finished: dict[tuple[str, int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}  # per direction of a link: when it is next idle
    free = [0.0] * len(schedule)
    position = [0] * len(schedule)
    runs: list[list[tuple[Action, float, float]]] = [[] for _ in schedule]
    remaining = sum(len(u) for u in units)
    while remaining:
        for actor, unit_list in enumerate(units):
            while position[actor] < len(unit_list):
                unit = unit_list[position[actor]]
                deps = [d for action in unit for d in dependencies(action, num_virtual)]
                if any(d not in finished for d in deps):
                    break
                start = max([free[actor]] + [finished[d] for d in deps])
                own = [cost(action) for action in unit]
                scale = overlapped[actor] / sum(own) if len(unit) == 2 and sum(own) else 1.0
                ends = [start + scale * sum(own[: i + 1]) for i in range(len(unit))]
                for action, begins, end in zip(unit, [start, *ends[:-1]], ends):
                    runs[actor].append((action, begins, end))
                    early = handed_on(action, actor) if len(unit) == 1 else None
                    # a block's outputs leave when it ends; a backward handed on early, after its I
                    leaves = ends[-1] if len(unit) == 2 else end if early is None else begins + early
                    for e in events(action):
                        finished[e] = _arrival(e, leaves, actor, owner, transfer, link_free)
                free[actor] = ends[-1]
                position[actor] += 1
                remaining -= 1
    return runs


def overlapped_pairs(actions: Sequence[Action]) -> list[tuple[Action, Action]]:
    """An actor's overlapped pairs (DualPipe's `F&B`): a forward directly followed by a whole
    backward of another of the actor's chunks, neither waiting for the other."""
    return [
        (a, b) for a, b in zip(actions, actions[1:]) if a.kind == FORWARD and b.kind == BACKWARD and a.stage != b.stage
    ]


def _units(actions: Sequence[Action], pairs: bool) -> list[tuple[Action, ...]]:
    """The actor's list as the blocks `timed` runs: its overlapped pairs as one (with `pairs`),
    every other action alone."""
    starts = {id(a) for a, _ in overlapped_pairs(actions)} if pairs else set()
    units: list[tuple[Action, ...]] = []
    i = 0
    while i < len(actions):
        take = 2 if id(actions[i]) in starts else 1
        units.append(tuple(actions[i : i + take]))
        i += take
    return units


def _arrival(
    event: tuple[str, int, int],
    end: float,
    actor: int,
    owner: Mapping[int, int],
    transfer: Callable[[int, int, str, int], float] | None,
    link_free: dict[tuple[int, int], float],
) -> float:
    """When `event`, made by `actor` at `end`, is available to the action that waits for it."""
    what, v, _ = event
    receiver = owner.get(v + 1 if what == "F" else v - 1) if what in ("F", "G") else None
    if transfer is None or receiver is None or receiver == actor:
        return end
    leaves = max(end, link_free.get((actor, receiver), 0.0))
    link_free[(actor, receiver)] = arrives = leaves + transfer(actor, receiver, what, v)
    return arrives


def bubble(schedule: Schedule, costs: Mapping[str, float], early_gradients: bool = False) -> float:
    """The planned bubble: the share of actor time idle between the step's first start and its
    last end, with the action costs given (see `timed`)."""
    runs = timed(schedule, costs, early_gradients=early_gradients)
    span = max(end for actor in runs for _, _, end in actor)
    busy = sum(end - start for actor in runs for _, start, end in actor)
    return 1.0 - busy / (span * len(runs))


def validate(schedule: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Checks a schedule is complete, well ordered, sendable and deadlock free.

    Every virtual stage runs on one actor; it runs each microbatch's forward once and
    either its whole backward `B` or its split `I` then `W`, after the forward; the
    microbatches cross each link between two actors in the order the receiver takes
    them; and a simulated run finishes.

    Raises:
        ScheduleError: naming the actor and action that break a rule.
    """
    if len(schedule) != num_stages:
        raise ScheduleError(f"schedule has {len(schedule)} actor lists, expected {num_stages}")
    who: dict[int, int] = {}
    for actor, actions in enumerate(schedule):
        for v in {a.stage for a in actions}:
            if who.setdefault(v, actor) != actor:
                raise ScheduleError(f"virtual stage {v} has actions on actors {who[v]} and {actor}")
    num_virtual = len(who)
    if sorted(who) != list(range(num_virtual)):
        raise ScheduleError(f"virtual stages {sorted(who)} are not 0..{num_virtual - 1}")
    if any(not actions for actions in schedule):
        raise ScheduleError(f"actors {[a for a, actions in enumerate(schedule) if not actions]} have no actions")
    for actor, actions in enumerate(schedule):
        seen: set[tuple[str, int, int]] = set()
        for index, action in enumerate(actions):
            v, kind, m = action.stage, action.kind, action.microbatch
            where = f"actor {actor}, position {index} ({action})"
            if kind not in KINDS or not 0 <= m < num_microbatches:
                raise ScheduleError(f"{where}: unknown kind or microbatch out of range 0..{num_microbatches - 1}")
            if (kind, v, m) in seen:
                raise ScheduleError(f"{where}: runs twice")
            if kind != FORWARD and (FORWARD, v, m) not in seen:
                raise ScheduleError(f"{where}: backward before its forward")
            if kind == WEIGHT_GRAD and (INPUT_GRAD, v, m) not in seen:
                raise ScheduleError(f"{where}: weight gradient before its input gradient")
            if kind in (BACKWARD, INPUT_GRAD) and ({BACKWARD, INPUT_GRAD} - {kind}).pop() in {
                k for k, vv, mm in seen if (vv, mm) == (v, m)
            }:
                raise ScheduleError(f"{where}: mixes a whole backward with a split one")
            seen.add((kind, v, m))
        for v in {a.stage for a in actions}:
            for m in range(num_microbatches):
                split = (INPUT_GRAD, v, m) in seen or (WEIGHT_GRAD, v, m) in seen
                needed = (FORWARD, INPUT_GRAD, WEIGHT_GRAD) if split else (FORWARD, BACKWARD)
                missing = [k for k in needed if (k, v, m) not in seen]
                if missing:
                    raise ScheduleError(f"actor {actor} never runs {', '.join(f'{v}{k}{m}' for k in missing)}")
    simulate(schedule, num_stages)
    _check_links(schedule, who)


def _check_links(schedule: Schedule, who: dict[int, int]) -> None:
    """Each link between two actors is a FIFO stream: the sender must send microbatches in the
    order the receiver takes them (activations v -> v+1, gradients v+1 -> v)."""

    def order(v: int, kinds: Sequence[str]) -> list[int]:
        return [a.microbatch for a in schedule[who[v]] if a.stage == v and a.kind in kinds]

    for v in range(len(who) - 1):
        if who[v] == who[v + 1]:
            continue  # a hand-off inside one actor
        for what, sent, taken in (
            ("activations", order(v, FORWARD), order(v + 1, FORWARD)),
            ("gradients", order(v + 1, GRADIENT_KINDS), order(v, GRADIENT_KINDS)),
        ):
            if sent != taken:
                raise ScheduleError(
                    f"{what} between virtual stages {v} and {v + 1} are sent in microbatch "
                    f"order {sent} but taken in order {taken}: a link delivers in order"
                )


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most (chunk, microbatch) pairs one actor holds activations for: forwarded, and not
    yet through their whole backward or their weight gradient."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1 if action.kind in FREEING_KINDS else 0
        peak = max(peak, live)
    return peak


def format_grid(
    grid: Sequence[Sequence[Action | None]],
    num_stages: int,
    stuck: dict[int, Action] | None = None,
) -> str:
    """Draws the actor x time grid, one line per actor; `.` is an idle tick.

    A stuck action (from a deadlock) is shown after the grid in brackets on its actor.
    """
    width = max([len(str(a)) for row in grid for a in row if a] + [3])
    lines = []
    for stage in range(num_stages):
        cells = [(str(row[stage]) if row[stage] else ".").rjust(width) for row in grid]
        tail = f"  [{stuck[stage]} stuck]" if stuck and stage in stuck else ""
        lines.append(f"stage {stage}: " + " ".join(cells) + tail)
    return "\n".join(lines)


def format_schedule(schedule: Schedule) -> str:
    """The schedule as its simulated grid (unit-time actions), for printing."""
    return format_grid(simulate(schedule, len(schedule)), len(schedule))
