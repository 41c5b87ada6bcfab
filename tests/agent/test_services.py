"""Service tasks in the embedded core: replicas kept running, restarts with backoff, crash
loops, readiness checks and the endpoints reported."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import psutil
import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.service_policy import RestartPolicy, fixed_fields
from federation.testing.services import HTTP_REPLICA

from .cores import CANCELLED, RUNNING, Recorder, node, offer, run


def service_offer(
    code: str, *, replicas: int = 1, job_id: str = "job-1", **policy: object
) -> site_link_service_pb2.Offer:
    o = offer(job_id, task="web", replicas=replicas, code=code)
    o.spec.kind = jobs_pb2.TASK_KIND_SERVICE
    o.spec.service.CopyFrom(jobs_pb2.ServicePolicy(**policy))  # type: ignore[arg-type]
    return o


def endpoints(recorder: Recorder, job_id: str = "job-1") -> list[jobs_pb2.Endpoint]:
    """The endpoints the newest report of the job carries."""
    reports = [r for r in recorder.reports if r.job_id == job_id]
    return list(reports[-1].endpoints) if reports else []


async def until(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def answer(address: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{address}:{port}/", timeout=2) as reply:
        return str(reply.read().decode())


def replica_pid(core: EmbeddedCore, replica: int, job_id: str = "job-1") -> int:
    """The pid of a replica's own process (its supervisor's child)."""
    (task,) = [t for t in core._tasks.values() if t.key[0] == job_id]
    (child,) = psutil.Process(task.replicas[replica].pid).children()
    return int(child.pid)


def test_backoff_doubles_per_short_run_and_is_longest_in_a_crash_loop() -> None:
    """The wait after 1, 2, 3 short runs: backoff_s, twice, four times; capped; the longest
    once crash-looping."""
    policy = RestartPolicy.of(
        jobs_pb2.ServicePolicy(backoff_s=1, max_backoff_s=5, crash_loop_after=5)
    )
    assert [policy.delay_s(n) for n in range(6)] == [1, 1, 2, 4, 5, 5]
    assert [policy.crash_looping(n) for n in (4, 5)] == [False, True]
    defaults = RestartPolicy.of(jobs_pb2.ServicePolicy())
    assert (defaults.always, defaults.backoff_s, defaults.max_backoff_s) == (True, 1, 300)
    on_failure = RestartPolicy.of(
        jobs_pb2.ServicePolicy(restart=jobs_pb2.ServicePolicy.RESTART_ON_FAILURE)
    )
    assert [on_failure.restarts(code) for code in (0, 1, -9)] == [False, True, True]


async def test_a_killed_replica_comes_back_ready_while_the_other_serves(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Two HTTP replicas, each on a port of its own, ready by an HTTP check; one killed comes
    back ready within backoff + 5 s and the other answers all along."""
    core = make_core([node("n", cpu=8)], service_address="127.0.0.1")
    readiness = jobs_pb2.ReadinessCheck(http_path="/", period_s=0.2)
    await run(core, service_offer(HTTP_REPLICA, replicas=2, backoff_s=0.5, readiness=readiness))
    await until(lambda: [e.ready for e in endpoints(recorder)] == [True, True], "both ready")
    first, second = endpoints(recorder)
    assert (first.site, first.node, first.address) == ("site-a", "n", "127.0.0.1")
    assert first.port != second.port
    assert answer("127.0.0.1", first.port) == "0"
    assert answer("127.0.0.1", second.port) == "1"
    psutil.Process(replica_pid(core, 0)).kill()
    killed_at = time.monotonic()
    await until(lambda: not endpoints(recorder)[0].ready, "replica 0 seen down", 5)
    while not (endpoints(recorder)[0].ready and endpoints(recorder)[0].restarts == 1):
        assert answer("127.0.0.1", second.port) == "1"  # the other serves meanwhile
        assert time.monotonic() - killed_at < 0.5 + 5, "replica 0 not ready again in time"
        await asyncio.sleep(0.1)
    assert answer("127.0.0.1", first.port) == "0"  # the same port again
    assert endpoints(recorder)[1].restarts == 0
    assert recorder.states()[-1] == RUNNING
    await core.cancel("job-1", "web", 0, "done")
    final = await recorder.final()
    assert final.state == CANCELLED
    assert not final.endpoints
    with pytest.raises(urllib.error.URLError):
        answer("127.0.0.1", second.port)


async def test_a_replica_that_exits_at_once_is_crash_looping(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Restarted after each exit, after a growing backoff; shown crash-looping after
    crash_loop_after short runs in a row; the task stays RUNNING."""
    core = make_core([node("n")], service_address="127.0.0.1")
    policy = {"backoff_s": 0.05, "max_backoff_s": 0.2, "crash_loop_after": 3}
    await run(core, service_offer("raise SystemExit(3)", **policy))
    await until(lambda: endpoints(recorder)[0].crash_looping, "crash loop")
    (looping,) = endpoints(recorder)
    assert looping.restarts >= 2
    assert not looping.ready
    assert recorder.states()[-1] == RUNNING
    assert all(r.state == RUNNING for r in recorder.reports)


async def test_on_failure_leaves_a_replica_that_exited_0_down(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Restart on_failure: the replica that exits 0 stays down, the one that fails is
    restarted; the task stays RUNNING until cancelled."""
    core = make_core([node("n", cpu=8)], service_address="127.0.0.1")
    code = (
        "import os, sys, time\n"
        "if os.environ['FEDERATION_REPLICA'] == '1': sys.exit(1)\n"
        "time.sleep(0.3)"
    )
    await run(
        core,
        service_offer(
            code, replicas=2, restart=jobs_pb2.ServicePolicy.RESTART_ON_FAILURE, backoff_s=0.05
        ),
    )
    await until(lambda: endpoints(recorder)[1].restarts >= 2, "replica 1 restarted")
    (task,) = [t for t in core._tasks.values() if t.key[0] == "job-1"]
    assert task.service is not None
    # Replica 0's keeper has seen it exit 0 and returned: it will not start it again.
    await until(lambda: task.keepers[0].done(), "replica 0's keeper to settle")
    assert task.replicas[0].exited
    assert task.service[0].down
    assert not task.keepers[1].done()  # replica 1's keeper goes on restarting it
    ended, failing = endpoints(recorder)
    assert (ended.restarts, ended.ready) == (0, False)
    assert failing.restarts >= 2
    assert core.queue().running_tasks == 1
    await core.cancel("job-1", "web", 0, "done")
    assert (await recorder.final()).state == CANCELLED


async def test_a_fixed_port_for_several_replicas_is_declined(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Every replica runs on this machine: a fixed port serves one."""
    core = make_core([node("n", cpu=8)])
    declined = await core.offer(service_offer(HTTP_REPLICA, replicas=2, port=8080))
    assert not declined.accepted
    assert "service.port 8080 is fixed" in declined.reason
    assert (await core.offer(service_offer(HTTP_REPLICA, replicas=1, port=8080))).accepted


async def test_a_command_check_runs_beside_the_replica(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A command check with the replica's environment: ready once it exits 0."""
    core = make_core([node("n")], service_address="127.0.0.1")
    check = [sys.executable, "-c", "import os, sys; sys.exit(os.path.exists('up') is False)"]
    readiness = jobs_pb2.ReadinessCheck(command=jobs_pb2.CommandCheck(argv=check), period_s=0.1)
    code = "import time; time.sleep(0.5); open('up', 'w').close(); time.sleep(60)"
    await run(core, service_offer(code, readiness=readiness))
    started = time.monotonic()
    await until(lambda: bool(endpoints(recorder)) and endpoints(recorder)[0].ready, "ready")
    assert time.monotonic() - started > 0.3  # not before the file was there
    assert not recorder.reports[0].endpoints[0].ready


def change_of(
    o: site_link_service_pb2.Offer, revision: int = 1, **fields: object
) -> site_link_service_pb2.ChangeTask:
    """A change of the offer's task to its spec with ``fields`` set."""
    spec = jobs_pb2.TaskSpec()
    spec.CopyFrom(o.spec)
    for name, value in fields.items():
        if name == "cpu":
            spec.resources.cpu = float(str(value))
        else:
            setattr(spec, name, value)
    return site_link_service_pb2.ChangeTask(
        job_id=o.job_id, task=o.task, epoch=o.epoch, spec=spec, revision=revision
    )


async def test_a_site_declines_what_it_cannot_change_and_keeps_its_own_spec(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Unknown task, a batch task, more replicas than the node has room for, an older
    revision, a revision taken with another spec: each declined with why. What the site was
    offered beyond the fields a change makes (here learned speeds) stays as offered, and a
    scale leaves the replica that runs alone (same process)."""
    core = make_core([node("n", cpu=4)])
    o = service_offer(HTTP_REPLICA, replicas=1)
    o.spec.speed["A100"] = 2.0  # the offer's learned speeds: not in the stored spec
    await run(core, o)
    await until(lambda: [e.ready for e in endpoints(recorder)] == [True], "ready")
    (before,) = endpoints(recorder)
    pid = replica_pid(core, 0)
    batch = offer("job-2", code="import time; time.sleep(30)")
    await run(core, batch)
    stored = jobs_pb2.TaskSpec()
    stored.CopyFrom(o.spec)
    del stored.speed["A100"]
    o.spec.CopyFrom(stored)
    declined = {
        "unknown": change_of(offer("job-9", task="web")),
        "batch": change_of(batch),
        "no-room": change_of(o, replicas=9),
    }
    reasons = {name: await core.change(change) for name, change in declined.items()}
    assert not any(answer.accepted for answer in reasons.values())
    assert "no task job-9/web epoch 1 runs here" in reasons["unknown"].reason
    assert "is not a service" in reasons["batch"].reason
    assert reasons["no-room"].reason.startswith("no room for 8 more replicas")
    assert (await core.change(change_of(o, revision=2, replicas=2))).accepted
    (task,) = [t for t in core._tasks.values() if t.key[0] == "job-1"]
    assert dict(task.spec.speed) == {"A100": 2.0}, "the offer's speeds were dropped"
    stale = await core.change(change_of(o, revision=1, replicas=1))
    assert stale.reason == "revision 1 is older than revision 2 here"
    assert (await core.change(change_of(o, revision=2, replicas=2))).accepted, "a retry"
    other = await core.change(change_of(o, revision=2, replicas=3))
    assert other.reason == "revision 2 was taken here with another spec"
    await until(lambda: [e.ready for e in endpoints(recorder)] == [True, True], "two ready")
    first = endpoints(recorder)[0]
    assert (first.port, first.restarts, first.revision) == (before.port, 0, 2)
    assert replica_pid(core, 0) == pid, "scaling replaced the replica that ran"
    await core.cancel("job-1", "web", 0, "done")
    await core.cancel("job-2", "train", 0, "done")


async def test_a_change_of_command_replaces_each_replica_within_max_unavailable(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Three replicas, max_unavailable 1: no report ever shows two not ready once all were
    ready; every replica ends on the new revision, in a new process."""
    core = make_core([node("n", cpu=4)])
    o = service_offer(
        HTTP_REPLICA,
        replicas=3,
        max_unavailable=1,
        readiness=jobs_pb2.ReadinessCheck(http_path="/", period_s=0.1, timeout_s=5),
    )
    await run(core, o)
    await until(lambda: [e.ready for e in endpoints(recorder)] == [True] * 3, "ready")
    pids = [replica_pid(core, i) for i in range(3)]
    seen_from = len(recorder.reports)
    o.spec.env["V"] = "2"
    assert (await core.change(change_of(o, revision=1))).accepted

    def rolled() -> bool:
        now = endpoints(recorder)
        return len(now) == 3 and all(e.ready and e.revision == 1 for e in now)

    await until(rolled, "every replica on revision 1")
    shown = [list(r.endpoints) for r in recorder.reports[seen_from:] if r.job_id == "job-1"]
    assert all(sum(not e.ready for e in listed) <= 1 for listed in shown), [
        [(e.replica, e.revision, e.ready) for e in listed] for listed in shown
    ]
    assert not {replica_pid(core, i) for i in range(3)} & set(pids)
    await core.cancel("job-1", "web", 0, "done")


def test_only_replicas_command_env_and_service_change_in_place() -> None:
    old = jobs_pb2.TaskSpec(name="web", command=["a"], replicas=1, requires={"cuda": ">=12"})
    new = jobs_pb2.TaskSpec(name="web", command=["b"], replicas=3, requires={"cuda": ">=12"})
    new.env["V"] = "2"
    new.service.max_unavailable = 2
    assert fixed_fields(old, new) == []
    new.requires["cuda"] = ">=13"
    new.checkpoint.SetInParent()  # set, though empty: not the same as unset
    new.timeout_s = 5
    new.service.port = 8080
    assert fixed_fields(old, new) == ["timeout_s", "requires", "checkpoint", "service.port"]
