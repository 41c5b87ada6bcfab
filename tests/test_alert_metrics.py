"""The metrics the alert rules (deploy/prometheus/alerts.yaml) need beyond the others:
who leads, how long store commits take, and how many jobs each queue has waiting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpc_health.v1.health import aio as health_aio
from prometheus_client import REGISTRY

from federation.api.v1 import queues_pb2
from federation.coordinator.ha.leadership import Leadership
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.policy.usage import QueueUsage
from federation.store import Put, SqliteStore


class _Services:
    """What ``Leadership`` calls on a term's services, and nothing else."""

    ended = None

    async def stop(self, **_: Any) -> None:
        return None


async def test_leader_gauge_follows_the_term() -> None:
    leadership = Leadership([health_aio.HealthServicer()], ["x.Service"])
    await leadership.lead(_Services())  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value("federation_coordinator_leader") == 1
    await leadership.follow()
    assert REGISTRY.get_sample_value("federation_coordinator_leader") == 0
    await leadership.lead(_Services())  # type: ignore[arg-type]
    await leadership.stop()
    assert REGISTRY.get_sample_value("federation_coordinator_leader") == 0


async def test_store_commits_are_timed(tmp_path: Path) -> None:
    labels = {"store": "sqlite"}
    before = REGISTRY.get_sample_value("federation_store_commit_seconds_count", labels) or 0
    store = await SqliteStore.open(tmp_path / "db")
    try:
        await store.commit([Put("k", b"v")])
        await store.commit([Put("k", b"w")])
    finally:
        await store.close()
    after = REGISTRY.get_sample_value("federation_store_commit_seconds_count", labels)
    assert after == before + 2


def q(name: str) -> queues_pb2.Queue:
    return queues_pb2.Queue(name=name, tenant="t", weight=1)


def test_queue_waiting_jobs_gauge() -> None:
    book = QueueBook(None)  # type: ignore[arg-type]  # never written: no store needed
    book._queues = {"a": q("a"), "b": q("b")}
    sharing = Sharing(book, QueueUsage())
    sharing.export_gauges({"gpu": 8}, {"a": 3})
    sample = REGISTRY.get_sample_value
    assert sample("federation_queue_waiting_jobs", {"queue": "a"}) == 3
    assert sample("federation_queue_waiting_jobs", {"queue": "b"}) == 0
    book._queues = {"b": q("b")}  # a queue deleted: its series goes
    sharing.export_gauges({"gpu": 8}, {})
    assert sample("federation_queue_waiting_jobs", {"queue": "a"}) is None
