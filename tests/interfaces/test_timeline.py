"""Schedule timelines (planned and measured), Chrome traces, RAYPIPE_TRACE and the progress bar."""

import json
import struct
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from raypipe import LayerSpec, Timeline, TrainConfig, Trainer, build_schedule
from raypipe.driver.engines.refs import submission_order
from raypipe.observe.step_breakdown import breakdown
from raypipe.schedules.actions import timed

from helpers import MLP7, Sleep, batch


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_planned_timeline_has_the_ideal_makespan_and_bubble(name):
    p, m, tf, tb = 4, 8, 1.0, 2.0
    line = Timeline.planned(build_schedule(name, p, m), tf, tb)
    assert len(line.spans) == 2 * p * m
    assert line.makespan == (m + p - 1) * (tf + tb)
    assert line.bubble() == pytest.approx([(p - 1) / (m + p - 1)] * p)
    for s in range(p):  # a stage never runs two actions at once
        spans = sorted((x for x in line.spans if x.stage == s), key=lambda x: x.start)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


def test_svg_and_chrome_trace_are_what_their_readers_accept(tmp_path):
    line = Timeline.planned(build_schedule("1f1b", 3, 4), 1.0, 2.0, title="t")
    root = ET.parse(line.save(tmp_path / "t.svg")).getroot()
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("fill") in ("#4c8bd6", "#f0a43a")]
    assert len(rects) == 2 * 3 * 4 + 2  # one per action, plus the legend's two swatches
    trace = json.loads(line.save(tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 24 and {e["tid"] for e in spans} == {0, 1, 2}
    assert {e["name"] for e in spans} >= {"0F0", "2B3"}
    with pytest.raises(ValueError, match="use .svg, .png, .pdf or .json"):
        line.save(tmp_path / "t.gif")


@pytest.mark.parametrize("suffix", [".png", ".pdf"])
def test_graphviz_renders_the_timeline(tmp_path, suffix, dot):
    data = Timeline.planned(build_schedule("gpipe", 2, 4)).save(tmp_path / f"t{suffix}").read_bytes()
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 600 and height > 60
    else:
        assert data.startswith(b"%PDF-") and b"%%EOF" in data[-64:]


@pytest.fixture(scope="module")
def sleepy(ray_session):
    """Two stages whose forward takes 20 ms each: timings well above the call overhead."""
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(Sleep, 0.02), LayerSpec(nn.Linear, 4, 4), LayerSpec(Sleep, 0.02)]
    config = TrainConfig(
        pp=2, microbatches=4, schedule="gpipe", optimizer={"name": "sgd", "lr": 0.01}, cpus_per_actor=0.5
    )
    with Trainer(layers, nn.functional.mse_loss, config) as t:
        yield t


def test_measured_timeline_follows_the_schedule(sleepy, tmp_path):
    with pytest.raises(Exception, match="no step has run yet"):
        sleepy.timeline()
    # the timeline is the last step's: the first step of fresh actors also pays one-time costs
    # inside its first actions (a first forward took over 35 ms in a CI run on a slow VM)
    for _ in range(2):
        sleepy.step(torch.randn(8, 4), torch.randn(8, 4))
    line = sleepy.timeline()
    schedule = build_schedule("gpipe", 2, 4)
    for s in range(2):
        ran = sorted((x for x in line.spans if x.stage == s), key=lambda x: x.start)
        assert [(x.kind, x.microbatch) for x in ran] == [(a.kind, a.microbatch) for a in schedule[s]]
        forwards = [x for x in ran if x.kind == "F"]
        # a 20 ms sleep: never shorter (a span that misses its action's start or end would be), and under
        # 100 ms even on a machine 3x slower than CI's, where only the few ms around the sleep grow
        assert all(19.5 <= x.end - x.start < 100 for x in forwards), [x.end - x.start for x in forwards]  # ms
    by = {(x.stage, x.kind, x.microbatch): x for x in line.spans}
    for m in range(4):  # stage 1 starts a microbatch only after stage 0 finished it; stage 0's
        # backward waits for stage 1's input gradient, sent before stage 1's weight gradients
        assert by[(1, "F", m)].start >= by[(0, "F", m)].end
        assert by[(1, "B", m)].start <= by[(0, "B", m)].start
    assert line.makespan >= 5 * 20  # (m + p - 1) forwards of 20 ms at least
    assert "stage0-dp0-tp0" in line.to_svg()
    planned = sleepy.timeline(planned=True)
    assert planned.unit == "ms" and planned.makespan == pytest.approx(line.makespan, rel=0.5)
    assert json.loads(line.save(tmp_path / "step.json").read_text())["traceEvents"]
    # where the step went: the replay with the measured durations and free messages is no longer
    # than the step's span, and leaves GPipe's bubble, at least one forward and one backward
    parts = line.breakdown
    assert max(parts.busy_ms) >= 4 * 20 and parts.step_ms > parts.span_ms >= parts.replay_ms - 1e-6
    assert parts.schedule_idle_ms >= 20 and parts.outside_ms > 0 and "waiting for messages" in str(parts)
    assert planned.breakdown is None


def test_the_step_breakdown_replays_the_measured_durations_without_the_waits():
    # a "measured" step: each message 7 ms on its way, the first stage's backwards handing on
    # nothing (its inputs take no gradient), stage 1's whole backwards handing their input
    # gradient on after their I part
    schedule = build_schedule("1f1b", 2, 4)
    costs = {"F": 0.010, "B": 0.020, "I": 0.008}
    hops = timed(schedule, costs, transfer=lambda *_: 0.007, early_gradients=True)
    events = [
        [
            (a.kind, a.microbatch, start, end, *([0.008] if a.stage == 1 and a.kind == "B" else []))
            for a, start, end in run
        ]
        for run in hops
    ]
    parts = breakdown(schedule, events, step_seconds=1.0)
    free = timed(schedule, costs, early_gradients=True)
    assert parts.replay_ms == pytest.approx(1000 * max(end for run in free for _, _, end in run))
    assert parts.span_ms == pytest.approx(1000 * max(end for run in hops for _, _, end in run))
    assert parts.messages_ms > 7 and parts.outside_ms == pytest.approx(1000 - parts.span_ms)
    assert parts.busy_ms == pytest.approx((120, 120))
    late = timed(schedule, costs)  # without the hand-on moments the replay would wait for whole backwards
    assert parts.replay_ms < 1000 * max(end for run in late for _, _, end in run)
    with pytest.raises(ValueError, match="actor 1's events"):
        breakdown(schedule, [events[0], events[1][:-1]])
    queued = breakdown(schedule, events, step_seconds=0.05)  # a clock started after the actors did
    assert queued.step_ms is None and queued.outside_ms is None and "around" not in str(queued)


def test_raypipe_trace_lists_every_action_in_issue_order(sleepy, tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("RAYPIPE_TRACE", str(path))
    sleepy.step(torch.randn(8, 4), torch.randn(8, 4))
    sleepy.step(torch.randn(8, 4), torch.randn(8, 4))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    p2p = sleepy.config.engine == "p2p"
    # F and B of 4 microbatches on 2 stages, then per actor the optimizer step (refs: and grad_stats before it)
    per_step = 2 * 2 * 4 + (2 if p2p else 4)
    assert len(lines) == 2 * per_step
    first = lines[:per_step]
    schedule = build_schedule("gpipe", 2, 4)
    # the p2p engine issues each stage's whole list in one call; the refs engine, one call per
    # action in the order of the schedule's simulated run
    if p2p:
        listed = [x for x in first if x["action"] != "optimizer_step"]
        order = [a for actions in schedule for a in actions]
        assert [x["action"] for x in first].count("optimizer_step") == 2
    else:
        listed, order = first[:16], submission_order(schedule)
        assert [x["action"] for x in first[16:]] == ["grad_stats"] * 2 + ["optimizer_step"] * 2
    assert [x["action"] for x in listed] == [str(a) for a in order]
    assert [x["actor"] for x in listed] == [f"stage{a.stage}-dp0-tp0" for a in order]
    assert [x["ts"] for x in lines] == sorted(x["ts"] for x in lines)
    assert lines[per_step]["step"] == first[0]["step"] + 1


def test_fit_shows_a_progress_bar_where_someone_watches(ray_session, monkeypatch, capsys):
    import raypipe.observe.progress

    config = TrainConfig(optimizer={"name": "sgd", "lr": 0.05}, cpus_per_actor=0.5)
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        t.fit(batch, 2, progress=True)  # pytest captures output: not a terminal, so no bar
        assert "raypipe:" not in capsys.readouterr().err
        monkeypatch.setattr(raypipe.observe.progress, "interactive", lambda: True)
        t.fit(batch, 4, progress=True)
    err = capsys.readouterr().err
    assert "raypipe: 100%" in err and "4/4" in err and "loss=" in err and "samples/s=" in err


def test_each_actor_hands_its_input_gradient_on_early_where_it_measures_the_split_free(ray_session, monkeypatch):
    """A whole backward that costs the same split (simulated layers: I 5 ms, W 20 ms) hands its
    input gradient on before its weight gradients once the actor has timed both ways (after its
    first step, three of each): the previous stage's backward then starts inside this one.
    RAYPIPE_LATE_GRADIENTS=1 (read at reconfigure) sends after the weight gradients, as torch does."""
    from raypipe.models.simulated import SimulatedCompute

    layers = [LayerSpec(SimulatedCompute, 0.005, 0.005, weight_s=0.02) for _ in range(2)]
    config = TrainConfig(
        pp=2, microbatches=4, schedule="gpipe", optimizer={"name": "sgd", "lr": 0.01}, cpus_per_actor=0.01
    )
    with Trainer(layers, nn.functional.mse_loss, config.replace(name="hand-on")) as t:
        x, y = torch.randn(8, 8), torch.randn(8, 8)

        def overlaps() -> list[bool]:  # per microbatch: stage 0's B began before stage 1's ended
            by = {(s.stage, s.kind, s.microbatch): s for s in t.timeline().spans}
            return [by[(0, "B", m)].start < by[(1, "B", m)].end for m in range(4)]

        for _ in range(4):  # the first step is not timed; two more time 3 B's each way
            t.step(x, y)
        assert overlaps() == [True] * 4
        monkeypatch.setenv("RAYPIPE_LATE_GRADIENTS", "1")
        t.reconfigure(microbatches=4)
        t.step(x, y)
        assert overlaps() == [False] * 4


def test_the_hand_on_choice_times_both_ways_then_asks_the_schedule():
    """After the first step a chunk's eligible backwards alternate whole and split until each way
    has 3 timings, the first split not counted. With the schedule known the chunk sends early where
    the action lists, timed with its costs, end sooner so: a split 5 % dearer pays in 1F1B, whose
    every gradient chain crosses the pipeline, and not in interleaved 1F1B or DualPipeV; without it
    the split wins within 10 %. "early" and "late" choose unmeasured, and so does tensor
    parallelism ("measured" runs late there)."""
    from raypipe.actors.step.hand_on import HandOnChoice, timed_schedule
    from raypipe.schedules.early_gradients import hand_on_mode

    def measured(split_s: float, spec=None) -> bool:  # forward 1 ms, whole backward 2 ms
        choice = HandOnChoice("measured", spec)
        choice.begin_step()
        assert not choice.early(1)
        choice.record(1, False, 1.0)  # the first step's timings do not count
        choice.begin_step()
        ways = []
        for _ in range(7):  # the first split is not counted either (first use)
            way = choice.early(1)
            ways.append(way)
            choice.forward(1, 0.001)
            choice.record(1, way, split_s if way else 0.002, split_s / 2)
        assert ways == [False, True, True, False, True, False, True] and 1 in choice.chosen
        assert [choice.early(1) for _ in range(3)] == [choice.chosen[1]] * 3 and choice.early(0) is False
        return choice.chosen[1]

    assert measured(0.00218) and not measured(0.00222)
    # the schedule as the driver hands it over: (name, pp, microbatches, chunks, extra_warmup)
    assert [measured(0.0021, (name, 4, 16, None, 0)) for name in ("1f1b", "interleaved-1f1b", "dualpipe-v")] == [
        True,
        False,
        False,
    ]
    assert not measured(0.0023, ("1f1b", 4, 16, None, 0))
    long = timed_schedule(("1f1b", 4, 1024, None, 0))  # timed with 16 microbatches: milliseconds
    assert max(a.microbatch for a in long[0]) == 15 and timed_schedule(None) is None
    assert len(timed_schedule(("1f1b", 2, 1, None, 0, 4))[0]) == 8  # a sample's 4 sequence chunks: 8 actions
    assert HandOnChoice("early").early(0) and not HandOnChoice("late").early(0)
    # tensor-parallel ranks do not each choose by their own timings: they all run late, or as forced
    assert [hand_on_mode(m, 2) for m in ("measured", "early", "late")] == ["late", "early", "late"]
    assert hand_on_mode("measured", 1) == "measured"
