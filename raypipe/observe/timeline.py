"""Schedule timelines: which stage ran which forward and backward when.

A `Timeline` is a list of spans (stage, F or B, microbatch, start, end). It comes
from a schedule (`Timeline.planned`: the schedule's own dependencies, with given
forward and backward durations) or from a step that ran (`Trainer.timeline()`: the
actors' own timestamps of each action). Both draw the same stage x time chart
(SVG written here, PNG/PDF through Graphviz), with forward and backward in two
colours, microbatch numbers and the idle gaps (the bubble) in plain view, and the
measured one also exports a Chrome trace for Perfetto or chrome://tracing. In a
notebook a Timeline shows itself inline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from raypipe.core.errors import ScheduleError
from raypipe.observe.step_breakdown import (  # all-to-all: a thin bar, not busy
    ALL_TO_ALL,
    StepBreakdown,
    breakdown,
)
from raypipe.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Schedule
from raypipe.schedules.actions import timed

# forward blue, backward orange; a split backward's input gradient orange, its weight gradient green
COLOURS = {"F": "#4c8bd6", "B": "#f0a43a", "I": "#f0a43a", "W": "#59a14f", "A": "#d62728"}
ROW, LEFT, WIDTH, TOP = 30, 150, 900, 40  # svg layout in pixels


@dataclass(frozen=True)
class Span:
    stage: int
    kind: str  # "F", "B", or a split backward's "I" and "W"
    microbatch: int
    start: float
    end: float
    virtual: int | None = None  # the virtual stage (model chunk) it ran, where known (planned)

    @property
    def label(self) -> str:
        """As the schedule prints the action: `3B1`, by virtual stage where known."""
        return f"{self.stage if self.virtual is None else self.virtual}{self.kind}{self.microbatch}"


@dataclass
class Timeline:
    """Spans of one step. `unit` names the time axis ("ms" measured, "ticks" planned)."""

    spans: list[Span]
    num_stages: int
    title: str = ""
    unit: str = "ms"
    stage_names: Sequence[str] = ()
    breakdown: StepBreakdown | None = None  # a measured step's: where its time went (`of_run`)

    # ----- building ---------------------------------------------------------------

    @classmethod
    def planned(
        cls,
        schedule: Schedule,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 2.0,
        title: str = "",
        unit: str = "ticks",
    ) -> Timeline:
        """The schedule run with the given per-action durations (one number, or one per stage).

        Each stage runs its actions in order; an action starts when its stage is free and
        every action it depends on (the previous stage's forward, the next stage's
        backward) has ended.
        """
        p = len(schedule)
        fwd = [forward] * p if isinstance(forward, (int, float)) else list(forward)
        bwd = [backward] * p if isinstance(backward, (int, float)) else list(backward)
        costs = [{FORWARD: f, BACKWARD: b, INPUT_GRAD: b / 2, WEIGHT_GRAD: b / 2} for f, b in zip(fwd, bwd)]
        try:
            runs = timed(schedule, costs)
        except ScheduleError as error:  # validate() rejects such schedules
            raise ValueError("the schedule deadlocks; build it with raypipe.build_schedule to see where") from error
        spans = [
            Span(s, a.kind, a.microbatch, start, end, a.stage) for s, run in enumerate(runs) for a, start, end in run
        ]
        return cls(spans, p, title, unit)

    @classmethod
    def measured(
        cls, events: Sequence[Sequence[tuple[str, int, float, float]]], title: str = "", stage_names: Sequence[str] = ()
    ) -> Timeline:
        """From each stage's (kind, microbatch, start, end) wall-clock events, in ms from the first start."""
        starts = [e[2] for stage in events for e in stage]
        origin = min(starts) if starts else 0.0
        spans = [
            Span(s, kind, m, 1000 * (start - origin), 1000 * (end - origin))
            for s, stage in enumerate(events)
            for kind, m, start, end, *_ in stage
        ]
        return cls(spans, len(events), title, "ms", tuple(stage_names))

    @classmethod
    def planned_as_measured(
        cls,
        schedule: Schedule,
        events: Sequence[Sequence[tuple[str, int, float, float]]],
        title: str = "",
        stage_names: Sequence[str] = (),
    ) -> Timeline:
        """`schedule` as planned, each stage's forward and backward lasting their mean in `events`
        (a step's measured actions, in ms; a split backward's I and W together); 1 and 2 ticks
        when there are none."""
        p = len(schedule)
        fwd, bwd, unit = [1.0] * p, [2.0] * p, "ticks"
        if events:
            unit = "ms"
            for s, stage in enumerate(events):
                # a microbatch's backward is one B, or one I and one W: its time is their sum
                for kinds, counted, durations in (("F", "F", fwd), ("BIW", "BI", bwd)):
                    total = sum(1000 * (e[3] - e[2]) for e in stage if e[0] in kinds)
                    count = sum(1 for e in stage if e[0] in counted)
                    durations[s] = total / count if count else 0.0
        line = cls.planned(schedule, fwd, bwd, title, unit)
        line.stage_names = tuple(stage_names)
        return line

    @classmethod
    def of_run(
        cls,
        schedule: Schedule,
        events: Sequence[Sequence[tuple]],
        title: str,
        stage_names: Sequence[str],
        planned: bool,
        step_seconds: float | None = None,
    ) -> Timeline:
        """A trainer's last step as measured (`events`), with `breakdown` where the events are the
        schedule's (not a step from before a `reconfigure`), `step_seconds` the driver's time of
        it; or with `planned` its schedule as planned.

        Raises:
            RaypipeError: no step has run yet and the measured one is asked for.
        """
        if planned:
            return cls.planned_as_measured(schedule, events, title, stage_names)
        if not events:
            from raypipe.core.errors import RaypipeError

            raise RaypipeError("no step has run yet: call step() first, or timeline(planned=True).")
        line = cls.measured(events, title, stage_names)
        try:
            line.breakdown = breakdown(schedule, events, step_seconds)
        except ValueError:
            pass
        return line

    # ----- reading ------------------------------------------------------------------

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=0.0) - min((s.start for s in self.spans), default=0.0)

    def busy(self) -> list[float]:
        """Per stage, the share of the makespan it spent running actions."""
        total = self.makespan or 1.0
        return [
            sum(s.end - s.start for s in self.spans if s.stage == st and s.kind != ALL_TO_ALL) / total
            for st in range(self.num_stages)
        ]

    def bubble(self) -> list[float]:
        """Per stage, the idle share of the makespan: 1 - busy."""
        return [max(0.0, 1.0 - b) for b in self.busy()]

    # ----- drawing --------------------------------------------------------------------

    def to_svg(self) -> str:
        """The stage x time chart as an SVG document."""
        scale = WIDTH / (self.makespan or 1.0)
        origin = min((s.start for s in self.spans), default=0.0)
        height = TOP + ROW * self.num_stages + 40
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 110}" height="{height}" '
            f'font-family="sans-serif" font-size="12">',
            '<rect width="100%" height="100%" fill="white"/>',
            f'<text x="{LEFT}" y="20" font-size="14">{escape(self.title)}</text>',
        ]
        bubble = self.bubble()
        for st in range(self.num_stages):
            y = TOP + ROW * st
            out.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH}" height="{ROW - 6}" fill="#eeeeee"/>')
            out.append(f'<text x="6" y="{y + 17}">{escape(self._stage_label(st))}</text>')
            out.append(f'<text x="{LEFT + WIDTH + 8}" y="{y + 17}">idle {100 * bubble[st]:.0f}%</text>')
        for span in self.spans:
            x, w = LEFT + (span.start - origin) * scale, max(1.0, (span.end - span.start) * scale)
            y = TOP + ROW * span.stage
            if span.kind == ALL_TO_ALL:
                out.append(
                    f'<rect x="{x:.2f}" y="{y + ROW - 12}" width="{w:.2f}" height="6" fill="{COLOURS[span.kind]}">'
                    f"<title>all-to-all in {span.microbatch}: {span.start:.2f}-{span.end:.2f} {self.unit}</title></rect>"  # noqa: E501
                )
                continue
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW - 6}" fill="{COLOURS[span.kind]}" '
                f'stroke="white" stroke-width="0.5"><title>{span.label}: {span.start:.2f}-{span.end:.2f} '
                f"{self.unit}</title></rect>"
            )
            if w >= 14:
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + 16}" text-anchor="middle" fill="white">'
                    f"{span.kind}{span.microbatch}</text>"
                )
        axis_y = TOP + ROW * self.num_stages + 14
        for i in range(6):
            value = self.makespan * i / 5
            out.append(
                f'<text x="{LEFT + WIDTH * i / 5:.1f}" y="{axis_y}" text-anchor="middle" fill="#555">'
                f"{value:.3g} {self.unit}</text>"
            )
        out.append(
            f'<rect x="{LEFT}" y="{axis_y + 10}" width="12" height="10" fill="{COLOURS["F"]}"/>'
            f'<text x="{LEFT + 16}" y="{axis_y + 19}">forward</text>'
            f'<rect x="{LEFT + 80}" y="{axis_y + 10}" width="12" height="10" fill="{COLOURS["B"]}"/>'
            f'<text x="{LEFT + 96}" y="{axis_y + 19}">backward (number: microbatch)</text>'
        )
        if any(span.kind == ALL_TO_ALL for span in self.spans):
            out.append(
                f'<rect x="{LEFT + 330}" y="{axis_y + 14}" width="12" height="6" fill="{COLOURS[ALL_TO_ALL]}"/>'
                f'<text x="{LEFT + 346}" y="{axis_y + 19}">all-to-all (MoE)</text>'
            )
        out.append("</svg>")
        return "\n".join(out)

    def to_dot(self) -> str:
        """Graphviz source with every span pinned in place (render with `neato -n2`)."""
        scale = WIDTH / (self.makespan or 1.0)
        origin = min((s.start for s in self.spans), default=0.0)
        lines = [
            "digraph timeline {",
            '  node [shape=box, style=filled, fontname="Helvetica", fontsize=10, '
            "fixedsize=true, penwidth=0.3, color=white];",
            f'  title [shape=plaintext, style="", label="{self.title}", pos="{LEFT + WIDTH / 2},'
            f'{ROW * (self.num_stages + 1)}!", width=6, height=0.3];',
        ]
        for st in range(self.num_stages):
            y = ROW * (self.num_stages - st - 1) + ROW / 2
            lines.append(
                f'  label{st} [shape=plaintext, style="", label="{self._stage_label(st)}", '
                f'pos="{LEFT / 2},{y}!", width={LEFT / 72:.2f}, height={(ROW - 6) / 72:.2f}];'
            )
        for i, span in enumerate(self.spans):
            if span.kind == ALL_TO_ALL:
                continue
            w = max(1.0, (span.end - span.start) * scale)
            x = LEFT + (span.start - origin) * scale + w / 2
            y = ROW * (self.num_stages - span.stage - 1) + ROW / 2
            lines.append(
                f'  s{i} [label="{span.kind}{span.microbatch if w >= 14 else ""}", fillcolor="{COLOURS[span.kind]}", '
                f'fontcolor=white, pos="{x:.2f},{y}!", width={w / 72:.3f}, height={(ROW - 6) / 72:.3f}];'
            )
        lines.append("}")
        return "\n".join(lines)

    def to_chrome_trace(self) -> dict:
        """The spans as Chrome trace events (one thread per stage), for Perfetto or chrome://tracing."""
        factor = 1000.0 if self.unit == "ms" else 1.0  # trace timestamps are microseconds
        events = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": st, "args": {"name": self._stage_label(st)}}
            for st in range(self.num_stages)
        ]
        for span in self.spans:
            events.append(
                {
                    "name": span.label,
                    "ph": "X",
                    "cat": {FORWARD: "forward", WEIGHT_GRAD: "weight gradient", ALL_TO_ALL: "all-to-all"}.get(
                        span.kind, "backward"
                    ),
                    "pid": 1,
                    "tid": span.stage,
                    "ts": span.start * factor,
                    "dur": (span.end - span.start) * factor,
                    "args": {"stage": span.stage, "microbatch": span.microbatch},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": self.title}}

    def save(self, path: str | Path) -> Path:
        """Writes the chart by the file's extension: .svg, .png or .pdf (Graphviz), .json (Chrome trace)."""
        path = Path(path)
        suffix = path.suffix.lower()
        path.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".svg":
            path.write_text(self.to_svg())
        elif suffix == ".json":
            path.write_text(json.dumps(self.to_chrome_trace()))
        elif suffix in (".png", ".pdf"):
            import graphviz

            data = graphviz.Source(self.to_dot(), engine="neato").pipe(format=suffix[1:], neato_no_op=2)
            path.write_bytes(data)
        else:
            raise ValueError(f"cannot write a timeline as {path.name!r}: use .svg, .png, .pdf or .json")
        return path

    def _repr_svg_(self) -> str:  # Jupyter shows the chart inline
        return self.to_svg()

    def _stage_label(self, stage: int) -> str:
        if stage < len(self.stage_names):
            return f"stage {stage} ({self.stage_names[stage]})"
        return f"stage {stage}"


__all__ = ["Span", "Timeline", "BACKWARD", "FORWARD"]
