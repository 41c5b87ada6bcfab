"""What every core decides of offers and commits, whichever scheduler holds the capacity.

Each case is steps played against a fresh core and the answers every core gives to its offers
and commits, in order. The embedded core (``test_core_consistency``), the Slurm core
(``tests/slurm/test_slurm_decisions``) and the Ray core (``tests/ray_core/test_ray_core``) play
the same cases, so a core that refuses what another accepts, or says so in other words, fails.

Reservation ids and node names differ from core to core: an answer names the reservation an
offer labelled ``a`` got as ``<a>``, and the core's one node as ``<node>``. An accepted offer
answers with the reservation it holds, a started commit with "".
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from federation.agent.core import LocalCore
from federation.api.v1 import jobs_pb2, site_link_service_pb2

Answer = tuple[bool, str]
"""Accepted (an offer) or started (a commit), and what the core said."""


@dataclass(frozen=True)
class Offer:
    """An offer of one plain task; its reservation is known by ``label`` from then on."""

    label: str = "a"
    job_id: str = "job-1"
    task: str = "main"
    epoch: int = 1
    command: tuple[str, ...] = (sys.executable, "-c", "pass")
    cpu: float = 1.0
    node_labels: Mapping[str, str] = field(default_factory=dict)
    cordon: bool = False
    """Whether the offer names the core's node as cordoned."""

    def message(self, node: str) -> site_link_service_pb2.Offer:
        spec = jobs_pb2.TaskSpec(
            name=self.task,
            command=self.command,
            resources=jobs_pb2.ResourceRequest(cpu=self.cpu, memory_mib=256),
        )
        return site_link_service_pb2.Offer(
            job_id=self.job_id,
            task=self.task,
            epoch=self.epoch,
            spec=spec,
            lease_s=60,
            node_labels=self.node_labels,
            cordoned_nodes=[node] if self.cordon else [],
        )


@dataclass(frozen=True)
class Commit:
    """A commit naming the reservation labelled ``of`` (a label no offer had: that very id)."""

    of: str = "a"
    job_id: str = "job-1"
    task: str = "main"
    epoch: int = 1


@dataclass(frozen=True)
class Release:
    """The coordinator lets the reservation labelled ``of`` go."""

    of: str = "a"


@dataclass(frozen=True)
class Cancel:
    """The coordinator cancels the task (every epoch of it)."""

    job_id: str = "job-1"
    task: str = "main"


Step = Offer | Commit | Release | Cancel


@dataclass(frozen=True)
class Case:
    steps: tuple[Step, ...]
    answers: tuple[Answer, ...]


HELD: Answer = (True, "<a>")
STARTED: Answer = (True, "")
UNKNOWN_A: Answer = (False, "unknown reservation '<a>' (lapsed or released)")

CASES = {
    # Offers every core declines before its scheduler is asked.
    "an invalid job id": Case(
        (Offer(job_id="../x"),), ((False, "invalid job id or task name '../x'/'main'"),)
    ),
    "an invalid task name": Case(
        (Offer(task="a/b/1"),), ((False, "invalid job id or task name 'job-1'/'a/b/1'"),)
    ),
    "a part of a divided task": Case((Offer(task="main/1"),), (HELD,)),
    "no command": Case((Offer(command=()),), ((False, "task has no command"),)),
    "a negative cpu request": Case((Offer(cpu=-1),), ((False, "invalid cpu request -1.0"),)),
    # The node has the final say (node_fit).
    "a node label no node has": Case(
        (Offer(node_labels={"torch": "9.9"}),),
        ((False, "no node qualifies: <node> needs node label torch='9.9', has none"),),
    ),
    "a cordoned node": Case(
        (Offer(cordon=True),), ((False, "no node qualifies: <node> is cordoned"),)
    ),
    # Epochs, as the reservation book fences them.
    "a repeated offer": Case((Offer(), Offer(label="b")), (HELD, HELD)),
    "a stale epoch": Case(
        (Offer(epoch=2), Offer(label="b", epoch=1)),
        (HELD, (False, "stale epoch 1: this site holds epoch 2 of the task")),
    ),
    "a newer epoch": Case((Offer(epoch=1), Offer(label="b", epoch=2)), (HELD, (True, "<b>"))),
    "an epoch committed already": Case(
        (Offer(), Commit(), Offer(label="b")),
        (HELD, STARTED, (False, "epoch 1 of the task was already committed here")),
    ),
    # Commits, as the reservation book settles them.
    "a commit": Case((Offer(), Commit()), (HELD, STARTED)),
    "a retried commit": Case((Offer(), Commit(), Commit()), (HELD, STARTED, STARTED)),
    "an unknown reservation": Case(
        (Commit(of="nope"),), ((False, "unknown reservation 'nope' (lapsed or released)"),)
    ),
    "a released reservation": Case((Offer(), Release(), Commit()), (HELD, UNKNOWN_A)),
    "a cancelled reservation": Case((Offer(), Cancel(), Commit()), (HELD, UNKNOWN_A)),
    "a reservation for another epoch": Case(
        (Offer(epoch=2), Commit(epoch=3)),
        (HELD, (False, "reservation '<a>' is for job-1/main epoch 2, not job-1/main epoch 3")),
    ),
    "a reservation for another task": Case(
        (
            Offer(),
            Offer(label="b", job_id="job-2"),
            Commit(job_id="job-2"),
            Commit(of="b", job_id="job-2"),
        ),
        (
            HELD,
            (True, "<b>"),
            (False, "reservation '<a>' is for job-1/main epoch 1, not job-2/main epoch 1"),
            STARTED,
        ),
    ),
}


async def play(core: LocalCore, case: Case) -> tuple[Answer, ...]:
    """Plays the case's steps against ``core`` (whose one node is its first); returns the
    answers to its offers and commits, reservation ids and the node named as in ``CASES``."""
    [node] = [n.name for n in core.nodes()]
    ids: dict[str, str] = {}
    answers: list[Answer] = []
    for step in case.steps:
        if isinstance(step, Offer):
            offered = await core.offer(step.message(node))
            if offered.accepted:
                ids.setdefault(step.label, offered.reservation_id)
            answers.append((offered.accepted, offered.reservation_id or offered.reason))
        elif isinstance(step, Commit):
            commit = site_link_service_pb2.Commit(
                reservation_id=ids.get(step.of, step.of),
                job_id=step.job_id,
                task=step.task,
                epoch=step.epoch,
            )
            started = await core.commit(commit)
            answers.append((started.started, started.reason))
        elif isinstance(step, Release):
            await core.release(ids[step.of])
        else:
            await core.cancel(step.job_id, step.task, 0, "cancelled by the test")
    return tuple((ok, _named(text, ids, node)) for ok, text in answers)


def _named(text: str, ids: Mapping[str, str], node: str) -> str:
    for label, reservation_id in ids.items():
        text = text.replace(reservation_id, f"<{label}>")
    return text.replace(node, "<node>")
