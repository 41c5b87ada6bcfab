"""Elastic cloud capacity in the replay: the nodes of a site's ``node_types``, launched when a
task is placed on them and released when idle, as ``federation.agent.elastic`` runs them.

The snapshot holds every node a site may launch, published as its agent publishes it
(``NodeType.node`` and ``NodeType.launch``): LAUNCHABLE, with the type's delay as p50 and p90
and its price, so the placement framework weighs the launch as in production (the delay added
to the completion time, price x (delay + run) to the cost). A site puts a task on running nodes
where they have room for every replica, else on any (``allocate``: the embedded core's rule);
those of its nodes that do not run launch (``hold``): LAUNCHING for the type's ``delay_s`` (the
simulated provider's launch, so the delay an agent would learn is that one too), then RUNNING.
The task starts once every node it got runs, then moves its inputs (the agent launches, then
stages). A running node that has held no task for the site's ``idle_release_s`` is released,
longest idle first and keeping ``warm_min`` running, and is launchable again. A type has
``max`` nodes, so no more than that run or launch at once.

Launches end and idle nodes are released at their own times, between the replay's events
(``advance``, called as the clock moves): nothing reads the state in between. A launched node
costs its type's price (its spot price for a ``spot`` type) from its launch to its release;
one that ``warm_min`` keeps running to the end costs until the replay's last event or release.

Spot nodes: where the site sets a reclaim model, each node of a ``spot`` type it launches is
taken back a while after it runs: ``spot_reclaim_after_s`` (as the agent's simulated provider),
or a draw from an exponential distribution of mean ``spot_mean_lifetime_s`` (from a generator
seeded by the replay's seed, drawn at each launch, so a seed gives the same reclaims). When it
launches, its reclaim is handed to the replay (``schedule``), which stops the node's tasks then
and asks ``reclaim`` first: a node released meanwhile is not taken back. A reclaimed node is
charged until then and is launchable again at once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from federation.api.v1 import resources_pb2
from federation.common.node_types import NodeType
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot
from federation.sim.state import Grant, SiteState
from federation.sim.topology import Topology

LAUNCHABLE = resources_pb2.NodeLaunch.STATE_LAUNCHABLE
LAUNCHING = resources_pb2.NodeLaunch.STATE_LAUNCHING
RUNNING = resources_pb2.NodeLaunch.STATE_RUNNING
_LAUNCHED, _IDLE = 0, 1
"""What comes due at a time, in the order handled at one instant."""


@dataclass(slots=True)
class LaunchTally:
    """What one replay's launches came to."""

    launches: int = 0
    node_s: float = 0.0
    """Node-seconds launched: per node, from each launch to its release."""
    usd: float = 0.0
    """Price per node-hour times those hours."""
    waits: list[float] = field(default_factory=list)
    """Seconds from placement to start, per placement that waited for a launch."""
    spot: bool = False
    """Some node type is ``spot``."""
    reclaims: int = 0
    """Spot nodes taken back while they ran."""


class Launches:
    """The launch state of every elastic node of one replay, kept in its snapshot's
    ``node_provision_s`` (the type's delay while launchable or launching, 0 while running)."""

    def __init__(
        self,
        topology: Topology,
        snap: Snapshot,
        seed: int = 0,
        schedule: Callable[[float, int], object] | None = None,
    ) -> None:
        """``schedule(when, node)``: the replay takes ``node`` back at ``when`` (a spot node
        launched now, under its site's reclaim model)."""
        self.snap = snap
        self.tally = LaunchTally()
        index = {name: i for i, name in enumerate(snap.node_names)}
        sites = {name: i for i, name in enumerate(snap.site_ids)}
        self._type: dict[int, NodeType] = {}
        self._at_site: dict[int, list[int]] = {}
        self._release: dict[int, tuple[float, int]] = {}
        """Per site with node types: its ``idle_release_s`` and ``warm_min``."""
        self._lifetime: dict[int, tuple[float, float]] = {}
        """Per site with node types: ``spot_reclaim_after_s`` and ``spot_mean_lifetime_s``."""
        for spec in topology.sites:
            if not spec.node_types:
                continue
            site = sites[spec.name]
            self._release[site] = (spec.idle_release_s, spec.warm_min)
            self._lifetime[site] = (spec.spot_reclaim_after_s, spec.spot_mean_lifetime_s)
            for node_type in spec.node_types:
                for name in node_type.node_names():
                    node = index[f"{spec.name}/{name}"]
                    self._type[node] = node_type
                    self._at_site.setdefault(site, []).append(node)
        self._state = dict.fromkeys(self._type, LAUNCHABLE)
        self._tasks = dict.fromkeys(self._type, 0)
        self._launched_at: dict[int, float] = {}
        self._ready_at: dict[int, float] = {}
        self._idle_since: dict[int, float] = {}
        self._due: list[tuple[float, int, int]] = []
        """(when, what, node): launches that end, idle nodes that may be released then."""
        self._last = 0.0
        """When the last launch ended or node was released."""
        self.tally.spot = any(t.spot for t in self._type.values())
        self._schedule = schedule
        self._rng = np.random.default_rng((seed, 1)) if self.tally.spot else None
        """Draws spot lifetimes; its own stream, so the replay's other draws stay as they were."""
        self._reclaim_at: dict[int, float] = {}
        """When each launched spot node is taken back (under a reclaim model)."""

    @property
    def any(self) -> bool:
        """Whether some site has node types."""
        return bool(self._type)

    def running(self, site: int) -> int:
        """Nodes of ``site``'s node types running now (busy or idle)."""
        return sum(self._state[n] == RUNNING for n in self._at_site.get(site, ()))

    def allocate(self, state: SiteState, req: Request, site: int, min_speed: float) -> Grant:
        """Room for every replica at ``site``, which has it: on running nodes where they hold
        every replica, else on any, launchable ones included (the embedded ``Room._place``)."""
        waiting = [n for n in self._at_site.get(site, ()) if self._state[n] != RUNNING]
        if not waiting:
            return state.allocate(req, site, min_speed)
        schedulable = self.snap.node_schedulable
        schedulable[waiting] = False
        self.snap.memo.clear()
        try:
            fits = state.room(req, site) >= req.replicas
            if fits:
                return state.allocate(req, site, min_speed)
        finally:
            schedulable[waiting] = True
            self.snap.memo.clear()
        return state.allocate(req, site, min_speed)

    def hold(self, nodes: tuple[int, ...], now: float) -> float:
        """A task placed on ``nodes`` now: those launchable launch; when all of them run."""
        ready = now
        for node in set(nodes):
            if node not in self._type:
                continue
            self._tasks[node] += 1
            self._idle_since.pop(node, None)
            if self._state[node] == LAUNCHABLE:
                self._state[node] = LAUNCHING
                self._launched_at[node] = now
                self._ready_at[node] = now + self._type[node].delay_s
                heapq.heappush(self._due, (self._ready_at[node], _LAUNCHED, node))
                self.tally.launches += 1
                self._lifetime_of(node)
            if self._state[node] == LAUNCHING:
                ready = max(ready, self._ready_at[node])
        if ready > now:
            self.tally.waits.append(ready - now)
        return ready

    def leave(self, nodes: tuple[int, ...], now: float) -> None:
        """A task gave back ``nodes``: those it leaves running and empty are idle from now."""
        for node in set(nodes):
            if node in self._type:
                self._tasks[node] -= 1
                self._idle(node, now)

    def advance(self, when: float) -> None:
        """Ends the launches and releases the idle nodes due by ``when``, in time order."""
        while self._due and self._due[0][0] <= when:
            at, what, node = heapq.heappop(self._due)
            if what == _LAUNCHED:
                self._state[node] = RUNNING
                self.snap.node_provision_s[node] = 0.0
                self.snap.memo.clear()
                self._idle(node, at)
            elif self._idle_since.get(node, math.nan) + self._release_s(node) != at:
                continue  # busy again since, or released already
            self._last = at
            self._release_idle(int(self.snap.node_site[node]), at)

    def reclaim(self, node: int, now: float) -> bool:
        """The cloud takes spot ``node`` back now, as scheduled when it launched, unless it
        was released since: charged until now, launchable again. True when taken back (the
        replay then stops its tasks)."""
        if self._reclaim_at.get(node) != now or self._state[node] != RUNNING:
            return False
        del self._reclaim_at[node]
        self._idle_since.pop(node, None)
        self._state[node] = LAUNCHABLE
        self.snap.node_provision_s[node] = self._type[node].delay_s
        self.snap.memo.clear()
        self._charge(node, now)
        self._last = max(self._last, now)
        self.tally.reclaims += 1
        return True

    def finish(self, now: float) -> None:
        """The replay ended at ``now``: what is due still happens, and nodes still running
        (kept by ``warm_min``) are charged until the end."""
        self.advance(math.inf)
        end = max(now, self._last)
        for node, node_state in self._state.items():
            if node_state == RUNNING:
                self._charge(node, end)

    def _lifetime_of(self, node: int) -> None:
        """A spot node launches: when its site's reclaim model takes it back, if ever."""
        after_s, mean_s = self._lifetime[int(self.snap.node_site[node])]
        if not self._type[node].spot or not (after_s or mean_s) or self._schedule is None:
            return
        assert self._rng is not None
        life_s = after_s or float(self._rng.exponential(mean_s))
        self._reclaim_at[node] = self._ready_at[node] + life_s
        self._schedule(self._reclaim_at[node], node)

    def _release_s(self, node: int) -> float:
        return self._release[int(self.snap.node_site[node])][0]

    def _idle(self, node: int, now: float) -> None:
        if self._state[node] == RUNNING and not self._tasks[node]:
            self._idle_since[node] = now
            heapq.heappush(self._due, (now + self._release_s(node), _IDLE, node))

    def _release_idle(self, site: int, now: float) -> None:
        """The agent's ``release_idle`` at ``site``: nodes idle for ``idle_release_s``,
        longest idle first, while more than ``warm_min`` run."""
        release_s, warm_min = self._release[site]
        idle = sorted(
            (since, node)
            for node in self._at_site[site]
            if (since := self._idle_since.get(node)) is not None and since + release_s <= now
        )
        spare = max(0, self.running(site) - warm_min)
        for _, node in idle[:spare]:
            del self._idle_since[node]
            self._reclaim_at.pop(node, None)
            self._state[node] = LAUNCHABLE
            self.snap.node_provision_s[node] = self._type[node].delay_s
            self._charge(node, now)
        if idle[:spare]:
            self.snap.memo.clear()

    def _charge(self, node: int, until: float) -> None:
        seconds = until - self._launched_at[node]
        self.tally.node_s += seconds
        node_type = self._type[node]
        price = node_type.spot_price_per_hour if node_type.spot else node_type.price_per_hour
        self.tally.usd += price * seconds / 3600.0
