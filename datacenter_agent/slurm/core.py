"""The Slurm local scheduler core: the site's own Slurm decides, holds and runs the work.

* **View.** A poller reads ``scontrol show partition|node|job`` and ``squeue --start`` every
  ``poll_interval_s``: usable nodes with Slurm's allocations, the partition's queue, and this
  site's jobs (found by their comment, so a restarted agent finds them again).
* **Offers.** ``sbatch --test-only`` asks Slurm whether and when the task would start; then the
  reservation is a *held* job (``sbatch --hold``), released with ``scontrol release`` on commit
  and cancelled with ``scancel`` when its lease lapses or it is released. Slurm has then
  checked everything it checks at submission (account, QoS, partition limits); a decline carries
  Slurm's own words. The view counts held jobs as used, as Slurm does not.
* **Runs.** The job is followed through ``scontrol show job``; cancel sends SIGTERM first (so
  the task can checkpoint), then ``scancel`` after the grace time. A job Slurm preempts or
  loses with its node is requeued in Slurm, not reported ended (see ``slurm_tasks``).
* **Images.** A task that names one runs in it with Podman on the node, as the embedded core
  runs it, as its tenant's uid (``slurm_containers``).
* **Checkpoints.** The embedded core's: the same folder, variables, watcher and reports
  (``federation.agent.checkpoints``); a requeued job restarts from the newest one.
* **Health.** When Slurm cannot be read the site is *degraded*: the view shows one unschedulable
  node labelled ``health=degraded`` with Slurm's error as ``health_reason``, and offers are
  declined with it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

import structlog

from datacenter_agent.slurm.checkpoints import adopted_checkpoints
from datacenter_agent.slurm.cli import Record, SlurmCli, SlurmError, slurm_env
from datacenter_agent.slurm.containers import ContainerJob
from datacenter_agent.slurm.job import (
    RESTORE_FILE,
    is_held,
    job_dir,
    job_outcome,
    parse_comment,
)
from datacenter_agent.slurm.offer import (
    accepted,
    foresee,
    offer_problem,
    submit_held,
    with_partition,
)
from datacenter_agent.slurm.reading import read_slurm
from datacenter_agent.slurm.reservations import HeldJobs, Reservation
from datacenter_agent.slurm.tasks import SlurmTask, follow
from datacenter_agent.slurm.view import ClusterView, Partition
from federation.agent.accounts import NoAccountError, TaskAccounts
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.commits import commit_key, refused, settled, started
from federation.agent.config import SlurmSettings
from federation.agent.containers import Containers, ContainerSettings, env_lines
from federation.agent.core import ChangeCallback, StatusCallback
from federation.agent.node_fit import qualifying_nodes
from federation.agent.packing import Usage, place
from federation.agent.process import ReplicaStartError
from federation.agent.reports import Reports
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common.keys import RunKey
from federation.placement.compat import CompatTable, load_table_files
from federation.stop_after import STOP_GRACE_S, announce_stop

log = structlog.get_logger()

_DEFAULT_LEASE_S = 10.0
_KILL_WAIT_S = 30.0
DEGRADED_NODE = "slurm"
"""Name of the one unschedulable node a degraded site publishes, carrying the reason."""


class SlurmCore:
    """Delegates tasks to Slurm; satisfies ``LocalCore``. ``start`` it before use.

    Args:
        settings: Partition, account, QoS, extra sbatch flags, GRES models, timings.
        site: This site's name, written into each job's comment.
        work_dir: Job folders (``JOB/TASK/EPOCH``); the compute nodes must see it too.
        on_status: Called with a task's report when it starts running and when it ends.
        on_change: Called whenever the view or the queue changes.
        kill_grace_s: Time between SIGTERM and scancel when a task is cancelled.
        environ: Environment to take PATH, SLURM_CONF... from; default the agent's.
        containers: Runs tasks that name an image (``slurm_containers``): the settings of
            the embedded core's; Podman runs on the nodes.
        accounts: Whose uid each tenant's containers run as; None: the site runs no image.
            Tasks without an image run as the account that submits them (the agent's).
    """

    name = "slurm"

    def __init__(
        self,
        settings: SlurmSettings,
        *,
        site: str,
        work_dir: Path,
        on_status: StatusCallback,
        on_change: ChangeCallback,
        kill_grace_s: float = 5.0,
        environ: Mapping[str, str] | None = None,
        compat: CompatTable | None = None,
        containers: ContainerSettings | None = None,
        accounts: TaskAccounts | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        env = slurm_env(settings, environ)
        self._environ = dict(environ)
        self._containers = Containers(
            containers or ContainerSettings(), work_dir.absolute(), local=False
        )
        self._accounts = accounts
        self._conf = Path(env["SLURM_CONF"]) if "SLURM_CONF" in env else None
        self._cli = SlurmCli(env, settings.command_timeout_s)
        self._settings = settings
        self._site, self._work_dir = site, work_dir.absolute()  # batch scripts run elsewhere
        self._reports = Reports(on_status, on_change)
        self._kill_grace_s = kill_grace_s
        self._compat = compat or load_table_files()
        self._partition = Partition(settings.partition, "UNKNOWN", None)
        self._cluster = ClusterView()
        self._queue = resources_pb2.QueueState()
        self._health = "Slurm not read yet"
        self._held = HeldJobs(self._cli, self._changed)
        self._tasks: dict[RunKey, SlurmTask] = {}
        self._forgotten: set[str] = set()
        self._adopted = False
        self._offer_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Reads Slurm once (adopting this site's jobs), then keeps reading it in the background."""
        await self.refresh()
        self._poller = asyncio.create_task(self._poll())

    # The view ------------------------------------------------------------------------------

    @property
    def health(self) -> str:
        """Why the site is degraded, or "" when Slurm answers."""
        return self._health

    def image_policy(self) -> tuple[str, list[str]]:
        """Why this site runs no image ("": it runs them), and the registries it pulls from.

        The nodes' images are not published: only a job on each node could list them, so
        placement counts a pull wherever a Slurm site runs the task."""
        return self._containers.policy(self._accounts)

    def nodes(self) -> list[resources_pb2.Node]:
        """Usable nodes less Slurm's allocations and this core's held jobs; or the degraded node."""
        if self._health:
            return [
                resources_pb2.Node(
                    name=DEGRADED_NODE,
                    schedulable=False,
                    labels={"health": "degraded", "health_reason": self._health},
                    provenance=resources_pb2.PROVENANCE_DISCOVERED,
                )
            ]
        usage = self._usage()
        views = []
        for base in self._cluster.nodes:
            node = resources_pb2.Node()
            node.CopyFrom(base)
            node.cpu_free = max(0.0, node.cpu_cores - usage.cpu[node.name])
            node.memory_free_mib = max(0, node.memory_mib - usage.memory_mib[node.name])
            for pos, device in enumerate(node.devices):
                device.allocated = (node.name, pos) in usage.devices
            views.append(node)
        return views

    def queue(self) -> resources_pb2.QueueState:
        """The partition's pending and running jobs (every user's) and its expected wait."""
        return self._queue

    def tasks(self) -> list[site_link_service_pb2.TaskReport]:
        """A report for every task not yet forgotten, waiting, running or finished."""
        return [task.report() for task in self._tasks.values()]

    def _usage(self) -> Usage:
        usage = self._cluster.usage.copy()
        for reservation in self._held:
            for slot in reservation.slots:
                usage.add(slot)
        for task in self._tasks.values():
            if task.state == jobs_pb2.JOB_STATE_DELEGATED:  # released, not started yet
                for slot in task.slots:
                    usage.add(slot)
        return usage

    # Negotiation ---------------------------------------------------------------------------

    async def offer(self, offer: site_link_service_pb2.Offer) -> site_link_service_pb2.OfferAnswer:
        """Asks Slurm whether and when the task would start, then holds a job for it."""
        key: RunKey = (offer.job_id, offer.task, offer.epoch)
        lease_s = offer.lease_s if offer.lease_s > 0 else _DEFAULT_LEASE_S
        held = self._held.for_task(key)
        if held is not None:  # a repeated offer: the same held job, its lease renewed
            self._held.renew(held, lease_s)
            return accepted(held.id, 0.0, lease_s)
        problem = offer_problem(
            offer,
            health=self._health,
            held=[r.key for r in self._held],
            committed=self._tasks.keys(),
        )
        container = self._container_job(offer) if not problem else None
        if isinstance(container, str):
            problem = container
        answer: site_link_service_pb2.OfferAnswer | str = problem
        if not problem:
            assert not isinstance(container, str)
            async with self._offer_lock:  # one at a time, so each sees the others' holds
                try:
                    answer = await self._reserve(offer, key, lease_s, container)
                except SlurmError as err:
                    answer = f"Slurm: {err.message}"
        if isinstance(answer, str):
            log.info("offer_declined", job_id=key[0], task=key[1], epoch=key[2], reason=answer)
            return site_link_service_pb2.OfferAnswer(accepted=False, reason=answer)
        return answer

    def _container_job(self, offer: site_link_service_pb2.Offer) -> ContainerJob | str | None:
        """How the task's image is run, and as whom; why it is not; None: it names none."""
        spec = offer.spec
        if not spec.image:
            return None
        if problem := self._containers.refusal(spec.image):
            return problem
        refusal, _ = self._containers.policy(self._accounts)
        if refusal:
            return f"{refusal} (image {spec.image})"
        if (spec.replicas or 1) > 1:
            return "this Slurm site runs a task from an image as one replica only"
        assert self._accounts is not None  # the policy refuses a site without accounts
        try:
            account = self._accounts.for_tenant(offer.tenant)
            if account is None or account.uid == 0 or account.gid == 0:
                return "containers run as the tenant's account, never as root or the agent's"
            env_lines(spec.env)
        except (NoAccountError, ReplicaStartError) as err:
            return str(err)
        return ContainerJob(self._containers.settings, account, self._work_dir, self._environ)

    async def _reserve(
        self,
        offer: site_link_service_pb2.Offer,
        key: RunKey,
        lease_s: float,
        container: ContainerJob | None,
    ) -> site_link_service_pb2.OfferAnswer | str:
        spec = offer.spec
        nodes = qualifying_nodes(self._cluster.nodes, offer, self._compat)
        if isinstance(nodes, str):
            return nodes
        names = {node.name for node in nodes}
        # Slurm picks the node: it may pick any but those that do not qualify.
        exclude = sorted(n.name for n in self._cluster.nodes if n.name not in names)
        settings = with_partition(self._settings, self._partition.name)
        foreseen = await foresee(
            self._cli,
            spec,
            settings,
            nodes,
            exclude=exclude,
            min_speed=offer.estimate.device_speed,
        )
        if isinstance(foreseen, str):
            return foreseen
        checkpoints = None
        if spec.HasField("checkpoint"):
            checkpoints = TaskCheckpoints(
                spec.checkpoint,
                job_dir(self._work_dir, key),
                offer.restore if offer.HasField("restore") else None,
                lambda _: self._checkpointed(key),
            )
        slurm_id = await submit_held(
            self._cli,
            spec,
            key,
            site=self._site,
            work_dir=self._work_dir,
            args=foreseen.args,
            checkpoints=checkpoints,
            restore=offer.restore if offer.HasField("restore") else None,
            container=container,
        )
        placed = place(nodes, spec, self._usage())  # what the view counts held
        slots = () if isinstance(placed, str) else placed
        reservation = Reservation(
            key, slurm_id, slots, lease_s, checkpoints, offer.stop_after_disconnect_s
        )
        self._held.hold(reservation)
        expected_start_s = max(0.0, foreseen.start - time.time())
        log.info(
            "offer_accepted",
            job_id=key[0],
            task=key[1],
            epoch=key[2],
            slurm_job=slurm_id,
            expected_start_s=round(expected_start_s, 1),
        )
        self._changed()
        return accepted(
            reservation.id, expected_start_s, lease_s, foreseen.run_s, foreseen.device_model
        )

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        """Releases the held job; Slurm starts it when it can."""
        key = commit_key(commit)
        held = self._held.get(commit.reservation_id)
        reservation = settled(commit, self._tasks.get(key), held)
        if isinstance(reservation, site_link_service_pb2.CommitAnswer):
            return reservation
        self._held.take(reservation.id)
        task = SlurmTask(key, reservation.slurm_id, reservation.id, reservation.slots)
        task.folder = job_dir(self._work_dir, key)
        task.stop_after_s = reservation.stop_after_s
        if reservation.checkpoints is not None:
            task.checkpoints = reservation.checkpoints
            task.restore_file = job_dir(self._work_dir, key) / RESTORE_FILE
        self._tasks[key] = task
        try:
            await self._cli.run("scontrol", "release", reservation.slurm_id)
        except SlurmError as err:
            del self._tasks[key]
            self._held.to_cancel.add(reservation.slurm_id)
            self._changed()
            reason = f"Slurm would not release job {reservation.slurm_id}: {err.message}"
            return refused(key, reason, warning=True)
        log.info("task_released", job_id=key[0], task=key[1], epoch=key[2], slurm_job=task.slurm_id)
        self._changed()
        self._wake.set()
        return started()

    async def release(self, reservation_id: str) -> None:
        """Cancels an uncommitted held job; a no-op when it is unknown."""
        if await self._held.drop(reservation_id, "reservation_released"):
            self._changed()

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        """Declined: a Slurm site runs no services (it declines their offers), and a batch
        job's allocation is fixed once it runs."""
        return site_link_service_pb2.ChangeAnswer(
            accepted=False, reason="a Slurm site runs no services, so none can change in place"
        )

    # Running tasks -------------------------------------------------------------------------

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None:
        """Stops the task (SIGTERM, then scancel after the grace time) and waits for its end.

        Epoch 0 means any epoch; an unknown, finished or other-epoch task is left alone. A held
        job for the task is cancelled too, so it can no longer be committed.
        """

        def targeted(key: RunKey) -> bool:
            return key[:2] == (job_id, task) and epoch in (0, key[2])

        held = [r for r in self._held if targeted(r.key)]
        for reservation in held:
            await self._held.drop(reservation.id, "reservation_cancelled")
        victims = [t for key, t in self._tasks.items() if targeted(key) and t.is_active]
        if not victims and not held:
            log.debug("cancel_ignored", job_id=job_id, task=task, epoch=epoch)
        await asyncio.gather(
            *(self._stop(victim, reason, self._kill_grace_s) for victim in victims)
        )
        if held:
            self._changed()

    async def stop_cut_off(self, cut_off_s: float) -> None:
        """Stops every task whose job asks for it after ``cut_off_s`` seconds cut off from every
        coordinator, waiting or running, and waits for their end: CANCELLED, reported
        interrupted. Slurm's own KillWait may make the end later than the coordinator counts."""
        victims = [
            t
            for t in self._tasks.values()
            if t.is_active and t.cancel_reason is None and 0 < t.stop_after_s <= cut_off_s
        ]
        grace_s = min(self._kill_grace_s, STOP_GRACE_S)
        stops = []
        for victim in victims:
            victim.interrupted = True
            reason = announce_stop(
                victim.key, cut_off_s, victim.stop_after_s, slurm_job=victim.slurm_id
            )
            stops.append(self._stop(victim, reason, grace_s))
        await asyncio.gather(*stops)

    async def _stop(self, task: SlurmTask, reason: str, grace_s: float) -> None:
        """SIGTERM to a running job, ``scancel`` after ``grace_s``; waits for its end."""
        task.cancel_reason, task.stopping = reason, True
        try:
            if task.state == jobs_pb2.JOB_STATE_RUNNING:
                try:  # first a signal the task may catch to save a checkpoint
                    await self._cli.run("scancel", "--signal=TERM", "--full", task.slurm_id)
                except SlurmError as err:
                    log.warning("slurm_signal_failed", slurm_job=task.slurm_id, error=err.message)
                else:
                    log.info("task_signalled", slurm_job=task.slurm_id, signal="TERM")
                    await self._until_finished(task, grace_s)
            if task.is_active:
                try:
                    await self._cli.run("scancel", task.slurm_id)
                except SlurmError as err:
                    # Slurm is unwell: the next good reading sends it again.
                    log.warning("slurm_cancel_failed", slurm_job=task.slurm_id, error=err.message)
                    return
                task.cancel_sent = True
                if not await self._until_finished(task, _KILL_WAIT_S):
                    log.warning("task_still_ending", slurm_job=task.slurm_id, waited_s=_KILL_WAIT_S)
        finally:
            task.stopping = False

    async def _until_finished(self, task: SlurmTask, timeout_s: float) -> bool:
        """Waits (reading Slurm at once) until the task has ended; False after ``timeout_s``."""
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                await task.finished.wait()
        except TimeoutError:
            return False
        return True

    def forget(self, job_id: str, task: str, epoch: int) -> None:
        """Drops a finished task's record; a running task is kept."""
        known = self._tasks.get((job_id, task, epoch))
        if known is not None and known.is_active:
            log.warning("forget_ignored", job_id=job_id, task=task, epoch=epoch, state="running")
        elif known is not None:
            del self._tasks[known.key]
            self._forgotten.add(known.slurm_id)

    # Reading Slurm -------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._settings.poll_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:
                log.exception("slurm_refresh_failed")

    async def refresh(self) -> None:
        """Reads the partition, its nodes, its queue and this site's jobs from Slurm once."""
        began = time.monotonic()
        try:
            reading = await read_slurm(self._cli, self._settings, self._conf)
        except SlurmError as err:
            self._degrade(err.message)
            return
        if reading.cluster.hidden != self._cluster.hidden:
            log.info("slurm_nodes_hidden", nodes=reading.cluster.hidden)
        self._partition, self._cluster, self._queue = (
            reading.partition,
            reading.cluster,
            reading.queue,
        )
        if self._health:
            log.info("site_recovered", partition=self._partition.name, was=self._health)
            self._health = ""
        await self._track(reading.jobs, began)
        self._changed()

    def _degrade(self, reason: str) -> None:
        if reason != self._health:
            log.warning("site_degraded", reason=reason)
            self._health = reason
            self._changed()

    async def _track(self, jobs: list[Record], began: float) -> None:
        """Follows this site's jobs; adopts them on the first good reading after a (re)start.

        Args:
            jobs: Every job Slurm lists.
            began: When this reading began: a task committed since may not be listed yet.
        """
        seen: set[str] = set()
        held = {r.slurm_id for r in self._held}
        mine = {task.slurm_id: task for task in self._tasks.values()}
        for record in jobs:
            key = parse_comment(record.value("Comment"), self._site)
            slurm_id = record.value("JobId")
            if key is None or slurm_id in self._forgotten:
                continue
            seen.add(slurm_id)
            if slurm_id in self._held.to_cancel:
                if job_outcome(record).is_final:
                    self._held.to_cancel.discard(slurm_id)
                else:
                    await self._held.cancel(slurm_id)
            elif slurm_id in mine:
                await follow(mine[slurm_id], record, self._cli, self._report)
            elif slurm_id not in held:
                await self._adopt(key, slurm_id, record)
        self._held.to_cancel &= seen
        for task in list(self._tasks.values()):
            if not task.is_active:
                continue
            if task.slurm_id not in seen and task.created < began:
                await follow(task, None, self._cli, self._report)
            elif task.cancel_reason is not None and not task.cancel_sent and not task.stopping:
                # Slurm missed the last try
                self._spawn(self._stop(task, task.cancel_reason, self._kill_grace_s))
        self._adopted = True

    async def _adopt(self, key: RunKey, slurm_id: str, record: Record) -> None:
        """Takes back a job an earlier run of the agent submitted; cancels stale held ones.

        A held job of this site that no reservation knows is stale (from before a restart, or
        an offer whose sbatch timed out) unless an offer is being recorded right now.
        """
        if is_held(record):
            if not self._offer_lock.locked():
                log.info("stale_reservation_cancelled", slurm_job=slurm_id)
                await self._held.cancel(slurm_id)
            return
        if self._adopted or key in self._tasks:
            return  # only a restart brings back jobs this core did not commit itself
        task = SlurmTask(key, slurm_id, f"slurm-{slurm_id}", ())
        folder = task.folder = job_dir(self._work_dir, key)
        task.checkpoints = await asyncio.to_thread(
            adopted_checkpoints, folder, lambda _: self._checkpointed(key)
        )
        if task.checkpoints is not None:  # watched from its start, as its submitter did
            task.restore_file = folder / RESTORE_FILE
        self._tasks[key] = task
        log.info("task_adopted", job_id=key[0], task=key[1], epoch=key[2], slurm_job=slurm_id)
        await follow(task, record, self._cli, self._report)

    # Plumbing ------------------------------------------------------------------------------

    def _checkpointed(self, key: RunKey) -> None:
        """A task completed a checkpoint: report it (the report carries the newest)."""
        task = self._tasks.get(key)
        if task is not None:
            self._report(task)

    def _report(self, task: SlurmTask) -> None:
        self._reports.status(task.report())

    def _changed(self) -> None:
        self._reports.view(self.nodes(), self._queue)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Stops reading Slurm and cancels held jobs; committed jobs stay with Slurm."""
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        await self._held.close()
        for known in self._tasks.values():
            if known.checkpoints is not None:
                known.checkpoints.stop()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        log.info("core_closed", running_tasks=sum(t.is_active for t in self._tasks.values()))

    async def shutdown(self, grace_s: float) -> None:
        """Lets go of Slurm for agent exit: committed jobs keep running under Slurm.

        A Slurm job outlives the agent by design; the agent that comes back finds it by its
        comment and reports it, and the coordinator's epochs fence it off if it was placed
        elsewhere meanwhile. Held jobs (uncommitted reservations) are cancelled.
        """
        active = [t.slurm_id for t in self._tasks.values() if t.is_active]
        if active:
            log.info("slurm_jobs_left_running", slurm_jobs=active)
        await self.close()
