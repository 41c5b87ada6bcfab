"""A service replica that starts or stops crash-looping is an event of its task (still
RUNNING), written with the report that carried it; other endpoint changes are not events."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2
from federation.common import job_state

from .test_reconcile import RUN, Federation, _run_at, fed, report

__all__ = ["fed"]  # the fixture, imported for pytest


async def service_running_at_a(fed: Federation) -> None:
    """Job j with service t of two replicas running at site a, epoch 1."""
    job = jobs_pb2.Job(id="j", state=job_state.PENDING)
    job.spec.id = job.spec.name = "j"
    job.spec.tasks.add(
        name="t",
        command=["x"],
        replicas=2,
        kind=jobs_pb2.TASK_KIND_SERVICE,
        service=jobs_pb2.ServicePolicy(max_backoff_s=30, crash_loop_after=3),
    )
    job.tasks.add(name="t", state=job_state.PENDING)
    await fed.jobs.create([job])
    await fed.jobs.update("j", _run_at("a"))


async def running_with(fed: Federation, *endpoints: jobs_pb2.Endpoint) -> None:
    """A RUNNING report from a carrying ``endpoints``."""
    out = report(1, RUN)
    out.endpoints.extend(endpoints)
    await fed.manager.apply_report("a", out)


def replica(index: int, restarts: int = 0, looping: bool = False) -> jobs_pb2.Endpoint:
    return jobs_pb2.Endpoint(
        site="a", replica=index, port=8000 + index, restarts=restarts, crash_looping=looping
    )


async def test_a_crash_loop_is_an_event_once_when_it_starts_and_once_when_it_ends(
    fed: Federation,
) -> None:
    await service_running_at_a(fed)
    started = len(await fed.jobs.events("j"))
    await running_with(fed, replica(0), replica(1))
    await running_with(fed, replica(0), replica(1, restarts=2))  # restarts alone: no event
    assert len(await fed.jobs.events("j")) == started
    await running_with(fed, replica(0), replica(1, restarts=3, looping=True))
    await running_with(fed, replica(0), replica(1, restarts=4, looping=True))  # still: no event
    await running_with(fed, replica(0), replica(1, restarts=4))
    events = (await fed.jobs.events("j"))[started:]
    assert [e.reason for e in events] == [
        "replica 1 is crash-looping: 3 restarts in a row after runs shorter than 10s; "
        "restarted every 30s",
        "replica 1 is no longer crash-looping",
    ]
    for event in events:
        assert (event.task, event.state, event.site, event.job_state) == ("t", RUN, "a", RUN)
    job = await fed.jobs.get("j")
    assert job.tasks[0].state == RUN
    assert job.tasks[0].endpoints[1].restarts == 4  # written with the events' reports
    assert job.last_event_sequence == events[-1].sequence
