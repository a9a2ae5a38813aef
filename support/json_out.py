"""A benchmark's standard output is its JSON and nothing else, so `benchmark.py > out.json` gives a
file `json.load` reads: `run(main)` runs the benchmark with every other line printed on its way
(a trainer's start log, which goes to `print` by default; progress; a library's notices) sent to
standard error, and `emit(value)` writes one JSON value to the standard output `run` found.

Before this, a trainer's "raypipe: starting 2 actors ..." lines led the JSON of every benchmark
that built one with the default log, and the documented `> x.json` commands wrote files that do
not parse."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from typing import TextIO

_stdout: list[TextIO] = []  # the standard output `run` found, while it runs


def emit(value: object, indent: int | None = None) -> None:
    """Writes `value` as JSON (one line unless `indent`) to the benchmark's standard output."""
    out = _stdout[-1] if _stdout else sys.stdout
    print(json.dumps(value, indent=indent), file=out, flush=True)


def run(main: Callable[[], object]) -> None:
    """Runs `main` with `print` and everything else written to standard output going to standard
    error instead; `emit` alone reaches standard output."""
    _stdout.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            main()
    finally:
        _stdout.pop()
