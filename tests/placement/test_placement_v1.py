"""Placement v1 plugins: shares and partitions, selectors, interconnect, compatibility,
and completion time over measured links."""

from __future__ import annotations

import numpy as np
import pytest

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.compat import load_table_files
from federation.placement.estimates import estimate
from federation.placement.plugins.capacity_fit import CapacityFit
from federation.placement.plugins.compatibility import Compatibility
from federation.placement.plugins.cost import CostCap
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.selectors import SelectorError, check_selector
from federation.placement.snapshot import SiteInput, build_snapshot

GPU = resources_pb2.DEVICE_KIND_GPU
NPU = resources_pb2.DEVICE_KIND_NPU


def dev(model: str = "A100-80GB", **fields: object) -> resources_pb2.Device:
    base: dict[str, object] = {
        "kind": GPU,
        "vendor": "nvidia",
        "model": model,
        "memory_total_mib": 81920,
        "health": 1,
    }
    return resources_pb2.Device(**{**base, **fields})  # type: ignore[arg-type]


def site(
    name: str, *devices: resources_pb2.Device, labels: dict[str, str] | None = None, **view: object
) -> SiteInput:
    node = resources_pb2.Node(
        name=f"{name}-n",
        cpu_free=64,
        memory_free_mib=1 << 20,
        schedulable=True,
        devices=devices,
        labels=labels or {},
    )
    return SiteInput(resources_pb2.SiteView(site=name, nodes=[node], **view), True, False)


def req(accelerator: dict[str, object] | None = None, **task: object) -> Request:
    spec = jobs_pb2.TaskSpec(name="t", command=["x"], **task)  # type: ignore[arg-type]
    if accelerator:
        spec.resources.accelerator.CopyFrom(jobs_pb2.AcceleratorRequest(**accelerator))  # type: ignore[arg-type]
    return Request.from_spec(jobs_pb2.JobSpec(name="j", tasks=[spec]), spec)


def feasible(request: Request, *sites: SiteInput) -> list[str]:
    return list(build_framework().place(request, build_snapshot(list(sites))).ranked)


def test_fraction_fits_only_shareable_devices_with_room() -> None:
    """A 0.5 share fits a shareable device with half free, not a whole-only one."""
    shared = site("shared", dev(shareable=True, free_fraction=0.5))
    whole = site("whole", dev())
    full = site("full", dev(shareable=True, free_fraction=0.25))
    assert feasible(req({"kind": GPU, "fraction": 0.5}), shared, whole, full) == ["shared"]


def test_partition_profile_must_be_free() -> None:
    """A MIG profile request fits where that profile has a free slot."""
    mig = [resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=2)]
    used = [resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=0)]
    a = site("a", dev(partitions=mig))
    b = site("b", dev(partitions=used))
    request = req({"kind": GPU, "partition": "1g.10gb"}, replicas=2)
    assert feasible(request, a, b) == ["a"]
    assert feasible(req({"kind": GPU, "partition": "1g.10gb"}, replicas=3), a, b) == []


def test_selector_is_evaluated_per_class() -> None:
    """A CEL selector keeps only devices whose attributes satisfy it."""
    npu = site("npu", dev("Ascend-910B", kind=NPU, vendor="huawei", memory_total_mib=65536))
    small = site("small", dev("Ascend-310P", kind=NPU, vendor="huawei", memory_total_mib=24576))
    request = req(
        {
            "kind": NPU,
            "count": 1,
            "selector": 'device.vendor == "huawei" && device.memory_gib >= 32',
        }
    )
    assert feasible(request, npu, small) == ["npu"]


def test_same_interconnect_keeps_a_replica_in_one_group() -> None:
    """Four GPUs split 2+2 across NVLink domains cannot hold a 4-GPU same-group replica."""
    split = site("split", *[dev(interconnect_group=f"nvl-{i // 2}") for i in range(4)])
    joined = site("joined", *[dev(interconnect_group="nvl-0") for _ in range(4)])
    request = req({"kind": GPU, "count": 4, "same_interconnect": True})
    assert feasible(request, split, joined) == ["joined"]
    assert sorted(feasible(req({"kind": GPU, "count": 4}), split, joined)) == ["joined", "split"]


@pytest.mark.parametrize(
    ("requires", "labels", "reason"),
    [
        (
            {"cuda": ">=12.1"},
            {"driver": "470.82"},
            "needs cuda>=12.1, node driver 470.82 supports cuda 11.4",
        ),
        ({"torch": "2.4.*"}, {"driver": "470.82"}, "torch 2.4.1 needs cuda>=11.8"),
        ({"arch": "x86_64"}, {"arch": "aarch64"}, "needs arch x86_64, node is aarch64"),
        ({"cann": ">=8.0"}, {"cann": "7.0.1"}, "needs cann>=8.0, node has cann 7.0.1"),
    ],
)
def test_compatibility_rejects_with_the_reason(
    requires: dict[str, str], labels: dict[str, str], reason: str
) -> None:
    """A node that cannot run the task's software is rejected and told why."""
    snap = build_snapshot(
        [
            site("old", labels=labels),
            site("new", labels={"driver": "550.54", "arch": "x86_64", "cann": "8.0.0"}),
        ]
    )
    verdict = Compatibility(load_table_files()).filter(req(requires=requires), snap)
    assert verdict.mask.tolist() == [True, False]  # sites sort by name: new, old
    assert reason in verdict.reasons[1]


def test_newer_driver_runs_older_cuda() -> None:
    """cuda==11.8 runs on a driver whose newest CUDA is 12.4."""
    snap = build_snapshot([site("s", labels={"driver": "550.54"})])
    assert Compatibility().filter(req(requires={"cuda": "==11.8"}), snap).mask.tolist() == [True]


def links(*pairs: tuple[str, float]) -> list[resources_pb2.Link]:
    return [resources_pb2.Link(peer_site=p, bandwidth_mbps=bw, rtt_ms=10) for p, bw in pairs]


def test_completion_time_weighs_transfer_against_speed() -> None:
    """Data stays put on a thin link and moves to the faster site over a fat one."""
    two_tb = 2 * 10**12
    for bandwidth, winner in ((100.0, "data"), (100_000.0, "fast")):
        data = site(
            "data", dev("V100"), datasets={"imagenet": two_tb}, links=links(("fast", bandwidth))
        )
        fast = site("fast", dev("H100-80GB"), links=links(("data", bandwidth)))
        request = req(
            {"kind": GPU, "count": 1},
            estimated_duration_s=36_000,
            inputs=[jobs_pb2.DataInput(dataset="imagenet")],
        )
        assert feasible(request, data, fast)[0] == winner, bandwidth


def test_estimate_breaks_down_by_term() -> None:
    """Queue, transfer and run add up; transfer uses the measured link and is zero at home."""
    data = site(
        "data",
        dev("A100-80GB"),
        datasets={"d": 10**9},
        links=links(("far", 800.0)),
        queue=resources_pb2.QueueState(estimated_wait_s=30),
    )
    far = site("far", dev("H100-80GB"))
    snap = build_snapshot([data, far])
    est = estimate(
        req(
            {"kind": GPU, "count": 1},
            estimated_duration_s=1000,
            inputs=[jobs_pb2.DataInput(dataset="d")],
        ),
        snap,
    )
    assert est.transfer_s[0] == 0.0
    assert est.transfer_s[1] == pytest.approx(10**9 * 8 / 800e6 + 0.01)
    assert est.run_s.tolist() == pytest.approx([1000.0, 400.0])  # H100 2.5x A100 for training
    assert est.total_s[0] == pytest.approx(1030.0)
    assert not est.unknown_links.any()


def test_unknown_link_is_assumed_and_flagged() -> None:
    """With no link measured between two sites, the default bandwidth is used and flagged."""
    snap = build_snapshot([site("a", datasets={"d": 10**9}), site("b")])
    est = estimate(req(inputs=[jobs_pb2.DataInput(dataset="d")]), snap)
    assert est.unknown_links.tolist() == [False, True]
    assert np.isfinite(est.transfer_s).all()


def test_cost_cap_rejects_expensive_sites() -> None:
    """A job's max cost keeps it off a cloud site whose price makes it too expensive."""
    cloud = site("cloud", dev(), price_per_device_hour=4.0)
    onprem = site("onprem", dev())
    request = Request.from_spec(
        jobs_pb2.JobSpec(name="j", objective=jobs_pb2.Objective(max_cost_usd=1.0)),
        jobs_pb2.TaskSpec(
            name="t",
            estimated_duration_s=3600,
            resources=jobs_pb2.ResourceRequest(
                accelerator=jobs_pb2.AcceleratorRequest(kind=GPU, count=1)
            ),
        ),
    )
    verdict = CostCap().filter(request, build_snapshot([cloud, onprem]))
    assert verdict.mask.tolist() == [False, True]
    assert "$4.00 exceeds the job's $1.00" in verdict.reasons[0]


def test_capacity_reason_names_shares() -> None:
    """A share that fits nowhere is described as a share in the rejection."""
    snap = build_snapshot([site("s", dev())])
    verdict = CapacityFit().filter(req({"kind": GPU, "fraction": 0.25}), snap)
    assert "0.25 of a shareable GPU" in verdict.reasons[0]


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("device.vendor == ", "expected a value"),
        ("device.colour == 'red'", "unknown attribute device.colour"),
        ("device.memory_gib", "must be true or false"),
    ],
)
def test_bad_selectors_are_refused(source: str, problem: str) -> None:
    """Unparsable selectors, unknown attributes and non-boolean ones are errors."""
    with pytest.raises(SelectorError, match=problem):
        check_selector(source)


def test_attribute_lookups_are_allowed() -> None:
    """A selector reading a device attribute by key is valid even if the sample lacks it."""
    check_selector('"cuda" in device.attributes && device.attributes["cuda"] == "12.4"')
