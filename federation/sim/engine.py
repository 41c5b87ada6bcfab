"""The discrete-event replay of one trace under one policy.

What is real: the placement framework and the policy's plugins decide; the coordinator's
negotiation rules (``offer_rounds``: the best site alone, then ``offers_at_once`` sites at a
time under one epoch per round, the best acceptance gets the commit, declines move down the
ranked list up to ``max_offers_per_round``, then the task waits in PENDING) and its task
state machine (``job_state.check_transition`` on every change) govern; sites take an offer by
the embedded core's rule (every replica on one node). What is simulated: the clock, the
sites' capacity, input transfers (``transfers``: bytes x 8 / bandwidth + RTT from the holder
that gets the data there soonest, as the estimate computes), runs (duration / the granted
device's speed) and power: a device running a task draws its TDP (times the share it runs),
and every other device of a node that holds some task draws ``idle_power_share`` of its TDP; a
node that holds no task is powered down and draws nothing.

A task that fits nowhere waits until capacity frees. Waiting tasks whose requests pass the
same filters form a group, and when a site frees capacity only the first task of each group
that now fits there is placed again: the answer for the others could not have changed.

With queues or priority classes in the topology, waiting tasks are taken as the coordinator's
scheduling cycle takes them (``_cycle``): in its line (``Sharing.order``), each through its
queues' quotas, then placement, then preemption where it may stop others (``_preempt_for``).
A stopped task waits again and restarts from its last checkpoint.

Sites with node types launch nodes for the tasks placed on them and release them when idle
(``federation.sim.elastic``): a task on nodes still to run starts once they do. A spot node the
cloud takes back (``RECLAIM``) has its tasks stopped as preempted ones are, and placed again.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from federation.common import job_state
from federation.coordinator.policy.preemption import Candidate, TaskAt, free_room
from federation.coordinator.policy.resources import demand
from federation.coordinator.scheduling.config import SchedulerConfig
from federation.coordinator.scheduling.learning import SpeedLearner
from federation.coordinator.scheduling.preemption import as_victim, plan_preemption
from federation.coordinator.scheduling.rounds import offer_rounds
from federation.jobspec import domain_name
from federation.placement.estimates import class_speed, estimate
from federation.placement.framework import Code, Framework
from federation.placement.request import Request
from federation.sim.elastic import Launches, LaunchTally
from federation.sim.policies import PROFILES, build_policy, feasibility_key
from federation.sim.queues import Shares, Tally
from federation.sim.runs import TaskRun
from federation.sim.state import SiteState, site_views
from federation.sim.trace import TraceTask
from federation.sim.transfers import transfer
from federation.sim.waiting import BusySites

F64 = npt.NDArray[np.float64]
# Event kinds, in the order they are handled at one instant: capacity frees before anything
# new is placed on it, and a scheduling cycle (with queues) sees everything that happened.
DONE, RECLAIM, START, RETRY, ARRIVE, CYCLE = 0, 1, 2, 3, 4, 5
_SCHEDULER = SchedulerConfig()
Progress = Callable[[int, int], None]
MAX_RECLAIMS = 100
"""A task its spot nodes are taken back from this often is given up (it stays PENDING): one
that runs longer than a fixed spot lifetime without checkpointing would restart forever."""
IDLE_POWER_SHARE = 0.25
"""An idle device of a powered node draws this share of its TDP: its own idle draw (about
10-15 % of TDP on the A100's and H100's spec sheets) plus its share of the host's."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Negotiation settings (the coordinator's defaults) and the replay's own knobs."""

    offers_at_once: int = _SCHEDULER.offers_at_once
    max_offers_per_round: int = _SCHEDULER.max_offers_per_round
    retry_interval_s: float = _SCHEDULER.retry_interval_s
    """Longest wait before a task every offered site declined is tried again."""
    wait_gain: float = _SCHEDULER.wait_gain
    """A task waits for a busy site where it would finish by this share of its finish where
    it can start now (in profiles that wait)."""
    seed: int = 0
    """Seeds the sites' random declines (``decline_rate``)."""
    learn: bool = False
    """Learn device speeds from finished tasks (the coordinator's ``SpeedLearner``) and
    estimate with them, as the coordinator does; else every estimate uses the speed table."""
    idle_power_share: float = IDLE_POWER_SHARE
    """Share of its TDP an idle device draws while its node is powered (holds some task)."""
    preemption_min_run_s: float = _SCHEDULER.preemption_min_run_s
    """A task runs this long before it may be preempted (with queues or priority classes)."""
    reclaim_min_run_s: float = _SCHEDULER.reclaim_min_run_s
    """A task on borrowed quota runs this long before the queue it borrowed from takes it
    back."""

    def __post_init__(self) -> None:
        # With no site offered per round a task would be retried forever.
        for name in ("offers_at_once", "max_offers_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0.0 <= self.idle_power_share <= 1.0:
            raise ValueError(f"idle_power_share must be in [0, 1], got {self.idle_power_share}")
        for name in ("preemption_min_run_s", "reclaim_min_run_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class Outcome:
    """Everything a replay leaves for the metrics."""

    policy: str
    tasks: list[TaskRun]
    models: tuple[str, ...]
    """Accelerator models as "KIND/model", the columns of the per-model figures."""
    capacity: F64
    """Devices per model."""
    busy_device_s: F64
    """Device-seconds running tasks, per model."""
    held_device_s: F64
    """Device-seconds held (transfers included), per model."""
    busy_until_last_arrival: F64 = field(default_factory=lambda: np.zeros(0))
    """``busy_device_s`` when the last task arrived."""
    idle_while_waiting_device_s: float = 0.0
    waiting_s: float = 0.0
    """Simulated time during which at least one task that fits somewhere waited."""
    site_ids: tuple[str, ...] = ()
    offers: int = 0
    declines: int = 0
    series: list[tuple[float, float, float, int]] = field(default_factory=list)
    """(time, devices running, devices held, tasks waiting) after every event."""
    learned_speeds: dict[str, dict[str, float]] | None = None
    """With ``learn``: the speeds learned by the end, workload class -> model -> speed."""
    busy_energy_j: float = 0.0
    """Joules drawn by devices running tasks (equals the tasks' ``energy_kwh``, summed)."""
    idle_energy_j: float = 0.0
    """Joules drawn by idle devices of powered nodes (nodes that hold some task)."""
    powered_node_s: float = 0.0
    """Node-seconds powered: summed over nodes, the time each held some task."""
    sharing: Tally | None = None
    """With queues or priority classes: per tenant, shares over the contended time."""
    straddles: dict[str, list[int]] = field(default_factory=dict)
    """Per topology level the nodes declare (``rack``...): [gangs placed over several nodes
    that all carry the level, of those the gangs whose nodes were in more than one value]."""
    elastic: LaunchTally | None = None
    """With node types in the topology: the nodes launched, for how long, and at what cost."""


class Simulation:
    """Replays ``tasks`` over ``state`` (a fresh ``SiteState``) under one policy."""

    def __init__(
        self,
        policy: str,
        state: SiteState,
        tasks: Sequence[TraceTask],
        config: SimConfig | None = None,
        estimated_s: Sequence[float] | None = None,
        framework: Framework | None = None,
        waits: str | None = None,
    ) -> None:
        """``framework`` and ``waits``: a profile of its own, for a policy not in
        ``PROFILES``."""
        self.policy = policy
        self.state = state
        self.snap = state.snap
        self.empty = state.fresh().snap
        self.config = config or SimConfig()
        self.framework = framework or build_policy(policy)
        filters = tuple(plugin.name for plugin in self.framework.filters)
        self.site_index = {name: i for i, name in enumerate(self.snap.site_ids)}
        sites = state.topology.sites
        self.decline_rate = np.array([s.decline_rate for s in sites])
        self.egress_usd_per_gb = np.array([s.egress_usd_per_gb for s in sites])
        self.rng = np.random.default_rng(self.config.seed)
        classes = self.snap.classes
        self.models = tuple(sorted({f"{c.attributes['kind']}/{c.model}" for c in classes}))
        self.class_model = np.array(
            [self.models.index(f"{c.attributes['kind']}/{c.model}") for c in classes],
            dtype=np.int64,
        )
        n_models = len(self.models)
        capacity = np.bincount(
            self.class_model[self.snap.device_class] if len(classes) else np.zeros(0, np.int64),
            minlength=n_models,
        )
        self.runs = [
            TaskRun(
                t,
                t.request(i, None if estimated_s is None else estimated_s[i]),
                held=np.zeros(n_models),
                remaining_s=t.duration_s,
            )
            for i, t in enumerate(tasks)
        ]
        self.keys = [feasibility_key(filters, r.request) for r in self.runs]
        self.out = Outcome(
            policy,
            self.runs,
            self.models,
            capacity.astype(np.float64),
            np.zeros(n_models),
            np.zeros(n_models),
            site_ids=self.snap.site_ids,
        )
        self._events: list[tuple[float, int, int, int]] = []
        self._sequence = 0
        self._now = 0.0
        self._running = np.zeros(n_models)
        self._holding = np.zeros(n_models)
        self._waiting = 0
        self._blocked: dict[object, list[int]] = {}
        if waits is None:
            waits = PROFILES[policy].waits if policy in PROFILES else ""
        self._at_site: list[set[int]] = [set() for _ in range(self.snap.n_sites)]
        """Tasks each site holds (placed, not finished): what frees there, and when."""
        self.busy = BusySites(self.snap, self.runs, self._at_site, waits, self.config.wait_gain)
        """Tasks waiting for a busy site, by that site: tried again when it frees capacity."""
        self._potential: dict[object, npt.NDArray[np.bool_]] = {}
        self._speeds: dict[tuple[str, tuple[tuple[str, float], ...]], F64] = {}
        self.learner = SpeedLearner(metrics=False) if self.config.learn else None
        self._learned: dict[str, dict[str, float]] = {}
        """Learned speeds per workload class, until the next task finishes."""
        # Power: a node is on while it holds some task (transfers included).
        self.node_watts = np.bincount(
            self.snap.device_node,
            weights=self.snap.device_power_watts,
            minlength=self.snap.n_nodes,
        ).astype(np.float64)
        self._node_tasks = np.zeros(self.snap.n_nodes, dtype=np.int64)
        self.launches = Launches(
            state.topology, self.snap, self.config.seed, lambda at, n: self._push(at, RECLAIM, n)
        )
        self.out.elastic = self.launches.tally if self.launches.any else None
        self._powered_nodes = 0
        self._powered_watts = 0.0
        self._running_watts = 0.0
        # Queues and preemption (``_cycle``), when the topology has queues or classes.
        topology = state.topology
        self.shares = None
        if topology.queues or topology.priority_classes:
            nodes = [node for site in site_views(topology) for node in site.view.nodes]
            self.shares = Shares(topology, tasks, nodes)
            self.out.sharing = self.shares.tally
        self._index = {(t.job_id, t.task): i for i, t in enumerate(tasks)}
        self._cancelled: set[int] = set()
        """Sequence numbers of events of preempted tasks, skipped when they come."""
        self._pending: set[int] = set()
        """Tasks that arrived and wait (fit somewhere, not placed)."""
        self._fresh: list[int] = []
        """Tasks the next cycle tries: arrived or due again since the last."""
        self._full = False
        """The next cycle tries every waiting task: room or quota freed."""
        self._cycle_due = False
        self._retry_at: dict[int, float] = {}
        """When each task backed off or waiting for a busy site is due again."""
        self._preempted_for: set[int] = set()
        """Waiting tasks that had others stopped for them (once while they wait)."""
        self._recheck: dict[int, float] = {}
        """When each waiting task that may preempt is tried again: as the coordinator's
        backoff would, once the first task it could stop has run long enough."""

    # The event loop.

    def run(self, progress: Progress | None = None) -> Outcome:
        """Replay every task to the end; ``progress(done, total)`` is called now and then."""
        for i, run in enumerate(self.runs):
            self._push(run.trace.submit_s, ARRIVE, i)
        handled = 0
        total = len(self.runs)
        last_arrival = max((r.trace.submit_s for r in self.runs), default=0.0)
        handlers = {
            DONE: self._done,
            START: self._start,
            RETRY: self._retry,
            ARRIVE: self._arrive,
            CYCLE: self._cycle,
            RECLAIM: self._reclaim,
        }
        while self._events:
            when, kind, sequence, i = heapq.heappop(self._events)
            if sequence in self._cancelled:
                self._cancelled.discard(sequence)
                continue
            self._advance(when)
            if (
                kind == ARRIVE
                and when >= last_arrival
                and not len(self.out.busy_until_last_arrival)
            ):
                self.out.busy_until_last_arrival = self.out.busy_device_s.copy()
            handlers[kind](i)
            self.out.series.append(
                (when, float(self._running.sum()), float(self._holding.sum()), self._waiting)
            )
            handled += kind == DONE
            if progress is not None and kind == DONE and handled % 256 == 0:
                progress(handled, total)
        self.launches.finish(self._now)
        if progress is not None:
            progress(total, total)
        if self.learner is not None:
            self.out.learned_speeds = self.learner.learned()
        return self.out

    def _push(self, when: float, kind: int, task: int) -> int:
        self._sequence += 1
        heapq.heappush(self._events, (when, kind, self._sequence, task))
        return self._sequence

    def _due(self, i: int, when: float) -> None:
        """Task ``i`` is held back (backed off, or waiting for a busy site) until ``when``."""
        self._push(when, RETRY, i)
        self._retry_at[i] = when

    def _advance(self, when: float) -> None:
        dt = when - self._now
        if dt > 0:
            self.out.busy_device_s += self._running * dt
            self.out.held_device_s += self._holding * dt
            idle_watts = max(self._powered_watts - self._running_watts, 0.0)
            self.out.busy_energy_j += self._running_watts * dt
            self.out.idle_energy_j += self.config.idle_power_share * idle_watts * dt
            self.out.powered_node_s += self._powered_nodes * dt
            if self._waiting:
                self.out.waiting_s += dt
                self.out.idle_while_waiting_device_s += self.state.free_devices * dt
            if self.shares is not None:
                self.shares.advance(dt)
        self.launches.advance(when)
        self._now = max(self._now, when)

    def _move(self, run: TaskRun, new: int) -> None:
        job_state.check_transition(run.state, new)
        run.state = new
        if self.shares is not None:
            self.shares.moved(run.request.sequence, new)  # the request's sequence: its index

    # What happens to a task.

    def _arrive(self, i: int) -> None:
        run = self.runs[i]
        if not self._potential_sites(i).any():
            run.never_fits = True  # stays PENDING for good, as in the coordinator
            return
        self._waiting += 1
        self._wait_or_try(i)

    def _wait_or_try(self, i: int) -> None:
        """Task ``i`` waits: in line for the next cycle (with queues), else placed now."""
        if self.shares is not None:
            self._wait_again(i)
            return
        group = self._blocked.get(self.keys[i])
        if group:
            heapq.heappush(group, i)  # tasks ahead of it with the same needs fit nowhere
        elif not self._try(i):
            self._block(i)

    def _retry(self, i: int) -> None:
        if self.shares is not None:
            if self.runs[i].state == job_state.PENDING:
                self._fresh.append(i)
                self._want_cycle()
        elif self.runs[i].state == job_state.PENDING and not self._try(i):
            self._block(i)

    def _start(self, i: int) -> None:
        run = self.runs[i]
        self._move(run, job_state.RUNNING)
        run.started_s = self._now
        self._running += run.held
        self._running_watts += run.watts
        run.event = self._push(self._now + run.run_s, DONE, i)

    def _done(self, i: int) -> None:
        run = self.runs[i]
        self._move(run, job_state.SUCCEEDED)
        run.finished_s = self._now
        self._leave(i, run.run_s, running=True)
        self._learn(run)
        if self.shares is None:
            self._wake(run.site)

    def _leave(self, i: int, ran_s: float, *, running: bool) -> None:
        """Task ``i`` gives back what it held at its site, after ``ran_s`` of run (billed from
        its placement, powered for its run)."""
        run = self.runs[i]
        if running:
            self._running -= run.held
            self._running_watts -= run.watts
        self._holding -= run.held
        assert run.grant is not None
        self._at_site[run.site].discard(i)
        for node in run.grant.nodes:
            self._node_tasks[node] -= 1
            if not self._node_tasks[node]:
                self._powered_nodes -= 1
                self._powered_watts -= float(self.node_watts[node])
        if not self._powered_nodes:  # nothing on: clear the sums' rounding
            self._powered_watts = self._running_watts = 0.0
        held_h = (self._now - run.placed_s) / 3600.0
        devices = len(run.grant.devices) * run.grant.device_share
        run.compute_usd += float(self.snap.price_per_device_hour[run.site]) * devices * held_h
        watts = self.snap.device_power_watts[list(run.grant.devices)].sum()
        run.energy_kwh += float(watts) * run.grant.device_share * ran_s / 3.6e6
        self.launches.leave(run.grant.nodes, self._now)
        self.state.release(run.grant)
        if self.shares is not None:
            # Room and quota freed: every waiting task is weighed again, those that chose to
            # wait for this site at once (as the coordinator's ``capacity_freed``).
            for j in self.busy.lines.at([self.snap.site_ids[run.site]]):
                self._retry_at.pop(j, None)
            self._full = True
            self._want_cycle()

    # Placement and negotiation.

    def _try(self, i: int) -> bool:
        """Place and negotiate; False when no site can take the task now."""
        run = self.runs[i]
        if run.state != job_state.PENDING:
            return True  # placed meanwhile (retried while it also waited in a line)
        lines = self.busy.lines
        lines.stop_waiting(i)  # weighed afresh, as ``Considering.task`` does
        req = self._estimating(run.request)
        decision = self.framework.place(req, self.snap)
        if not decision.ranked:
            return False
        wait = self.busy.sooner(req, decision, self._now)
        if wait is not None and lines.within_promise(i, wait, self._now):
            # A task's end there wakes it, and it is weighed again by then anyway.
            self._due(i, self._now + lines.wait_for(i, wait))
            return True
        candidates = decision.ranked[: self.config.max_offers_per_round]
        for first, stop in offer_rounds(len(candidates), self.config.offers_at_once):
            batch = candidates[first:stop]
            run.epoch += 1  # one epoch for every offer of the round
            run.offers += len(batch)
            self.out.offers += len(batch)
            # Sites answer on their own state; the best acceptance gets the commit, so the
            # answers of sites ranked below it change nothing (they would be released).
            for name in batch:
                site = self.site_index[name]
                if self._accepts(req, site):
                    self._delegate(i, site, req)
                    return True
                run.declines += 1
                self.out.declines += 1
        self._move(run, job_state.PENDING)
        run.backoff_s = min(run.backoff_s * 2, self.config.retry_interval_s)
        self._due(i, self._now + run.backoff_s)
        return True

    def _accepts(self, req: Request, site: int) -> bool:
        if self.state.room(req, site) < req.replicas:
            return False
        rate = self.decline_rate[site]
        return not (rate > 0 and self.rng.random() < rate)

    def _delegate(self, i: int, site: int, req: Request) -> None:
        """Delegate task ``i`` to ``site``; ``req`` is its request as the scheduler estimates
        it (learned speeds included), which the site packs by, as real sites read the
        offer's speeds."""
        run = self.runs[i]
        # The site packs as the estimate assumed (the faster devices), as real sites do.
        assumed = float(estimate(req, self.snap).device_speed[site])
        run.grant = grant = self.launches.allocate(self.state, req, site, assumed)
        self._move(run, job_state.DELEGATED)
        self._waiting -= 1
        self.busy.lines.forget(i)
        if self.shares is not None:
            self._pending.discard(i)
            self._preempted_for.discard(i)
            self.shares.waiting[self.shares.tally.tenant_of[i]] -= 1
        run.site = site
        self._at_site[site].add(i)
        run.placed_s = self._now
        run.launch_s = self.launches.hold(grant.nodes, self._now) - self._now
        run.transfer_s, wan_bytes, egress_usd = transfer(
            run.request, site, self.snap, self.site_index, self.egress_usd_per_gb
        )
        run.wan_bytes += wan_bytes  # a restart reads its inputs again
        run.egress_usd += egress_usd
        classes = self.snap.device_class[list(grant.devices)]
        np.add.at(run.held, self.class_model[classes], grant.device_share)
        self._holding += run.held
        # Devices run at the table's speed times the topology's factors, whatever the
        # scheduler believes.
        true = self._speed(run.request)[classes] * self.state.speed_factor[list(grant.devices)]
        speed = float(true.min()) if len(classes) else 1.0
        run.run_s = run.remaining_s / speed
        run.assumed_speed, run.speed = assumed, speed if len(classes) else 0.0
        believed = float(class_speed(req, self.snap)[classes].min()) if len(classes) else 1.0
        run.estimated_run_s = req.duration_s / believed
        watts = self.snap.device_power_watts[list(grant.devices)].sum()
        run.watts = float(watts) * grant.device_share
        self._count_straddles(grant.nodes)
        for node in grant.nodes:
            if not self._node_tasks[node]:
                self._powered_nodes += 1
                self._powered_watts += float(self.node_watts[node])
            self._node_tasks[node] += 1
        run.event = self._push(self._now + run.launch_s + run.transfer_s, START, i)

    def _count_straddles(self, nodes: tuple[int, ...]) -> None:
        """A gang over several nodes: whether it straddled each level its nodes carry."""
        if len(set(nodes)) < 2:
            return
        for level in self.state.topology.levels:
            values = {self.snap.node_labels[n].get(level) for n in nodes}
            if None in values:
                continue
            counts = self.out.straddles.setdefault(level, [0, 0])
            counts[0] += 1
            counts[1] += len(values) > 1

    def _estimating(self, req: Request) -> Request:
        """``req`` with the learned speeds where it sets none of its own (as the scheduler's
        ``_with_learned_speeds``)."""
        if self.learner is None:
            return req
        learned = self._learned.get(req.workload_class)
        if learned is None:
            learned = self._learned[req.workload_class] = self.learner.overrides(
                req.workload_class, {}
            )
        if not learned:
            return req
        speeds = {**learned, **dict(req.speed)}
        return dataclasses.replace(req, speed=tuple(sorted(speeds.items())))

    def _learn(self, run: TaskRun) -> None:
        """A task that succeeded on devices teaches the learner its slowest device's speed,
        as the coordinator learns from the model its site committed."""
        grant = run.grant
        if self.learner is None or grant is None or not grant.devices or run.run_s <= 0:
            return
        if run.preemptions or run.reclaims:
            return  # it ran only what was left of the duration its estimate is for
        devices = list(grant.devices)
        true = self._speed(run.request)[self.snap.device_class[devices]]
        slowest = devices[int(np.argmin(true * self.state.speed_factor[devices]))]
        model = self.snap.classes[int(self.snap.device_class[slowest])].model
        self.learner.observe(
            run.request.workload_class,
            model,
            run.request.duration_s,
            run.estimated_run_s,
            run.run_s,
            site=self.snap.site_ids[run.site],
        )
        self._learned.clear()

    def _speed(self, req: Request) -> F64:
        key = (req.workload_class, req.speed)
        if key not in self._speeds:
            self._speeds[key] = class_speed(req, self.snap)
        return self._speeds[key]

    # Queues and preemption: the coordinator's scheduling cycle.

    def _wait_again(self, i: int) -> None:
        """Task ``i`` arrived, or was stopped: it waits in line for the next cycle."""
        assert self.shares is not None
        self._pending.add(i)
        self.shares.waiting[self.shares.tally.tenant_of[i]] += 1
        self._fresh.append(i)
        self._want_cycle()

    def _want_cycle(self) -> None:
        if not self._cycle_due:
            self._cycle_due = True
            self._push(self._now, CYCLE, -1)

    def _cycle(self, _: int) -> None:
        """Waiting tasks in the coordinator's line (``Sharing.order``), each through its
        queues' quotas, then placement, then preemption when it fits nowhere for want of room
        (as ``Considering.task``). Only tasks that arrived or came due are tried unless room
        or quota freed: for the others nothing changed since the last cycle."""
        assert self.shares is not None
        shares = self.shares
        tasks = self._pending if self._full else self._fresh
        self._cycle_due, self._full, self._fresh = False, False, []
        failed: set[object] = set()
        """Requests that fit nowhere now: those after them with the same needs do not either."""
        for i in shares.order(tasks):
            run = self.runs[i]
            if run.state != job_state.PENDING or self._retry_at.get(i, -math.inf) > self._now:
                continue  # placed meanwhile, backed off, or waiting for a busy site
            if shares.admission(i) is not None:
                if not (self._reclaim_for(i) and shares.admission(i) is None):
                    continue  # over its quota: a task's end wakes it
                failed.clear()  # quota and room freed; it is first in line for them
            key = self.keys[i]
            if key not in failed:
                if self._try(i):
                    continue
                failed.add(key)
            if self._preempt_for(i):
                failed.clear()  # room freed
                self._try(i)  # first in line for it

    def _preempt_for(self, i: int) -> bool:
        """Stop tasks to make room for waiting task ``i`` at a site only short of room, as
        ``Preemption.preempt_for``: when it may preempt (tasks of lower priority), or when its
        queue is owed its nominal quota (tasks of the queues that borrow it,
        ``Sharing.lenders``); victims by ``plan_preemption``, the coordinator's own. Once
        while it waits (room is summed per site, not fitted per node). True when it stopped
        some."""
        assert self.shares is not None
        shares = self.shares
        urgent = shares.may_preempt(i)
        if i in self._preempted_for or (not urgent and shares.queue(i) not in shares.queues):
            return False
        lenders = set() if urgent else shares.lenders(i)
        if not urgent and not lenders:
            return False
        short, _ = self._short_and_ranked(i)
        need, room = shares.demand(i), free_room(self.snap, short)

        def choose(found: list[Candidate]) -> list[Candidate] | None:
            plan = plan_preemption(need, room, lambda: found)
            return plan.victims if plan is not None else None

        return self._stop_for(i, sorted(short), lenders, choose)

    def _short_and_ranked(self, i: int) -> tuple[set[str], set[str]]:
        """The sites only short of room for waiting task ``i``, and those it fits at now."""
        decision = self.framework.place(self._estimating(self.runs[i].request), self.snap)
        short = {r.site for r in decision.rejections if r.code == Code.INSUFFICIENT_FREE_CAPACITY}
        return short, set(decision.ranked)

    def _reclaim_for(self, i: int) -> bool:
        """Stop tasks of the queues that borrow what waiting task ``i``'s queue is owed within
        its nominal quota, as ``Preemption.reclaim_for``: victims by ``plan_preemption`` with
        the queues' debts, so that it fits at a site and the debts are paid; once while it
        waits. True when it stopped some."""
        assert self.shares is not None
        shares = self.shares
        if i in self._preempted_for:
            return False
        debts = shares.owed(i)
        if not debts or not all(debt.over for debt in debts):
            return False
        lenders = {q for d in debts for lender in d.over for q in shares.sharing.subtree(lender)}
        short, ranked = self._short_and_ranked(i)
        need, room = shares.demand(i), free_room(self.snap, short | ranked)

        def choose(found: list[Candidate]) -> list[Candidate] | None:
            plan = plan_preemption(need, room, lambda: found, debts=debts)
            return plan.victims if plan is not None else None

        return self._stop_for(i, self.snap.site_ids, lenders, choose)

    def _stop_for(
        self,
        i: int,
        sites: Sequence[str],
        lenders: set[str],
        choose: Callable[[list[Candidate]], list[Candidate] | None],
    ) -> bool:
        """Stop the victims ``choose`` takes among the tasks at ``sites`` that waiting task
        ``i`` may stop now; when some it could take have not run long enough yet, try again
        once they have (the coordinator's backoff). True when it stopped some."""
        found = [
            found
            for site in sites
            for j in sorted(self._at_site[self.site_index[site]])
            if (found := self._candidate(j, i, lenders)) is not None
        ]
        victims = choose([c for c, ready in found if ready <= self._now])
        if victims is None:
            later = min((ready for _, ready in found if ready > self._now), default=None)
            if (
                later is not None
                and self._recheck.get(i) != later
                and choose([c for c, _ in found]) is not None
            ):
                self._recheck[i] = later
                self._push(later, RETRY, i)
            return False
        self._preempted_for.add(i)
        for victim in victims:
            j = self._index[victim.job_id, victim.task]
            self._stop(j)
            self._wait_again(j)
        return True

    def _candidate(self, j: int, i: int, lenders: set[str]) -> tuple[Candidate, float] | None:
        """Task ``j`` as a victim for waiting task ``i``, and from when (``as_victim``, as
        ``Preemption._candidates`` takes them): of a preemptible class, and of a queue in
        ``lenders`` or else of lower priority, once it has run its minimum."""
        assert self.shares is not None
        shares, run, snap = self.shares, self.runs[j], self.snap
        assert run.grant is not None
        models = [str(snap.device_model[d]) for d in run.grant.devices]
        found = as_victim(
            shares.sharing,
            shares.job[j],
            TaskAt(run.trace.job_id, run.trace.task, snap.site_ids[run.site], run.epoch),
            holds=demand(shares.job[j].spec.tasks[shares.slot[j]], models),  # as granted
            domain=domain_name(int(snap.domain[run.site])),
            started_s=run.started_s if run.state == job_state.RUNNING else None,
            lost_s=run.since_checkpoint(self._now),
            urgent=shares.job[i],
            lenders=lenders,
            min_runs=self.config,
        )
        if found is not None and found[1] == math.inf:
            # Placed, its input still moving: the replay knows when it starts.
            ready = run.placed_s + run.launch_s + run.transfer_s + self.config.reclaim_min_run_s
            return found[0], ready
        return found

    def _stop(self, j: int, *, reclaimed: bool = False) -> None:
        """Preempt task ``j`` (or stop it on a spot node taken back: ``reclaimed``, counted
        apart): it gives back its room, waits (the caller puts it in line), and keeps the run
        up to its last checkpoint (its site stops it at once: no grace for a last checkpoint)."""
        run = self.runs[j]
        running = run.state == job_state.RUNNING
        ran_s = run.stop(self._now, reclaimed=reclaimed)
        self._cancelled.add(run.event)
        self._move(run, job_state.PENDING)
        self._leave(j, ran_s, running=running)
        run.held[:] = 0.0  # nothing until it is placed again (counted twice, it was)
        self._waiting += 1

    def _reclaim(self, node: int) -> None:
        """The cloud takes spot ``node`` back (unless released since): its tasks stop as
        preempted ones do, not counted as preempted or failed, and are placed again."""
        if not self.launches.reclaim(node, self._now):
            return
        site = int(self.snap.node_site[node])
        stopped = [j for j in sorted(self._at_site[site]) if node in self.runs[j].nodes]
        for j in stopped:
            self._stop(j, reclaimed=True)
        for j in stopped:
            if self.runs[j].reclaims < MAX_RECLAIMS:
                self._wait_or_try(j)
            else:
                self._waiting -= 1
        if self.shares is None:
            self._wake(site)

    # Waiting tasks.

    def _potential_sites(self, i: int) -> npt.NDArray[np.bool_]:
        """Sites that could take the task if the whole federation were idle."""
        key = self.keys[i]
        if key not in self._potential:
            ranked = self.framework.place(self.runs[i].request, self.empty).ranked
            mask = np.zeros(self.snap.n_sites, dtype=bool)
            mask[[self.site_index[name] for name in ranked]] = True
            mask &= self.decline_rate < 1.0  # such a site takes nothing
            self._potential[key] = mask
        return self._potential[key]

    def _block(self, i: int) -> None:
        heapq.heappush(self._blocked.setdefault(self.keys[i], []), i)

    def _fits_at(self, i: int, site: int) -> bool:
        req = self.runs[i].request
        return bool(self._potential[self.keys[i]][site]) and self.state.room(req, site) >= (
            req.replicas
        )

    def _wake(self, site: int) -> None:
        """Capacity freed at ``site``: place the waiting tasks that now fit, oldest first;
        first those that chose to wait for it."""
        for j in self.busy.lines.at([self.snap.site_ids[site]]):
            if not self._try(j):
                self._block(j)
            elif self.runs[j].state == job_state.PENDING:
                break  # what freed was not enough for the first in line: the rest wait on
        woken = [
            (group[0], key) for key, group in self._blocked.items() if self._fits_at(group[0], site)
        ]
        heapq.heapify(woken)
        while woken:
            _, key = heapq.heappop(woken)
            group = self._blocked[key]
            if not self._try(group[0]):
                continue
            heapq.heappop(group)
            if not group:
                del self._blocked[key]
            elif self._fits_at(group[0], site):
                heapq.heappush(woken, (group[0], key))
