"""What a site's reservation book decides of an offer's epoch and of a commit, for every core.

A core holds reservations (offers accepted, not yet committed) and committed tasks; the
coordinator commits a task by the reservation its offer's answer named. Whatever holds the
capacity (the embedded core's own book, a held Slurm job, a Ray placement group), the book
decides alike, with one set of texts:

* an offer for an older epoch than one the site holds or runs is stale, and one for an epoch
  already committed here comes too late;
* a commit for a task committed here under the same reservation is a retry, answered as the
  first was (started);
* a commit naming a reservation the site does not hold (it lapsed, was released or cancelled,
  or never was) is refused, as is one naming a reservation held for another task or epoch;
* any other commit goes ahead: the core takes the reservation and starts the task.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol, TypeVar

import structlog

from federation.api.v1 import site_link_service_pb2
from federation.common.keys import RunKey

log = structlog.get_logger()


class Held(Protocol):
    """A reservation, as the book knows it."""

    @property
    def key(self) -> RunKey:
        """The task and epoch it was offered for."""
        ...


H = TypeVar("H", bound=Held)


class Committed(Protocol):
    """A committed task, as the book knows it."""

    @property
    def reservation_id(self) -> str:
        """The reservation it was committed by."""
        ...


def stale_epoch(epoch: int, held: int) -> str:
    """Why an offer for ``epoch`` is declined where the site holds epoch ``held`` of the task."""
    return f"stale epoch {epoch}: this site holds epoch {held} of the task"


def committed_already(epoch: int) -> str:
    """Why an offer for an epoch committed here is declined."""
    return f"epoch {epoch} of the task was already committed here"


def unknown_reservation(reservation_id: str) -> str:
    """Why a commit naming a reservation the site does not hold is refused."""
    return f"unknown reservation {reservation_id!r} (lapsed or released)"


def other_task(reservation_id: str, held: RunKey, asked: RunKey) -> str:
    """Why a commit naming a reservation held for another task or epoch is refused."""
    return (
        f"reservation {reservation_id!r} is for {held[0]}/{held[1]} epoch {held[2]}, "
        f"not {asked[0]}/{asked[1]} epoch {asked[2]}"
    )


def epoch_problem(
    offer: site_link_service_pb2.Offer, held: Iterable[RunKey], committed: Collection[RunKey]
) -> str:
    """Why the offer's epoch is declined, or "".

    Args:
        offer: The offer.
        held: The tasks the site holds a reservation for.
        committed: The tasks committed here (running or ended, not yet forgotten).
    """
    epochs = [k[2] for k in [*committed, *held] if k[:2] == (offer.job_id, offer.task)]
    if epochs and max(epochs) > offer.epoch:
        return stale_epoch(offer.epoch, max(epochs))
    if (offer.job_id, offer.task, offer.epoch) in committed:
        return committed_already(offer.epoch)
    return ""


def commit_key(commit: site_link_service_pb2.Commit) -> RunKey:
    """The task and epoch a commit names."""
    return commit.job_id, commit.task, commit.epoch


def settled(
    commit: site_link_service_pb2.Commit, committed: Committed | None, held: H | None
) -> H | site_link_service_pb2.CommitAnswer:
    """The reservation the commit goes ahead with, or the answer when the book settles it alone
    (a retry, or a refusal).

    Args:
        commit: The commit.
        committed: The task the commit names, if committed here.
        held: The reservation the commit names, if the site holds it.
    """
    if committed is not None and committed.reservation_id == commit.reservation_id:
        return started()  # a retried commit
    key = commit_key(commit)
    if held is None:
        return refused(key, unknown_reservation(commit.reservation_id))
    if held.key != key:
        return refused(key, other_task(commit.reservation_id, held.key, key))
    return held


def started() -> site_link_service_pb2.CommitAnswer:
    """The answer to a commit the site took."""
    return site_link_service_pb2.CommitAnswer(started=True)


def refused(
    key: RunKey, reason: str, *, warning: bool = False
) -> site_link_service_pb2.CommitAnswer:
    """The answer to a commit the site refuses, logged; ``warning``: the site's own scheduler
    would not start a task it had reserved for."""
    (log.warning if warning else log.info)(
        "commit_refused", job_id=key[0], task=key[1], epoch=key[2], reason=reason
    )
    return site_link_service_pb2.CommitAnswer(started=False, reason=reason)
