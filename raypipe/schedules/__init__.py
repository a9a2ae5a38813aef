"""Pipeline schedules: functions `(num_stages, num_microbatches[, chunks]) -> list[list[Action]]`,
one list per actor, registered by name with how many model chunks each actor holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from raypipe.core.errors import ScheduleError
from raypipe.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OVERLAPPED,
    WEIGHT_GRAD,
    Action,
    Schedule,
    bubble,
    format_grid,
    format_schedule,
    overlapped_pairs,
    owners,
    peak_in_flight,
    simulate,
    timed,
    validate,
    virtual_stages,
)
from raypipe.schedules.dualpipe_v import dualpipe_v
from raypipe.schedules.gpipe import gpipe
from raypipe.schedules.interleaved import interleaved_1f1b
from raypipe.schedules.one_f_one_b import one_f_one_b
from raypipe.schedules.zero_bubble import zb_h1, zb_v


@dataclass(frozen=True)
class ScheduleKind:
    """A registered schedule.

    Attributes:
        build: `(p, m) -> Schedule`, or `(p, m, chunks)` when `chunks` is None.
        chunks: the model chunks per actor it always has, or None when the config chooses
            (`TrainConfig.chunks`, `default_chunks` unless given).
        split_backward: whether its backwards are split into I and W.
        extra_warmup: whether it takes `extra_warmup` (more forwards in flight before the
            first backward, for slow links: `one_f_one_b`).
        overlapped: whether its steady state pairs a forward with another chunk's backward to
            overlap them (`overlapped_pairs`, DualPipe's F&B).
    """

    build: Callable[..., Schedule]
    chunks: int | None = 1
    split_backward: bool = False
    default_chunks: int = 2
    extra_warmup: bool = False
    overlapped: bool = False

    def chunks_for(self, chunks: int | None) -> int:
        return self.chunks if self.chunks is not None else (chunks or self.default_chunks)


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(gpipe),
    "1f1b": ScheduleKind(one_f_one_b, extra_warmup=True),
    "interleaved-1f1b": ScheduleKind(interleaved_1f1b, chunks=None),
    "zb-h1": ScheduleKind(zb_h1, split_backward=True, extra_warmup=True),
    "zb-v": ScheduleKind(zb_v, chunks=2, split_backward=True),
    "dualpipe-v": ScheduleKind(dualpipe_v, chunks=2, split_backward=True, overlapped=True),
}


# the schedules that take a microbatch's sequence chunks as their unit (`TrainConfig.sequence_chunks`)
SEQUENCE_CHUNKED = ("gpipe", "1f1b", "zb-h1")


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    chunks: int | None = None,
    extra_warmup: int | None = 0,
    sequence_chunks: int = 1,
) -> Schedule:
    """Builds and validates the named schedule.

    Args:
        chunks: model chunks per actor, for the schedules that let the config choose.
        extra_warmup: forwards each stage but the last runs ahead beyond the schedule's own
            warm-up (1F1B-ordered schedules: "1f1b", "zb-h1"), for slow links; None: 0 (a
            config's unset value, which a trainer decides once its actors are placed).
        sequence_chunks: k > 1 cuts each microbatch along the sequence into k units, unit u being
            chunk u % k of microbatch u // k, forwards in chunk order and backwards in reverse
            (`SEQUENCE_CHUNKED` schedules): the schedule has `num_microbatches` x k units.

    Raises:
        KeyError: for an unknown name (the config validates names before this).
        ScheduleError: if the schedule is invalid for these sizes, or `chunks` is not its own.
    """
    kind, extra_warmup = SCHEDULES[name], extra_warmup or 0
    if sequence_chunks != 1:
        if name not in SEQUENCE_CHUNKED or sequence_chunks < 1:
            raise ScheduleError(
                f"schedule {name!r} does not run sequence chunks (sequence_chunks={sequence_chunks}): "
                f"{' and '.join(repr(n) for n in SEQUENCE_CHUNKED)} do; or use sequence_chunks=1"
            )
        units = num_microbatches * sequence_chunks
        if name == "gpipe":
            schedule = gpipe(num_stages, units)
        else:
            schedule = kind.build(num_stages, units, extra_warmup, sequence_chunks)
        validate(schedule, num_stages, units)
        return schedule
    if extra_warmup and not kind.extra_warmup:
        takers = ", ".join(repr(n) for n, k in SCHEDULES.items() if k.extra_warmup)
        raise ScheduleError(f"schedule {name!r} has no extra warm-up: {takers} take one; leave extra_warmup at 0")
    if extra_warmup < 0:
        raise ScheduleError(f"extra_warmup is {extra_warmup}: it counts forwards, 0 or more")
    if kind.chunks is None:
        schedule = kind.build(num_stages, num_microbatches, kind.chunks_for(chunks))
    else:
        if chunks not in (None, kind.chunks):
            raise ScheduleError(
                f"schedule {name!r} always runs {kind.chunks} chunk(s) per actor, got chunks={chunks}; "
                f"leave chunks unset, or use interleaved-1f1b to choose them"
            )
        extra = (extra_warmup,) if kind.extra_warmup else ()
        schedule = kind.build(num_stages, num_microbatches, *extra)
    validate(schedule, num_stages, num_microbatches)
    return schedule


__all__ = [
    "Action",
    "BACKWARD",
    "FORWARD",
    "INPUT_GRAD",
    "OVERLAPPED",
    "WEIGHT_GRAD",
    "SCHEDULES",
    "SEQUENCE_CHUNKED",
    "Schedule",
    "ScheduleKind",
    "bubble",
    "build_schedule",
    "dualpipe_v",
    "format_grid",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "overlapped_pairs",
    "owners",
    "peak_in_flight",
    "simulate",
    "timed",
    "validate",
    "virtual_stages",
    "zb_h1",
    "zb_v",
]
