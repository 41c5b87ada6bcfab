"""Spot capacity taken back, end to end: a cloud site may launch one node of the spot type
a100-spot (2 A100, $8 on demand and $3 spot a node-hour, about 1 s to launch with the
simulated provider, which takes each spot node back 6 s after its launch). A checkpointed job
runs there; its node is taken back mid-run: the site's view shows the node lost (launchable
again), the task is reported interrupted (capacity lost: placed again, no attempt counted,
though it has a single one), the node launches anew, and the task restarts from its newest
checkpoint and succeeds. Its estimate charged the spot price."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, resources_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import admin, jobs, running, spec, until, until_event, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-spot")

A100 = {"kind": "GPU", "vendor": "nvidia", "model": "A100-80GB", "memory_mib": 81920}
LAUNCH_S = 1.0
RECLAIM_AFTER_S = 6.0
PRICE, SPOT_PRICE = 8.0, 3.0
NODE = "a100-spot-0"
LAUNCHABLE = resources_pb2.NodeLaunch.STATE_LAUNCHABLE
RUNNING = resources_pb2.NodeLaunch.STATE_RUNNING

# A checkpoint a step (its step number), every 0.2 s. A fresh run goes on until stopped; a
# restored one writes restored-RUN (the checkpoint it was given and what it read there) and
# ends a few steps on. On SIGTERM it takes a moment to end, as a job saving its state would.
TASK = """
import os, signal, sys, time
markers = sys.argv[1]
run = os.environ["FEDERATION_EPOCH"]
def stop(*_):
    open(os.path.join(markers, "stopped-" + run), "w").close()
    time.sleep(1.0)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
if restore:
    with open(os.path.join(markers, ".restored"), "w") as out:
        out.write(os.path.basename(restore) + " " + str(step))
    os.rename(os.path.join(markers, ".restored"), os.path.join(markers, "restored-" + run))
last = step + 3 if restore else None
while last is None or step < last:
    step += 1
    name = os.path.join(folder, "step-%04d" % step)
    open(name, "w").write(str(step))
    open(name + ".done", "w").close()
    time.sleep(0.2)
print("finished at step", step)
"""


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    cloud = SiteSpec(
        "cloud",
        "cloud",
        node_types=[
            {
                "name": "a100-spot",
                "cpu_cores": 16,
                "memory_mib": 131072,
                "devices": [{**A100, "count": 2}],
                "max": 1,
                "price_per_hour": PRICE,
                "spot_price_per_hour": SPOT_PRICE,
                "spot": True,
                "delay_s": LAUNCH_S,
            }
        ],
        settings={
            "elastic": {
                "provider": "simulated",
                "idle_release_s": 60.0,
                "spot_reclaim_after_s": RECLAIM_AFTER_S,
            }
        },
    )
    with running(tmp_path_factory.mktemp("spot"), [cloud]) as f:
        yield f


def markers(folder: Path, kind: str) -> list[str]:
    """The contents of the task's markers of ``kind``, one a run that wrote one."""
    return [path.read_text() for path in sorted(folder.glob(f"{kind}-*"))]


async def spot_node(channel: grpc.aio.Channel) -> resources_pb2.NodeLaunch:
    reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    (cloud,) = [s for s in reply.sites if s.name == "cloud"]
    (node,) = [n for n in cloud.view.nodes if n.name == NODE]
    return node.launch


async def test_a_spot_node_taken_back_places_its_task_again_from_its_checkpoint(
    fed: LocalFederation, tmp_path: Path
) -> None:
    async with fed.operator().channel() as channel:
        launch = await spot_node(channel)
        assert (launch.state, launch.spot, launch.spot_price_per_hour) == (
            LAUNCHABLE,
            True,
            SPOT_PRICE,
        )
        task = {
            "name": "train",
            "command": [sys.executable, "-c", TASK, str(tmp_path)],
            "estimated_duration_s": 30,
            "resources": {"cpu": 1, "accelerator": {"kind": "GPU", "count": 2}},
            "checkpoint": {"interval_s": 0.2},
            "retry": {"max_attempts": 1},  # a failed run would end the job
        }
        job_id = "spot-ckpt"
        request = job_service_pb2.SubmitJobRequest(spec=spec(job_id, [task], id=job_id))
        await jobs(channel).SubmitJob(request)

        async def first_run_checkpointed() -> bool:
            reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
            (status,) = reply.job.tasks
            return status.state == jobs_pb2.JOB_STATE_RUNNING and bool(status.checkpoint.path)

        await until(first_run_checkpointed, "the first run running with a checkpoint")
        assert (await spot_node(channel)).state == RUNNING

        # The cloud takes the node back: the site's view shows it lost, launchable again,
        # while the task on it is still being stopped (it takes a second to end).
        async def lost() -> bool:
            return (await spot_node(channel)).state == LAUNCHABLE

        await until(lost, "the site's view showing the spot node lost", timeout_s=30)
        interrupted = await until_event(
            channel,
            job_id,
            lambda e: "taken back by its provider" in e.reason,
            "the task placed again after its node was taken back",
        )
        (event,) = [e for e in interrupted.events if "taken back by its provider" in e.reason]
        assert event.state == jobs_pb2.JOB_STATE_PENDING
        assert event.reason.startswith(
            f"stopped by cloud: node {NODE} was taken back by its provider: spot capacity "
            f"reclaimed (simulated, {RECLAIM_AFTER_S:g}s after launch); placing it again from "
            "checkpoint "
        ), event.reason
        placed_from = event.reason.rsplit("from checkpoint ", 1)[1]

        job = await wait_for_job(channel, job_id, timeout_s=60)
        assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.reason
        (status,) = job.tasks
        assert status.failed_attempts == 0  # capacity lost is no failure of the task
        assert status.epoch >= 2
        assert status.nodes == [NODE]  # launched again
        # The restart read the newest checkpoint the coordinator had when it placed it again.
        (restored,) = markers(tmp_path, "restored")
        name, step = restored.split()
        assert name == Path(placed_from).name
        assert int(step) == int(name.removeprefix("step-")) > 0
        print(f"taken back: {event.reason}; the restart read {name}: step {step}")
        assert len(markers(tmp_path, "stopped")) == 1  # the first run, by the reclaim
        assert f"finished at step {int(step) + 3}" in status.output_tail
        # Charged the spot price from launch to the end of the run.
        estimate = status.estimate
        assert estimate.cost_usd == pytest.approx(
            SPOT_PRICE * (estimate.provision_s + estimate.run_s) / 3600
        )
