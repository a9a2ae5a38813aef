"""What stops a `fit` from outside: SIGTERM (`ray job stop`, a preempted node, a batch scheduler)
becomes an interrupt in the driver's main thread while `fit` runs, so one path handles it and
Ctrl-C (a terminal, a notebook's stop button): the queued steps are booked, a checkpoint is
written at the last completed step, and the loggers mark the run KILLED."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while `fit` ran: the process is being stopped, so the trainer shuts down."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (elsewhere: unchanged, since
    only the main thread may set handlers). The previous handler is back on leaving, so a second
    SIGTERM during the clean-up after the block ends the process as it would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(f"signal {signal.Signals(signum).name}")

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextmanager
def held_interrupts() -> Iterator[None]:
    """Within the block Ctrl-C (SIGINT) and SIGTERM wait, their handlers running as the block
    ends: a step's calls then go out to every actor or to none. A step sent to some of its actors
    only would leave those waiting for neighbours that never run it, until `step_timeout`, with
    every later call (a Ctrl-C save too) queued behind it. Sending takes milliseconds; elsewhere
    than the main thread (where no signal lands) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if arrived:  # as it would have been handled, now that the calls are out
            handler = previous[arrived[0]]
            if callable(handler):
                handler(arrived[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(arrived[0])
