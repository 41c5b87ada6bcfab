"""The cores decide alike, and as the coordinator expects.

* The embedded core accepts an offer exactly when the coordinator's CapacityFit says it fits.
  Each case builds nodes, holds some offers on a core, then asks both sides about one more: the
  coordinator through a snapshot of the core's published view, the core through a real offer.
* Every core gives the same answers to the same offers and commits (``decisions``): the
  embedded core here, the Slurm and Ray cores in their own folders against a real Slurm and a
  real Ray head, each held to the one table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.placement.plugins.capacity_fit import CapacityFit
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, build_snapshot

from .cores import node, offer
from .decisions import CASES as DECISIONS
from .decisions import Case as Decision
from .decisions import play

MIG = {"1g.10gb": 7, "3g.40gb": 2}
CUDA_12 = 'device.attributes["cuda"] >= "12"'


@dataclass(frozen=True)
class Case:
    """Nodes, offers already held, and the request both sides judge."""

    nodes: Callable[[], list[resources_pb2.Node]]
    held: tuple[Mapping[str, object], ...]
    ask: Mapping[str, object]
    fits: bool


def shareable(count: int = 1, **extra: object) -> Callable[[], list[resources_pb2.Node]]:
    """Builds one node of ``count`` shareable GPUs."""
    return lambda: [node("n", devices=count, shareable=True, **extra)]  # type: ignore[arg-type]


def cut(partitions: dict[str, int] = MIG) -> Callable[[], list[resources_pb2.Node]]:
    """Builds one node of one shareable GPU that can be cut into ``partitions``."""
    return lambda: [node("n", devices=1, shareable=True, partitions=partitions)]


def two_cuda_versions() -> list[resources_pb2.Node]:
    """One node whose GPU 0 has CUDA 11.8 and GPU 1 CUDA 12.4."""
    box = node("n", devices=2)
    box.devices[0].attributes["cuda"] = "11.8"
    box.devices[1].attributes["cuda"] = "12.4"
    return [box]


def grouped(groups: list[str], unhealthy: tuple[int, ...] = ()) -> list[resources_pb2.Node]:
    """One node with a GPU per entry of ``groups``, its interconnect group."""
    box = node("n", devices=len(groups))
    for device, group in zip(box.devices, groups, strict=True):
        device.interconnect_group = group
        if device.index in unhealthy:
            device.health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
    return [box]


def two_nodes(**extra: object) -> Callable[[], list[resources_pb2.Node]]:
    """Builds nodes a and b alike."""
    return lambda: [node(name, **extra) for name in ("a", "b")]  # type: ignore[arg-type]


HALF_MEMORY = {"fraction": 0.25, "share_memory_mib": 40960}
NEW_CUDA = {"cuda": ">=12.1"}
NEW_CUDA_ASK = {"requires": NEW_CUDA}
TORCH = {"torch": "2.4.1"}


def cuda_and_plain() -> list[resources_pb2.Node]:
    """Node ``b`` has CUDA 12.4, torch 2.4.1 and x86_64; node ``a``, first in every tie,
    declares none of them."""
    return [
        node("a", devices=1),
        node("b", devices=1, labels={"cuda": "12.4", **TORCH}, arch="x86_64"),
    ]


CASES = {
    "half of a fresh shareable GPU": Case(shareable(), (), {"fraction": 0.5}, True),
    "a third half": Case(shareable(), ({"fraction": 0.5},) * 2, {"fraction": 0.5}, False),
    "0.2 after four 0.2": Case(
        shareable(), ({"fraction": 0.2, "replicas": 4},), {"fraction": 0.2}, True
    ),
    "two halves in one gang": Case(shareable(), (), {"fraction": 0.5, "replicas": 2}, True),
    "three halves in one gang": Case(shareable(), (), {"fraction": 0.5, "replicas": 3}, False),
    "a second half of the memory": Case(
        shareable(), ({"fraction": 0.25, "share_memory_mib": 40960},), HALF_MEMORY, True
    ),
    "a third half of the memory, fraction left": Case(
        shareable(), ({"fraction": 0.25, "share_memory_mib": 40960},) * 2, HALF_MEMORY, False
    ),
    "memory shares over two GPUs": Case(
        shareable(2), ({"fraction": 0.25, "share_memory_mib": 40960},) * 2, HALF_MEMORY, True
    ),
    "a share of a plain GPU": Case(lambda: [node("n", devices=1)], (), {"fraction": 0.5}, False),
    "a share of a GPU given whole": Case(shareable(), ({"devices": 1},), {"fraction": 0.1}, False),
    "a share of a cut GPU": Case(cut(), ({"partition": "1g.10gb"},), {"fraction": 0.1}, False),
    "a slot of a shared GPU": Case(cut(), ({"fraction": 0.1},), {"partition": "1g.10gb"}, False),
    "a slot of a GPU given whole": Case(cut(), ({"devices": 1},), {"partition": "1g.10gb"}, False),
    "the 7th slot": Case(
        cut(), ({"partition": "1g.10gb", "replicas": 6},), {"partition": "1g.10gb"}, True
    ),
    "an 8th slot": Case(
        cut(), ({"partition": "1g.10gb", "replicas": 7},), {"partition": "1g.10gb"}, False
    ),
    "3g after a 1g": Case(cut(), ({"partition": "1g.10gb"},), {"partition": "3g.40gb"}, True),
    "3g after 1g and 3g": Case(
        cut(), ({"partition": "1g.10gb"}, {"partition": "3g.40gb"}), {"partition": "3g.40gb"}, False
    ),
    "an unknown profile": Case(cut(), (), {"partition": "2g.20gb"}, False),
    "a selector one GPU meets": Case(
        two_cuda_versions, (), {"devices": 1, "selector": CUDA_12}, True
    ),
    "a selector for two GPUs": Case(
        two_cuda_versions, (), {"devices": 2, "selector": CUDA_12}, False
    ),
    "a selector no GPU meets": Case(
        two_cuda_versions,
        (),
        {"devices": 1, "selector": 'device.attributes["cuda"] >= "13"'},
        False,
    ),
    "a selector on a missing attribute": Case(
        two_cuda_versions, (), {"devices": 1, "selector": 'device.attributes["rocm"] != ""'}, False
    ),
    "a selector on a vendor written in capitals": Case(
        lambda: [node("n", devices=1, vendor="NVIDIA")],
        (),
        {"devices": 1, "selector": 'device.vendor == "nvidia"'},
        True,
    ),
    "a share by selector": Case(
        shareable(2, attributes={"cuda": "12.4"}), (), {"fraction": 0.5, "selector": CUDA_12}, True
    ),
    "one group short": Case(
        lambda: grouped(["x", "x", "y", "y"], unhealthy=(1, 2)),
        (),
        {"devices": 2, "same_interconnect": True},
        False,
    ),
    "across groups when allowed": Case(
        lambda: grouped(["x", "x", "y", "y"], unhealthy=(1, 2)), (), {"devices": 2}, True
    ),
    "the second group": Case(
        lambda: grouped(["x", "y", "x", "y"]),
        ({"devices": 2, "same_interconnect": True},),
        {"devices": 2, "same_interconnect": True},
        True,
    ),
    "no group left": Case(
        lambda: grouped(["x", "y", "x", "y"]),
        ({"devices": 2, "same_interconnect": True},) * 2,
        {"devices": 1, "same_interconnect": True},
        False,
    ),
    "ungrouped GPUs in one group": Case(
        lambda: [node("n", devices=2)], (), {"devices": 2, "same_interconnect": True}, False
    ),
    "a gang over two nodes": Case(
        two_nodes(devices=2), ({"devices": 1},), {"devices": 1, "replicas": 3}, True
    ),
    "a gang of pairs over two nodes": Case(
        two_nodes(devices=2), ({"devices": 1},), {"devices": 2, "replicas": 2}, False
    ),
    "shares over two nodes": Case(
        two_nodes(devices=1, shareable=True),
        ({"fraction": 0.75},),
        {"fraction": 0.5, "replicas": 2},
        True,
    ),
    "too many shares over two nodes": Case(
        two_nodes(devices=1, shareable=True),
        ({"fraction": 0.75},),
        {"fraction": 0.5, "replicas": 3},
        False,
    ),
    "more CPU than the node has": Case(shareable(), (), {"fraction": 0.5, "cpu": 40}, False),
    # Node-level constraints: the node with room must be the node that qualifies.
    "a requirement only the busy node meets": Case(
        cuda_and_plain,
        ({"devices": 1, "requires": NEW_CUDA},),
        {"devices": 1, **NEW_CUDA_ASK},
        False,
    ),
    "a requirement the free node meets": Case(
        cuda_and_plain, ({"devices": 1},), {"devices": 1, **NEW_CUDA_ASK}, True
    ),
    "a requirement no node meets": Case(cuda_and_plain, (), {"requires": {"cuda": ">=13"}}, False),
    "a framework only the busy node has": Case(
        cuda_and_plain,
        ({"devices": 1, "node_labels": TORCH},),
        {"devices": 1, "node_labels": TORCH},
        False,
    ),
    "a framework the free node has": Case(
        cuda_and_plain, ({"devices": 1},), {"devices": 1, "node_labels": TORCH}, True
    ),
    "an arch no node has": Case(cuda_and_plain, (), {"requires": {"arch": "aarch64"}}, False),
    "an arch one node has": Case(cuda_and_plain, (), {"requires": {"arch": "x86_64"}}, True),
}
SHARED_USE = {
    # Device.allocated marks only devices held whole; the coordinator must also treat a partly
    # shared or partitioned device as taken for whole-device requests, as the core does.
    "a whole GPU of a shared device": Case(
        shareable(), ({"fraction": 0.25},), {"devices": 1}, False
    ),
    "a whole GPU of a cut device": Case(cut(), ({"partition": "1g.10gb"},), {"devices": 1}, False),
}


def coordinator_fits(core: EmbeddedCore, o: site_link_service_pb2.Offer) -> bool:
    """What CapacityFit says of ``o`` for a site publishing the core's nodes."""
    view = resources_pb2.SiteView(site="site-a", nodes=core.nodes())
    snap = build_snapshot([SiteInput(view=view, is_connected=True, is_cordoned=False)])
    constraints = jobs_pb2.Constraints(node_labels=o.node_labels)
    job = jobs_pb2.JobSpec(name="job", tasks=[o.spec], constraints=constraints)
    return bool(CapacityFit().filter(Request.from_spec(job, job.tasks[0]), snap).mask[0])


@pytest.mark.parametrize(
    "case",
    [
        *(pytest.param(case, id=name) for name, case in CASES.items()),
        *(pytest.param(case, id=name) for name, case in SHARED_USE.items()),
    ],
)
async def test_core_accepts_exactly_what_capacity_fit_admits(
    make_core: Callable[..., EmbeddedCore], case: Case
) -> None:
    """For each case the coordinator and the core give the same, expected, answer."""
    core = make_core(case.nodes())
    for i, held in enumerate(case.held):
        answer = await core.offer(offer(f"held-{i}", **held))  # type: ignore[arg-type]
        assert answer.accepted, answer.reason
    ask = offer("asked", **case.ask)  # type: ignore[arg-type]
    coordinator = coordinator_fits(core, ask)
    answer = await core.offer(ask)
    assert (coordinator, answer.accepted) == (case.fits, case.fits), answer.reason


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in DECISIONS.items()])
async def test_embedded_core_decides_as_every_core(
    make_core: Callable[..., EmbeddedCore], case: Decision
) -> None:
    """The embedded core answers each offer and commit as the table says every core does."""
    core = make_core([node("fed-node-1", cpu=8, memory_mib=16000)])
    assert await play(core, case) == case.answers
