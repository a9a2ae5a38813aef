"""Long phases of work that say what they are doing and how far along they are.

Starting the actors, profiling the layers for an "auto" plan and generating a GRPO batch each
take seconds in which nothing else is printed. On a terminal or in a notebook a phase shows a
bar once it has run `SHOW_AFTER` seconds (quick phases show nothing) and removes it when it ends;
where no one watches a terminal (a `ray job submit` log) an announced phase writes a line as it
starts, and any phase still running writes how far it got every `HEARTBEAT_S` seconds. An
announced phase ends with a line saying how long it took, in both places.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raypipe.observe.progress import interactive

SHOW_AFTER = 1.0  # seconds before a terminal's bar appears
HEARTBEAT_S = 30.0  # seconds between a log's "still ..." lines


class Phase:
    """One phase: `what` it does ("starting 4 actors"), out of `total` `unit`s (None: unknown).

    Used as a context manager; `at(done)` reports progress. `announce`: write a start and an end
    line (False for a phase that recurs every step, as generation does: only its heartbeat).
    `done_line`: the end line, given the seconds taken (default: "<what>: done in N s").
    """

    def __init__(
        self,
        what: str,
        log: Callable[[str], None],
        total: int | None = None,
        unit: str = "",
        announce: bool = True,
        done_line: Callable[[float], str] | None = None,
    ) -> None:
        self.what, self.log, self.total, self.unit, self.announce = what, log, total, unit, announce
        self.done_line = done_line or (lambda s: f"raypipe: {what}: done in {s:.1f} s")
        self.bar, self.started = None, time.monotonic()
        self.heard = self.started  # when the last heartbeat line was written
        self.shown = interactive()

    def __enter__(self) -> Phase:
        self.started = self.heard = time.monotonic()
        if self.shown:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.total, desc=f"raypipe: {self.what}", unit=self.unit or "it", leave=False, delay=SHOW_AFTER
            )
        elif self.announce:
            self.log(f"raypipe: {self.what} ...")
        return self

    def at(self, done: int) -> None:
        """`done` units of `total` are done."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif time.monotonic() - self.heard >= HEARTBEAT_S:
            self.heard = time.monotonic()
            self.log(f"raypipe: still {self.what}: {self.progress(done)}")

    def progress(self, done: int) -> str:
        """How far along, for a log line: "12/64 tokens, 31 s"."""
        counted = f"{done}/{self.total} {self.unit}".rstrip() + ", " if self.total else ""
        return f"{counted}{time.monotonic() - self.started:.0f} s"

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.announce and kind is None:
            self.log(self.done_line(time.monotonic() - self.started))
