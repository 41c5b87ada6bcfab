"""This coordinator's part: its services while it leads, a refusal naming the leader otherwise.

The gRPC servers run from start to stop whatever the part. Every servicer asks ``current()``
for the services of the term in progress; on a follower (or a leader that just stepped down)
that raises ``NotLeaderError``, which reaches the caller as ``UNAVAILABLE`` with reason
``NOT_LEADER`` and the leader's addresses in its ``ErrorInfo``. Health follows the part: the
coordinator's services report ``SERVING`` only on the leader, the server as a whole always.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from federation.coordinator.ha.fencing import FencedStore, not_leader
from federation.coordinator.ha.leader import CoordinatorInfo
from federation.coordinator.services import Services
from federation.metrics import COORDINATOR_LEADER

log = structlog.get_logger()


class Leadership:
    """Holds the current term's services and keeps health in step with them.

    Args:
        health: Health servicers of this coordinator's servers.
        service_names: The services whose health follows the lead.
    """

    def __init__(
        self, health: Sequence[health_aio.HealthServicer], service_names: Sequence[str]
    ) -> None:
        self._health = tuple(health)
        self._names = tuple(service_names)
        self._services: Services | None = None
        self._fence: FencedStore | None = None
        self.leader: Callable[[], CoordinatorInfo | None] = lambda: None
        """Who leads now, for refusals; set once the election exists."""

    @property
    def is_leading(self) -> bool:
        """Whether a term is in progress here."""
        return self._services is not None

    def current(self) -> Services:
        """The services of the term in progress.

        Raises:
            NotLeaderError: This coordinator does not lead (any more).
        """
        services = self._services
        if services is None or services.ended is not None:
            raise not_leader(self.leader())
        return services

    async def lead(self, services: Services, fence: FencedStore | None = None) -> None:
        """Serve a new term; ``fence`` is the store view its writes go through, if fenced."""
        self._services = services
        self._fence = fence
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        COORDINATOR_LEADER.set(1)
        log.info("term_started", fenced=fence is not None)

    async def follow(self) -> None:
        """End the term at once (the lead is lost): refuse writes, end sessions and watches."""
        if self._fence is not None:
            self._fence.fence()  # first, before anything can await
        services, self._services = self._services, None
        # Not serving before the term's streams end: a client they send away, or a health
        # check, never finds this one still serving while its services stop.
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if services is not None:
            await services.stop(step_down=not_leader(self.leader()))
        COORDINATOR_LEADER.set(0)

    async def stop(self) -> None:
        """End the term for a shutdown; the servers' own stop ends the streams."""
        services, self._services = self._services, None
        COORDINATOR_LEADER.set(0)
        if services is not None:
            await services.stop()

    async def serve_health(self) -> None:
        """Report the server as a whole serving, and the services as the part says."""
        for health in self._health:
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._set_health(
            health_pb2.HealthCheckResponse.SERVING
            if self._services is not None
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def _set_health(self, status: int) -> None:
        """Set every service's status (a ``HealthCheckResponse`` serving status)."""
        for health in self._health:
            for name in self._names:
                await health.set(name, status)
