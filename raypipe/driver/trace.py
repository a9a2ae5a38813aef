"""RAYPIPE_TRACE: every call an engine issues, appended as JSON lines in issue order."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from raypipe.core import env
from raypipe.schedules import Schedule


def trace_lists(step: int, schedule: Schedule, names: Sequence[Sequence[Sequence[str]]]) -> None:
    """With RAYPIPE_TRACE set: each actor's actions as issued (all at once), then its optimizer step."""
    trace = env.trace_path()
    if not trace:
        return
    now = time.time()
    issued: list[tuple[float, str, str]] = []
    for stages in names:
        for s, tp_names in enumerate(stages):
            for name in tp_names:
                issued += [(now, name, str(a)) for a in schedule[s]]
                issued.append((now, name, "optimizer_step"))
    write_trace(trace, step + 1, issued)


def write_trace(path: str, step: int, issued: Sequence[tuple[float, str, str]]) -> None:
    """Appends one JSON line per issued call: {"ts", "step", "actor", "action"}, in issue order."""
    with open(path, "a") as f:
        for ts, actor, action in issued:
            f.write(json.dumps({"ts": ts, "step": step, "actor": actor, "action": action}) + "\n")
