"""Every filter that rejects a site, each with its reason code: what ``jobs explain`` lists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.framework import (
    REASON_CODES,
    Code,
    Framework,
    LazyReasons,
    Rejection,
    Verdict,
)
from federation.placement.plugins.capacity_fit import CapacityFit
from federation.placement.plugins.constraints import Constraints
from federation.placement.plugins.site_state import SiteState
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

from .builders import CLOUD, DATACENTER, EDGE, GPU, NPU, device, node, request, site, snapshot

SCHEDULING = Path(__file__).resolve().parents[2] / "docs" / "scheduling.md"


class Coded:
    """Rejects the named sites with a code of its own."""

    name: ClassVar[str] = "Coded"

    def __init__(self, sites: set[str], code: str) -> None:
        self.sites, self.code_ = sites, code

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        mask = np.array([s not in self.sites for s in snap.site_ids], dtype=bool)
        return Verdict(mask=mask, default_reason=f"no {self.code_}", default_code=self.code_)


class CodedToo(Coded):
    name: ClassVar[str] = "CodedToo"


def every(decision_rejections: object) -> list[tuple[str, str, str]]:
    return [(r.site, r.plugin, r.code) for r in decision_rejections]  # type: ignore[attr-defined]


def test_a_site_rejected_by_two_filters_lists_both_with_their_codes() -> None:
    """The first rejection per site stays as it was; ``every_rejection`` holds both."""
    snap = snapshot(site("a", node()), site("b", node()), site("c", node()))
    framework = Framework([Coded({"a"}, "FIRST"), CodedToo({"a", "b"}, "SECOND")], [])
    decision = framework.place(request(cpu=1), snap)
    assert decision.ranked == ("c",)
    assert decision.rejections == (
        Rejection("a", "Coded", "no FIRST", "FIRST"),
        Rejection("b", "CodedToo", "no SECOND", "SECOND"),
    )
    assert decision.every_rejection == (
        Rejection("a", "Coded", "no FIRST", "FIRST"),
        Rejection("a", "CodedToo", "no SECOND", "SECOND"),
        Rejection("b", "CodedToo", "no SECOND", "SECOND"),
    )


def test_default_profile_lists_every_filter_that_rejects_a_site() -> None:
    """A cordoned edge site with NPUs, for a datacenter job wanting a GPU: three filters, three
    codes, in profile order; the GPU site in the datacenter passes."""
    snap = snapshot(
        site("edge", node(devices=[device(NPU, vendor="huawei")]), domain=EDGE, cordoned=True),
        site("dc", node(devices=[device(GPU)]), domain=DATACENTER),
    )
    decision = build_framework().place(
        request(cpu=1, kind=GPU, count=1, domains=[DATACENTER]), snap
    )
    assert decision.ranked == ("dc",)
    assert every(decision.every_rejection) == [
        ("edge", "SiteState", Code.SITE_CORDONED),
        ("edge", "Constraints", Code.DOMAIN_NOT_ALLOWED),
        ("edge", "CapacityFit", Code.NO_DEVICE_OF_MODEL),
    ]
    assert every(decision.rejections) == [("edge", "SiteState", Code.SITE_CORDONED)]


def test_site_state_gives_both_codes_to_a_cordoned_disconnected_site() -> None:
    snap = snapshot(site("a", node(), connected=False, cordoned=True))
    verdict = SiteState().filter(request(cpu=1), snap)
    assert verdict.why(0) == [
        (Code.SITE_CORDONED, "site is cordoned"),
        (Code.SITE_UNREACHABLE, "site agent is not connected"),
    ]
    assert verdict.code(0) == Code.SITE_CORDONED  # the first, as the job record keeps it


def test_constraints_give_a_code_for_every_rule_a_site_breaks() -> None:
    snap = snapshot(site("dc", node(), domain=DATACENTER, region="eu-west"))
    verdict = Constraints().filter(
        request(domains=[EDGE, CLOUD], regions=["us-east"], sites=["x"]), snap
    )
    assert [code for code, _ in verdict.why(0)] == [
        Code.DOMAIN_NOT_ALLOWED,
        Code.REGION_NOT_ALLOWED,
        Code.SITE_NOT_ALLOWED,
    ]
    assert "site is datacenter" in verdict.why(0)[0][1]


A100_40 = device(GPU, model="A100", memory_mib=40960)


@pytest.mark.parametrize(
    ("nodes", "req", "code"),
    [
        pytest.param([], request(cpu=1), Code.NO_NODES, id="no-nodes"),
        pytest.param(
            [node(devices=[A100_40])],
            request(kind=GPU, count=1, models=["H100"]),
            Code.NO_DEVICE_OF_MODEL,
            id="no-model",
        ),
        pytest.param(
            [node(devices=[A100_40])],
            request(kind=GPU, count=1, models=["A100"], min_memory_mib=81920),
            Code.INSUFFICIENT_DEVICE_MEMORY,
            id="memory",
        ),
        pytest.param(
            [node(devices=[A100_40])],
            dataclasses.replace(request(kind=GPU, count=1), selector="device.model == 'H100'"),
            Code.DEVICE_SELECTOR_UNMATCHED,
            id="selector",
        ),
        pytest.param(
            [node(devices=[A100_40], labels={"zone": "a"})],
            request(kind=GPU, count=1, node_labels={"zone": "b"}),
            Code.NODE_LABELS_UNMATCHED,
            id="labels",
        ),
        pytest.param(
            [node(devices=[device(GPU, model="A100", allocated=True)])],
            request(kind=GPU, count=1),
            Code.INSUFFICIENT_FREE_CAPACITY,
            id="devices-busy",
        ),
        pytest.param(
            [node(cpu=2)], request(cpu=4), Code.INSUFFICIENT_FREE_CAPACITY, id="cpu-short"
        ),
    ],
)
def test_capacity_fit_code_names_the_most_basic_lack(
    nodes: list[resources_pb2.Node], req: Request, code: Code
) -> None:
    snap = snapshot(site("s", *nodes))
    verdict = CapacityFit().filter(req, snap)
    assert not verdict.mask[0]
    assert verdict.code(0) == code
    assert verdict.why(0) == [(code, verdict.reason(0))]


def test_capacity_fit_code_for_room_only_on_incompatible_nodes() -> None:
    """Room exists, but only on a node whose driver misses the requirement."""
    snap = snapshot(site("s", node(devices=[device(GPU)], labels={"driver": "470.82"})))
    task = jobs_pb2.TaskSpec(
        name="t",
        command=["x"],
        requires={"cuda": ">=12.1"},
        resources=jobs_pb2.ResourceRequest(
            accelerator=jobs_pb2.AcceleratorRequest(kind=GPU, count=1)
        ),
    )
    req = Request.from_spec(jobs_pb2.JobSpec(name="j", tasks=[task]), task)
    verdict = CapacityFit().filter(req, snap)
    assert verdict.code(0) == Code.REQUIREMENTS_UNMET


def test_every_rejection_is_built_only_when_read() -> None:
    """Scheduling reads only the ranking: no reason or code is written for it."""
    calls: list[int] = []

    def why(site: int) -> str:
        calls.append(site)
        return "why"

    class Counted:
        name: ClassVar[str] = "Counted"

        def filter(self, req: Request, snap: Snapshot) -> Verdict:
            mask = np.zeros(snap.n_sites, dtype=bool)
            failing = np.flatnonzero(~mask)
            return Verdict(
                mask=mask,
                reasons=LazyReasons(failing, why),
                codes=LazyReasons(failing, lambda i: "CODE"),
            )

    decision = Framework([Counted(), Counted()], []).place(
        request(cpu=1), snapshot(site("a", node()))
    )
    assert decision.ranked == ()
    assert calls == []
    assert len(decision.every_rejection) == 2
    assert calls == [0, 0]


def test_every_code_is_documented_in_the_table_and_the_readme() -> None:
    assert set(REASON_CODES) == set(Code)
    assert all(filters and meaning for filters, meaning in REASON_CODES.values())
    readme = SCHEDULING.read_text()
    assert {c.value for c in Code} <= set(re.findall(r"`([A-Z_]+)`", readme))
