"""A site cut off by a partition: its task moves elsewhere from its last checkpoint, once.

One agent reaches the coordinator through a small TCP proxy that the test can pause
(``federation.testing.proxy``): paused, it stops forwarding on open connections (a silent
partition: only missed heartbeats reveal it) and closes new ones at once; healed, it forwards
again. The agent and its task live on
throughout, as they would behind a cut link.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation
from federation.testing.cluster import cpu_site, site_state, until
from federation.testing.proxy import PausableProxy, proxy_to

from .conftest import admin, jobs, python_task, spec
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-partition")

HEARTBEAT_S = 0.5
MISSED = 3
LOST_AFTER_S = 3.0


# Counts steps, one checkpoint per step, from the restored step on; stops at the file "go".
TASK = """
import os, signal, sys, time
def mark(folder, name, text):  # whole: a test reads a marker the moment it appears
    temporary = os.path.join(os.path.dirname(folder), "." + name)
    open(temporary, "w").write(text)
    os.rename(temporary, os.path.join(folder, name))
markers = sys.argv[1]
tag = os.environ["FEDERATION_SITE"] + "-" + os.environ["FEDERATION_EPOCH"]
def stop(*_):
    open(os.path.join(markers, "stopped-" + tag), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
mark(markers, "start-" + tag, restore)
while not os.path.exists(os.path.join(markers, "go")):
    step += 1
    name = os.path.join(folder, "step-%04d" % step)
    open(name, "w").write(str(step))
    open(name + ".done", "w").close()
    time.sleep(0.2)
mark(markers, "done-" + tag, str(step))
"""


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation(
        tmp_path / "fed",
        [cpu_site("edge-p"), cpu_site("edge-q")],
        coordinator_args=[
            "--heartbeat-interval-s",
            str(HEARTBEAT_S),
            "--missed-heartbeats",
            str(MISSED),
        ],
    )
    try:
        yield federation
    finally:
        federation.stop()


def finished_copies(markers: Path) -> list[str]:
    """SITE-EPOCH of every copy of the task that ran to its end."""
    return sorted(p.name.removeprefix("done-") for p in markers.glob("done-*"))


def read_step(path: str) -> tuple[int, int]:
    """The step a checkpoint file holds, and its size."""
    saved = Path(path)
    return int(saved.read_text()), saved.stat().st_size


class Partition:
    """One job cut off with edge-p behind the proxy, and the checks every rule shares."""

    def __init__(
        self, fed: LocalFederation, proxy: PausableProxy, channel: grpc.aio.Channel, markers: Path
    ) -> None:
        self.fed, self.proxy, self.channel, self.markers = fed, proxy, channel, markers
        self.stub = jobs(channel)
        self.job_id = ""

    async def get(self, *, events: bool = False) -> job_service_pb2.GetJobResponse:
        request = job_service_pb2.GetJobRequest(job_id=self.job_id, include_events=events)
        return await self.stub.GetJob(request)

    async def marker(self, name: str, what: str) -> None:
        """Wait until the marker file ``name`` exists."""

        async def exists() -> bool:
            return (self.markers / name).exists()

        await until(exists, 30, what)

    async def start(self, reconcile: str) -> None:
        """edge-p (behind the proxy) runs the job and has checkpointed; edge-q is up too."""
        await self.fed.start_site(cpu_site("edge-p", coordinator=f"127.0.0.1:{self.proxy.port}"))
        await self.fed.wait_connected(["edge-p"])
        task = python_task(
            "t", TASK, resources={"cpu": 1, "memory_mib": 64}, checkpoint={"interval_s": 0.2}
        )
        task["command"] = [*task["command"], str(self.markers)]  # type: ignore[misc]
        policy = {"lost_after_s": LOST_AFTER_S, "reconcile": reconcile}
        job_spec = spec("cut-off", [task], disconnect=policy)
        reply = await self.stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))
        self.job_id = reply.job.id

        async def checkpointed_at_p() -> bool:
            current = (await self.get()).job.tasks[0]
            return current.site == "edge-p" and current.checkpoint.path != ""

        await until(checkpointed_at_p, 30, "a checkpoint recorded at edge-p")
        await self.fed.start_site(cpu_site("edge-q"))
        await self.fed.wait_connected(["edge-q"])

    async def cut(self) -> tuple[float, float, jobs_pb2.JobEvent, jobs_pb2.TaskStatus]:
        """Pause the proxy until the task runs at edge-q from edge-p's last checkpoint.

        Returns the seconds until edge-p was UNREACHABLE and until the task ran at edge-q,
        the move's event and the moved task.
        """
        self.proxy.pause()
        cut_at = time.monotonic()

        async def p_unreachable() -> bool:
            site = await site_state(self.channel, "edge-p")
            return site.state == admin_service_pb2.SITE_STATE_UNREACHABLE

        detected_at = await until(p_unreachable, 15, "edge-p to become UNREACHABLE")

        async def running_at_q() -> bool:
            current = (await self.get()).job.tasks[0]
            return current.site == "edge-q" and current.state == jobs_pb2.JOB_STATE_RUNNING

        moved_at = await until(running_at_q, 30, "the task to run at edge-q")
        status = await admin(self.channel).GetFederationStatus(
            admin_service_pb2.GetFederationStatusRequest()
        )
        p_site = await site_state(self.channel, "edge-p")
        assert p_site.unreachable_s >= LOST_AFTER_S
        assert not status.rescheduling_paused  # one of two sites lost is not a partition
        reply = await self.get(events=True)
        (move,) = [e for e in reply.events if e.moved_from]
        assert (move.moved_from, move.state) == ("edge-p", jobs_pb2.JOB_STATE_PENDING)
        assert "site edge-p unreachable for" in move.reason
        moved = reply.job.tasks[0]
        assert moved.moves == 1
        assert (moved.displaced.site, moved.displaced.epoch) == ("edge-p", 1)
        restored_from = move.reason.rsplit("from checkpoint ", 1)[1]
        await self.marker(f"start-edge-q-{moved.epoch}", "the replacement to start")
        assert (self.markers / f"start-edge-q-{moved.epoch}").read_text() == restored_from
        assert Path(restored_from).parent.parts[-4:-1] == (self.job_id, "t", "1")
        step, size = read_step(restored_from)
        assert step >= 1
        assert moved.estimate.transfer_bytes == size
        return detected_at - cut_at, moved_at - cut_at, move, moved

    async def heal_and_finish(self, stopped: str) -> job_service_pb2.GetJobResponse:
        """Heal; once the copy ``stopped`` (SITE-EPOCH) was stopped, let the job finish."""
        self.proxy.heal()
        await self.fed.wait_connected(["edge-p"])
        await self.marker(f"stopped-{stopped}", f"the copy {stopped} to be stopped")
        (self.markers / "go").touch()

        async def finished() -> bool:
            return (await self.get()).job.state == jobs_pb2.JOB_STATE_SUCCEEDED

        await until(finished, 30, "the job to succeed")
        return await self.get(events=True)


@contextlib.asynccontextmanager
async def partition(fed: LocalFederation, markers: Path) -> AsyncIterator[Partition]:
    await fed.start_coordinator()
    async with proxy_to(fed.port) as proxy, fed.operator().channel() as channel:
        yield Partition(fed, proxy, channel, markers)


async def test_partitioned_site_loses_its_task_to_another_from_its_checkpoint(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """A task cut off past lost_after restarts elsewhere from its checkpoint; its stale copy
    is stopped on healing, its result never accepted, and the job finishes exactly once."""
    async with partition(fed, tmp_path) as cut:
        await cut.start("keep_replacement")
        detection_s, elsewhere_s, move, moved = await cut.cut()
        done = await cut.heal_and_finish(stopped="edge-p-1")
    final = done.job.tasks[0]
    assert (final.site, final.epoch) == ("edge-q", moved.epoch)
    assert finished_copies(tmp_path) == [f"edge-q-{moved.epoch}"]
    ends = [e for e in done.events if e.state == jobs_pb2.JOB_STATE_SUCCEEDED]
    assert [(e.site, e.task) for e in ends] == [("edge-q", "t")]
    after_move = [e for e in done.events if e.sequence > move.sequence]
    assert all(e.site != "edge-p" for e in after_move), after_move
    shown = fedctl(fed, "jobs", "get", cut.job_id)
    assert shown.returncode == 0, shown.stderr
    assert f"checkpoint: {final.checkpoint.path} " in shown.stdout
    assert "moves (1):" in shown.stdout
    assert "moved from edge-p: site edge-p unreachable for" in shown.stdout
    print(f"\nlost-site detection {detection_s:.2f}s, running elsewhere after {elsewhere_s:.2f}s")
    assert detection_s < MISSED * HEARTBEAT_S + 2.0
    assert elsewhere_s < detection_s + LOST_AFTER_S + 10.0


async def test_keep_original_takes_the_returning_copy_back(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """With reconcile keep_original the copy that comes back runs on and finishes the job; the
    replacement is stopped and its result never accepted."""
    async with partition(fed, tmp_path) as cut:
        await cut.start("keep_original")
        _, _, move, moved = await cut.cut()
        done = await cut.heal_and_finish(stopped=f"edge-q-{moved.epoch}")
    final = done.job.tasks[0]
    assert (final.site, final.epoch, final.issued_epoch) == ("edge-p", 1, moved.epoch)
    assert finished_copies(tmp_path) == ["edge-p-1"]
    after_move = [e for e in done.events if e.sequence > move.sequence]
    back = [e for e in after_move if e.moved_from == "edge-q"]
    assert [e.state for e in back] == [jobs_pb2.JOB_STATE_PENDING]
    assert "keep_original keeps it" in back[0].reason
    ends = [e for e in done.events if e.state == jobs_pb2.JOB_STATE_SUCCEEDED]
    assert [e.site for e in ends] == ["edge-p"]


async def test_stopped_sites_are_disconnected_and_crashed_ones_unreachable(
    fed: LocalFederation,
) -> None:
    """SIGTERM says goodbye (DISCONNECTED); SIGKILL does not (UNREACHABLE, timed), and with no
    site left reachable the coordinator suspects a partition and says so in fedctl status."""
    await fed.start()
    fed.terminate("edge-q")
    fed.kill("edge-p")
    async with fed.operator().channel() as channel:

        async def both_gone() -> bool:
            reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
            return all(s.state != admin_service_pb2.SITE_STATE_CONNECTED for s in reply.sites)

        await until(both_gone, 15, "both sessions to end")

        async def paused() -> bool:
            status = await admin(channel).GetFederationStatus(
                admin_service_pb2.GetFederationStatusRequest()
            )
            return status.rescheduling_paused

        await until(paused, 15, "the partition suspicion")
        q = await site_state(channel, "edge-q")
        p = await site_state(channel, "edge-p")
    assert q.state == admin_service_pb2.SITE_STATE_DISCONNECTED
    assert q.unreachable_s == 0
    assert p.state == admin_service_pb2.SITE_STATE_UNREACHABLE
    assert p.unreachable_s > 0
    table = fedctl(fed, "status")
    assert table.returncode == 0, table.stderr
    assert "unreachable for" in table.stdout
    assert "rescheduling paused: 1 of 1 sites are unreachable (edge-p)" in table.stdout
