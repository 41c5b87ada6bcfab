"""The site runs a task on devices as fast as the coordinator's estimate assumed, or says how
much slower it will be."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.coordinator.scheduling.task_requests import estimate_proto
from federation.placement.devices import device_speeds
from federation.placement.estimates import estimate
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, build_snapshot

from .cores import node, offer

H100 = device_speeds("training")("H100-80GB", 0.0)
T4 = device_speeds("training")("T4", 0.0)
DURATION_S = 3600.0


def mixed() -> list[resources_pb2.Node]:
    """One slow T4 on "a-t4", first in every tie and the tightest fit, and eight H100s."""
    return [node("a-t4", devices=1, model="T4"), node("b-h100", devices=8, model="H100-80GB")]


def gpu_offer(job_id: str, speed: float) -> site_link_service_pb2.Offer:
    o = offer(job_id, devices=1)
    o.spec.estimated_duration_s = DURATION_S
    o.estimate.device_speed = speed
    o.estimate.run_s = DURATION_S / speed if speed else DURATION_S
    return o


def the_estimate(core: EmbeddedCore, o: site_link_service_pb2.Offer) -> jobs_pb2.Estimate:
    """What the coordinator estimates, and offers with, for a site publishing ``core``'s
    nodes."""
    view = resources_pb2.SiteView(site="site-a", nodes=core.nodes())
    snap = build_snapshot([SiteInput(view=view, is_connected=True, is_cordoned=False)])
    job = jobs_pb2.JobSpec(name="job", tasks=[o.spec])
    return estimate_proto(estimate(Request.from_spec(job, job.tasks[0]), snap), 0)


async def test_the_smallest_case_runs_where_the_estimate_said(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """One GPU task on an idle site of eight H100s and one T4: the coordinator estimates the
    H100's run time, and the site reserves an H100 (best fit alone would take the T4)."""
    core = make_core(mixed())
    o = gpu_offer("smallest", 0.0)
    o.estimate.CopyFrom(the_estimate(core, o))
    assert o.estimate.device_speed == H100
    answer = await core.offer(o)
    assert answer.accepted, answer.reason
    held = {n.name: [d.index for d in n.devices if d.allocated] for n in core.nodes()}
    assert held == {"a-t4": [], "b-h100": [0]}
    assert answer.run_s == pytest.approx(DURATION_S / H100)


async def test_without_a_promise_the_tightest_fit_wins(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """An offer that names no device speed (a CPU estimate, an older coordinator) is packed by
    best fit as before: the lone T4; the answer still says how long it will run there."""
    core = make_core(mixed())
    answer = await core.offer(gpu_offer("no-promise", 0.0))
    assert answer.accepted, answer.reason
    assert [d.allocated for d in core.nodes()[0].devices] == [True]
    assert answer.run_s == pytest.approx(DURATION_S / T4)


async def test_only_slower_devices_left_means_a_slower_answer(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """With every H100 held, the site still takes an offer that assumed H100 speed, on the T4,
    and answers the T4's longer run time for the coordinator to weigh."""
    core = make_core(mixed())
    for i in range(8):
        assert (await core.offer(gpu_offer(f"h100-{i}", H100))).accepted
    answer = await core.offer(gpu_offer("late", H100))
    assert answer.accepted, answer.reason
    assert answer.run_s == pytest.approx(DURATION_S / T4)
