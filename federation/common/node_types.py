"""Node types of elastic sites: kinds of node a site launches when a task needs them.

Shared by the site agents that launch them (``federation.agent.elastic``) and the simulator
that replays them (``federation.sim.elastic``), so that both publish a launchable node alike:
its hardware from the type's template, its launch state, delay and price in ``Node.launch``.
"""

from __future__ import annotations

from dataclasses import dataclass

from federation.api.v1 import resources_pb2

MAX_LAUNCHABLE = 1000
"""Nodes of one type a site may launch: each is a node of its view."""
DEFAULT_DELAY_S = 60.0
"""A type's expected launch delay when its declaration gives none."""
IDLE_RELEASE_S = 300.0
"""A launched node that holds no task this long is released, unless configured otherwise."""


@dataclass(frozen=True, slots=True)
class NodeType:
    """One kind of node a site may launch, as its inventory declares it."""

    name: str
    template: resources_pb2.Node
    """The hardware of one such node (its name unset)."""
    max: int
    """How many may run at once (the site's quota)."""
    price_per_hour: float = 0.0
    spot_price_per_hour: float = 0.0
    delay_s: float = DEFAULT_DELAY_S
    """Expected launch delay until launches are measured; the simulated provider's delay."""
    spot: bool = False
    """Its nodes are launched as spot capacity: charged ``spot_price_per_hour``, and the cloud
    may take one back at any time (its tasks are then placed again)."""

    def node_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.max)]

    def node(self, name: str) -> resources_pb2.Node:
        """One node of the type called ``name``, labelled with the type, its devices' ids
        ``<name>-<index>``; without ``launch`` (see ``node_launch``)."""
        node = resources_pb2.Node()
        node.CopyFrom(self.template)
        node.name = name
        node.labels["node_type"] = self.name
        for i, device in enumerate(node.devices):
            device.id = f"{name}-{i}"
        return node

    def launch(
        self,
        state: resources_pb2.NodeLaunch.State.ValueType,
        delay_p50_s: float,
        delay_p90_s: float,
        idle_since: float = 0.0,
    ) -> resources_pb2.NodeLaunch:
        """What a node of the type publishes in ``Node.launch``: its state, launch delay
        and prices."""
        return resources_pb2.NodeLaunch(
            node_type=self.name,
            state=state,
            delay_p50_s=delay_p50_s,
            delay_p90_s=delay_p90_s,
            price_per_hour=self.price_per_hour,
            spot_price_per_hour=self.spot_price_per_hour,
            idle_since=idle_since,
            spot=self.spot,
        )
