"""Elastic capacity: nodes a cloud site launches when a task needs them and releases when
idle, through a provider.

The site's inventory declares node types (``node_types``: a node's hardware, how many may
run, the price per node-hour and the expected launch delay). The agent publishes every node it
may run, each with ``Node.launch``: LAUNCHABLE ones carry their capacity, their delay (p50 and
p90, learned from the site's own launches) and price, so the coordinator's placement counts
them with the delay added to the completion time and the price to the cost. An offer goes to
running nodes where they have room, else to launchable ones; the commit launches them, and the
task starts once they run (it stays DELEGATED meanwhile, like a task staging its inputs). A
running node that has held no task for ``idle_release_s`` is released (at most down to
``warm_min`` running), and is launchable again.

Spot nodes: a node type declared ``spot`` is launched as spot capacity, charged its
``spot_price_per_hour``, and its cloud may take a node back at any time. The provider tells the
site through the callback ``Elastic`` handed it (``Provider.watch``): the node is launchable
again at once, and the core stops the tasks on it and reports them interrupted, so the
coordinator places them again, from their newest checkpoints, without counting a failed attempt.

Providers: ``simulated`` starts no machine (a node "launches" after its type's delay; the
tasks run on the agent's host, as the declared inventory's do), and with
``spot_reclaim_after_s`` takes each spot node back that long after it runs: for tests, demos
and rehearsals. ``ray`` asks the autoscaler of the site's Ray cluster for nodes, and the Ray core
runs the tasks on them (``datacenter_agent.ray_cluster.autoscaler``); a launched Ray node that
dies is reported taken back. A real cloud's provider implements ``Provider``: an AWS one would
call the callback on a spot interruption notice (instance metadata or EventBridge), a GCP one
on a preemption.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import structlog

from federation.api.v1 import resources_pb2
from federation.common.node_types import IDLE_RELEASE_S, NodeType
from federation.config import at_least, one_of, positive

log = structlog.get_logger()

State: TypeAlias = resources_pb2.NodeLaunch.State.ValueType
LAUNCHABLE = resources_pb2.NodeLaunch.STATE_LAUNCHABLE
LAUNCHING = resources_pb2.NodeLaunch.STATE_LAUNCHING
RUNNING = resources_pb2.NodeLaunch.STATE_RUNNING
LEARNED_LAUNCHES = 20
"""Launches per node type whose delays give its p50 and p90."""
IDLE_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class ElasticSettings:
    """The ``[elastic]`` table of an agent's config."""

    provider: str = field(default="", metadata=one_of("", "simulated", "ray"))
    """Who starts and stops the inventory's ``node_types``; empty: none (they are ignored).
    ``ray``: Ray's autoscaler, on a ``scheduler = "ray"`` site
    (``datacenter_agent.ray_cluster.autoscaler``)."""
    idle_release_s: float = field(default=IDLE_RELEASE_S, metadata=positive())
    """A launched node that holds no task this long is released."""
    warm_min: int = field(default=0, metadata=at_least(0))
    """At least this many launched nodes stay running, busy or idle."""
    launch_timeout_s: float = field(default=0.0, metadata=at_least(0))
    """How long a launch may take before it fails (the ``ray`` provider); 0: three times the
    type's p90 launch delay."""
    spot_reclaim_after_s: float = field(default=0.0, metadata=at_least(0))
    """The ``simulated`` provider takes each node of a ``spot`` type back this long after it
    runs, as a cloud reclaims spot capacity; 0: never."""


TakenBack: TypeAlias = Callable[[str, str], None]
"""Told that a node was taken back: its name and why."""


class LaunchError(Exception):
    """A provider could not start a node; the message says why."""


class Provider(Protocol):
    """Starts and stops the machines of an elastic site.

    ``Elastic`` calls it, one coroutine per node, on the agent's event loop (blocking cloud
    calls belong in ``asyncio.to_thread``). ``node`` is the site's name for the node
    (``<type>-<index>``, stable: the provider keeps which machine is which node); ``node_type``
    its hardware, ``max``, prices and configured ``delay_s``. The core runs a node's tasks once
    ``launch`` returns, and ``Elastic`` learns the type's delay from how long it took.
    """

    def watch(self, taken_back: TakenBack) -> None:
        """Takes the site's callback for nodes lost, once, before any launch. The provider
        calls ``taken_back(node, why)`` on the agent's event loop (from a thread:
        ``loop.call_soon_threadsafe``) when a node it launched is gone without a release: a
        spot node the cloud takes back (an interruption notice, a preemption), a machine that
        died. ``why`` says so in a few words; the tasks on the node are reported interrupted
        with it. A node still launching fails its ``launch`` instead. Providers that never lose
        a node keep nothing."""

    async def launch(self, node: str, node_type: NodeType) -> None:
        """Starts a machine of the type for ``node`` and returns once it runs and can take
        tasks. Raises LaunchError saying why not (quota, capacity, timeout: the message is
        the task's failure reason), having stopped or withdrawn whatever it started. It may be
        cancelled (the agent stops); it then withdraws its request too."""

    async def release(self, node: str) -> None:
        """Stops the node's machine (it holds no task); ``node`` may be launched again later."""


class SimulatedProvider:
    """Launches nothing: a node runs after its type's ``delay_s`` (tasks run on the agent's
    host, as for a declared inventory). With ``spot_reclaim_after_s``, each node of a spot type
    is taken back that long after it runs, unless released first. For tests, demos and
    rehearsals."""

    def __init__(self, spot_reclaim_after_s: float = 0.0) -> None:
        self._reclaim_after_s = spot_reclaim_after_s
        self._taken_back: TakenBack | None = None
        self._reclaims: dict[str, asyncio.TimerHandle] = {}
        self.launched: list[str] = []
        """The nodes it launched, in order (a node launched twice is there twice)."""

    def watch(self, taken_back: TakenBack) -> None:
        self._taken_back = taken_back

    async def launch(self, node: str, node_type: NodeType) -> None:
        await asyncio.sleep(node_type.delay_s)
        self.launched.append(node)
        if node_type.spot and self._reclaim_after_s > 0:
            self._reclaims[node] = asyncio.get_running_loop().call_later(
                self._reclaim_after_s, self._reclaim, node
            )

    async def release(self, node: str) -> None:
        if (reclaim := self._reclaims.pop(node, None)) is not None:
            reclaim.cancel()

    def _reclaim(self, node: str) -> None:
        del self._reclaims[node]
        if self._taken_back is not None:
            why = f"spot capacity reclaimed (simulated, {self._reclaim_after_s:g}s after launch)"
            self._taken_back(node, why)


def provider_named(settings: ElasticSettings) -> Provider:
    """The provider of an embedded site; ``ray``'s is the Ray core's own."""
    if settings.provider == "simulated":
        return SimulatedProvider(settings.spot_reclaim_after_s)
    raise ValueError(f"unknown elastic provider {settings.provider!r} for this core")


class Elastic:
    """The launch state of an elastic site's nodes."""

    def __init__(
        self,
        types: Iterable[NodeType],
        provider: Provider,
        settings: ElasticSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._types = {t.name: t for t in types}
        self._provider = provider
        self._settings = settings
        self._clock = clock
        self._type_of = {name: t for t in self._types.values() for name in t.node_names()}
        self._state: dict[str, State] = dict.fromkeys(self._type_of, LAUNCHABLE)
        self._idle_since: dict[str, float] = {}
        self._launches: dict[str, asyncio.Task[None]] = {}
        self._delays: dict[str, deque[float]] = {
            t: deque(maxlen=LEARNED_LAUNCHES) for t in self._types
        }
        self._on_taken_back: TakenBack | None = None
        provider.watch(self._reported_lost)

    def on_taken_back(self, handler: TakenBack) -> None:
        """The core's handler for a node its provider lost: it stops the tasks there and
        reports them interrupted. Called once the node is launchable again."""
        self._on_taken_back = handler

    def nodes(self) -> list[resources_pb2.Node]:
        """Every node the site may launch, as launchable nodes with their capacity."""
        out = []
        for name, node_type in self._type_of.items():
            node = node_type.node(name)
            self.decorate(node)
            out.append(node)
        return out

    def decorate(self, node: resources_pb2.Node) -> None:
        """Sets ``node.launch`` from its state now (nothing for a node that is not elastic)."""
        node_type = self._type_of.get(node.name)
        if node_type is None:
            return
        p50, p90 = self.delays(node_type.name)
        idle_since = self._idle_since.get(node.name, 0.0)
        node.launch.CopyFrom(node_type.launch(self._state[node.name], p50, p90, idle_since))

    def delays(self, node_type: str) -> tuple[float, float]:
        """The p50 and p90 launch delay of the type: learned, else as configured."""
        seen = self._delays[node_type]
        if not seen:
            configured = self._types[node_type].delay_s
            return configured, configured
        if len(seen) == 1:
            return seen[0], seen[0]
        cuts = statistics.quantiles(seen, n=10, method="inclusive")
        return statistics.median(seen), cuts[8]

    def ready(self, node: str) -> bool:
        """Whether the node runs now (a node that is not elastic always does)."""
        return self._state.get(node, RUNNING) == RUNNING

    def running(self, nodes: Collection[str]) -> None:
        """Marks nodes running without a launch: a restarted agent found tasks on them."""
        for node in nodes:
            if node in self._state:
                self._state[node] = RUNNING

    async def ensure_running(self, nodes: Collection[str], changed: Callable[[], None]) -> None:
        """Launches those of ``nodes`` not running (each once, however many tasks wait for
        it) and returns once all run; raises LaunchError naming the node that failed."""
        waits = []
        for node in nodes:
            if self.ready(node):
                continue
            launch = self._launches.get(node)
            if launch is None:
                launch = self._launches[node] = asyncio.create_task(self._launch(node, changed))
            waits.append(asyncio.shield(launch))
        await asyncio.gather(*waits)

    async def _launch(self, node: str, changed: Callable[[], None]) -> None:
        node_type = self._type_of[node]
        self._state[node] = LAUNCHING
        changed()
        started = time.monotonic()
        log.info("node_launching", node=node, node_type=node_type.name)
        try:
            await self._provider.launch(node, node_type)
        except Exception as exc:
            self._state[node] = LAUNCHABLE
            changed()
            log.warning("node_launch_failed", node=node, error=str(exc))
            raise LaunchError(f"launching node {node} ({node_type.name}) failed: {exc}") from exc
        finally:
            del self._launches[node]
        delay_s = time.monotonic() - started
        self._delays[node_type.name].append(delay_s)
        self._state[node] = RUNNING
        self._idle_since[node] = self._clock()
        log.info("node_launched", node=node, node_type=node_type.name, delay_s=round(delay_s, 2))
        changed()

    def taken_back(self, node: str, why: str = "") -> bool:
        """The provider lost a running or launching node (a spot node taken back by the
        cloud): it is launchable again. False for a node not elastic or not running."""
        if self._state.get(node, LAUNCHABLE) == LAUNCHABLE:
            return False
        self._state[node] = LAUNCHABLE
        self._idle_since.pop(node, None)
        log.warning("node_taken_back", node=node, why=why)
        return True

    def _reported_lost(self, node: str, why: str) -> None:
        """The provider's callback: the node is launchable again, and the core stops its
        tasks. A node not launched (released meanwhile, say) is ignored."""
        if not self.taken_back(node, why):
            log.info("node_taken_back_ignored", node=node, why=why)
            return
        if self._on_taken_back is not None:
            self._on_taken_back(node, why)

    async def release_idle(self, busy: Collection[str], changed: Callable[[], None]) -> list[str]:
        """Releases the running nodes idle for idle_release_s, longest idle first, keeping
        warm_min running; returns their names."""
        now = self._clock()
        running = [n for n, s in self._state.items() if s == RUNNING]
        for node in running:
            if node in busy:
                self._idle_since.pop(node, None)
            else:
                self._idle_since.setdefault(node, now)
        idle = sorted(
            (self._idle_since[n], n)
            for n in running
            if n not in busy and now - self._idle_since[n] >= self._settings.idle_release_s
        )
        spare = max(0, len(running) - self._settings.warm_min)
        released = [node for _, node in idle[:spare]]
        for node in released:
            await self._provider.release(node)
            self._state[node] = LAUNCHABLE
            idle_s = now - self._idle_since.pop(node)
            log.info("node_released", node=node, idle_s=round(idle_s, 1))
        if released:
            changed()
        return released

    async def run(self, busy: Callable[[], Collection[str]], changed: Callable[[], None]) -> None:
        """Releases idle nodes, every IDLE_CHECK_S."""
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            try:
                await self.release_idle(busy(), changed)
            except Exception:
                log.exception("idle_release_failed")
