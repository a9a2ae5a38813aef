"""Schedules as data: completeness, dependency order, deadlock freedom, memory bound, printing."""

import pytest

from raypipe.errors import ScheduleError
from raypipe.schedules import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Action,
    format_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    simulate,
    validate,
)

SIZES = [(p, m) for p in range(1, 9) for m in range(1, 33)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_size_is_valid(name):
    for p, m in SIZES:
        schedule = SCHEDULES[name](p, m)
        validate(schedule, p, m)
        for stage, actions in enumerate(schedule):
            assert len(actions) == 2 * m
            assert {a.stage for a in actions} == {stage}


def test_one_f_one_b_bounds_activations_per_stage():
    for p, m in SIZES:
        schedule = one_f_one_b(p, m)
        for s, actions in enumerate(schedule):
            assert peak_in_flight(actions) == min(p - s, m), (p, m, s)


def test_gpipe_holds_every_microbatch():
    for p, m in SIZES:
        assert all(peak_in_flight(actions) == m for actions in gpipe(p, m))


def test_one_f_one_b_order_on_a_known_case():
    stage0 = [str(a) for a in one_f_one_b(4, 6)[0]]
    assert stage0 == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5".split()
    last = [str(a) for a in one_f_one_b(4, 6)[3]]
    assert last == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5".split()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_simulated_length_is_the_ideal_pipeline(name):
    # with unit-time actions both schedules take 2 (m + p - 1) ticks
    for p, m in [(1, 1), (2, 3), (4, 8), (4, 16), (8, 5)]:
        assert len(simulate(SCHEDULES[name](p, m), p)) == 2 * (m + p - 1)


def test_simulation_respects_dependencies():
    for p, m in [(3, 5), (4, 2)]:
        grid = simulate(one_f_one_b(p, m), p)
        tick = {a: t for t, row in enumerate(grid) for a in row if a}
        for a, t in tick.items():
            if a.kind == FORWARD and a.stage > 0:
                assert tick[Action(a.stage - 1, FORWARD, a.microbatch)] < t
            if a.kind == BACKWARD and a.stage < p - 1:
                assert tick[Action(a.stage + 1, BACKWARD, a.microbatch)] < t


def test_action_prints_like_torch_pipelining():
    assert str(Action(1, FORWARD, 3)) == "1F3"
    assert repr([Action(0, BACKWARD, 12)]) == "[0B12]"


def test_grid_printer_shows_every_stage():
    text = format_schedule(gpipe(2, 2))
    assert text.splitlines() == [
        "stage 0: 0F0 0F1   .   . 0B1 0B0",
        "stage 1:   . 1F0 1F1 1B1 1B0   .",
    ]


def test_validator_rejects_a_missing_backward():
    schedule = gpipe(2, 3)
    schedule[1].remove(Action(1, BACKWARD, 2))
    with pytest.raises(ScheduleError, match="stage 1 never runs 1B2"):
        validate(schedule, 2, 3)


def test_validator_rejects_duplicates_and_misorder():
    schedule = gpipe(2, 2)
    schedule[0].append(Action(0, FORWARD, 1))
    with pytest.raises(ScheduleError, match=r"stage 0, position 4 \(0F1\): runs twice"):
        validate(schedule, 2, 2)
    backwards_first = [[Action(0, BACKWARD, 0), Action(0, FORWARD, 0)]]
    with pytest.raises(ScheduleError, match="backward before its forward"):
        validate(backwards_first, 1, 1)
    with pytest.raises(ScheduleError, match="out of range"):
        validate([[Action(0, FORWARD, 0), Action(0, BACKWARD, 0), Action(0, FORWARD, 5)]], 1, 1)


def test_validator_finds_a_deadlock_and_marks_it_in_the_grid():
    # stage 1 wants B1 before B0, but stage 0 will not send F1 until it has done B0
    schedule = [
        [Action(0, FORWARD, 0), Action(0, BACKWARD, 0), Action(0, FORWARD, 1), Action(0, BACKWARD, 1)],
        [Action(1, FORWARD, 0), Action(1, FORWARD, 1), Action(1, BACKWARD, 1), Action(1, BACKWARD, 0)],
    ]
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 2, 2)
    message = str(info.value)
    assert "deadlocks" in message
    assert "stage 0 waits at 0B0 for 1B0" in message
    assert "stage 1 waits at 1F1 for 0F1" in message
    assert "[1F1 stuck]" in message and "[0B0 stuck]" in message
