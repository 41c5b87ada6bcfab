"""The embedded local scheduler core: reserves room for tasks on the agent's nodes and runs them.

Held capacity is never tracked incrementally: it is recomputed from the reservations and the
unfinished tasks whenever it is needed, so it cannot drift from them.

Each replica runs under a supervisor that outlives the agent (``federation.agent.supervisor``),
and each task is recorded in state_dir (``federation.agent.task_records``): an agent stopped on
purpose leaves its tasks running, and the next one adopts them with their epochs.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from federation.agent.accounts import (
    TaskAccounts,
)
from federation.agent.commits import commit_key, settled, started
from federation.agent.containers import (
    IMAGE_REFRESH_S,
    Containers,
    ContainerSettings,
    container_name,
)
from federation.agent.core import ChangeCallback, StatusCallback
from federation.agent.elastic import Elastic, LaunchError
from federation.agent.embedded.folders import TaskFolders, safe_part
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.reservations import Reservations
from federation.agent.embedded.room import Room
from federation.agent.embedded.service_changes import ServiceChanges
from federation.agent.embedded.service_replicas import ReplicaKeeper
from federation.agent.embedded.task import State, Task, ended_by_themselves
from federation.agent.embedded.task_book import TaskBook
from federation.agent.embedded.task_files import TaskFiles
from federation.agent.host_watch import FAST, Pace, merge_rediscovered, worth_publishing
from federation.agent.object_store import DataError
from federation.agent.process import ReplicaProcess, ReplicaStartError, describe_exit
from federation.agent.reports import Reports
from federation.agent.service import ReplicaService, free_port, is_service
from federation.agent.supervisor import LEAVING
from federation.agent.task_data import TaskData
from federation.agent.task_logs import read_log
from federation.agent.task_records import TaskRecord, TaskRecords
from federation.agent.usage import apply_usage
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common.keys import RunKey
from federation.placement.compat import CompatTable, load_table_files
from federation.stop_after import STOP_GRACE_S, announce_stop

log = structlog.get_logger()


class EmbeddedCore:
    """Runs tasks as processes on the agent's own nodes; satisfies ``LocalCore``.

    Args:
        nodes: The site's nodes. Their free capacity and ``Device.allocated`` are ignored: this
            core owns allocation.
        site: Site name, given to tasks as ``FEDERATION_SITE``.
        work_dir: Each replica runs in ``work_dir/<job>/<task>/<epoch>/<replica>/``.
        on_status: Called with a task's report when it starts running and when it ends.
        on_change: Called whenever allocations or the queue change.
        kill_grace_s: Time between SIGTERM and SIGKILL when a task is stopped.
        accounts: Who runs each tenant's tasks.
        compat: How software requirements are read (the shipped table by default).
        state_dir: Where tasks are recorded for a restarted agent to adopt (``adopt``); None:
            tasks are not recorded and die with this process.
        service_address: Where clients reach the services this core runs (every replica runs
            on this machine); empty: the machine's name.
        data: Stages tasks' inputs and stores their outputs; default: a site without an
            object store.
        containers: Runs tasks that name an image (``federation.agent.containers``);
            default: Podman on PATH, any registry.
    """

    name = "embedded"

    def __init__(
        self,
        nodes: list[resources_pb2.Node],
        *,
        site: str,
        work_dir: Path,
        on_status: StatusCallback,
        on_change: ChangeCallback,
        kill_grace_s: float = 5.0,
        accounts: TaskAccounts | None = None,
        compat: CompatTable | None = None,
        owner_share: resources_pb2.OwnerShare | None = None,
        state_dir: Path | None = None,
        service_address: str = "",
        data: TaskData | None = None,
        containers: ContainerSettings | None = None,
        elastic: Elastic | None = None,
        topology_levels: Sequence[str] = (),
    ) -> None:
        """``elastic``: the nodes of the site's node types, launched when a task needs them
        (``federation.agent.elastic``); they join ``nodes`` as launchable ones.
        ``topology_levels``: node labels that are the site's topology levels, widest first
        (``federation.agent.packing.place``)."""
        self.data = data or TaskData(None, site)
        self._address = service_address or socket.getfqdn()
        self._containers = Containers(
            containers or ContainerSettings(),
            work_dir.absolute(),
            auth_dir=state_dir.absolute() / "pull-auth" if state_dir is not None else None,
        )
        self._nodes: dict[str, resources_pb2.Node] = {}
        self._elastic = elastic
        if elastic is not None:
            elastic.on_taken_back(self._node_taken_back)
        self._idle_releases: asyncio.Task[None] | None = None
        for node in [*nodes, *(elastic.nodes() if elastic is not None else [])]:
            if node.name in self._nodes:
                raise ValueError(f"duplicate node name {node.name!r}")
            self._nodes[node.name] = resources_pb2.Node()
            self._nodes[node.name].CopyFrom(node)
        self._site = site
        self._work_dir = work_dir.absolute()  # tasks run elsewhere: no relative paths
        self._folders = TaskFolders(self._work_dir)
        self._records = TaskRecords(state_dir / "tasks") if state_dir is not None else None
        self._book = TaskBook(self._records, Reports(on_status, on_change), self._folders)
        self._tasks = self._book.tasks
        self._kill_grace_s = kill_grace_s
        self._accounts = accounts
        """Who runs each tenant's tasks; None: the agent itself (tests of the core alone)."""
        self._reservations = Reservations(self._book.changed)
        self._readings_published: dict[str, tuple[float, resources_pb2.Node]] = {}
        """Per node: when its readings were last published, and the node as it was then."""
        self._launcher = ReplicaLauncher(
            self._nodes,
            site=site,
            folders=self._folders,
            containers=self._containers,
            accounts=accounts,
            kill_grace_s=kill_grace_s,
            records=self._records,
            on_pulled=self.refresh_images,
        )
        self._room = Room(
            self._nodes,
            self._reservations,
            self._tasks,
            elastic=elastic,
            levels=topology_levels,
            compat=compat or load_table_files(),
            owner_share=owner_share or resources_pb2.OwnerShare(),
            containers=self._containers,
            changed=self._book.changed,
        )
        self._files = TaskFiles(self.data, self._folders, self._launcher, self._book.report)
        self._keeper = ReplicaKeeper(self._launcher, self._book, self._folders, self._address)
        self._services = ServiceChanges(
            self._book, self._room, self._launcher, self._keeper, self._folders, self._files
        )
        self._images: list[resources_pb2.CachedImage] = []
        """The images in the host's Podman store, which every node here starts from."""
        self._image_watch: asyncio.Task[None] | None = None

    def nodes(self) -> list[resources_pb2.Node]:
        """Nodes with free cpu/memory and devices reflecting all held capacity.

        ``Device.allocated`` marks devices held whole, ``free_fraction`` what shares may still
        take, and each partition profile's ``free`` its slots left (see ``agent.usage``).
        """
        usage = self._room.usage()
        views = []
        for base in self._nodes.values():
            node = resources_pb2.Node()
            node.CopyFrom(base)
            apply_usage(node, usage)
            if self._elastic is not None:
                self._elastic.decorate(node)
            node.images.extend(self._images)
            views.append(node)
        return views

    def image_policy(self) -> tuple[str, list[str]]:
        """Why this site runs no image ("": it runs them), and the registries it pulls from."""
        return self._containers.policy(self._accounts)

    async def refresh_images(self) -> None:
        """Reads the images in the Podman store again; a change is published with the nodes."""
        images = await self._containers.images()
        if [i.SerializeToString(deterministic=True) for i in images] != [
            i.SerializeToString(deterministic=True) for i in self._images
        ]:
            self._images = images
            log.info("images_stored", images=len(images))
            self._book.changed()

    def watch_images(self, interval_s: float = IMAGE_REFRESH_S) -> None:
        """Reads the images again every ``interval_s`` (an operator may prune or load some),
        beside each pull, until ``close``."""

        async def watch() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.refresh_images()
                except (OSError, ValueError) as err:
                    log.warning("images_not_listed", error=str(err))

        if self._image_watch is None and not self._containers.site_refusal():
            self._image_watch = asyncio.create_task(watch())

    def refresh(self, found: resources_pb2.Node, pace: Pace = FAST) -> None:
        """Takes a fresh discovery of one of its nodes: devices gone, new or of another health,
        and what the node and its devices use now. A device that stops being healthy gets no
        new work; the tasks already on it are named in the log. Readings are published at
        ``pace``: when they moved by its steps since they were last published, at most once
        per its interval."""
        current = self._nodes.get(found.name)
        if current is None:
            return
        before = resources_pb2.Node()
        before.CopyFrom(current)
        changes = merge_rediscovered(current, found)
        for pos, (old, new) in enumerate(zip(before.devices, current.devices, strict=False)):
            if old.health != new.health:
                on_it = [
                    f"{t.key[0]}/{t.key[1]}"
                    for t in self._tasks.values()
                    if t.active
                    and any(s.node == found.name and pos in s.device_positions for s in t.slots)
                ]
                log.warning(
                    "device_health_changed",
                    node=found.name,
                    device=new.id,
                    health=resources_pb2.DeviceHealth.Name(new.health),
                    reason=new.health_reason,
                    tasks=on_it,
                )
        if changes:
            log.info("host_rediscovered", node=found.name, changes=changes)
        # Until some are published, the readings the node was first published with.
        sent_at, sent = self._readings_published.setdefault(found.name, (-math.inf, before))
        now = time.monotonic()
        due = now - sent_at >= pace.min_interval_s
        if changes or (due and worth_publishing(sent, current, pace)):
            kept = resources_pb2.Node()
            kept.CopyFrom(current)
            self._readings_published[found.name] = (now, kept)
            self._book.changed()

    def queue(self) -> resources_pb2.QueueState:
        """Reservations not yet committed, and tasks starting or running."""
        running = sum(1 for t in self._tasks.values() if t.active)
        return resources_pb2.QueueState(
            pending_tasks=len(self._reservations), running_tasks=running, estimated_wait_s=0.0
        )

    def tasks(self) -> list[site_link_service_pb2.TaskReport]:
        """A report for every task not yet forgotten, running or finished."""
        return [t.report() for t in self._tasks.values()]

    async def offer(self, offer: site_link_service_pb2.Offer) -> site_link_service_pb2.OfferAnswer:
        """Reserves room for every replica of the task at once, or declines with a reason."""
        return await self._room.offer(offer)

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        """Starts every replica of a reserved task.

        A replica that cannot be started (a missing program, say) does not refuse the commit:
        the task was taken, and it ends FAILED with the reason, reported through ``on_status``.
        """
        key = commit_key(commit)
        held = self._reservations.get(commit.reservation_id)
        reservation = settled(commit, self._tasks.get(key), held)
        if isinstance(reservation, site_link_service_pb2.CommitAnswer):
            return reservation
        self._reservations.drop(reservation.id)
        devices = self._room.device_labels(reservation.slots)
        task = Task(
            key, reservation.id, reservation.spec, reservation.slots, devices, self._kill_grace_s
        )
        task.tenant, task.restore = reservation.tenant, reservation.restore
        task.stop_after_s, task.revision = reservation.stop_after_s, reservation.revision
        task.site, task.address = self._site, self._address
        task.inputs = list(commit.inputs)
        task.gang_peers, task.gang_rank = list(commit.gang_peers), commit.gang_rank
        restore = reservation.restore
        if restore is not None and restore.HasField("stored"):
            # Uploaded: the task restores from a copy staged here, or starts fresh.
            task.restore_input = site_link_service_pb2.StagedInput(
                dataset=restore.stored.name,
                error="the commit carried no copy of the checkpoint to restore",
            )
            if commit.HasField("restore"):
                task.restore_input.CopyFrom(commit.restore)
            task.restore_of, task.restore = restore, None
            restore = None
        if is_service(reservation.spec):
            task.service = [
                ReplicaService.new(reservation.spec, task.revision) for _ in reservation.slots
            ]
        if reservation.spec.HasField("checkpoint"):
            self._files.watch_checkpoints(task, restore)
        self._tasks[key] = task
        self._book.changed()
        if task.inputs or task.restore_input is not None or self._room.to_launch(task):
            # Downloads and launches may take long: the commit is answered now, and the task
            # stays DELEGATED (not RUNNING) until its nodes run and every input is in place.
            task.supervisor = asyncio.create_task(self._stage_then_launch(task))
        else:
            await self._launch(task)
        return started()

    async def _stage_then_launch(self, task: Task) -> None:
        """Launches the task's nodes that do not run yet and stages its inputs, then starts
        it; a cancel meanwhile ends it CANCELLED, a node that cannot be launched or an input
        that cannot be had FAILED, before any replica ran."""
        staging = asyncio.ensure_future(self._provision_and_stage(task))
        cancelled = asyncio.ensure_future(task.cancelled.wait())
        try:
            await asyncio.wait({staging, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if not staging.done():
            staging.cancel()
            await asyncio.gather(staging, return_exceptions=True)
            self._book.finish(task, jobs_pb2.JOB_STATE_CANCELLED, 0, task.cancel_reason or "", "")
            return
        if (problem := staging.result()) is not None:
            self._book.finish(task, jobs_pb2.JOB_STATE_FAILED, 0, problem, "")
            return
        await self._launch(task)

    async def _provision_and_stage(self, task: Task) -> str | None:
        if self._elastic is not None and (nodes := self._room.to_launch(task)):
            try:
                await self._elastic.ensure_running(nodes, self._book.changed)
            except LaunchError as exc:
                return str(exc)
        if not task.inputs and task.restore_input is None:
            return None
        return await self._files.stage(task)

    async def _launch(self, task: Task) -> None:
        """Starts every replica and supervises the task (or ends it, if one cannot start)."""
        key = task.key
        devices = task.devices
        try:
            await self._launcher.start_replicas(task)
        except asyncio.CancelledError:  # the agent is going: no record, so no adoption
            for replica in task.replicas:
                replica.kill()
            raise
        except ReplicaStartError as exc:
            await asyncio.gather(*(p.terminate(task.grace_s) for p in task.replicas))
            if task.cancel_reason is not None:
                self._book.finish(task, jobs_pb2.JOB_STATE_CANCELLED, 0, task.cancel_reason, "")
            else:
                self._book.finish(task, jobs_pb2.JOB_STATE_FAILED, exc.exit_code, str(exc), "")
            return
        task.state, task.started_at = jobs_pb2.JOB_STATE_RUNNING, time.time()
        self._book.save(task)
        if task.checkpoints is not None:
            task.checkpoints.start(task.started_at)
        log.info("task_started", job_id=key[0], task=key[1], epoch=key[2], devices=devices)
        self._book.report(task)
        # Held so the supervisor is not garbage-collected while it runs.
        task.supervisor = asyncio.create_task(self._supervise(task))

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        """Takes a running service's new spec (``federation.service_policy``) or declines it
        with a reason (``federation.agent.embedded.service_changes``)."""
        return await self._services.change(change)

    async def release(self, reservation_id: str) -> None:
        """Frees an uncommitted reservation; a no-op when it is unknown."""
        if self._reservations.drop(reservation_id) is not None:
            log.info("reservation_released", reservation_id=reservation_id)
            self._book.changed()

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None:
        """Stops the task and waits until it has ended CANCELLED.

        Epoch 0 means any epoch; an unknown, finished or other-epoch task is left alone. A
        reservation for the task is dropped too, so it can no longer be committed.
        """

        def targeted(key: RunKey) -> bool:
            return key[:2] == (job_id, task) and epoch in (0, key[2])

        dropped = [r.id for r in self._reservations if targeted(r.key)]
        for reservation_id in dropped:
            self._reservations.drop(reservation_id)
        if dropped:
            self._book.changed()
        victims = [t for key, t in self._tasks.items() if targeted(key) and t.active]
        if not victims and not dropped:
            log.debug("cancel_ignored", job_id=job_id, task=task, epoch=epoch)
        for victim in victims:
            victim.drain_first = True
        await self._stop(victims, reason, self._kill_grace_s)

    async def stop_cut_off(self, cut_off_s: float) -> None:
        """Stops every task whose job asks for it after ``cut_off_s`` seconds cut off from every
        coordinator, and waits until they have ended CANCELLED, reported interrupted: the
        coordinator places them elsewhere once they are surely gone (``stop_after``)."""
        victims = [
            t
            for t in self._tasks.values()
            if t.active and t.cancel_reason is None and 0 < t.stop_after_s <= cut_off_s
        ]
        for victim in victims:
            victim.interrupted = True
            victim.cancel_reason = announce_stop(victim.key, cut_off_s, victim.stop_after_s)
            victim.grace_s = min(self._kill_grace_s, STOP_GRACE_S)
            victim.cancelled.set()
        await asyncio.gather(*(victim.finished.wait() for victim in victims))

    def _node_taken_back(self, node: str, why: str) -> None:
        """An elastic node its provider lost (a spot node taken back), launchable again: the
        tasks on it stop and are reported interrupted, so the coordinator places them again
        (from their newest checkpoints) as capacity lost; reservations there are dropped."""
        for reservation in self._reservations:
            if any(slot.node == node for slot in reservation.slots):
                self._reservations.drop(reservation.id)
        victims = [
            t
            for t in self._tasks.values()
            if t.active and t.cancel_reason is None and any(s.node == node for s in t.slots)
        ]
        for victim in victims:
            victim.interrupted = True
            victim.cancel_reason = f"node {node} was taken back by its provider: {why}"
            victim.grace_s = min(self._kill_grace_s, STOP_GRACE_S)
            victim.cancelled.set()
        self._book.changed()

    async def read_logs(
        self, request: site_link_service_pb2.ReadLogs
    ) -> site_link_service_pb2.LogsAnswer:
        """A replica's output lines, from its log beside its work folder (kept after the
        task ends, as the work folder is)."""
        key = (request.job_id, request.task, request.epoch)
        if not all(safe_part(part) for part in (request.job_id, request.task)):
            return site_link_service_pb2.LogsAnswer(error="no such task here")
        run_dir = self._folders.run_dir(key, request.replica)
        return await asyncio.to_thread(read_log, run_dir, request)

    def forget(self, job_id: str, task: str, epoch: int) -> None:
        """Drops a finished task's record; a running task is kept."""
        known = self._tasks.get((job_id, task, epoch))
        if known is not None and known.active:
            log.warning("forget_ignored", job_id=job_id, task=task, epoch=epoch, state="running")
        elif known is not None:
            del self._tasks[known.key]
            if self._records is not None:
                self._records.drop(known.reservation_id)

    async def close(self) -> None:
        """Drops reservations and their timers; running tasks go on and are still reported,
        and are left to the next agent on this state_dir when this one exits."""
        for reservation in self._reservations:
            self._reservations.drop(reservation.id)
        if self._image_watch is not None:
            self._image_watch.cancel()
            self._image_watch = None
        if self._records is not None:
            self._records.leave()
        if self._idle_releases is not None:
            self._idle_releases.cancel()
            await asyncio.gather(self._idle_releases, return_exceptions=True)
        log.info("core_closed", running_tasks=self.queue().running_tasks)

    async def shutdown(self, grace_s: float) -> None:
        """Stops every running task (SIGTERM, SIGKILL after ``grace_s``), then closes. The
        tasks stopped are forgotten, as a crashed agent's are: the coordinator places them
        again rather than take the stop for a cancel."""
        victims = [t for t in self._tasks.values() if t.active]
        await self._stop(victims, "agent shutting down", grace_s)
        if self._records is not None:
            for victim in victims:
                self._records.drop(victim.reservation_id)
        await self.close()

    async def adopt(self) -> None:
        """Takes over the tasks recorded in state_dir by the agent before this one.

        Tasks it left on purpose (its core closed) are adopted with their epochs: a replica
        whose supervisor still runs (the same pid and start time) is watched again, one that
        ended meanwhile reports how; a task that had ended keeps its final report. Tasks of an
        agent that crashed are stopped, if any process is left, and forgotten: the coordinator
        places them again, as it does for every task a site no longer reports; but one whose
        replicas had all ended by themselves is reported as they ended.
        """
        if self._elastic is not None and self._idle_releases is None:
            self._idle_releases = asyncio.create_task(
                self._elastic.run(self._room.busy_nodes, self._book.changed)
            )
        if self._records is None:
            return
        previous = self._records.claim()
        handed_over = previous is not None and previous[2] == LEAVING
        for record in self._records.load():
            if record.final is not None:
                self._adopt_final(record)
                continue
            replicas = [
                ReplicaProcess.adopt(r.pid, r.start_ticks, self._folders.run_dir(record.key, i))
                for i, r in enumerate(record.replicas)
            ]
            for i, replica in enumerate(replicas):
                self._launcher.bind_container(record.key, record.spec, i, replica)
                if replica.exited and record.spec.image:
                    # Ended meanwhile: its supervisor may have had to leave the container.
                    await self._containers.remove(container_name(self._work_dir, record.key, i))
            ended_alone = ended_by_themselves(replicas)
            died = any(p.ended and p.ended.why == "agent_died" for p in replicas)
            # A task whose every replica had ended by itself is reported as it ended, crash or
            # not: its end was only not reported yet, and placed again it would run twice.
            if not ended_alone and (not handed_over or died):
                for replica in replicas:
                    replica.kill()
                await asyncio.gather(*(replica.wait() for replica in replicas))
                if ended_by_themselves(replicas):
                    # Each ended by itself while being stopped (its supervisor says it was not
                    # stopped): the work is done, and placed again it would run twice.
                    self._adopt_running(record, replicas)
                    continue
                self._records.drop(record.reservation_id)
                job_id, name, epoch = record.key
                log.warning("task_not_adopted", job_id=job_id, task=name, epoch=epoch)
                continue
            for replica in replicas:
                replica.claim()
            self._adopt_running(record, replicas)
        if self._elastic is not None:  # launched by the agent before: they run
            self._elastic.running(self._room.busy_nodes())
        self._book.changed()

    def _adopted(self, record: TaskRecord) -> Task:
        task = Task(
            record.key,
            record.reservation_id,
            record.spec,
            record.slots,
            record.devices,
            self._kill_grace_s,
        )
        task.tenant, task.restore, task.started_at = (
            record.tenant,
            record.restore,
            record.started_at,
        )
        task.site, task.address, task.revision = self._site, self._address, record.revision
        if is_service(record.spec):
            kept = record.service or tuple((free_port(), 0, 0) for _ in record.slots)
            task.service = [
                ReplicaService(port, restarts, revision=revision)
                for port, restarts, revision in kept
            ]
        self._tasks[record.key] = task
        return task

    def _adopt_final(self, record: TaskRecord) -> None:
        """A task that ended before the restart: its final report, until acknowledged."""
        assert record.final is not None
        task = self._adopted(record)
        task.final, task.state = record.final, record.final.state
        task.finished.set()

    def _adopt_running(self, record: TaskRecord, replicas: list[ReplicaProcess]) -> None:
        task = self._adopted(record)
        task.replicas, task.state = replicas, jobs_pb2.JOB_STATE_RUNNING
        if record.spec.HasField("checkpoint"):
            checkpoints = self._files.watch_checkpoints(task, record.restore)
            checkpoints.start(record.started_at)
        job_id, name, epoch = record.key
        log.info(
            "task_adopted",
            job_id=job_id,
            task=name,
            epoch=epoch,
            supervisors=[p.pid for p in replicas],
            ended=[p.exited for p in replicas],
        )
        task.supervisor = asyncio.create_task(self._supervise(task))

    async def _stop(self, victims: list[Task], reason: str, grace_s: float) -> None:
        """Asks each task's supervisor to stop it and waits until all have ended."""
        for victim in victims:
            victim.cancel_reason, victim.grace_s = reason, grace_s
            victim.cancelled.set()
        await asyncio.gather(*(victim.finished.wait() for victim in victims))

    async def _supervise(self, task: Task) -> None:
        """Runs the task to its end; a bug here must not leave it (and cancel) hanging."""
        try:
            await (
                self._services.watch_service(task)
                if task.service is not None
                else self._watch(task)
            )
        except Exception as exc:
            log.exception("task_supervision_failed", job_id=task.key[0], task=task.key[1])
            await asyncio.gather(
                *(p.terminate(task.grace_s) for p in task.replicas), return_exceptions=True
            )
            self._book.finish(task, jobs_pb2.JOB_STATE_FAILED, 0, f"supervision failed: {exc}", "")

    async def _watch(self, task: Task) -> None:
        """Waits for every replica, the first failure, the timeout or a cancel; ends the task."""
        loop = asyncio.get_running_loop()
        waits = {asyncio.ensure_future(p.wait()): i for i, p in enumerate(task.replicas)}
        cancelled = asyncio.ensure_future(task.cancelled.wait())
        timeout_s = task.spec.timeout_s
        # From its start, which an adopted task had before this agent did.
        ran_s = max(0.0, time.time() - task.started_at)
        deadline = loop.time() + timeout_s - ran_s if timeout_s > 0 else None
        state: State = jobs_pb2.JOB_STATE_SUCCEEDED
        exit_code, reason, tail_of = 0, "", 0
        try:
            while waits:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait(
                    {*waits, cancelled}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                if cancelled in done:
                    state, reason = jobs_pb2.JOB_STATE_CANCELLED, task.cancel_reason or "cancelled"
                    break
                if not done:
                    state, reason = jobs_pb2.JOB_STATE_FAILED, f"timed out after {timeout_s:g}s"
                    break
                exits = sorted((waits.pop(future), future.result()) for future in done)
                failures = [(replica, code) for replica, code in exits if code != 0]
                if failures:
                    tail_of, exit_code = failures[0]
                    ended = task.replicas[tail_of].ended
                    why = ended.why if ended is not None else ""
                    reason = (
                        f"replica {tail_of}: {why}"
                        if why
                        else f"replica {tail_of} {describe_exit(exit_code)}"
                    )
                    state = jobs_pb2.JOB_STATE_FAILED
                    break
        finally:
            for future in [*waits, cancelled]:
                future.cancel()
        stopped = await asyncio.gather(*(p.terminate(task.grace_s) for p in task.replicas))
        ended_by_itself = not any(stopped) and all(p.returncode == 0 for p in task.replicas)
        if state == jobs_pb2.JOB_STATE_CANCELLED and ended_by_itself:
            # Every replica had ended by itself, with 0, before the stop could reach it: the
            # work is done, and a preempted task must not run again. (One that exits 0 once
            # signalled has not said so: it may have saved a checkpoint and quit.)
            state, reason = jobs_pb2.JOB_STATE_SUCCEEDED, ""
        await self._files.settle_checkpoints(task, state)
        if state == jobs_pb2.JOB_STATE_SUCCEEDED and task.spec.outputs:
            try:
                task.artifacts, reason = await self.data.publish(
                    task.key,
                    task.tenant,
                    task.spec.outputs,
                    self._folders.task_dir(task.key) / "0",
                    self._folders.run_dir(task.key, 0).parent,
                )
            except DataError as exc:
                job_id, name, _ = task.key
                log.warning("outputs_not_stored", job_id=job_id, task=name, error=str(exc))
                state, reason = jobs_pb2.JOB_STATE_FAILED, str(exc)
        elif state != jobs_pb2.JOB_STATE_SUCCEEDED and task.spec.outputs:
            task.artifacts = await self.data.keep_partial(
                task.key,
                task.tenant,
                task.spec.outputs,
                self._folders.task_dir(task.key) / "0",
                self._folders.run_dir(task.key, 0).parent,
            )
        self._book.finish(task, state, exit_code, reason, task.replicas[tail_of].output_tail)
