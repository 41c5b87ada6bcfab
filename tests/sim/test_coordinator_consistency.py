"""The simulator and the coordinator decide alike on the same snapshot.

A replay is stopped with tasks running and delegated at its sites. For one waiting task, the
simulator's own decision path (``Simulation``: quota, placement, a wait for a busy site) is
read; the coordinator's parts are then asked the same question from job records written as
the coordinator would hold them (``waits.occupants`` reads them, ``Placing`` places,
``Waiting`` weighs the wait on the coordinator's clock, ``Sharing`` counts quotas). The two
must agree on where the task goes, or which site it waits for and for how long.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.queues import QueueTable
from federation.coordinator.policy.sharing import Sharing, task_demand
from federation.coordinator.policy.usage import QueueUsage
from federation.coordinator.scheduling import preemption as coordinator_preemption
from federation.coordinator.scheduling import waiting as coordinator_waiting
from federation.coordinator.scheduling.admission import Admission
from federation.coordinator.scheduling.config import SchedulerConfig
from federation.coordinator.scheduling.cycle_state import Cycle
from federation.coordinator.scheduling.learning import SpeedLearner
from federation.coordinator.scheduling.placing import Placing
from federation.coordinator.scheduling.preemption import Plan, Preemption, plan_preemption
from federation.coordinator.scheduling.waiting import Waiting
from federation.coordinator.sites.registry import SiteRegistry
from federation.placement.framework import Code
from federation.sim import engine
from federation.sim import waiting as sim_waiting
from federation.sim.engine import SimConfig, Simulation
from federation.sim.queues import _spec, resolve
from federation.sim.state import SiteState
from federation.sim.topology import load_topology
from federation.sim.trace import TraceTask, load_trace
from federation.store import SqliteStore

from .conftest import write

# ``fast``: two H100s (speed 2.5 for training); ``slow``: two V100s (0.38).
SITES = """
sites:
  - {name: fast, nodes: [{cpu: 16, memory_mib: 16384, devices: [{model: H100-80GB, count: 2}]}]}
  - {name: slow, nodes: [{cpu: 16, memory_mib: 16384, devices: [{model: V100, count: 2}]}]}
"""
QUOTA = """queues:
  - {name: a, tenant: team-a, quotas: [{resource: gpu, nominal: 2}]}
"""
HEADER = "job_id,submit_s,duration_s,accelerator_count,tenant\n"


@dataclass(frozen=True, slots=True)
class Decided:
    """What a decision comes to for one task: over quota, the site it goes to, or the busy
    site it waits for and how long."""

    quota: bool
    site: str
    waits_for: str
    wait_s: float


def _replay(
    tmp_path: Path, topology: str, rows: list[str], policy: str, header: str = HEADER
) -> Simulation:
    topo = load_topology(write(tmp_path, "t.yaml", topology))
    trace = write(tmp_path, "trace.csv", header + "\n".join(rows) + "\n")
    tasks = resolve(load_trace(trace), topo, str(trace))  # tenants to their queues
    return Simulation(policy, SiteState(topo), tasks, SimConfig())


def _held(sim: Simulation, placed: dict[int, tuple[str, float, bool]], now: float) -> None:
    """Delegate task ``i`` to ``site`` at time ``when`` (``placed``), running if asked; then
    set the clock to ``now``."""
    for i, (site, when, running) in placed.items():
        sim._now = when
        sim._waiting += 1
        if sim.shares is not None:
            sim._wait_again(i)
        req = sim._estimating(sim.runs[i].request)
        sim._delegate(i, sim.site_index[site], req)
        if running:
            sim._cancelled.add(sim.runs[i].event)
            sim._start(i)
    sim._now = now


def _simulator(sim: Simulation, i: int) -> Decided:
    """The simulator's decision for waiting task ``i``, as ``Simulation._try`` and
    ``_cycle`` take it, without acting on it."""
    if sim.shares is not None and sim.shares.admission(i) is not None:
        return Decided(True, "", "", 0.0)
    req = sim._estimating(sim.runs[i].request)
    decision = sim.framework.place(req, sim.snap)
    wait = sim.busy.sooner(req, decision, sim._now)
    if wait is not None and sim.busy.lines.within_promise(i, wait, sim._now):
        return Decided(False, "", wait.site, round(wait.wait_s, 6))
    return Decided(False, decision.ranked[0] if decision.ranked else "", "", 0.0)


def _records(sim: Simulation) -> Iterator[jobs_pb2.Job]:
    """Each task the replay placed, as the coordinator's job record holds it: its spec, its
    site and nodes, its committed estimate, and when it started."""
    for run in sim.runs:
        if run.state not in job_state.AT_SITE or run.grant is None:
            continue
        t = run.trace
        job = _job(t)
        status = job.tasks.add(name=t.task, state=run.state, site=sim.snap.site_ids[run.site])
        status.epoch = run.epoch
        status.nodes.extend(sim.snap.node_names[n] for n in run.grant.nodes)
        status.estimate.run_s = run.estimated_run_s
        status.estimate.transfer_s = run.transfer_s
        status.estimate.device_model = str(sim.snap.device_model[run.grant.devices[0]])
        if run.state == job_state.RUNNING:
            status.started_at.FromNanoseconds(round(run.started_s * 1e9))
            status.started_at.SetInParent()  # started at 0 s is started too
        yield job


def _job(t: TraceTask) -> jobs_pb2.Job:
    """The job record of trace task ``t``, its task not yet added: its queue, priority (as
    its class sets it) and class, and its spec."""
    job = jobs_pb2.Job(id=t.job_id)
    job.spec.queue, job.spec.priority, job.spec.priority_class = (
        t.queue,
        t.priority,
        t.priority_class,
    )
    job.spec.tasks.append(_spec(t))
    return job


def _coordinator(sim: Simulation, i: int, monkeypatch: pytest.MonkeyPatch) -> Decided:
    """The coordinator's parts on the same snapshot: quota (``Sharing.admission`` over usage
    counted from the records), then ``Placing.place``, then ``Waiting.sooner`` and its
    promise, on a clock that reads the replay's time."""
    records = list(_records(sim))
    clock = types.SimpleNamespace(time=lambda: sim._now, monotonic=lambda: sim._now)
    monkeypatch.setattr(coordinator_waiting, "time", clock)
    t = sim.runs[i].trace
    job = _job(t)
    job.tasks.add(name=t.task, state=job_state.PENDING)
    queues = sim.state.topology.queues
    if queues:
        usage = QueueUsage()
        for record in records:
            usage.update(record, {})
        sharing = Sharing(QueueTable(queues), usage, sim.state.topology.priority_classes)
        if sharing.admission(job, task_demand(job, t.task), {}) is not None:
            return Decided(True, "", "", 0.0)
    placing = Placing(sim.framework, SpeedLearner(metrics=False), 4, 0.9, lambda: None)
    request = sim.runs[i].request
    placement = placing.place(request, sim.snap)
    _, ranked, _, busy, _ = placement
    jobs = types.SimpleNamespace(at_site=lambda: iter(records))
    waiting = Waiting(jobs, 0.9)  # type: ignore[arg-type]
    cycle = Cycle(snapshot=sim.snap)
    wait = waiting.sooner(request, placement, ranked, cycle) if busy and ranked else None
    if wait is not None and waiting.within_promise((t.job_id, t.task), wait):
        return Decided(False, "", wait.site, round(wait.wait_s, 6))
    return Decided(False, ranked[0] if ranked else "", "", 0.0)


def _both(sim: Simulation, i: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Decided, Decided]:
    return _simulator(sim, i), _coordinator(sim, i, monkeypatch)


def test_with_free_capacity_both_send_the_task_to_the_fastest_site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing runs: both send a long GPU task to the free H100s."""
    sim = _replay(tmp_path, SITES, ["j0,0,1000,1,"], "completion-time")
    simulated, coordinated = _both(sim, 0, monkeypatch)
    assert simulated == coordinated == Decided(False, "fast", "", 0.0)


def test_with_the_fast_site_busy_both_wait_for_it_as_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both H100s are held, one by a task running since 0 s (400 s there), one by a task
    delegated at 50 s that has not started (the coordinator expects it to end 400 s from
    now, at 500 s, not 400 s after it was placed); at 100 s a 1,000 s task on two GPUs
    would run 2,632 s on the free V100s, or 400 s on the H100s once both are free: both
    wait for ``fast``, 400 s."""
    rows = ["r0,0,1000,1,", "r1,0,1000,1,", "w,100,1000,2,"]
    sim = _replay(tmp_path, SITES, rows, "completion-time")
    _held(sim, {0: ("fast", 0.0, True), 1: ("fast", 50.0, False)}, now=100.0)
    simulated, coordinated = _both(sim, 2, monkeypatch)
    assert simulated == coordinated
    assert simulated.waits_for == "fast"
    assert simulated.wait_s == pytest.approx(400.0)


def test_a_short_task_starts_now_in_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting would not pay for a 10 s task: both start it on a free V100 now."""
    rows = ["r0,0,1000,1,", "r1,0,1000,1,", "w,100,10,1,"]
    sim = _replay(tmp_path, SITES, rows, "completion-time")
    _held(sim, {0: ("fast", 0.0, True), 1: ("fast", 0.0, True)}, now=100.0)
    simulated, coordinated = _both(sim, 2, monkeypatch)
    assert simulated == coordinated == Decided(False, "slow", "", 0.0)


def test_over_its_quota_both_hold_the_task_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Team a's queue has 2 GPUs and holds both: its third task waits by quota in both,
    though the V100s are free."""
    rows = ["a0,0,1000,1,team-a", "a1,0,1000,1,team-a", "a2,100,1000,1,team-a"]
    sim = _replay(tmp_path, SITES + QUOTA, rows, "completion-time")
    _held(sim, {0: ("fast", 0.0, True), 1: ("fast", 0.0, True)}, now=100.0)
    simulated, coordinated = _both(sim, 2, monkeypatch)
    assert simulated == coordinated == Decided(True, "", "", 0.0)


def test_the_comparison_fails_when_one_side_decides_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulator that read a task's end other than the coordinator does (here: ignoring
    that the delegated tasks' inputs have yet to move) waits a different time, and the
    comparison sees it."""
    rows = ["r0,0,1000,1,", "r1,0,1000,1,", "w,100,1000,1,"]
    sim = _replay(tmp_path, SITES, rows, "completion-time")
    _held(sim, {0: ("fast", 0.0, False), 1: ("fast", 0.0, False)}, now=100.0)
    for run in sim.runs[:2]:
        run.transfer_s = 50.0
    monkeypatch.setattr(sim_waiting, "expected_end", lambda run_s, _, started, now: now + run_s)
    simulated, coordinated = _both(sim, 2, monkeypatch)
    assert simulated.waits_for == coordinated.waits_for == "fast"
    assert simulated != coordinated


# Preemption: the victims (and their site) the simulator stops for a waiting task, against
# those the coordinator's ``Preemption`` marks, over a job repository on a real store.

CLASSES = """priority_classes:
  urgent: {value: 900, may_preempt: true}
  batch: {value: -100}
  vital: {value: 0, preemptible: false}
  peer: {value: 900}
"""
# ``fast``: three H100s; ``slow``: two V100s.
FULL = """
sites:
  - {name: fast, nodes: [{cpu: 16, memory_mib: 16384, devices: [{model: H100-80GB, count: 3}]}]}
  - {name: slow, nodes: [{cpu: 16, memory_mib: 16384, devices: [{model: V100, count: 2}]}]}
"""
BORROWED = """queues:
  - {name: a, tenant: team-a, quotas: [{resource: gpu, nominal: 2, borrowing_limit: 2}]}
  - {name: b, tenant: team-b, quotas: [{resource: gpu, nominal: 2}]}
"""
CLASS_HEADER = "job_id,submit_s,duration_s,accelerator_count,priority_class\n"


@dataclass(frozen=True, slots=True)
class Stopped:
    """A preemption's choice: the site it makes room at, and its victims (job, task,
    epoch)."""

    site: str
    victims: tuple[tuple[str, str, int], ...]


def _simulator_stops(sim: Simulation, i: int, monkeypatch: pytest.MonkeyPatch) -> Stopped:
    """What the simulator's cycle would stop for waiting task ``i`` (``_reclaim_for`` when
    its quotas hold it back, else ``_preempt_for`` once it fits nowhere), without stopping
    it: the plan ``plan_preemption`` returned, read on its way."""
    plans: list[Plan] = []

    def recorded(*args: Any, **kwargs: Any) -> Plan | None:
        plan = plan_preemption(*args, **kwargs)
        if plan is not None:
            plans.append(plan)
        return plan

    monkeypatch.setattr(engine, "plan_preemption", recorded)
    monkeypatch.setattr(sim, "_stop", lambda j: None)
    assert sim.shares is not None
    if sim.shares.admission(i) is not None:
        sim._reclaim_for(i)
    else:
        assert not sim.framework.place(sim._estimating(sim.runs[i].request), sim.snap).ranked
        sim._preempt_for(i)
    if not plans:
        return Stopped("", ())
    victims = sorted((v.job_id, v.task, v.epoch) for v in plans[0].victims)
    return Stopped(plans[0].site, tuple(victims))


async def _coordinator_stops(
    sim: Simulation, i: int, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> Stopped:
    """What the coordinator's ``Preemption`` stops for the same waiting task, as
    ``Considering.task`` asks it: over its quotas, what it is owed (``owed``) taken back by
    ``reclaim_for``; else, fitting nowhere, ``preempt_for``. Its jobs are the replay's
    records in a ``JobRepository`` on a real ``SqliteStore``, on a clock that reads the
    replay's time; its victims are the tasks it marked as being preempted."""
    clock = types.SimpleNamespace(time=lambda: sim._now, monotonic=lambda: sim._now)
    monkeypatch.setattr(coordinator_preemption, "time", clock)
    t = sim.runs[i].trace
    job = _job(t)
    job.tasks.add(name=t.task, state=job_state.PENDING)
    store = await SqliteStore.open(folder / "db")
    try:
        jobs = JobRepository(store, EventHub())
        await jobs.create([*_records(sim), job])
        sites = SiteRegistry(store, lambda: None)
        topology = sim.state.topology
        sharing = Sharing(QueueTable(topology.queues), jobs.usage, topology.priority_classes)
        config = SchedulerConfig(
            preemption_min_run_s=sim.config.preemption_min_run_s,
            reclaim_min_run_s=sim.config.reclaim_min_run_s,
        )
        preemption = Preemption(jobs, sites, sharing, Admission(jobs, sites, sharing), config)
        placing = Placing(sim.framework, SpeedLearner(metrics=False), 4, 0.9, lambda: None)
        verdicts, ranked, _, _, _ = placing.place(sim.runs[i].request, sim.snap)
        cycle = Cycle(snapshot=sim.snap)
        need = task_demand(job, t.task)
        if sharing.admission(job, need, cycle.tentative) is not None:
            debts = preemption.owed(job, t.task, need, cycle)
            short = {v.site for v in verdicts if v.code == Code.INSUFFICIENT_FREE_CAPACITY}
            options = [(debts, {*ranked, *short}, need)] if debts else []
            said = preemption.reclaim_for(job, t.task, options, cycle)
        else:
            assert not ranked
            said = preemption.preempt_for(job, t.task, verdicts, cycle)
        await asyncio.gather(*preemption.running())
        marked = sorted(
            (other.id, task.name, task.epoch)
            for other in jobs.at_any_site()
            for task in other.tasks
            if task.preempted_by
        )
    finally:
        await store.close()
    return Stopped(said[0].site if said else "", tuple(marked))


@pytest.mark.parametrize("perturbed", [False, True])
async def test_an_urgent_task_stops_the_same_victims_in_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, perturbed: bool
) -> None:
    """Every GPU is held when an urgent task (one GPU) arrives at 500 s. At ``fast``: a
    vital task (not preemptible, since 400 s), a batch task (since 0 s: 500 s of run to
    lose) and a peer of equal priority (since 300 s); at ``slow``: a batch task too young to
    stop (since 470 s, under the 60 s minimum) and one since 200 s (300 s to lose). Each of
    the three that may not be stopped would lose less than the two that may: both stop the
    batch task at ``slow`` that ran 300 s. Perturbed, the coordinator counts no run lost by
    a victim, and stops the batch task at ``fast`` (first by name): the comparison sees
    it."""
    rows = [
        "f0,0,5000,1,vital",
        "f1,0,5000,1,batch",
        "f2,0,5000,1,peer",
        "s0,0,5000,1,batch",
        "s1,0,5000,1,batch",
        "u,500,100,1,urgent",
    ]
    sim = _replay(tmp_path, FULL + CLASSES, rows, "completion-time", CLASS_HEADER)
    at = {0: 400.0, 1: 0.0, 2: 300.0, 3: 470.0, 4: 200.0}
    where = {i: ("fast" if i < 3 else "slow", when, True) for i, when in at.items()}
    _held(sim, where, now=500.0)
    if perturbed:
        monkeypatch.setattr(coordinator_preemption, "_lost_s", lambda task, started, now: 0.0)
    coordinated = await _coordinator_stops(sim, 5, tmp_path, monkeypatch)
    simulated = _simulator_stops(sim, 5, monkeypatch)
    if perturbed:
        assert simulated == Stopped("slow", (("s1", "main", 0),))
        assert coordinated == Stopped("fast", (("f1", "main", 0),))
    else:
        assert simulated == coordinated == Stopped("slow", (("s1", "main", 0),))


async def test_a_queue_takes_back_what_it_lent_from_the_same_victims_in_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue a (nominal 2 GPUs, may borrow 2) holds all four GPUs of ``SITES``, two of them
    borrowed from queue b (nominal 2), whose task (one GPU) arrives at 500 s: its quotas
    hold it back (the two nominal quotas together are all there is), and both take back
    one GPU, stopping the task of queue a that has run 120 s and loses least: the one at
    ``fast`` since 300 s, not the one at ``slow`` since 450 s (under the 120 s minimum for
    borrowed quota) nor those since 0 s and 100 s."""
    rows = [
        "a0,0,5000,1,team-a",
        "a1,0,5000,1,team-a",
        "a2,0,5000,1,team-a",
        "a3,0,5000,1,team-a",
        "b0,500,100,1,team-b",
    ]
    sim = _replay(tmp_path, SITES + BORROWED, rows, "completion-time")
    at = {0: ("fast", 0.0, True), 1: ("fast", 300.0, True)}
    at |= {2: ("slow", 100.0, True), 3: ("slow", 450.0, True)}
    _held(sim, at, now=500.0)
    coordinated = await _coordinator_stops(sim, 4, tmp_path, monkeypatch)
    simulated = _simulator_stops(sim, 4, monkeypatch)
    assert simulated == coordinated == Stopped("fast", (("a1", "main", 0),))
