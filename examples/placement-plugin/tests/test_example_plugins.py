"""The example plugins, loaded by name through their entry points as a coordinator loads them."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.registry import DEFAULT_FILTERS, build_framework
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, build_snapshot


def site(name: str, **labels: str) -> SiteInput:
    node = resources_pb2.Node(name="n0", cpu_cores=8, cpu_free=8, schedulable=True, labels=labels)
    view = resources_pb2.SiteView(site=name, nodes=[node])
    return SiteInput(view=view, is_connected=True, is_cordoned=False)


def request() -> Request:
    task = jobs_pb2.TaskSpec(name="t", command=["true"], resources=jobs_pb2.ResourceRequest(cpu=1))
    job = jobs_pb2.JobSpec(name="j", tasks=[task])
    return Request.from_spec(job, task)


def test_avoid_maintenance_rejects_the_site_with_its_code() -> None:
    framework = build_framework((*DEFAULT_FILTERS, "AvoidMaintenance"), {})
    snap = build_snapshot([site("a", maintenance="true"), site("b")])
    decision = framework.place(request(), snap)
    assert decision.ranked == ("b",)
    assert [(r.site, r.plugin, r.code) for r in decision.rejections] == [
        ("a", "AvoidMaintenance", "IN_MAINTENANCE")
    ]


def test_renewable_power_ranks_the_green_site_first() -> None:
    snap = build_snapshot([site("a"), site("b", power="renewable")])
    assert build_framework(DEFAULT_FILTERS, {}).place(request(), snap).ranked == ("a", "b")
    framework = build_framework(DEFAULT_FILTERS, {"RenewablePower": 1.0})
    assert framework.place(request(), snap).ranked == ("b", "a")
