"""Elastic nodes launched by Ray's autoscaler: ``[elastic] provider = "ray"`` on a Ray site.

Each of the inventory's node types is a node type of the Ray cluster's autoscaling config of
the same name, which declares a custom resource of that name, 1 per node (``a100x2: 1``):
asking the autoscaler for that resource starts exactly a node of that type, and the resource
tells the site which Ray nodes are of which type.

* **Launch.** The provider asks the autoscaler for one ``{TYPE: 1}`` bundle per node of the
  site launching or running (``ray.autoscaler.sdk.request_resources``, which replaces the
  cluster's previous request: the site owns it), then waits until a Ray node with the resource
  is alive that no other node of the site stands for, and keeps which Ray node (its id) is which
  of the site's nodes. A launch the autoscaler reports failed, or that brings no node within
  the timeout (``[elastic] launch_timeout_s``, else 3 x the type's p90 delay), raises
  ``LaunchError`` with what the autoscaler said; its demand is withdrawn.
* **Release.** The node's bundle is withdrawn from the request; the autoscaler removes the node
  once it has been idle for its ``idle_timeout_minutes``. Until then the node is no longer the
  site's (it is out of the view), and a launch of its type may take it back.
* **Lost.** A Ray node of the site that dies (the cloud took it back, or the autoscaler removed
  it) is reported taken back (``Provider.watch``): its node is launchable again, and the Ray
  core stops the tasks that were on it and reports them interrupted.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from federation.agent.elastic import LaunchError, TakenBack
from federation.common.node_types import NodeType

log = structlog.get_logger()

POLL_S = 0.5
"""Time between two readings of Ray's nodes while a launch waits."""
TIMEOUT_P90S = 3.0
"""Without ``launch_timeout_s``, a launch fails after this many times the type's p90 delay."""
STATUS_KEY = "__autoscaling_status"
"""Where Ray's autoscaler (the monitor) writes its report in the GCS key-value store."""


class RayAutoscalerProvider:
    """Launches and releases the site's nodes through Ray's autoscaler; a ``Provider``.

    Ray must be connected (``ray.init``) before a launch: the Ray core does so when it starts.

    Args:
        types: The site's node types; each names a Ray resource and an autoscaler node type.
        timeout_s: How long a launch may take; 0: ``TIMEOUT_P90S`` x the type's p90 delay.
        delays: The p50 and p90 launch delay of a type as the site learned them
            (``Elastic.delays``); unset: the type's configured ``delay_s``.
    """

    def __init__(
        self,
        types: Iterable[NodeType],
        *,
        timeout_s: float = 0.0,
        delays: Callable[[str], tuple[float, float]] | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self._types = {t.name: t for t in types}
        self._timeout_s = timeout_s
        self.delays = delays
        self._poll_s = poll_s
        self._ray_node: dict[str, str] = {}
        """The site's node → the id of the Ray node that is it."""
        self._claimed_at: dict[str, float] = {}
        """When (monotonic) each launched node was claimed: a reading of Ray's nodes taken
        before that may not show it yet."""
        self._wanted: dict[str, str] = {}
        """The site's nodes launching or running → their type: the autoscaler's request."""
        self._requesting = asyncio.Lock()
        self._taken_back: TakenBack | None = None

    # What the Ray core's view needs ---------------------------------------------------------

    def names(self) -> dict[str, str]:
        """Ray node id → the site's node it is, for the nodes launched and not released."""
        return {ray_id: node for node, ray_id in self._ray_node.items()}

    def ray_node(self, node: str) -> str | None:
        """The id of the Ray node that is ``node``; None when it does not run."""
        return self._ray_node.get(node)

    def type_of(self, record: Mapping[str, Any]) -> str | None:
        """The node type a Ray node (a ``ray.nodes()`` record) is of, by its resource."""
        resources = record.get("Resources") or {}
        return next((t for t in sorted(self._types) if resources.get(t, 0) >= 1), None)

    def visible(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records of ``ray.nodes()`` the site's view shows: nodes of no type, and nodes
        of a type that stand for one of the site's nodes. A node of a type that does not (it
        is starting for a launch, or released and waiting for the autoscaler to remove it)
        is left out: the site's node it may become is in the view, launching or launchable."""
        names = self.names()
        return [r for r in records if self.type_of(r) is None or r.get("NodeID") in names]

    async def lost(self, records: list[dict[str, Any]], read_at: float) -> list[str]:
        """The site's launched nodes whose Ray node is no longer alive in ``records`` (read
        from ``ray.nodes()`` starting at ``read_at``, monotonic): forgotten here, reported
        taken back, and withdrawn from the autoscaler's request (else it would start others
        for them). A node claimed after the reading began is not judged by it. Returns their
        names."""
        alive = {r.get("NodeID") for r in records if r.get("Alive")}
        gone = [
            (node, ray_id)
            for node, ray_id in self._ray_node.items()
            if ray_id not in alive and self._claimed_at.get(node, -math.inf) <= read_at
        ]
        for node, ray_id in gone:
            del self._ray_node[node]
            self._claimed_at.pop(node, None)
            self._wanted.pop(node, None)
            log.warning("ray_node_lost", node=node, ray_node=ray_id)
            if self._taken_back is not None:
                self._taken_back(node, f"its Ray node {ray_id} is no longer alive")
        if gone:
            await self._request()
        return [node for node, _ in gone]

    async def adopt(self, node_names: Iterable[str]) -> list[str]:
        """Takes the alive Ray nodes of the site's types (launched for the agent before this
        one) as the first of ``node_names`` of their type not running; returns those names.
        They stay in the autoscaler's request until released."""
        import ray

        records = await asyncio.to_thread(ray.nodes)
        free = [n for n in node_names if n not in self._ray_node]
        taken = set(self._ray_node.values())
        adopted = []
        for record in sorted(records, key=lambda r: str(r.get("NodeID"))):
            node_type = self.type_of(record)
            if not record.get("Alive") or node_type is None or record["NodeID"] in taken:
                continue
            node = next((n for n in free if n.rsplit("-", 1)[0] == node_type), None)
            if node is None:
                continue
            free.remove(node)
            self._ray_node[node], self._wanted[node] = record["NodeID"], node_type
            self._claimed_at[node] = time.monotonic()
            adopted.append(node)
        if adopted:
            log.info("ray_nodes_adopted", nodes=adopted)
            await self._request()
        return adopted

    # Provider --------------------------------------------------------------------------------

    def watch(self, taken_back: TakenBack) -> None:
        """Reports the launched nodes Ray loses (``lost``, on each reading of Ray's nodes)."""
        self._taken_back = taken_back

    async def launch(self, node: str, node_type: NodeType) -> None:
        """Asks the autoscaler for the node and returns once a Ray node of its type is alive
        (that Ray node is ``node`` from now on); raises LaunchError with Ray's word."""
        import ray

        timeout_s = self.timeout_s(node_type)
        self._wanted[node] = node_type.name
        deadline = time.monotonic() + timeout_s
        try:
            await self._request()
            while True:
                records = await asyncio.to_thread(ray.nodes)
                if (found := self._unclaimed(records, node_type.name)) is not None:
                    self._ray_node[node], self._claimed_at[node] = found, time.monotonic()
                    log.info("ray_node_claimed", node=node, ray_node=found)
                    return
                report = await asyncio.to_thread(_autoscaler_report)
                if failure := _failure(report, node_type.name):
                    raise LaunchError(
                        f"Ray's autoscaler could not launch a {node_type.name} node: {failure}"
                    )
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"Ray started no {node_type.name} node (resource "
                        f"{{{node_type.name!r}: 1}}) within {timeout_s:.0f}s; its autoscaler "
                        f"reports {_summary(report, node_type.name)}"
                    )
                await asyncio.sleep(self._poll_s)
        except BaseException:
            self._wanted.pop(node, None)
            await asyncio.shield(self._request())
            raise

    async def release(self, node: str) -> None:
        """Withdraws the node from the autoscaler's request: Ray removes it once idle."""
        self._ray_node.pop(node, None)
        self._claimed_at.pop(node, None)
        if self._wanted.pop(node, None) is not None:
            await self._request()

    def timeout_s(self, node_type: NodeType) -> float:
        if self._timeout_s > 0:
            return self._timeout_s
        p90 = self.delays(node_type.name)[1] if self.delays else node_type.delay_s
        return TIMEOUT_P90S * p90

    def _unclaimed(self, records: list[dict[str, Any]], node_type: str) -> str | None:
        taken = set(self._ray_node.values())
        ids = sorted(
            r["NodeID"]
            for r in records
            if r.get("Alive") and self.type_of(r) == node_type and r["NodeID"] not in taken
        )
        return ids[0] if ids else None

    async def _request(self) -> None:
        """Sends the demand as it is now. One request at a time, each read when it is sent: a
        request replaces the one before, so an older demand must never be sent last."""
        from ray.autoscaler.sdk import request_resources

        async with self._requesting:
            bundles = [{node_type: 1} for _, node_type in sorted(self._wanted.items())]
            await asyncio.to_thread(request_resources, bundles=bundles)
        log.debug("ray_resources_requested", bundles=len(bundles))


def _autoscaler_report(key: str = STATUS_KEY) -> dict[str, Any]:
    """The autoscaler's last report ({} when there is none: no autoscaler runs)."""
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        raw = _internal_kv_get(key)
        return dict(json.loads(raw)) if raw else {}
    except Exception as err:  # an unreadable report is no reason to fail a launch
        log.debug("autoscaler_report_unreadable", error=str(err))
        return {}


def _failure(report: Mapping[str, Any], node_type: str) -> str:
    """Why the autoscaler cannot launch nodes of ``node_type``, from its report; "" if not."""
    said = report.get("autoscaler_report") or {}
    summary = (said.get("node_availability_summary") or {}).get("node_availabilities") or {}
    available = summary.get(node_type) or {}
    if available and available.get("is_available") is False:
        info = available.get("unavailable_node_information") or {}
        return str(info.get("description") or info.get("category") or "unavailable")
    return ""


def _summary(report: Mapping[str, Any], node_type: str) -> str:
    """What the autoscaler says of ``node_type``, in one line."""
    said = report.get("autoscaler_report")
    if not said:
        return "nothing (is the head started with --autoscaling-config?)"
    active = (said.get("active_nodes") or {}).get(node_type, 0)
    pending = [p for p in said.get("pending_nodes") or [] if node_type in map(str, p)]
    launches = (said.get("pending_launches") or {}).get(node_type, 0)
    failed = [f for f in said.get("failed_nodes") or [] if node_type in map(str, f)]
    requested = [
        count
        for bundle, count in (report.get("load_metrics_report") or {}).get("request_demand") or []
        if bundle == {node_type: 1}
    ]
    return (
        f"{active} {node_type} node(s) active, {launches} launching, {len(pending)} pending, "
        f"{len(failed)} failed, {sum(requested)} requested (no node type of its autoscaling "
        f"config that declares the resource {node_type!r}, or its max_workers reached?)"
    )
