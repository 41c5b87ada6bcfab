"""Predicted waits at the coordinator: a task waits for a busy fast site when, by the
committed estimates of what runs there and of the tasks already waiting for it, it would
finish there sooner than where it can start now."""

from __future__ import annotations

import dataclasses

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.scheduling.waits import (
    MAX_AHEAD,
    Occupant,
    Waiter,
    occupants,
    sooner_by_waiting,
)
from federation.placement.estimates import estimate
from federation.placement.framework import Code
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

from .builders import GPU, device, node, request, site, snapshot

NOW = 1_000_000.0


def _fleet(*, fast_busy: bool = True) -> Snapshot:
    """``fast``: one H100 (speed 2.5 for training), busy; ``slow``: one free V100 (0.38)."""
    return snapshot(
        site("fast", node("n0", devices=[device(model="H100-80GB", allocated=fast_busy)])),
        site("slow", node("n0", devices=[device(model="V100")])),
    )


def _gpu_task(duration_s: float) -> Request:
    return dataclasses.replace(request(kind=GPU, count=1), duration_s=duration_s)


def _held_until(end: float) -> Occupant:
    return Occupant(end, ("n0",), 0.0, 0.0, 1, "H100-80GB")


def _wait(req: Request, snap: Snapshot, held: list[Occupant], ahead: list[Waiter] = []):  # noqa: B006
    decision = build_framework().place(req, snap)
    assert decision.ranked == ("slow",)
    busy = decision.short_of_room().tolist()
    now_s = float(estimate(req, snap).total_s[snap.site_index("slow") or 0])
    return sooner_by_waiting(
        req, snap, busy, now_s, {"fast": held}, {"fast": ahead} if ahead else {}, NOW
    )


def test_the_busy_site_is_short_only_of_room() -> None:
    snap = _fleet()
    decision = build_framework().place(_gpu_task(1000), snap)
    assert [r.code for r in decision.rejections] == [Code.INSUFFICIENT_FREE_CAPACITY]
    assert decision.short_of_room().tolist() == [snap.site_index("fast")]


def test_a_long_task_waits_for_the_fast_site_that_frees_soon() -> None:
    """1,000 s of work: 2,632 s on the V100 now, or a 40 s wait and 400 s on the H100."""
    wait = _wait(_gpu_task(1000), _fleet(), [_held_until(NOW + 40)])
    assert wait is not None
    assert wait.site == "fast"
    assert wait.wait_s == 40.0
    assert abs(wait.finish_s - 440.0) < 1e-6


def test_a_task_starts_now_when_waiting_would_not_pay() -> None:
    """10 s of work (26 s on the V100) does not wait 40 s; nor does a long one wait 2,500 s."""
    assert _wait(_gpu_task(10), _fleet(), [_held_until(NOW + 40)]) is None
    assert _wait(_gpu_task(1000), _fleet(), [_held_until(NOW + 2500)]) is None


def test_a_service_near_a_region_does_not_wait_to_finish_sooner() -> None:
    """Ranked by its RTT to the region, not by when it finishes: it starts where it can now."""
    near = dataclasses.replace(_gpu_task(1000), near_region="eu-west")
    assert _wait(near, _fleet(), [_held_until(NOW + 40)]) is None


def test_tasks_waiting_already_take_what_frees_first() -> None:
    """One task waits for the H100 already: the next one can have it only when that one ends
    (40 + 400 s), which still beats 2,632 s; behind two such, 840 + 400 s does too, but not
    behind five."""
    req = _gpu_task(1000)
    ahead = Waiter(req, 2.5, 400.0)
    wait = _wait(req, _fleet(), [_held_until(NOW + 40)], [ahead])
    assert wait is not None
    assert abs(wait.wait_s - 440.0) < 1e-6
    assert _wait(req, _fleet(), [_held_until(NOW + 40)], [ahead] * 5) is None


def test_a_task_with_no_estimate_holds_its_devices_for_good() -> None:
    assert _wait(_gpu_task(1000), _fleet(), [_held_until(float("inf"))]) is None


def test_an_overrunning_task_is_expected_to_need_a_tenth_of_its_estimate_more() -> None:
    job = jobs_pb2.Job(
        spec=jobs_pb2.JobSpec(
            tasks=[jobs_pb2.TaskSpec(name="t", resources=jobs_pb2.ResourceRequest(cpu=2))]
        )
    )
    task = job.tasks.add(name="t", state=job_state.RUNNING, site="fast", nodes=["n0"])
    task.estimate.run_s = 100.0
    task.started_at.FromSeconds(int(NOW - 500))  # due 400 s ago
    (held,) = occupants([job], NOW)["fast"]
    assert held.end == NOW + 10.0
    assert held.cpu == 2.0
    assert held.nodes == ("n0",)


def test_a_site_with_too_long_a_line_is_not_waited_for() -> None:
    """Past ``MAX_AHEAD`` waiters the site is not weighed (each would replay the whole line),
    even where, with tasks ending every second, the wait would pay."""
    req = _gpu_task(100_000)
    quick = Waiter(_gpu_task(1), 2.5, 0.4)
    held = [_held_until(NOW + 1)]
    assert _wait(req, _fleet(), held, [quick] * MAX_AHEAD) is not None
    assert _wait(req, _fleet(), held, [quick] * (MAX_AHEAD + 1)) is None
