"""Schedules as data: completeness, dependency order, deadlock freedom, memory bound, printing."""

import json

import pytest

from raypipe.core.errors import ScheduleError
from raypipe.schedules import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OVERLAPPED,
    SCHEDULES,
    WEIGHT_GRAD,
    Action,
    bubble,
    build_schedule,
    format_schedule,
    gpipe,
    one_f_one_b,
    overlapped_pairs,
    peak_in_flight,
    simulate,
    timed,
    validate,
    virtual_stages,
)

SIZES = [(p, m) for p in range(1, 9) for m in range(1, 33)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_size_is_valid(name):
    kind = SCHEDULES[name]
    for p, m in SIZES:
        if name == "interleaved-1f1b" and m % p:
            with pytest.raises(ScheduleError, match="divisible by pp"):
                build_schedule(name, p, m)
            continue
        schedule = build_schedule(name, p, m)  # validates
        chunks = kind.chunks_for(None)
        for actor, actions in enumerate(schedule):
            if kind.overlapped:  # whole backwards in its steady state, split ones around it
                assert sum(a.kind == FORWARD for a in actions) == m * chunks
            else:
                assert len(actions) == (3 if kind.split_backward else 2) * m * chunks
            assert len({a.stage for a in actions}) == chunks


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


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_length_is_the_ideal_pipeline(name):
    # with unit-time actions both schedules take 2 (m + p - 1) ticks
    for p, m in [(1, 1), (2, 3), (4, 8), (4, 16), (8, 5)]:
        assert len(simulate(build_schedule(name, p, m), p)) == 2 * (m + p - 1)


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
    with pytest.raises(ScheduleError, match="actor 1 never runs 1B2"):
        validate(schedule, 2, 3)


def test_validator_rejects_duplicates_and_misorder():
    schedule = gpipe(2, 2)
    schedule[0].append(Action(0, FORWARD, 1))
    with pytest.raises(ScheduleError, match=r"actor 0, position 4 \(0F1\): runs twice"):
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
    assert "actor 0 waits at 0B0 for 1B0" in message
    assert "actor 1 waits at 1F1 for 0F1" in message
    assert "[1F1 stuck]" in message and "[0B0 stuck]" in message


# ----- chunks and split backwards (interleaved 1F1B, ZB-H1, ZB-V) --------------------------

UNIT = {FORWARD: 1.0, INPUT_GRAD: 1.0, WEIGHT_GRAD: 1.0}  # B = I + W = 2


def test_planned_bubbles_equal_their_formulas():
    """F, I and W of one unit each: 1F1B and GPipe idle (p-1)/(m+p-1) of the step; interleaved
    with v chunks (p-1)/(vm+p-1); ZB-H1 (p-1)/(3m+p-1); ZB-V (chunks of half a stage) (p-1)/(6m+p-1)."""
    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):

            def planned(name, chunks=None):
                return bubble(build_schedule(name, p, m, chunks), UNIT)

            assert planned("gpipe") == pytest.approx((p - 1) / (m + p - 1))
            assert planned("1f1b") == pytest.approx((p - 1) / (m + p - 1))
            for v in (2, 3):
                assert planned("interleaved-1f1b", v) == pytest.approx((p - 1) / (v * m + p - 1)), (p, m, v)
            assert planned("zb-h1") == pytest.approx((p - 1) / (3 * m + p - 1)), (p, m)
            if m >= 2 * p - 1:
                assert planned("zb-v") == pytest.approx((p - 1) / (6 * m + p - 1)), (p, m)
    # the comparison point: p = 4, m = 16
    one_f = bubble(build_schedule("1f1b", 4, 16), UNIT)
    assert bubble(build_schedule("zb-h1", 4, 16), UNIT) <= 0.4 * one_f
    assert bubble(build_schedule("zb-v", 4, 16), UNIT) <= 0.2 * one_f


def test_peak_stashed_microbatches_within_each_bound():
    """1F1B: p - s; ZB-H1: p on every actor (1F1B's first stage); ZB-V: 2p chunk halves, the same
    memory; interleaved: (v-1)p + 2(p-1-s) + 1 chunks (Megatron's warm-up plus one)."""
    for p in (1, 2, 3, 4, 6):
        for m in (1, p, 2 * p + 1, 4 * p):
            for s, actions in enumerate(build_schedule("zb-h1", p, m)):
                assert peak_in_flight(actions) <= min(p, m)
            for s, actions in enumerate(build_schedule("zb-v", p, m)):
                assert peak_in_flight(actions) <= min(2 * p, 2 * m)
            if m % p == 0:
                for s, actions in enumerate(build_schedule("interleaved-1f1b", p, m, 2)):
                    assert peak_in_flight(actions) <= min(p + 2 * (p - 1 - s) + 1, 2 * m)


def test_chunks_are_placed_as_each_schedule_says():
    assert virtual_stages(build_schedule("interleaved-1f1b", 4, 8, 3)) == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert virtual_stages(build_schedule("zb-v", 4, 8)) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert virtual_stages(build_schedule("zb-h1", 3, 4)) == [[0], [1], [2]]
    with pytest.raises(ScheduleError, match="always runs 2 chunk"):
        build_schedule("zb-v", 2, 4, chunks=3)


def test_split_backward_order_on_a_known_case():
    # 1F1B's order with each backward split; actor s defers its weight gradients by s steps
    first, last = ([str(a) for a in actions] for actions in build_schedule("zb-h1", 2, 3))
    assert first == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2".split()
    assert last == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2".split()


def test_validator_checks_the_split_backward_rules():
    w_first = [[Action(0, FORWARD, 0), Action(0, WEIGHT_GRAD, 0), Action(0, INPUT_GRAD, 0)]]
    with pytest.raises(ScheduleError, match="weight gradient before its input gradient"):
        validate(w_first, 1, 1)
    no_w = [[Action(0, FORWARD, 0), Action(0, INPUT_GRAD, 0)]]
    with pytest.raises(ScheduleError, match="never runs 0W0"):
        validate(no_w, 1, 1)
    mixed = [[Action(0, FORWARD, 0), Action(0, BACKWARD, 0), Action(0, INPUT_GRAD, 0), Action(0, WEIGHT_GRAD, 0)]]
    with pytest.raises(ScheduleError, match="mixes a whole backward with a split one"):
        validate(mixed, 1, 1)


def test_validator_checks_chunks_and_link_order():
    schedule = build_schedule("interleaved-1f1b", 2, 2)
    schedule[1].append(Action(0, FORWARD, 0))
    with pytest.raises(ScheduleError, match="virtual stage 0 has actions on actors 0 and 1"):
        validate(schedule, 2, 2)
    # actor 1 takes stage 0's activations in the order 1, 0 while actor 0 sends 0, 1
    swapped = [
        [Action(0, FORWARD, 0), Action(0, FORWARD, 1), Action(0, BACKWARD, 0), Action(0, BACKWARD, 1)],
        [Action(1, FORWARD, 1), Action(1, FORWARD, 0), Action(1, BACKWARD, 0), Action(1, BACKWARD, 1)],
    ]
    with pytest.raises(
        ScheduleError,
        match=r"activations between virtual stages 0 and 1 are sent in microbatch order \[0, 1\] but taken in order \[1, 0\]",  # noqa: E501
    ):
        validate(swapped, 2, 2)
    # a V turn inside one actor is a hand-off and needs no link
    validate(build_schedule("zb-v", 3, 5), 3, 5)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_an_extra_warmup_keeps_the_schedule_valid_and_holds_that_many_more(name):
    for p, m in SIZES[::3]:
        for extra in (1, 2, 5):
            schedule = build_schedule(name, p, m, extra_warmup=extra)  # validates: complete, no deadlock
            plain = build_schedule(name, p, m)
            for s, (actions, before) in enumerate(zip(schedule, plain)):
                ahead = extra if s < p - 1 else 0  # the last stage's backward follows its forward at once
                if name == "1f1b":
                    assert peak_in_flight(actions) == min(p - s + ahead, m), (p, m, s, extra)
                else:  # ZB-H1 defers weight gradients, so its actors hold p already; at most `extra` more
                    assert peak_in_flight(before) <= peak_in_flight(actions) <= peak_in_flight(before) + ahead


def test_an_extra_warmup_is_refused_where_the_schedule_has_none():
    from raypipe.config import TrainConfig
    from raypipe.core.errors import ConfigError

    with pytest.raises(ScheduleError, match="'1f1b', 'zb-h1' take one"):
        build_schedule("gpipe", 2, 4, extra_warmup=1)
    with pytest.raises(ConfigError, match="extra_warmup"):
        TrainConfig(pp=2, microbatches=4, schedule="interleaved-1f1b", extra_warmup=1)
    with pytest.raises(ConfigError, match="extra_warmup"):
        TrainConfig(pp=2, microbatches=4, extra_warmup=-1)


def test_an_unset_extra_warmup_is_one_where_stages_cross_nodes_and_follows_a_new_schedule():
    """`extra_warmup=None` (the default) is 0 to a schedule; once the actors are placed, stages on
    different nodes get 1 (`replan.overlap_links`, logged), one node keeps 0, and a schedule without
    extra warm-up (GPipe) keeps 0. A later `reconfigure` of the schedule carries the trainer's choice
    along (0 for GPipe, 1 back on 1F1B), until the user sets the field."""
    from types import SimpleNamespace

    from raypipe.config import TrainConfig
    from raypipe.driver.cluster.topology import Topology
    from raypipe.driver.links import replan

    assert TrainConfig().extra_warmup is None and build_schedule("1f1b", 2, 4, extra_warmup=None) == build_schedule(
        "1f1b", 2, 4
    )

    def group(nodes, schedule="1f1b"):
        config = TrainConfig(pp=3, microbatches=4, schedule=schedule)
        made = SimpleNamespace(config=config, topology=Topology(3, 1, 1, 1), links=[], warmup_chosen=False)
        made.names = [f"stage{s}-dp0-tp0" for s in range(3)]
        made.nodes = dict(zip(made.names, nodes))
        made.reconfigure = lambda new: setattr(made, "config", new)
        return made

    lines = []
    across = group(["a", "a", "b"])
    assert replan.overlap_links(across, lines.append) and across.config.extra_warmup == 1
    assert lines[0].startswith("raypipe: stages on different nodes (stage 1 -> stage 2): extra_warmup=1"), lines
    one_node, gpipe = group(["a", "a", "a"]), group(["a", "b", "c"], "gpipe")
    assert not replan.overlap_links(one_node, lines.append) and not replan.overlap_links(gpipe, lines.append)
    assert one_node.config.extra_warmup is None and gpipe.config.extra_warmup is None and len(lines) == 1
    across.warmup_chosen = True
    assert replan.with_chosen_warmup(across, {"schedule": "gpipe"}) == {"schedule": "gpipe", "extra_warmup": 0}
    assert replan.with_chosen_warmup(across, {"schedule": "zb-h1"}) == {"schedule": "zb-h1", "extra_warmup": 1}
    assert replan.with_chosen_warmup(across, {"extra_warmup": 2}) == {"extra_warmup": 2}
    assert not across.warmup_chosen and replan.with_chosen_warmup(across, {"schedule": "gpipe"}) == {
        "schedule": "gpipe"
    }


def test_timed_messages_wait_for_their_link_one_at_a_time():
    from raypipe.schedules import timed

    def end(schedule, link):
        runs = timed(schedule, {"F": 1.0, "B": 2.0}, None if link is None else lambda a, b, what, v: link)
        return max(t for run in runs for _, _, t in run)

    # F0 ends at 1, crosses in 5; 1F0 6-7, 1B0 7-9; the gradient crosses in 5; 0B0 14-16
    assert end(one_f_one_b(2, 1), 5.0) == 16.0
    assert end(one_f_one_b(2, 4), 0.0) == end(one_f_one_b(2, 4), None) == 2 * (4 + 1) * 1.5
    # a link slower than compute: 1F1B waits a round trip per microbatch (and the one activation it
    # sends early queues behind the first); with one more in flight the link is what limits:
    # activations leave at 1, 2, 3 and arrive at 6, 11, 16; gradients leave at 9, 14, 19, 25
    # (3F after 0B0 at 14-16 arrives at 22: 1F3 22-23, 1B3 23-25) and the last lands at 30: 0B3 30-32
    slow, ahead = end(one_f_one_b(2, 4), 5.0), end(build_schedule("1f1b", 2, 4, extra_warmup=1), 5.0)
    assert ahead == 32.0 < slow


# ----- DualPipeV ----------------------------------------------------------------------------


def _torch_dualpipe_v(p, m, rank):
    """torch.distributed.pipelining's ScheduleDualPipeV order for one rank, its F&B pairs unfolded."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    sizes = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    plan = ScheduleDualPipeV._calculate_single_rank_operations(sizes, rank)
    return [
        f"{a.stage_index}{kinds[str(a.computation_type).split('.')[-1]]}{a.microbatch_index}"
        for action in plan
        for a in action.sub_actions or (action,)
    ]


def test_dualpipe_v_is_torchs_order_with_its_pairs_in_place():
    for p in (2, 3, 4, 5):
        for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 2):
            schedule = build_schedule("dualpipe-v", p, m)
            for rank, actions in enumerate(schedule):
                assert [str(a) for a in actions] == _torch_dualpipe_v(p, m, rank), (p, m, rank)
            # the steady state: one F&B pair per chunk and microbatch beyond the fill and drain
            assert sum(len(overlapped_pairs(a)) for a in schedule) >= p * (2 * (m - 2 * p) + 1)
    assert virtual_stages(build_schedule("dualpipe-v", 4, 8)) == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_dualpipe_v_bubble_is_deepseeks_formula():
    """Each F&B pair one block (DualPipe's overlap): every actor idles (PP/2 - 1)(F&B + B - 3W) with
    PP = 2p virtual stages, at F&B = F + B and F <= I. Run one action after the other, as a CPU runs
    a pair, the forward's send leaves before the backward: (p - 1)(F + B - 2W) where I <= F, ZB-H1's
    over p actors of half the size. Activations: at most PP + 1 chunk-microbatches in flight."""
    for p in (2, 3, 4, 6):
        for m in (2 * p, 3 * p + 1, 4 * p):
            schedule = build_schedule("dualpipe-v", p, m)
            blocks = [(f, i, w, f + i + w) for f, i, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (0.5, 1.0, 0.7))]
            in_turn = [(f, i, w, None) for f, i, w in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0))]
            for f, i, w, pair in blocks + in_turn:  # F <= I for the blocks' formula, I <= F in turn
                b = i + w
                costs = {FORWARD: f, INPUT_GRAD: i, WEIGHT_GRAD: w, **({OVERLAPPED: pair} if pair else {})}
                formula = (2 * p / 2 - 1) * (pair + b - 3 * w) if pair else (p - 1) * (f + b - 2 * w)
                runs = timed(schedule, costs)
                span = max(end for run in runs for _, _, end in run)
                for actor, run in enumerate(runs):
                    idle = span - sum(end - start for _, start, end in run)
                    assert idle == pytest.approx(formula), (p, m, costs, actor)
            assert max(peak_in_flight(a) for a in schedule) <= 2 * p + 1
    # against the other V at the comparison point (p = 4, m = 16): no more bubble than ZB-V
    assert bubble(build_schedule("dualpipe-v", 4, 16), UNIT) <= bubble(build_schedule("zb-v", 4, 16), UNIT) + 1e-9


def test_dualpipe_v_prints_and_draws(capsys, tmp_path):
    from raypipe.cli import main

    assert main(["schedule", "dualpipe-v", "--pp", "2", "-m", "4", "-o", str(tmp_path / "dualpipe.json")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[2:7] == "0F0 0F1 0F2 3F0 3I0".split()
    assert "virtual stages per actor: [[0, 3], [1, 2]]" in out
    assert "overlapped F&B pairs: 7; planned bubble with each pair one block (F&B = F + B): 0.077" in out
    events = json.loads((tmp_path / "dualpipe.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("ph") == "X"} >= {"0F0", "3B1", "3I0", "3W0"}
