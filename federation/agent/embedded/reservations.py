"""The embedded core's reservations: capacity held for a task's replicas until it is
committed, released, or its lease lapses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Reservation:
    """Capacity held for every replica of a task until it is committed or its lease lapses."""

    id: str
    key: RunKey
    spec: jobs_pb2.TaskSpec
    slots: tuple[Slot, ...]
    lease_s: float
    restore: jobs_pb2.CheckpointRecord | None = None
    """The checkpoint the task restarts from, if the offer carried one."""
    tenant: str = ""
    """Whose task it is: it runs as that tenant's account."""
    run_s: float = 0.0
    """How long the task runs on the devices held (0: not said), as the answer told."""
    device_model: str = ""
    """The model of the slowest device held, as the answer told."""
    stop_after_s: float = 0.0
    """The offer's ``stop_after_disconnect_s``: cut off this long, the site stops the task."""
    revision: int = 0
    """The offer's spec revision (a service's endpoints report it)."""


class Reservations:
    """The site's uncommitted reservations, by id, each with its lease.

    Args:
        on_change: Called when a reservation goes away by itself (its lease lapsed).
    """

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._held: dict[str, Reservation] = {}
        self._lease_timers: dict[str, asyncio.TimerHandle] = {}
        self._on_change = on_change

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._held.values()))

    def __len__(self) -> int:
        return len(self._held)

    def get(self, reservation_id: str) -> Reservation | None:
        """The reservation, if it is still held."""
        return self._held.get(reservation_id)

    def for_task(self, key: RunKey) -> Reservation | None:
        """The reservation held for a task, if any."""
        return next((r for r in self._held.values() if r.key == key), None)

    def hold(self, reservation: Reservation) -> None:
        """Keeps the reservation (a new one, or one renewed) until its lease lapses from now."""
        self._held[reservation.id] = reservation
        self._arm_lease(reservation)

    def drop(self, reservation_id: str) -> Reservation | None:
        """Lets go of the reservation and its lease; None when it is not held."""
        if (timer := self._lease_timers.pop(reservation_id, None)) is not None:
            timer.cancel()
        return self._held.pop(reservation_id, None)

    def _arm_lease(self, reservation: Reservation) -> None:
        if (timer := self._lease_timers.pop(reservation.id, None)) is not None:
            timer.cancel()
        self._lease_timers[reservation.id] = asyncio.get_running_loop().call_later(
            reservation.lease_s, self._lapse, reservation.id
        )

    def _lapse(self, reservation_id: str) -> None:
        if self.drop(reservation_id) is not None:
            log.info("reservation_lapsed", reservation_id=reservation_id)
            self._on_change()


def accepted(reservation: Reservation) -> site_link_service_pb2.OfferAnswer:
    """The answer that takes an offer with ``reservation``."""
    return site_link_service_pb2.OfferAnswer(
        accepted=True,
        reservation_id=reservation.id,
        expected_start_s=0.0,
        lease_s=reservation.lease_s,
        run_s=reservation.run_s,
        device_model=reservation.device_model,
    )
