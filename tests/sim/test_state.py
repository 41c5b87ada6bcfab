"""Simulated sites: the accept rule matches the embedded core's packer and CapacityFit, and
grants and releases keep the placement arrays exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.agent.packing import Placed, Slot, Usage, place_as_estimated
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.plugins.capacity_fit import replicas_per_node
from federation.placement.request import Request
from federation.sim.links import LinkPlan, link_matrix
from federation.sim.state import Grant, SiteState, site_views
from federation.sim.topology import KNOWN_MODELS, DeviceSpec, NodeSpec, SiteSpec, Topology

GPU = resources_pb2.DEVICE_KIND_GPU
MODELS = ("A100-80GB", "V100", "T4")


def _device(model: str, count: int, shareable: bool = False) -> DeviceSpec:
    known = KNOWN_MODELS[model]
    return DeviceSpec(
        GPU,
        "nvidia",
        model,
        known.memory_mib,
        known.tflops_fp16,
        known.power_watts,
        count,
        shareable,
    )


def one_site(nodes: list[NodeSpec]) -> Topology:
    """A topology of one datacenter site with ``nodes``."""
    site = SiteSpec("s", resources_pb2.DOMAIN_DATACENTER, "r", tuple(nodes))
    bandwidth, rtt, known = link_matrix(["s"], ["r"], [False], LinkPlan())
    return Topology((site,), bandwidth, rtt, known)


def _task(replicas: int, cpu: float, memory_mib: int, count: float, models: list[str]) -> tuple:
    """A task spec for the packer and the same task as a placement request; a ``count`` below
    1 asks for that fraction of a shareable device."""
    whole, fraction = (int(count), 0.0) if count >= 1 else (0, count)
    spec = jobs_pb2.TaskSpec(
        name="t",
        command=["x"],
        replicas=replicas,
        resources=jobs_pb2.ResourceRequest(
            cpu=cpu,
            memory_mib=memory_mib,
            accelerator=jobs_pb2.AcceleratorRequest(
                kind=GPU, count=whole, fraction=fraction, models=models
            ),
        ),
    )
    return spec, Request.from_spec(jobs_pb2.JobSpec(name="j", tasks=[spec]), spec)


nodes_st = st.lists(
    st.builds(
        lambda cpu, mem, devices: NodeSpec(
            cpu, mem, tuple(_device(m, n) for m, n in devices if n), 1
        ),
        st.sampled_from([4.0, 8.0, 16.0]),
        st.sampled_from([8192, 16384]),
        st.lists(st.tuples(st.sampled_from(MODELS), st.integers(0, 4)), max_size=3),
    ),
    min_size=1,
    max_size=4,
)
task_st = st.tuples(
    st.integers(1, 3),
    st.sampled_from([1.0, 2.0, 4.0]),
    st.sampled_from([1024, 4096, 8192]),
    st.sampled_from([1, 2, 3, 0.25, 0.5, 0.3, 0.7]),
    st.sampled_from([[], ["A100-80GB"], ["V100"], ["T4"]]),
)


def _usage(state: SiteState, grants: list[Grant]) -> Usage:
    """The embedded core's tally of what ``grants`` hold."""
    names = [n.name for n in site_views(state.topology)[0].view.nodes]
    slots = []
    for grant in grants:
        per_replica = len(grant.devices) // len(grant.nodes)
        for k, node in enumerate(grant.nodes):
            held = grant.devices[k * per_replica : (k + 1) * per_replica]
            positions = tuple(d - int(state.device_lo[node]) for d in held)
            memory = int(grant.memory_mib)
            slots.append(Slot(names[node], grant.cpu, memory, positions, fraction=grant.fraction))
    return Usage.of(slots)


@settings(max_examples=150, deadline=None)
@given(
    nodes=nodes_st,
    earlier=st.lists(task_st, max_size=4),
    probe=task_st,
    assumed=st.sampled_from([0.0, 0.12, 0.38, 1.0, 2.5]),
)
def test_a_site_accepts_exactly_when_the_embedded_packer_would(
    nodes: list[NodeSpec], earlier: list[tuple], probe: tuple, assumed: float
) -> None:
    """After any grants, the simulated site and the packer agree on the next task (and on
    where it goes, on devices as fast as the estimate ``assumed`` where they fit), and the
    room equals CapacityFit's count for the site."""
    state = SiteState(one_site(nodes))
    grants = []
    for args in earlier:
        _, req = _task(*args)
        if state.room(req, 0) >= req.replicas:
            grants.append(state.allocate(req, 0))
    spec, req = _task(*probe)
    node_protos = list(site_views(state.topology)[0].view.nodes)
    packed = place_as_estimated(node_protos, spec, _usage(state, grants), assumed)
    assert (state.room(req, 0) >= req.replicas) == isinstance(packed, Placed)
    counted = replicas_per_node(req, state.snap, cap=float(1 << 20)).sum()
    assert state.room(req, 0) == counted
    if isinstance(packed, Placed):  # and the same nodes and devices, replica by replica
        grant = state.allocate(req, 0, assumed)
        assert _usage(state, [grant]) == Usage.of(packed.slots)


@settings(max_examples=60, deadline=None)
@given(nodes=nodes_st, tasks=st.lists(task_st, max_size=6))
def test_releasing_every_grant_restores_the_arrays(nodes: list[NodeSpec], tasks: list) -> None:
    """Grant then release, in any order, leaves free CPU, memory and devices as they were."""
    state = SiteState(one_site(nodes))
    before = state.fresh().snap
    grants = []
    for args in tasks:
        _, req = _task(*args)
        if state.room(req, 0) >= req.replicas:
            grants.append(state.allocate(req, 0))
    for grant in reversed(grants[::2]):
        state.release(grant)
    for grant in grants[1::2]:
        state.release(grant)
    snap = state.snap
    assert np.allclose(snap.node_cpu_free, before.node_cpu_free)
    assert np.allclose(snap.node_memory_free_mib, before.node_memory_free_mib)
    assert (snap.device_available == before.device_available).all()
    assert (snap.pair_free == before.pair_free).all()
    assert state.free_devices == len(snap.device_node)


def test_fractions_share_a_device_that_whole_requests_then_cannot_take(tmp_path: Path) -> None:
    """Two halves fill a shareable T4; while shared it is not a free whole device."""
    state = SiteState(one_site([NodeSpec(16.0, 65536, (_device("T4", 1, shareable=True),))]))
    half = Request(
        replicas=1,
        cpu=1,
        memory_mib=1024,
        accelerator_kind=GPU,
        accelerator_count=0,
        accelerator_models=frozenset(),
        accelerator_vendor="",
        accelerator_min_memory_mib=0,
        domains=frozenset(),
        regions=frozenset(),
        sites=frozenset(),
        node_labels=(),
        fraction=0.5,
    )
    _, whole = _task(1, 1.0, 1024, 1, [])
    assert state.room(half, 0) == 2
    first = state.allocate(half, 0)
    assert state.room(half, 0) == 1
    assert state.room(whole, 0) == 0
    assert state.free_devices == 0
    second = state.allocate(half, 0)
    assert state.room(half, 0) == 0
    state.release(first)
    state.release(second)
    assert state.room(whole, 0) == 1
    assert state.free_devices == 1
