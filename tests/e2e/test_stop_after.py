"""At most one copy when the job asks for it: a cut-off site stops its copy before the
replacement starts (``disconnect.stop_after_s``); a job that does not ask keeps running.

edge-p reaches the coordinator through a proxy (``federation.testing.proxy``) that the test
pauses: silently (only missed heartbeats tell the coordinator, and the agent's stream looks
open until its keepalive gives up, up to 15 s later), or breaking its connections too (the
coordinator loses the session at once, the tightest case for the margin). Each copy of a task
appends timestamps to a marker file of its own, so the test reads from the copies themselves
when each ran.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.local import LocalFederation
from federation.testing.cluster import cpu_site, until
from federation.testing.proxy import proxy_to

from .conftest import jobs, python_task, spec

pytestmark = pytest.mark.xdist_group("e2e-stop-after")

RUNNING = jobs_pb2.JOB_STATE_RUNNING

HEARTBEAT_S = 0.5
LOST_AFTER_S = 5.0
STOP_AFTER_S = 5.0
"""As long as lost_after_s: only the margin keeps the replacement from starting too soon."""
KILL_GRACE_S = 2.0
"""The agents' kill_grace_s (``LocalFederation``): the copies ignore SIGTERM and are killed."""

# One marker file per copy: "start T", then "alive T" every 50 ms until the file "go" exists,
# then "done T". SIGTERM is noted ("term T") and ignored: only SIGKILL ends a copy early.
TASK = """
import os, signal, sys, time
folder = sys.argv[1]
copy = "copy-" + os.environ["FEDERATION_SITE"] + "-" + os.environ["FEDERATION_EPOCH"]
out = open(os.path.join(folder, copy), "a", buffering=1)
termed = []
signal.signal(signal.SIGTERM, lambda *_: termed.append(time.time()))
out.write(f"start {time.time()}\\n")
while not os.path.exists(os.path.join(folder, "go")):
    while termed:
        out.write(f"term {termed.pop(0)}\\n")
    out.write(f"alive {time.time()}\\n")
    time.sleep(0.05)
out.write(f"done {time.time()}\\n")
"""


@dataclass(frozen=True)
class Copy:
    """When one copy ran, as its marker file says."""

    start: float
    last: float
    term: float | None
    done: bool


def read_copy(path: Path) -> Copy:
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]  # a line being written is left for later
    marks = [(kind, float(at)) for kind, at in (line.split() for line in complete.splitlines())]
    term = next((at for kind, at in marks if kind == "term"), None)
    return Copy(marks[0][1], marks[-1][1], term, marks[-1][0] == "done")


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation(
        tmp_path / "fed",
        [],
        coordinator_args=["--heartbeat-interval-s", str(HEARTBEAT_S), "--missed-heartbeats", "3"],
    )
    try:
        yield federation
    finally:
        federation.stop()


def journaled(fed: LocalFederation, site: str) -> list[pb.TaskReport]:
    """The final reports a site's agent keeps until the coordinator acknowledges them."""
    path = fed.root / "sites" / site / "state" / "journal.db"
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [
            pb.TaskReport.FromString(blob) for (blob,) in conn.execute("SELECT report FROM reports")
        ]
    finally:
        conn.close()


@pytest.mark.parametrize("broken", [False, True], ids=["silent", "broken"])
async def test_a_cut_off_copy_stops_before_its_replacement_starts(
    fed: LocalFederation, tmp_path: Path, broken: bool
) -> None:
    """With stop_after_s the copy at the cut-off site is stopped (SIGTERM, SIGKILL after the
    grace) counting from the last message its agent heard, and its replacement starts only
    afterwards: the copies never overlap, and the job finishes once. Without it the copy runs
    on through the cut, beside its replacement. Before the cut both copies ran longer than
    stop_after_s: in touch, nothing is stopped."""
    await fed.start_coordinator()
    async with proxy_to(fed.port) as proxy, fed.operator().channel() as channel:
        stub = jobs(channel)
        await fed.start_site(cpu_site("edge-p", coordinator=f"127.0.0.1:{proxy.port}"))
        await fed.wait_connected(["edge-p"])
        policies = {
            "at-most-once": {"lost_after_s": LOST_AFTER_S, "stop_after_s": STOP_AFTER_S},
            "at-least-once": {"lost_after_s": LOST_AFTER_S},
        }
        ids = {}
        for name, policy in policies.items():
            (tmp_path / name).mkdir()
            task = python_task("t", TASK, resources={"cpu": 1, "memory_mib": 64})
            task["command"] = [*task["command"], str(tmp_path / name)]  # type: ignore[misc]
            request = job_service_pb2.SubmitJobRequest(spec=spec(name, [task], disconnect=policy))
            ids[name] = (await stub.SubmitJob(request)).job.id

        async def get(name: str) -> jobs_pb2.Job:
            request = job_service_pb2.GetJobRequest(job_id=ids[name])
            return (await stub.GetJob(request)).job

        def copy(name: str, site: str, epoch: int) -> Path:
            return tmp_path / name / f"copy-{site}-{epoch}"

        def running_at(site: str) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                tasks = [(await get(name)).tasks[0] for name in ids]
                return all((t.site, t.state) == (site, RUNNING) for t in tasks)

            return check

        await until(running_at("edge-p"), 30, "both jobs running at edge-p")
        await fed.start_site(cpu_site("edge-q"))
        await fed.wait_connected(["edge-q"])
        await asyncio.sleep(STOP_AFTER_S + 1)  # in touch all along: no copy is stopped
        assert await running_at("edge-p")()
        for name in ids:
            before = read_copy(copy(name, "edge-p", 1))
            assert before.term is None
            assert before.last - before.start > STOP_AFTER_S

        proxy.pause()
        if broken:
            proxy.cut()
        cut_at = time.time()
        await until(running_at("edge-q"), 60, "both tasks running at edge-q")
        epochs = {name: (await get(name)).tasks[0].epoch for name in ids}
        (tmp_path / "at-most-once" / "go").touch()
        (tmp_path / "at-least-once" / "go").touch()
        for name in ids:

            async def succeeded(name: str = name) -> bool:
                return (await get(name)).state == jobs_pb2.JOB_STATE_SUCCEEDED

            await until(succeeded, 30, f"{name} to succeed")
        request = job_service_pb2.GetJobRequest(job_id=ids["at-most-once"], include_events=True)
        events = (await stub.GetJob(request)).events

    original = read_copy(copy("at-most-once", "edge-p", 1))
    replacement = read_copy(copy("at-most-once", "edge-q", epochs["at-most-once"]))
    kept = read_copy(copy("at-least-once", "edge-p", 1))
    beside = read_copy(copy("at-least-once", "edge-q", epochs["at-least-once"]))
    term_s = "none" if original.term is None else f"{original.term - cut_at:.2f}s"
    timeline = (
        f"stop_after {STOP_AFTER_S:g}s, lost_after {LOST_AFTER_S:g}s: the cut-off copy got "
        f"SIGTERM at {term_s} after the cut and was last seen at {original.last - cut_at:.2f}s; "
        f"its replacement started at {replacement.start - cut_at:.2f}s; without stop_after_s "
        f"the replacement started at {beside.start - cut_at:.2f}s"
    )
    print(f"\n{timeline}")
    assert original.last < replacement.start, timeline  # never two copies at once
    assert original.term is not None
    assert original.term >= cut_at + STOP_AFTER_S - 2 * HEARTBEAT_S  # counted from its last news
    assert original.last >= original.term + KILL_GRACE_S - 0.5  # it ignored SIGTERM: killed
    assert not original.done
    assert replacement.done
    ends = [e.site for e in events if e.state == jobs_pb2.JOB_STATE_SUCCEEDED]
    assert ends == ["edge-q"]
    # The stop's report waits in edge-p's journal for the next hello.
    (stopped,) = [r for r in journaled(fed, "edge-p") if r.job_id == ids["at-most-once"]]
    assert (stopped.epoch, stopped.state, stopped.interrupted) == (
        1,
        jobs_pb2.JOB_STATE_CANCELLED,
        True,
    )
    assert stopped.reason.startswith("cut off from every coordinator for ")
    assert stopped.reason.endswith(f" s (disconnect.stop_after_s {STOP_AFTER_S:g})")

    assert kept.term is None
    assert kept.last > beside.start  # ran on through the cut, beside its replacement
