"""`TrainConfig.checkpoint`: where a run's checkpoints go, how often, and whether it resumes."""

from __future__ import annotations

from raypipe.checkpoint.storage import check_available, is_uri, split_uri
from raypipe.config.checks import check_int, fail
from raypipe.config.sections.base import Section, section


@section("checkpoint")
class CheckpointConfig(Section):
    """Where a run's checkpoints go, how often, how many are kept, and whether it resumes from one.

    Attributes:
        checkpoint_dir: where checkpoints go (`<dir>/step-N/`): a directory (shared by all nodes in
            a multi-node run) or a URI `pyarrow.fs` opens (`s3://bucket/run`; `raypipe.checkpoint.storage`).
            None disables automatic checkpoints.
        checkpoint_every: save every this many steps (0: only on `Trainer.save`).
        keep_checkpoints: how many of the run's newest checkpoints to keep (0: all; never another run's).
        resume: continue the run in `checkpoint_dir` from its newest valid checkpoint (true) or
            step N's (an int); false (a new run) refuses a directory holding another run's.
    """

    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool | int = False

    def __post_init__(self) -> None:
        where = self.checkpoint_dir
        if where is not None and (not isinstance(where, str) or not where):
            raise fail("checkpoint_dir", where, "give a directory path, a URI (s3://bucket/run) or null.")
        if is_uri(where):
            split_uri(where)  # a URI it cannot read is refused here, its secret unshown
            check_available(where, "checkpoint_dir")
        check_int("checkpoint_every", self.checkpoint_every, 0)
        if self.checkpoint_every and where is None:
            raise fail("checkpoint_every", self.checkpoint_every, "set checkpoint_dir too, or use 0.")
        check_int("keep_checkpoints", self.keep_checkpoints, 0)
        resume = self.resume
        if not isinstance(resume, bool) and not (isinstance(resume, int) and resume >= 0):
            raise fail("resume", resume, "give true (the newest checkpoint), a step number, or false (a new run).")
        if resume is not False and where is None:
            raise fail("resume", resume, "resuming needs checkpoint_dir (the run's checkpoints); set it.")
