"""Long phases in a log with no terminal: a line as an announced one starts, how far along any
one is while it runs, and its time as it ends; on a terminal, a bar instead of the first two."""

from raypipe.observe import phases
from raypipe.observe.phases import Phase


def test_a_phase_in_a_log_says_what_it_does_how_far_along_it_is_and_how_long_it_took(monkeypatch):
    monkeypatch.setattr(phases, "interactive", lambda: False)
    monkeypatch.setattr(phases, "HEARTBEAT_S", 0.0)  # every report is a heartbeat
    lines: list[str] = []
    with Phase("starting 4 actors", lines.append, 4, "actors") as phase:
        phase.at(1)
        phase.at(3)
    assert lines[0] == "raypipe: starting 4 actors ..."
    assert lines[1].startswith("raypipe: still starting 4 actors: 1/4 actors, ") and lines[1].endswith(" s")
    assert lines[2].startswith("raypipe: still starting 4 actors: 3/4 actors, ")
    assert lines[3].startswith("raypipe: starting 4 actors: done in ") and len(lines) == 4

    lines.clear()
    monkeypatch.setattr(phases, "HEARTBEAT_S", 3600.0)  # a quick phase that recurs says nothing
    with Phase("generating 8 completions", lines.append, 64, "tokens", announce=False) as phase:
        phase.at(64)
    assert lines == []

    lines.clear()
    try:
        with Phase("profiling", lines.append, done_line=lambda s: "never"):
            raise ValueError("profile failed")
    except ValueError:
        pass
    assert lines == ["raypipe: profiling ..."]  # a failed phase ends with its error, not a time


def test_a_phase_on_a_terminal_shows_a_bar_and_no_start_line(monkeypatch, capsys):
    monkeypatch.setattr(phases, "interactive", lambda: True)
    monkeypatch.setattr(phases, "SHOW_AFTER", 0.0)
    lines: list[str] = []
    with Phase("starting 2 actors", lines.append, 2, "actors") as phase:
        phase.at(2)
        assert phase.bar is not None and phase.bar.n == 2
    assert phase.bar is None and len(lines) == 1 and lines[0].startswith("raypipe: starting 2 actors: done in")
    assert "starting 2 actors" in capsys.readouterr().err  # tqdm's bar, on stderr
