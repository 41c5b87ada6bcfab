"""A gang's rendezvous (ranks by part number then replica, a port per replica from the
base) and when a gang must be stopped to start again together."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.gangs import broken, host_of, rendezvous

RUNNING, PENDING = jobs_pb2.JOB_STATE_RUNNING, jobs_pb2.JOB_STATE_PENDING


def test_ranks_follow_part_numbers_and_replicas() -> None:
    parts = [("train/1", "b", 2), ("train/0", "a", 1), ("train/10", "c", 1)]
    peers, first = rendezvous(parts, {"a": "10.0.0.1", "b": "fd00::2", "c": "10.0.0.3"}, 0)
    assert peers == ["10.0.0.1:29500", "[fd00::2]:29500", "[fd00::2]:29501", "10.0.0.3:29500"]
    assert first == {"train/0": 0, "train/1": 1, "train/10": 3}
    assert rendezvous([("t/0", "a", 1)], {"a": "h"}, 7000)[0] == ["h:7000"]


def test_a_sites_host_is_its_probe_address_else_its_streams() -> None:
    assert host_of("10.0.0.5:7443", "ipv4:10.0.0.9:5123") == "10.0.0.5"
    assert host_of("[fd00::5]:7443", "") == "fd00::5"
    assert host_of("", "ipv4:10.0.0.9:5123") == "10.0.0.9"
    assert host_of("", "ipv6:[fd00::9]:5123") == "fd00::9"


def test_a_part_back_in_pending_stops_the_parts_still_at_sites() -> None:
    def part(name: str, state: int, site: str = "", preempted_by: str = "") -> jobs_pb2.TaskStatus:
        return jobs_pb2.TaskStatus(
            name=name,
            state=state,
            site=site,
            epoch=2,
            preempted_by=preempted_by,  # type: ignore[arg-type]
        )

    back, running = broken(
        [part("t/0", RUNNING, "a"), part("t/1", PENDING), part("t/2", RUNNING, "c")]
    )
    assert back.name == "t/1"
    assert [(r.task, r.site) for r in running] == [("t/0", "a"), ("t/2", "c")]
    # Being stopped already: nothing more to do; all running or all pending: nothing.
    assert broken([part("t/0", RUNNING, "a", "gang"), part("t/1", PENDING)])[1] == []
    assert broken([part("t/0", RUNNING, "a"), part("t/1", RUNNING, "b")])[1] == []
    assert broken([part("t/0", PENDING), part("t/1", PENDING)])[1] == []
