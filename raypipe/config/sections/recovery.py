"""`TrainConfig.recovery`: what a run does when an actor or a node is lost, or a step hangs."""

from __future__ import annotations

from raypipe.config.checks import check_int, check_positive, fail
from raypipe.config.sections.base import Section, section


@section("recovery")
class RecoveryConfig(Section):
    """What a run does when an actor or a node is lost, or a step stops making progress.

    Attributes:
        max_restarts: how many times `Trainer.fit` rebuilds the actors after one dies,
            restoring the last checkpoint, before it gives up.
        restore_from_replicas: after a loss with dp > 1, the new actors take the surviving
            replicas' weights and optimizer state from memory when they hold the whole model
            (`raypipe.driver.run.replicas`): the failed step runs again and none is replayed. False
            (or ZeRO, or dp = 1): always the last checkpoint.
        elastic: when a node is lost and no node takes its actors within `replace_wait`, go on
            with what is left (`raypipe.driver.run.elastic`): fewer dp replicas (the global batch kept
            by more microbatches) or fewer pipeline stages (the layers split again), from the
            surviving replicas (`restore_from_replicas`) or the last checkpoint; grow back to this
            config at a checkpoint once a node joins. Needs max_restarts >= 1 (each shrink or
            failed regrowth spends one).
        min_pp: the fewest pipeline stages an elastic run may shrink to.
        min_dp: the fewest dp replicas an elastic run may shrink to.
        replace_wait: seconds an elastic run waits for a node to take a lost node's actors
            before it shrinks (part of the time from the loss to the next step).
        step_timeout: seconds a step may go without any action finishing before it is abandoned
            (under engine="compiled", where a step is one call per actor: seconds for the whole step).
    """

    max_restarts: int = 0
    restore_from_replicas: bool = True
    elastic: bool = False
    min_pp: int = 1
    min_dp: int = 1
    replace_wait: float = 10.0
    step_timeout: float = 300.0

    def __post_init__(self) -> None:  # min_pp and min_dp against the topology: `validation.check_across`
        check_int("max_restarts", self.max_restarts, 0)
        for name in ("elastic", "restore_from_replicas"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, getattr(self, name), "give true or false.")
        check_int("min_pp", self.min_pp, 1)
        check_int("min_dp", self.min_dp, 1)
        check_positive("replace_wait", self.replace_wait)
        check_positive("step_timeout", self.step_timeout)
        if self.elastic and self.max_restarts < 1:
            raise fail(
                "elastic",
                self.elastic,
                "an elastic run rebuilds its actors after a loss, which spends TrainConfig.max_restarts: "
                "set max_restarts >= 1 (e.g. 3).",
            )
