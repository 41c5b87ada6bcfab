"""Reservations as held Slurm jobs: each with a lease, cancelled when dropped.

A reservation is the task's real job, submitted with ``sbatch --hold``: a commit releases it
(``scontrol release``), a release or a lapsed lease cancels it (``scancel``). A cancel Slurm
did not take (it was down) is remembered and sent again after the next good reading, so no
held job is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from datacenter_agent.slurm.cli import SlurmCli, SlurmError
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.packing import Slot
from federation.common.keys import RunKey

log = structlog.get_logger()


@dataclass(slots=True, eq=False)
class Reservation:
    """A held Slurm job waiting for a commit, and the capacity the view counts for it."""

    key: RunKey
    slurm_id: str
    slots: tuple[Slot, ...]
    """Where the view counts the held capacity (Slurm itself counts none for a held job)."""
    lease_s: float
    checkpoints: TaskCheckpoints | None = None
    """The task's checkpoint folder and watcher, when it declares a checkpoint policy."""
    stop_after_s: float = 0.0
    """The offer's ``stop_after_disconnect_s``: cut off this long, the site stops the task."""
    timer: asyncio.TimerHandle | None = None

    @property
    def id(self) -> str:
        """The reservation id the coordinator commits: ``slurm-`` and the held job's id."""
        return f"slurm-{self.slurm_id}"


class HeldJobs:
    """The site's uncommitted reservations, by id.

    Args:
        cli: Runs ``scancel``.
        on_change: Called when a reservation goes away by itself (its lease lapsed).
    """

    def __init__(self, cli: SlurmCli, on_change: Callable[[], None]) -> None:
        self._cli = cli
        self._on_change = on_change
        self._held: dict[str, Reservation] = {}
        self._lapsing: set[asyncio.Task[None]] = set()
        self.to_cancel: set[str] = set()
        """Slurm job ids whose ``scancel`` failed; sent again after the next good reading."""

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._held.values()))

    def get(self, reservation_id: str) -> Reservation | None:
        """The reservation, if it is still held."""
        return self._held.get(reservation_id)

    def for_task(self, key: RunKey) -> Reservation | None:
        """The reservation held for a task, if any."""
        return next((r for r in self._held.values() if r.key == key), None)

    def hold(self, reservation: Reservation) -> None:
        """Keeps a new reservation until its lease lapses."""
        self._held[reservation.id] = reservation
        self.renew(reservation, reservation.lease_s)

    def renew(self, reservation: Reservation, lease_s: float) -> None:
        """Restarts the reservation's lease (a repeated offer)."""
        if reservation.timer is not None:
            reservation.timer.cancel()
        reservation.lease_s = lease_s
        reservation.timer = asyncio.get_running_loop().call_later(
            lease_s, self._start_lapse, reservation.id
        )

    def take(self, reservation_id: str) -> Reservation | None:
        """Removes a reservation without cancelling its job (a commit releases it)."""
        reservation = self._held.pop(reservation_id, None)
        if reservation is not None and reservation.timer is not None:
            reservation.timer.cancel()
        return reservation

    async def drop(self, reservation_id: str, event: str) -> bool:
        """Removes a reservation and cancels its held job; False when it was not held."""
        reservation = self.take(reservation_id)
        if reservation is None:
            return False
        log.info(event, reservation_id=reservation_id, slurm_job=reservation.slurm_id)
        await self.cancel(reservation.slurm_id)
        return True

    async def cancel(self, slurm_id: str) -> None:
        """``scancel`` a held job; when Slurm does not take it, it is sent again later."""
        try:
            await self._cli.run("scancel", slurm_id)
        except SlurmError as err:
            self.to_cancel.add(slurm_id)
            log.warning("slurm_cancel_failed", slurm_job=slurm_id, error=err.message)
        else:
            self.to_cancel.discard(slurm_id)

    def _start_lapse(self, reservation_id: str) -> None:
        task = asyncio.create_task(self._lapse(reservation_id))
        self._lapsing.add(task)
        task.add_done_callback(self._lapsing.discard)

    async def _lapse(self, reservation_id: str) -> None:
        if await self.drop(reservation_id, "reservation_lapsed"):
            self._on_change()

    async def close(self) -> None:
        """Cancels every held job (nobody will commit them now)."""
        for reservation in self:
            await self.drop(reservation.id, "reservation_dropped")
        for task in list(self._lapsing):
            task.cancel()
        await asyncio.gather(*self._lapsing, return_exceptions=True)
