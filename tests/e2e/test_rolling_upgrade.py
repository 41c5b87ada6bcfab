"""A rolling upgrade of an HA group, as the README's "Upgrades" describes it.

Two coordinators on one etcd whose store an earlier release wrote (key layout 1, more jobs
than one etcd transaction can rewrite), and an agent running a job throughout: the follower is
restarted, the leader stops so the restarted one takes over, then the old leader is restarted.
The first coordinator to lead migrates the store. The job succeeds, having run once, and
every earlier job is found.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator.test_layout import write_layout_1

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.coordinator.layout import CURRENT, LAYOUT_KEY
from federation.local import LocalFederation
from federation.store.etcd import EtcdStore
from federation.testing.cluster import (
    etcd_coordinator_args,
    federation_status,
    leader_name,
    submit,
    until,
)
from federation.testing.etcd import LocalEtcd, etcd_binary

from .conftest import SITES, etcd_prefix, jobs, python_task, read_marker, spec, wait_for_job

pytestmark = [
    pytest.mark.xdist_group("ha"),
    pytest.mark.skipif(
        etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"
    ),
]

LEASE_S = 2.0
OLD_JOBS = 140


@pytest.fixture
def prefix() -> str:
    return etcd_prefix()


@pytest.fixture
def fed(tmp_path: Path, shared_etcd: LocalEtcd, prefix: str) -> Iterator[LocalFederation]:
    federation = LocalFederation(
        tmp_path / "fed",
        SITES[:1],
        coordinator_args=etcd_coordinator_args(shared_etcd.endpoint, prefix, LEASE_S),
    )
    try:
        yield federation
    finally:
        federation.stop()


async def restart(fed: LocalFederation, name: str) -> None:
    """Stop a coordinator and start it again on its ports (as a new release would be)."""
    port, join_port = fed.coordinators[name]
    assert fed.terminate(name)
    await fed.start_coordinator(name=name, port=port, join_port=join_port)


async def test_rolling_upgrade_of_an_ha_group_loses_nothing(
    fed: LocalFederation, shared_etcd: LocalEtcd, prefix: str, tmp_path: Path
) -> None:
    store = await EtcdStore.open([shared_etcd.endpoint], prefix=prefix)
    try:
        written = await write_layout_1(store, OLD_JOBS)
    finally:
        await store.close()
    for name in ("coord-a", "coord-b"):
        await fed.start_coordinator(name=name)
    await fed.start_site(SITES[0])
    await fed.wait_connected()

    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'a').write('run\\n'); import time; time.sleep(8)"
    task = python_task("t", code, resources={"cpu": 1, "memory_mib": 64})
    job_id = await submit(fed, spec("rolling", [task], id="rolling"))
    async with fed.operator().channel() as channel:
        await wait_for_job(channel, job_id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))

    leader = await leader_name(fed)
    follower = next(name for name in fed.coordinators if name != leader)
    await restart(fed, follower)  # 1. each follower, one at a time
    assert await leader_name(fed) == leader
    assert fed.terminate(leader)  # 2. the leader last: it gives its lease back
    await until(lambda: _leads(fed, follower), LEASE_S + 10, "the upgraded follower to lead")
    port, join_port = fed.coordinators[leader]
    await fed.start_coordinator(name=leader, port=port, join_port=join_port)  # 3. rejoins

    async with fed.operator().at(fed.address_of(follower)).channel() as channel:
        now = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
        assert now.job.state == jobs_pb2.JOB_STATE_RUNNING  # it ran through every step
        done = await wait_for_job(channel, job_id, timeout_s=60)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
        stub = jobs(channel)
        for old_id, events in written.items():
            old = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=old_id))).job
            assert old.id == old_id
            if len(events) > 1:  # finished before: as it was (the others were scheduled)
                assert old.tasks[0].state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert read_marker(marker) == ["run"]  # ran once, through every step
    status = await federation_status(fed)
    assert status.leader == fed.address_of(follower)
    assert sorted(c.address for c in status.coordinators) == sorted(
        fed.address_of(name) for name in fed.coordinators
    )
    store = await EtcdStore.open([shared_etcd.endpoint], prefix=prefix)
    try:
        layout = await store.get(LAYOUT_KEY)
    finally:
        await store.close()
    assert layout is not None
    assert layout.value == str(CURRENT).encode()


async def _leads(fed: LocalFederation, name: str) -> bool:
    try:
        return (await federation_status(fed)).leader == fed.address_of(name)
    except Exception:
        return False
