"""The room on the embedded core's nodes: what reservations and unfinished tasks hold, and
where an offer, or the replicas a service's change adds, fits (the node has the final say:
``federation.agent.node_fit``). Held capacity is never tracked incrementally: it is
recomputed from the reservations and the tasks whenever it is needed."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence

import structlog

from federation.agent.commits import epoch_problem
from federation.agent.containers import Containers
from federation.agent.device_env import device_labels
from federation.agent.elastic import Elastic
from federation.agent.embedded.reservations import Reservation, Reservations, accepted
from federation.agent.embedded.task import Task
from federation.agent.node_fit import qualifying_nodes, task_problem
from federation.agent.owner_share import held
from federation.agent.packing import Placed, place_as_estimated
from federation.agent.service import is_service
from federation.agent.usage import Slot, Usage
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common.keys import RunKey
from federation.placement.compat import CompatTable
from federation.resources import capacity, owner_share_refusal

log = structlog.get_logger()

DEFAULT_LEASE_S = 10.0
"""How long a reservation is held when the offer names no lease."""


def fixed_port_problem(spec: jobs_pb2.TaskSpec) -> str:
    """Why a service's replicas cannot run here with the port its spec fixes, or ""."""
    if is_service(spec) and spec.service.port and spec.replicas > 1:
        return (
            f"service.port {spec.service.port} is fixed, and this site runs every replica on "
            "one machine: only one could listen on it (give port 0 for a port per replica)"
        )
    return ""


class Room:
    """Decides offers on the site's nodes and holds the room they take.

    Args:
        nodes: The site's nodes by name.
        reservations: The reservations not yet committed.
        tasks: The tasks by key (the unfinished ones hold room).
        elastic: The site's launchable nodes, if it has any.
        levels: Node labels that are the site's topology levels, widest first.
        compat: How software requirements are read.
        owner_share: What the site's owners keep for themselves.
        containers: Says why an image is refused.
        changed: Called when a reservation is taken.
    """

    def __init__(
        self,
        nodes: dict[str, resources_pb2.Node],
        reservations: Reservations,
        tasks: dict[RunKey, Task],
        *,
        elastic: Elastic | None,
        levels: Sequence[str],
        compat: CompatTable,
        owner_share: resources_pb2.OwnerShare,
        containers: Containers,
        changed: Callable[[], None],
    ) -> None:
        self._nodes = nodes
        self._reservations = reservations
        self._tasks = tasks
        self._elastic = elastic
        self._levels = tuple(levels)
        self._compat = compat
        self._owner_share = owner_share
        self._containers = containers
        self._changed = changed

    async def offer(self, offer: site_link_service_pb2.Offer) -> site_link_service_pb2.OfferAnswer:
        """Reserves room for every replica of the task at once, or declines with a reason."""
        key: RunKey = (offer.job_id, offer.task, offer.epoch)
        lease_s = offer.lease_s if offer.lease_s > 0 else DEFAULT_LEASE_S
        held = self._reservations.for_task(key)
        if held is not None:
            # A repeated offer: the same reservation, its lease renewed from now.
            held = dataclasses.replace(held, lease_s=lease_s)
            self._reservations.hold(held)
            return accepted(held)
        problem = self._offer_problem(offer)
        nodes = problem or qualifying_nodes(self._nodes.values(), offer, self._compat)
        placed = nodes if isinstance(nodes, str) else self._place(nodes, offer)
        if not isinstance(placed, str):
            placed = self.owner_share_refusal(offer.tenant, placed.slots) or placed
        if isinstance(placed, str):
            log.info("offer_declined", job_id=key[0], task=key[1], epoch=key[2], reason=placed)
            return site_link_service_pb2.OfferAnswer(accepted=False, reason=placed)
        spec = jobs_pb2.TaskSpec()
        spec.CopyFrom(offer.spec)
        restore = offer.restore if offer.HasField("restore") else None
        reservation = Reservation(
            uuid.uuid4().hex,
            key,
            spec,
            placed.slots,
            lease_s,
            restore,
            tenant=offer.tenant,
            run_s=placed.run_s,
            device_model=placed.device_model,
            stop_after_s=offer.stop_after_disconnect_s,
            revision=offer.revision,
        )
        self._reservations.hold(reservation)
        log.info(
            "offer_accepted",
            job_id=key[0],
            task=key[1],
            epoch=key[2],
            reservation_id=reservation.id,
            nodes=[slot.node for slot in placed.slots],
            run_s=round(placed.run_s, 1),
        )
        self._changed()
        return accepted(reservation)

    def _place(
        self, nodes: list[resources_pb2.Node], offer: site_link_service_pb2.Offer
    ) -> Placed | str:
        """Room for the offer: on running nodes where they have it, else (an elastic site)
        with nodes still to launch."""
        usage, speed, levels = self.usage(), offer.estimate.device_speed, self._levels
        if self._elastic is None:
            return place_as_estimated(nodes, offer.spec, usage, speed, levels)
        running = [node for node in nodes if self._elastic.ready(node.name)]
        placed = place_as_estimated(running, offer.spec, usage, speed, levels) if running else ""
        if isinstance(placed, str):
            placed = place_as_estimated(nodes, offer.spec, usage, speed, levels)
        return placed

    def _offer_problem(self, offer: site_link_service_pb2.Offer) -> str:
        """Why an offer is declined before placement is even tried, or ""."""
        if problem := task_problem(offer):
            return problem
        if offer.spec.image and (problem := self._containers.refusal(offer.spec.image)):
            return problem
        if problem := fixed_port_problem(offer.spec):
            return problem
        return epoch_problem(offer, (r.key for r in self._reservations), self._tasks)

    def owner_share_refusal(self, tenant: str, slots: Iterable[Slot]) -> str | None:
        """Why ``tenant`` may not hold ``slots`` by the site's owner share, or None."""
        share = self._owner_share
        if not share.keep or tenant in share.tenants:
            return None
        guests = [s for r in self._reservations if r.tenant not in share.tenants for s in r.slots]
        guests += [
            s
            for t in self._tasks.values()
            if t.active and t.tenant not in share.tenants
            for s in t.slots
        ]
        return owner_share_refusal(
            share,
            tenant,
            held(slots, self._nodes),
            held(guests, self._nodes),
            capacity(self._nodes.values()),
        )

    def usage(self) -> Usage:
        held = [slot for r in self._reservations for slot in r.slots]
        held += [slot for t in self._tasks.values() if t.active for slot in t.slots]
        return Usage.of(held)

    def place_added(
        self,
        task: Task,
        new: jobs_pb2.TaskSpec,
        change: site_link_service_pb2.ChangeTask,
        extra: int,
    ) -> tuple[Slot, ...] | str:
        """Room for ``extra`` more replicas of a service, on nodes that may run it."""
        spec = jobs_pb2.TaskSpec()
        spec.CopyFrom(new)
        spec.replicas = extra
        wanted = site_link_service_pb2.Offer(
            spec=spec,
            tenant=task.tenant,
            node_labels=change.node_labels,
            cordoned_nodes=change.cordoned_nodes,
        )
        nodes = qualifying_nodes(self._nodes.values(), wanted, self._compat)
        if isinstance(nodes, str):
            return nodes
        placed = place_as_estimated(nodes, spec, self.usage(), 0.0)
        if isinstance(placed, str):
            return placed
        return self.owner_share_refusal(task.tenant, placed.slots) or placed.slots

    def device_labels(self, slots: Iterable[Slot]) -> list[str]:
        return [label for slot in slots for label in device_labels(self._nodes[slot.node], slot)]

    def busy_nodes(self) -> set[str]:
        """Nodes that hold a reservation or an unfinished task."""
        held = [r.slots for r in self._reservations]
        held += [t.slots for t in self._tasks.values() if t.active]
        return {slot.node for slots in held for slot in slots}

    def to_launch(self, task: Task) -> set[str]:
        """The nodes of the task that an elastic site has yet to launch."""
        if self._elastic is None:
            return set()
        return {slot.node for slot in task.slots if not self._elastic.ready(slot.node)}
