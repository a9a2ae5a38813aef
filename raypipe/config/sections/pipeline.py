"""`TrainConfig.pipeline`: how a step runs through the stages."""

from __future__ import annotations

from raypipe.config.checks import check_choice, check_int, fail, is_int
from raypipe.config.engines import ENGINES, engine_kind, engines_that
from raypipe.config.sections.base import Section, section
from raypipe.schedules import SCHEDULES, SEQUENCE_CHUNKED

SCHEDULE_NAMES = (*SCHEDULES, "auto")  # auto: chosen from profiled layers (`raypipe.planning.autoschedule`)


@section("pipeline")
class PipelineConfig(Section):
    """How a step runs through the stages: its schedule, its microbatches and its engine.

    Attributes:
        microbatches: microbatches each batch is split into; the batch size must divide by it.
        schedule: pipeline schedule: "1f1b" (bounded activation memory), "gpipe", "interleaved-1f1b"
            (`chunks` model chunks per actor, chunk c of actor s being virtual stage c*pp+s: the
            bubble divided by the chunks; microbatches a multiple of pp), "zb-h1" (backward split
            into input and weight gradients, the weight gradients filling the bubble, at 1F1B's
            peak memory), "zb-v" (two chunks per actor in a V, virtual stages s and 2pp-1-s:
            nearly no bubble) or "dualpipe-v" (DeepSeek's DualPipeV: zb-v's V with each forward
            paired with the other chunk's backward, communication hiding under compute; best from
            2pp microbatches). p2p and compiled engines only for the last four. "auto": the
            schedule, chunks and microbatches with the least predicted step time that fit every
            device's memory, from the layers timed on each device kind (needs `Trainer(...,
            sample=(x, y))`; prints every candidate's prediction; `raypipe.planning.autoschedule`).
        chunks: model chunks per actor for "interleaved-1f1b" (default 2); the other schedules
            fix their own (1, or 2 for "zb-v" and "dualpipe-v").
        extra_warmup: forwards each stage but the last runs ahead before its first backward,
            beyond its schedule's warm-up ("1f1b" and "zb-h1"): over a slow link the next
            microbatches' activations cross while the first one's gradient comes back, so the
            link stays busy instead of idling one round trip per microbatch. Each costs one more
            microbatch's stashed activations on those stages. 1 is enough on the links measured
            (docs/BENCHMARKS.md, "A slow link"); schedule="auto" chooses it where the links
            between stages were measured (`probe_links`). None (the default): 1 where neighbouring
            stages run on different nodes (known once the actors start; the log says so), else 0.
        sequence_chunks: k > 1 cuts every sample along the sequence into k chunks that flow
            through the pipeline one after another (Seq1F1B), so one long sample fills it (m = 1
            idles (pp - 1)/pp of each step); a length k does not divide gives chunks a token
            apart, as fast on one node. Forwards run in chunk order, backwards in reverse;
            attention keeps earlier chunks' keys and values and their gradients: exact
            (`raypipe.nn.sequence_chunks`). "gpipe", "1f1b", "zb-h1"; GPT and transformers' families;
            token-weighted losses. With activation_checkpointing a stage keeps each chunk's input,
            keys and values, one chunk's activations at a time. "auto": the count of 1 to 16
            (>= 32 tokens each) predicted fastest from the layers timed on the sample cut each way
            (`sample=`), then it, the counts next to it (half and twice) and 1 timed in real steps
            on the sample (state put back after), the fastest kept (the planner's unless
            another is over 5 % faster; 1 wherever no slower:
            `raypipe.driver.run.chunk_trial`; a model whose layers cannot run on chunks
            stays whole). Not with compile, DPO or GRPO, nor a layer lacking
            `runs_sequence_chunks`.
        engine: how a step runs. "refs": the driver issues every forward and backward
            as an actor call and boundary tensors travel as Ray object references;
            "p2p": one call per actor per step with its whole action list, boundary
            tensors sent actor to actor over torch.distributed (gloo) point to point;
            "compiled": p2p's step issued through a Ray Compiled Graph (one `execute`
            per step instead of one Ray task per actor).
        actor_steps: 0: `fit` submits each step from the driver. N > 0: the actors drive runs of up to N
            steps themselves (batches from a reader actor, outcomes to a board actor the driver reads
            once per step): the driver's cost per step does not grow with the actors. p2p engine, a
            Dataset or batches(step) Ray can pickle. "auto": runs of 256 where those hold, the fit
            overlaps (no on_step, or overlap=True) and its steps x actors >= 3000 (repays the helpers).
    """

    microbatches: int = 1
    schedule: str = "1f1b"  # a name in `raypipe.schedules.SCHEDULES`, or "auto"
    chunks: int | None = None
    extra_warmup: int | None = None  # None: 1 across nodes, else 0 (`links.replan.overlap_links`)
    sequence_chunks: int | str = 1
    engine: str = "p2p"  # a name in `raypipe.config.engines.ENGINES`
    actor_steps: int | str = "auto"

    def __post_init__(self) -> None:
        check_int("microbatches", self.microbatches, 1)
        check_choice("schedule", self.schedule, SCHEDULE_NAMES)
        if self.chunks is not None:
            check_int("chunks", self.chunks, 1)
        if self.extra_warmup is not None:
            check_int("extra_warmup", self.extra_warmup, 0)
        check_choice("engine", self.engine, tuple(ENGINES))
        self._check_sequence_chunks()
        self._check_schedule()
        steps = self.actor_steps
        if steps != "auto" and not (is_int(steps) and steps >= 0):
            raise fail("actor_steps", steps, 'give "auto" or a whole number >= 0 (0: the driver steps).')
        if steps not in (0, "auto") and not engine_kind(self.engine).actor_steps:
            raise fail(
                "actor_steps",
                steps,
                f"actor-driven runs use the {engines_that('actor_steps')} engine, not {self.engine!r}: set "
                "engine='p2p' or actor_steps=0.",
            )

    def num_chunks(self) -> int:
        """Model chunks per actor: the schedule's own, or `chunks` where it lets the config choose
        (1 for "auto" until the trainer has chosen)."""
        return 1 if self.schedule == "auto" else SCHEDULES[self.schedule].chunks_for(self.chunks)

    def _check_schedule(self) -> None:
        """The schedule fits its chunks and its engine (pp and the split: `validation.check_across`)."""
        if self.schedule == "auto":
            if self.chunks is not None:
                raise fail(
                    "chunks",
                    self.chunks,
                    "schedule='auto' chooses the split and chunks itself: leave it unset, or name a schedule.",
                )
            return
        kind = SCHEDULES[self.schedule]
        if self.chunks is not None and kind.chunks is not None and self.chunks != kind.chunks:
            raise fail(
                "chunks",
                self.chunks,
                f"schedule {self.schedule!r} always runs {kind.chunks} per actor: "
                f"leave chunks unset, or use schedule='interleaved-1f1b'.",
            )
        if (self.num_chunks() > 1 or kind.split_backward) and not engine_kind(self.engine).whole_step_calls:
            raise fail(
                "engine",
                self.engine,
                f"schedule {self.schedule!r} runs on the {engines_that('whole_step_calls')} engines "
                f"(its chunks and split backwards live inside one call per step): use engine='p2p'.",
            )

    def _check_sequence_chunks(self) -> None:
        """A whole number or "auto", under a schedule that runs sequence chunks."""
        value, auto = self.sequence_chunks, self.sequence_chunks == "auto"
        if not auto and not (is_int(value) and value >= 1):
            raise fail("sequence_chunks", value, 'give a whole number >= 1 (1: not cut) or "auto".')
        if value != 1 and self.schedule not in SEQUENCE_CHUNKED and not (auto and self.schedule == "auto"):
            raise fail(
                "sequence_chunks",
                value,
                f"schedule {self.schedule!r} does not run sequence chunks: use schedule='1f1b' (or 'gpipe', "
                f"'zb-h1'), or sequence_chunks=1.",
            )
