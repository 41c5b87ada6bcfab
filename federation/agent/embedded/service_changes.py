"""A running service's changes in place: a new spec taken (or declined) with room for added
replicas held at once, then its replicas brought to it (the ones past its count retired,
missing ones started, those of an older revision replaced), while its replicas are kept."""

from __future__ import annotations

import asyncio

import structlog

from federation.agent.accounts import private_folder
from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.room import Room, fixed_port_problem
from federation.agent.embedded.service_replicas import ReplicaKeeper
from federation.agent.embedded.task import Task
from federation.agent.embedded.task_book import TaskBook
from federation.agent.embedded.task_files import TaskFiles
from federation.agent.process import ReplicaStartError
from federation.agent.service import ReplicaService
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey
from federation.service_policy import RestartPolicy, in_place, max_unavailable, only_scaled

log = structlog.get_logger()


class ServiceChanges:
    """Changes running services in place and supervises them until they are cancelled.

    Args:
        book: The tasks; records and reports each change.
        room: Finds room for added replicas and names their devices.
        launcher: Starts replicas.
        keeper: Keeps each replica running, and drains one being taken away.
        folders: Where each replica runs.
        files: Settles a service's checkpoints as it ends.
    """

    def __init__(
        self,
        book: TaskBook,
        room: Room,
        launcher: ReplicaLauncher,
        keeper: ReplicaKeeper,
        folders: TaskFolders,
        files: TaskFiles,
    ) -> None:
        self._book = book
        self._tasks = book.tasks
        self._room = room
        self._launcher = launcher
        self._keeper = keeper
        self._folders = folders
        self._files = files

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        """Takes a running service's new spec (``federation.service_policy``) or declines it
        with a reason. Room for added replicas is held at once; the replicas are brought to
        the spec after the answer (``_converge``)."""
        key: RunKey = (change.job_id, change.task, change.epoch)
        task = self._tasks.get(key)
        problem = self._change_problem(task, change)
        spec = in_place(task.spec, change.spec) if task is not None else change.spec
        if task is not None and not problem and change.revision == task.revision:
            if spec == task.spec:
                return site_link_service_pb2.ChangeAnswer(accepted=True)  # a retried change
            problem = f"revision {change.revision} was taken here with another spec"
        added: tuple[Slot, ...] = ()
        if task is not None and not problem:
            extra = (spec.replicas or 1) - len(task.slots)
            placed = self._room.place_added(task, spec, change, extra) if extra > 0 else ()
            if isinstance(placed, str):
                problem = f"no room for {extra} more replicas: {placed}"
            else:
                added = placed
        if problem or task is None or task.service is None:
            log.info("change_declined", job_id=key[0], task=key[1], epoch=key[2], reason=problem)
            return site_link_service_pb2.ChangeAnswer(accepted=False, reason=problem)
        if only_scaled(task.spec, spec):
            # The replicas that run are the new revision already: none is replaced.
            for replica in task.service:
                if replica.revision == task.revision:
                    replica.revision = change.revision
        task.spec, task.revision = spec, change.revision
        task.slots += added
        task.service += [ReplicaService.new(spec, task.revision) for _ in added]
        task.devices = self._room.device_labels(task.slots)
        self._book.save(task)
        log.info(
            "service_changed",
            job_id=key[0],
            task=key[1],
            epoch=key[2],
            revision=task.revision,
            replicas=len(task.slots),
        )
        task.reshaped.set()
        self._book.changed()
        return site_link_service_pb2.ChangeAnswer(accepted=True)

    def _change_problem(self, task: Task | None, change: site_link_service_pb2.ChangeTask) -> str:
        """Why a change of a running service is declined before any room is sought, or ""."""
        if task is None or not task.active:
            return f"no task {change.job_id}/{change.task} epoch {change.epoch} runs here"
        if task.service is None:
            return f"{change.job_id}/{change.task} is not a service"
        if task.state != jobs_pb2.JOB_STATE_RUNNING:
            return f"{change.job_id}/{change.task} is still starting"
        if change.revision < task.revision:
            return f"revision {change.revision} is older than revision {task.revision} here"
        if change.revision == task.revision:
            return ""
        if len(task.slots) > (task.spec.replicas or 1):
            return (
                f"the change to revision {task.revision} is still stopping replicas "
                f"({len(task.slots)} left of {task.spec.replicas or 1}); try again in a moment"
            )
        return fixed_port_problem(change.spec)

    async def watch_service(self, task: Task) -> None:
        """Keeps every replica of a service running, and brings them to its spec each time
        that changes in place, until the task is cancelled."""
        task.keepers = [
            asyncio.create_task(self._keeper.keep(task, i)) for i in range(len(task.replicas))
        ]
        converger = asyncio.create_task(self._converge(task))
        try:
            await task.cancelled.wait()
            if task.drain_first and task.spec.service.HasField("autoscale"):
                # No change under way while the replicas drain (an autoscaler's scale-in of a
                # part stops it whole): each is shown draining, then waited on, all at once.
                converger.cancel()
                await asyncio.gather(converger, return_exceptions=True)
                count = min(len(task.replicas), len(task.service or []))
                await asyncio.gather(
                    *(self._keeper.drain(task, i) for i in range(count)), return_exceptions=True
                )
        finally:
            converger.cancel()
            await asyncio.gather(converger, return_exceptions=True)
            for keeper in task.keepers:
                keeper.cancel()
            await asyncio.gather(*task.keepers, return_exceptions=True)
        await asyncio.gather(*(p.terminate(task.grace_s) for p in task.replicas))
        await self._files.settle_checkpoints(task, jobs_pb2.JOB_STATE_CANCELLED)
        self._book.finish(
            task, jobs_pb2.JOB_STATE_CANCELLED, 0, task.cancel_reason or "cancelled", ""
        )

    async def _converge(self, task: Task) -> None:
        """Brings a service's replicas to its spec as it changes in place: the replicas past
        its count stop (the highest-numbered first), missing ones start, and those of an older
        revision are replaced, never more than max_unavailable not ready at once (a replica
        not ready anyway is replaced first: that costs nothing)."""
        assert task.service is not None
        job_id, name, epoch = task.key
        while True:
            task.reshaped.clear()
            task.moved.clear()
            busy, pause = False, 1.0
            waits_for: list[asyncio.Event] = [task.moved, task.reshaped]
            try:
                while len(task.slots) > (task.spec.replicas or 1):
                    await self._retire(task)
                while len(task.replicas) < len(task.slots):
                    await self._start_added(task, len(task.replicas))
                for replica in self._to_replace(task):
                    await self._replace(task, replica)
                busy = any(r.revision < task.revision for r in task.service)
            except ReplicaStartError as exc:
                # Tried again after the policy's backoff, as a crashed replica is restarted;
                # a newer change does not wait for it.
                failed = task.service[len(task.replicas)]
                failed.short_runs += 1
                failed.checked = True
                pause = RestartPolicy.of(task.spec.service).delay_s(failed.short_runs)
                busy, waits_for = True, [task.reshaped]
                log.warning(
                    "replica_start_failed", job_id=job_id, task=name, error=str(exc), in_s=pause
                )
                self._book.report(task)
            except Exception:
                log.exception("service_change_failed", job_id=job_id, task=name, epoch=epoch)
                busy = True
            if not busy:
                await task.reshaped.wait()
                continue
            waits = [asyncio.ensure_future(event.wait()) for event in waits_for]
            try:
                await asyncio.wait(waits, timeout=pause, return_when="FIRST_COMPLETED")
            finally:
                for wait in waits:
                    wait.cancel()

    def _to_replace(self, task: Task) -> list[int]:
        """The replicas of an older revision to replace now: every one known not to be ready,
        and as many ready ones as leave at most max_unavailable not ready. None while a
        replica's readiness is not known yet (just started, or adopted before its first
        check): it may be ready."""
        assert task.service is not None
        service = task.service[: len(task.replicas)]
        if not all(r.checked for r in service):
            return []
        stale = [i for i, r in enumerate(service) if r.revision < task.revision]
        budget = max_unavailable(task.spec) - sum(not r.ready for r in task.service)
        ready = [i for i in stale if service[i].ready][: max(0, budget)]
        return [i for i in stale if not service[i].ready] + ready

    async def _retire(self, task: Task) -> None:
        """Stops a service's highest-numbered replica and gives its room back: shown not
        ready first, so whoever follows the endpoints stops sending to it."""
        assert task.service is not None
        replica = len(task.slots) - 1
        if task.spec.service.HasField("autoscale") and replica < len(task.replicas):
            await self._keeper.drain(task, replica)
        if replica < len(task.keepers):
            keeper = task.keepers.pop(replica)
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        task.service[replica].ready = False
        self._book.report(task)
        if replica < len(task.replicas):
            await task.replicas[replica].terminate(task.grace_s)
            task.replicas.pop(replica)
        task.service.pop(replica)
        task.slots = task.slots[:replica]
        task.devices = self._room.device_labels(task.slots)
        self._book.save(task)
        self._book.report(task)
        self._book.changed()

    async def _start_added(self, task: Task, replica: int) -> None:
        """Starts a replica a change added (or one a restarted agent found not started)."""
        account = self._launcher.account(task)
        folder = self._folders.task_dir(task.key) / str(replica)
        try:
            await asyncio.to_thread(private_folder, folder, account)
        except OSError as exc:
            raise ReplicaStartError(f"cannot create working directory: {exc}", 0) from exc
        await self._launcher.start_replica(task, replica, account)
        task.keepers.append(asyncio.create_task(self._keeper.keep(task, replica)))
        self._book.save(task)
        self._book.report(task)

    async def _replace(self, task: Task, replica: int) -> None:
        """Stops one replica and starts it with the task's current spec. A start that fails
        is the keeper's to retry, with its backoff, as after a crash."""
        assert task.service is not None
        keeper = task.keepers[replica]
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        state = task.service[replica]
        state.ready, state.down, state.short_runs = False, False, 0
        self._book.report(task)
        await task.replicas[replica].terminate(task.grace_s)
        try:
            await self._launcher.start_replica(task, replica, self._launcher.account(task))
        except ReplicaStartError as exc:
            # Of the new revision all the same: its keeper restarts it, with its backoff.
            state.revision, state.checked = task.revision, True
            log.warning(
                "replica_replace_failed", job_id=task.key[0], task=task.key[1], error=str(exc)
            )
        task.keepers[replica] = asyncio.create_task(self._keeper.keep(task, replica))
        self._book.save(task)
        self._book.report(task)
