"""The embedded local scheduler core: reserves room for tasks on the agent's nodes and runs them.

``EmbeddedCore`` satisfies ``LocalCore`` and asks its parts (``federation.agent.embedded``):
``room`` decides offers and holds their ``reservations``; ``task_runs`` takes a commit, stages
the task's inputs (``task_files``, which also follows its checkpoints), starts its replicas
(``launching``) and watches it to its end; ``service_changes`` changes a running service in
place and supervises it, with ``service_replicas`` keeping each replica; ``stops`` stops tasks;
``adoption`` takes over what the agent before this one left running. ``task_book`` holds the
tasks, records and reports them; ``folders`` says where they run. The core itself keeps the
node views, their rediscovered readings and images, and the agent's logs and lifecycle calls.

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

from federation.agent.accounts import TaskAccounts
from federation.agent.containers import IMAGE_REFRESH_S, Containers, ContainerSettings
from federation.agent.core import ChangeCallback, StatusCallback
from federation.agent.elastic import Elastic
from federation.agent.embedded.adoption import Adoption
from federation.agent.embedded.folders import TaskFolders, safe_part
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.reservations import Reservations
from federation.agent.embedded.room import Room
from federation.agent.embedded.service_changes import ServiceChanges
from federation.agent.embedded.service_replicas import ReplicaKeeper
from federation.agent.embedded.stops import Stops
from federation.agent.embedded.task_book import TaskBook
from federation.agent.embedded.task_files import TaskFiles
from federation.agent.embedded.task_runs import TaskRuns
from federation.agent.host_watch import FAST, Pace, merge_rediscovered, worth_publishing
from federation.agent.reports import Reports
from federation.agent.task_data import TaskData
from federation.agent.task_logs import read_log
from federation.agent.task_records import TaskRecords
from federation.agent.usage import apply_usage
from federation.api.v1 import resources_pb2, site_link_service_pb2
from federation.placement.compat import CompatTable, load_table_files

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
        self._idle_releases: asyncio.Task[None] | None = None
        for node in [*nodes, *(elastic.nodes() if elastic is not None else [])]:
            if node.name in self._nodes:
                raise ValueError(f"duplicate node name {node.name!r}")
            self._nodes[node.name] = resources_pb2.Node()
            self._nodes[node.name].CopyFrom(node)
        self._work_dir = work_dir.absolute()  # tasks run elsewhere: no relative paths
        self._folders = TaskFolders(self._work_dir)
        self._records = TaskRecords(state_dir / "tasks") if state_dir is not None else None
        self._book = TaskBook(self._records, Reports(on_status, on_change), self._folders)
        self._tasks = self._book.tasks
        self._accounts = accounts
        """Who runs each tenant's tasks; None: the agent itself (tests of the core alone)."""
        self._reservations = Reservations(self._book.changed)
        self._readings_published: dict[str, tuple[float, resources_pb2.Node]] = {}
        """Per node: when its readings were last published, and the node as it was then."""
        self._images: list[resources_pb2.CachedImage] = []
        """The images in the host's Podman store, which every node here starts from."""
        self._image_watch: asyncio.Task[None] | None = None
        self._assemble(
            site=site,
            kill_grace_s=kill_grace_s,
            compat=compat or load_table_files(),
            owner_share=owner_share or resources_pb2.OwnerShare(),
            topology_levels=topology_levels,
        )

    def _assemble(
        self,
        *,
        site: str,
        kill_grace_s: float,
        compat: CompatTable,
        owner_share: resources_pb2.OwnerShare,
        topology_levels: Sequence[str],
    ) -> None:
        """Builds the core's parts, each given the parts below it that it asks."""
        self._launcher = ReplicaLauncher(
            self._nodes,
            site=site,
            folders=self._folders,
            containers=self._containers,
            accounts=self._accounts,
            kill_grace_s=kill_grace_s,
            records=self._records,
            on_pulled=self.refresh_images,
        )
        self._room = Room(
            self._nodes,
            self._reservations,
            self._tasks,
            elastic=self._elastic,
            levels=topology_levels,
            compat=compat,
            owner_share=owner_share,
            containers=self._containers,
            changed=self._book.changed,
        )
        self._files = TaskFiles(self.data, self._folders, self._launcher, self._book.report)
        self._keeper = ReplicaKeeper(self._launcher, self._book, self._folders, self._address)
        self._services = ServiceChanges(
            self._book, self._room, self._launcher, self._keeper, self._folders, self._files
        )
        self._runs = TaskRuns(
            self._reservations,
            self._book,
            self._room,
            self._launcher,
            self._files,
            self._services,
            folders=self._folders,
            data=self.data,
            elastic=self._elastic,
            kill_grace_s=kill_grace_s,
            site=site,
            address=self._address,
        )
        self._adoption = (
            Adoption(
                self._records,
                self._book,
                self._launcher,
                self._files,
                self._runs,
                folders=self._folders,
                containers=self._containers,
                kill_grace_s=kill_grace_s,
                site=site,
                address=self._address,
            )
            if self._records is not None
            else None
        )
        self._stops = Stops(self._reservations, self._tasks, kill_grace_s, self._book.changed)
        if self._elastic is not None:
            self._elastic.on_taken_back(self._stops.node_taken_back)

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

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        """Takes a running service's new spec (``federation.service_policy``) or declines it
        with a reason (``federation.agent.embedded.service_changes``)."""
        return await self._services.change(change)

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        """Starts every replica of a reserved task (``federation.agent.embedded.task_runs``).

        A replica that cannot be started (a missing program, say) does not refuse the commit:
        the task was taken, and it ends FAILED with the reason, reported through ``on_status``.
        """
        return await self._runs.commit(commit)

    async def release(self, reservation_id: str) -> None:
        """Frees an uncommitted reservation; a no-op when it is unknown."""
        if self._reservations.drop(reservation_id) is not None:
            log.info("reservation_released", reservation_id=reservation_id)
            self._book.changed()

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None:
        """Stops the task and waits until it has ended CANCELLED (epoch 0: any epoch;
        ``federation.agent.embedded.stops``). A reservation for the task is dropped too."""
        await self._stops.cancel(job_id, task, epoch, reason)

    async def stop_cut_off(self, cut_off_s: float) -> None:
        """Stops every task whose job asks for it after ``cut_off_s`` seconds cut off from every
        coordinator, and waits until they have ended CANCELLED, reported interrupted."""
        await self._stops.stop_cut_off(cut_off_s)

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
        await self._stops.stop(victims, "agent shutting down", grace_s)
        if self._records is not None:
            for victim in victims:
                self._records.drop(victim.reservation_id)
        await self.close()

    async def adopt(self) -> None:
        """Takes over the tasks recorded in state_dir by the agent before this one
        (``federation.agent.embedded.adoption``); at an elastic site, starts letting go of the
        nodes that stay idle, and counts those launched before as running."""
        if self._elastic is not None and self._idle_releases is None:
            self._idle_releases = asyncio.create_task(
                self._elastic.run(self._room.busy_nodes, self._book.changed)
            )
        if self._adoption is None:
            return
        await self._adoption.adopt()
        if self._elastic is not None:  # launched by the agent before: they run
            self._elastic.running(self._room.busy_nodes())
        self._book.changed()
