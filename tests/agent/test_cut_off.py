"""A site cut off from every coordinator stops the tasks of jobs that ask for at most one copy
(``disconnect.stop_after_s``), reports them interrupted, and keeps the report for its next hello.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from structlog.testing import capture_logs

from federation.agent.config import AgentConfig
from federation.agent.cut_off import CutOffWatch
from federation.agent.embedded import stops
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.journal import Journal
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import site_link_service_pb2 as pb

from .beacon import Beacon
from .cores import CANCELLED, RUNNING, Recorder, node, offer, run

SLEEP = "import time; time.sleep(60)"
IGNORES_SIGTERM = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "send(f'ready {os.getpid()}')\n"
    "time.sleep(60)\n"
)


class Clock:
    """Monotonic time that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def states(core: EmbeddedCore) -> dict[str, int]:
    return {report.job_id: report.state for report in core.tasks()}


async def test_only_tasks_whose_jobs_ask_are_stopped(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Cut off 2.6 s: the task that asks to stop after 2 s ends CANCELLED, reported interrupted
    with why (also in what the next hello carries); one that asks for 5 s and one that asks
    for nothing run on."""
    core = make_core([node("n")])
    await run(core, offer("stops", code=SLEEP, stop_after_s=2))
    await run(core, offer("later", code=SLEEP, stop_after_s=5))
    await run(core, offer("keeps", code=SLEEP))
    await asyncio.wait_for(core.stop_cut_off(2.6), 10)
    report = await recorder.final("stops")
    assert (report.state, report.interrupted) == (CANCELLED, True)
    assert report.reason == "cut off from every coordinator for 3 s (disconnect.stop_after_s 2)"
    assert states(core) == {"stops": CANCELLED, "later": RUNNING, "keeps": RUNNING}
    assert [r.interrupted for r in core.tasks()] == [True, False, False]
    assert not any(r.interrupted for r in recorder.reports if r.state == RUNNING)


async def test_a_cut_off_stop_kills_within_the_stop_grace(
    make_core: Callable[..., EmbeddedCore],
    recorder: Recorder,
    beacon: Beacon,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task that ignores SIGTERM is SIGKILLed after STOP_GRACE_S, not the longer kill grace
    of the site: the coordinator's margin counts on it."""
    monkeypatch.setattr(stops, "STOP_GRACE_S", 0.3)
    core = make_core([node("n")], kill_grace_s=60)
    await run(core, offer(code=beacon.child(IGNORES_SIGTERM), stop_after_s=1))
    pid = int((await beacon.expect("ready")).split()[1])
    started = time.monotonic()
    await asyncio.wait_for(core.stop_cut_off(1), 10)
    assert 0.3 <= time.monotonic() - started < 5
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    report = await recorder.final()
    assert (report.state, report.interrupted) == (CANCELLED, True)


async def test_a_task_the_coordinator_is_stopping_is_left_to_that_stop(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, beacon: Beacon
) -> None:
    """A task already being cancelled ends as the cancel says: not interrupted."""
    core = make_core([node("n")], kill_grace_s=0.3)
    await run(core, offer(code=beacon.child(IGNORES_SIGTERM), stop_after_s=1))
    await beacon.expect("ready")
    cancelling = asyncio.create_task(core.cancel("job-1", "train", 0, "user asked"))
    await asyncio.sleep(0)  # the cancel has begun
    await asyncio.wait_for(core.stop_cut_off(10), 10)
    await asyncio.wait_for(cancelling, 10)
    report = await recorder.final()
    assert (report.state, report.reason, report.interrupted) == (CANCELLED, "user asked", False)


async def test_silence_counts_once_in_touch_and_past_two_heartbeats(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Before any coordinator was heard there is nothing to count from; a silence shorter than
    two heartbeat intervals is the gap between answers; a message ends the silence."""
    clock = Clock()
    watch = CutOffWatch(make_core([node("n")]), clock=clock)
    clock.now += 1000
    assert watch.cut_off_s() == 0
    watch.heard(heartbeat_s=1.0)
    clock.now += 1.9
    assert watch.cut_off_s() == 0
    clock.now += 0.1
    assert watch.cut_off_s() == pytest.approx(2.0)
    watch.heard(heartbeat_s=1.0)
    assert watch.cut_off_s() == 0


async def test_the_watch_stops_a_task_once_silent_for_its_stop_after(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """While messages come the task runs on, well past its stop_after_s; once they stop it is
    stopped no sooner than stop_after_s after the last one, and soon after. A task that does
    not ask runs on."""
    core = make_core([node("n")])
    watch = CutOffWatch(core, tick_s=0.05)
    await run(core, offer(code=SLEEP, stop_after_s=0.5))
    await run(core, offer("keeps", code=SLEEP))
    looking = asyncio.create_task(watch.run())
    try:
        for _ in range(30):  # 1.5 s in touch, three times stop_after_s
            watch.heard(heartbeat_s=0.05)
            last_heard = time.monotonic()
            await asyncio.sleep(0.05)
        assert states(core) == {"job-1": RUNNING, "keeps": RUNNING}
        report = await recorder.final()
        silent_s = time.monotonic() - last_heard
    finally:
        looking.cancel()
    assert (report.state, report.interrupted) == (CANCELLED, True)
    assert 0.5 <= silent_s < 3.0
    assert states(core)["keeps"] == RUNNING


async def test_a_watch_that_never_heard_a_coordinator_stops_nothing(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """The clock starts when contact is lost, not when the agent starts."""
    core = make_core([node("n")])
    await run(core, offer(code=SLEEP, stop_after_s=0.1))
    clock = Clock()
    watch = CutOffWatch(core, tick_s=0.05, clock=clock)
    looks: list[float] = []
    look = watch.cut_off_s
    looked_thrice = asyncio.Event()

    def counted() -> float:
        looks.append(look())
        if len(looks) == 3:
            looked_thrice.set()
        return looks[-1]

    watch.cut_off_s = counted  # type: ignore[method-assign]
    looking = asyncio.create_task(watch.run())
    clock.now += 3600  # an hour since the agent started: far past the task's stop_after_s
    try:
        async with asyncio.timeout(10):
            await looked_thrice.wait()
    finally:
        looking.cancel()
    assert looks[:3] == [0.0, 0.0, 0.0]
    assert states(core) == {"job-1": RUNNING}


async def test_the_interrupted_report_waits_in_the_journal_for_the_next_hello(
    tmp_path: Path,
) -> None:
    """The agent journals the interrupted report like any final one; a restarted agent, whose
    core knows nothing, still says hello with it; the coordinator's heartbeat answers are
    heard, not taken for requests."""
    config = AgentConfig(
        site="edge-1",
        domain="edge",
        coordinator="127.0.0.1:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
    )
    journal = Journal(tmp_path / "journal.db")
    runtimes: list[AgentRuntime] = []
    cores: list[EmbeddedCore] = []

    def agent() -> AgentRuntime:
        core = EmbeddedCore(
            [node("n")],
            site="edge-1",
            work_dir=tmp_path / "work",
            on_status=lambda report: runtimes[-1].on_status(report),
            on_change=lambda: None,
        )
        cores.append(core)
        runtimes.append(AgentRuntime(config, credential_paths(tmp_path), core, journal=journal))
        return runtimes[-1]

    first = agent()
    with capture_logs() as logs:
        first._dispatch(pb.CoordinatorMessage(heartbeat=pb.Heartbeat()), asyncio.Queue())
        await asyncio.sleep(0)
    assert [e["event"] for e in logs] == []
    await run(cores[0], offer(code=SLEEP, stop_after_s=1))
    await asyncio.wait_for(cores[0].stop_cut_off(1.2), 10)
    (kept,) = journal.pending()
    assert (kept.state, kept.interrupted) == (CANCELLED, True)
    (said,) = agent().hello_tasks()
    assert (said.job_id, said.state, said.interrupted) == ("job-1", CANCELLED, True)
    assert said.reason == "cut off from every coordinator for 1 s (disconnect.stop_after_s 1)"
    await cores[0].close()
