"""A step's outcome on the driver: waiting for it with a timeout that names what is pending,
and turning what the actors raised into the error that names the root cause.

Shared by every engine (`refs`, `p2p`, `compiled`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from raypipe.core.env import call_timeout
from raypipe.core.errors import ActorDiedError, StageError, StepTimeoutError
from raypipe.core.protocol import PeerStopped

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def root_failure(errors: Sequence[Exception]) -> Exception:
    """Of the errors the actors of one step raised, the stage that failed first, not the
    neighbours it stopped."""
    return next((e for e in errors if not isinstance(e, PeerStopped)), errors[0])


def gather(
    refs: Sequence[ray.ObjectRef],
    what: str,
    actors: Sequence[ActorHandle] = (),
    names: Sequence[str] = (),
    timeout: float | None = None,
) -> list[Any]:
    """ray.get that turns actor-side failures into a StageError carrying the stage's own message.

    A dead actor becomes an ActorDiedError naming it (from `actors` and `names`) and
    Ray's account of why it died; a call still running after `timeout` seconds (a hung mount, a
    stalled bucket) a StepTimeoutError naming the actors still at it and the operation.
    """
    refs = list(refs)
    timeout = call_timeout() if timeout is None else timeout
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        late = set(pending)
        who = [n for r, n in zip(refs, names or [f"call {i}" for i in range(len(refs))]) if r in late]
        for ref in pending:
            ray.cancel(ref, force=False)
        raise StepTimeoutError(
            f"{what} did not finish within {timeout:.0f} s (RAYPIPE_CALL_TIMEOUT): still waiting on "
            f"{', '.join(who[:8])}{' ...' if len(who) > 8 else ''}. A hung filesystem or bucket, or a stuck "
            f"actor: check it, then build a new Trainer (or raise RAYPIPE_CALL_TIMEOUT)."
        ) from None
    except StageError as error:  # raised by an actor; Ray re-raises it as this type
        raise (PeerStopped if isinstance(error, PeerStopped) else StageError)(cause_message(error)) from None
    except ray.exceptions.RayActorError as error:
        by_id = {a._actor_id.hex(): n for a, n in zip(actors, names)}
        name = by_id.get(getattr(error, "actor_id", None) or "", "a stage actor")
        lines = [line.strip() for line in str(error).splitlines()]
        cause = " ".join(line for line in lines[1:] if line and ":" not in line[:12]) or lines[0]
        raise ActorDiedError(f"{name} died during {what}: {cause}", actor=name, cause=cause) from None
    except ray.exceptions.RayTaskError as error:
        raise StageError(f"{what} failed: {cause_message(error)}") from None


def raise_if_died(
    ready: Sequence[ray.ObjectRef], actors: dict[ray.ObjectRef, tuple[ActorHandle, str]], what: str
) -> None:
    """Raises ActorDiedError at once when one of `actors`' calls ended with its actor's death:
    its neighbours would otherwise wait for it until the collective timeout."""
    for ref in ready:
        if ref in actors:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                actor, name = actors[ref]
                gather([ref], what, [actor], [name])
            except Exception:  # noqa: BLE001 - other failures are reported once all lists are done
                pass


def wait_for_progress(
    pending: dict[ray.ObjectRef, tuple[str, str]], timeout: float, what: str, on_ready: Any = None
) -> None:
    """Waits until every reference is ready, failing if none finishes for `timeout` s.

    `pending` maps each reference to (actor name, action label) for the error message;
    `on_ready(refs)`, when given, sees every reference as soon as it is ready.
    """
    refs = list(pending)
    while refs:
        ready, refs = ray.wait(refs, num_returns=1 if on_ready else len(refs), timeout=timeout, fetch_local=False)
        if on_ready is not None:
            on_ready(ready)
        if not ready and refs:
            by_actor: dict[str, list[str]] = {}
            for ref in refs:
                name, label = pending[ref]
                by_actor.setdefault(name, []).append(label)
            detail = "; ".join(
                f"{name}: {', '.join(labels[:8])}{' ...' if len(labels) > 8 else ''}"
                for name, labels in by_actor.items()
            )
            for ref in refs:
                ray.cancel(ref, force=False)
            raise StepTimeoutError(
                f"{what} made no progress for {timeout:.0f} s (TrainConfig.step_timeout); "
                f"{len(refs)} actions pending: {detail}"
            )


def cause_message(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return str(cause) if isinstance(cause, StageError) else f"{type(cause).__name__}: {cause}"
    return last_line(error)


def last_line(error: BaseException) -> str:
    """The last line of an error's text: Ray puts the remote traceback first, the cause last."""
    text = str(error).strip()
    line = text.splitlines()[-1] if text else type(error).__name__
    return line.removeprefix("raypipe.core.errors.StageError: ")
