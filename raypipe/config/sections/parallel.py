"""`TrainConfig.parallel`: how the model and the batch are split across actors."""

from __future__ import annotations

from raypipe.config.checks import check_choice, check_int, check_positive, check_shard_plan, fail
from raypipe.config.choices import PARTITION_NAMES, Partition
from raypipe.config.sections.base import Section, section


@section("parallel")
class ParallelConfig(Section):
    """How the model and the batch are split across actors.

    Attributes:
        pp: number of pipeline stages (one Ray actor each).
        dp: data-parallel replicas of the whole pipeline; the batch is split across them
            and gradients are averaged, so the result is the full batch's gradient.
        tp: tensor-parallel ranks per stage: layers that declare a `tp_plan` (the
            reference GPT does) are split across tp actors joined by collectives; layers
            without one are replicated on every tp rank.
        ep: expert-parallel ranks, carved out of the dp replicas (ep divides dp, as in Megatron
            and DeepSpeed): each MoE layer's experts (`raypipe.nn.MoE`) are split across ep
            replicas, tokens travel to their experts and back by all-to-all, and expert
            gradients are averaged only among the replicas holding the same experts.
        zero: 1 shards optimizer state across the dp replicas (ZeRO stage 1): each replica
            steps its share of the parameters and sends the result to the others; 0 off.
            Reconfigurable: switching it re-shards the optimizer state, nothing is lost.
            3 (ZeRO stage 3 / FSDP inside each stage) shards the weights, gradients and optimizer
            state too: each layer is gathered among the replicas just before its forward and
            its backward and freed after (p2p and compiled engines; not with quantize or ep;
            not switched to or from on a running trainer). Checkpoints stay whole.
        dp_bucket_mb: MiB of gradients the dp all-reduce flattens into one collective (torch
            DDP's `bucket_cap_mb`, same default): larger amortises each collective's latency.
        shard_plan: explicit contiguous [start, end) layer ranges, one per stage (per virtual
            stage with chunks, in virtual-stage order); overrides `partition`.
        partition: how to split layers when no shard_plan is given: "uniform" (layer count),
            "parameters" (parameter count) or "profile" (time every layer on each device
            kind of the run, then the exact split minimising the slowest stage within each
            device's memory; needs `Trainer(..., sample=(x, y))`).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    dp_bucket_mb: float = 25.0
    shard_plan: list[list[int]] | None = None
    partition: Partition = "uniform"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep"):
            check_int(name, getattr(self, name), 1)
        if self.dp % self.ep:
            raise fail(
                "ep",
                self.ep,
                f"expert-parallel ranks are carved out of the dp={self.dp} replicas: use an ep "
                f"that divides dp (e.g. ep={self.dp}), or raise dp to a multiple of {self.ep}.",
            )
        if self.zero not in (0, 1, 3) or isinstance(self.zero, bool):
            raise fail(
                "zero",
                self.zero,
                "give 0 (off), 1 (shard optimizer state across dp replicas) or 3 (shard the weights, "
                "gradients and optimizer state, each layer gathered when it runs).",
            )
        check_positive("dp_bucket_mb", self.dp_bucket_mb)
        check_shard_plan(self.shard_plan)  # its length against pp and the chunks: `validation.check_across`
        if self.shard_plan is not None:
            self.normalise("shard_plan", [list(r) for r in self.shard_plan])
        check_choice("partition", self.partition, PARTITION_NAMES)
