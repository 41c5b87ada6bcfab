"""The Ray local scheduler core: an existing Ray cluster holds and runs the site's tasks.

* **View.** Ray's live nodes (``ray.nodes()``) with their devices named (``ray_view``), less
  what this core's placement groups hold, read every ``poll_interval_s``.
* **Offers.** The reservation is a detached placement group named after the site and task,
  one bundle per replica pinned to the node the view placed it on (``PACK``, or
  ``STRICT_PACK`` when every replica is on one node), among the nodes that qualify
  (``node_fit``: the job's node labels, requirements and cordons). Ray has no lease: the core
  removes the group when the offer's lease lapses. A group Ray cannot place at once is
  removed and the offer declined with Ray's scheduling state.
* **Runs.** Commit submits a Ray job (submission id: site, job, task and epoch, so a retried
  commit finds the job it submitted) whose 0-CPU launcher starts one actor per bundle
  (``ray_launcher``). Cancel stops the job: Ray sends the launcher SIGTERM, which passes it to
  every replica; Ray kills it after ``RAY_JOB_STOP_WAIT_TIME_S``, set to the stop grace.
* **Data.** The agent and the Ray nodes share ``work_dir`` (as a Slurm site's nodes share
  theirs), so the agent stages a task's inputs into its replicas' folders before its job is
  submitted (the task DELEGATED meanwhile), watches and uploads its checkpoints and stores its
  outputs once it succeeded, with the embedded core's parts (``ray_cluster.task_data``).
  Tasks that name an image are declined.
* **Restart.** Groups and jobs carry the site's name: a restarted agent adopts the running jobs,
  with their data and nodes as the record in their folders tells (``ray_cluster.adoption``),
  and removes groups no job uses (reservations it no longer knows).
* **Elastic.** With ``[elastic] provider = "ray"`` the site's node types are launched by Ray's
  autoscaler (``ray_autoscaler``): the view adds the nodes not running as launchable ones
  (``Node.launch``) and names a launched Ray node as the site's node it is. An offer that needs
  launchable nodes is held without a group (nothing to place it on yet) and accepted with the
  launch delay as its expected start; the commit launches the nodes, then places the group on
  them (pinned by Ray node id) and submits the job, the task DELEGATED meanwhile. A failed
  launch fails the task with Ray's word. Nodes idle for ``idle_release_s`` are released. A
  launched node Ray loses is taken back: its reservations are released and its tasks stopped,
  reported interrupted (placed again by the coordinator, from their newest checkpoints); a job
  Ray ended FAILED as its replica's actor died waits for Ray's word on the node (``verdict``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import structlog

from datacenter_agent.ray_cluster.adoption import FINAL, adopted_task, status_of, unfinished
from datacenter_agent.ray_cluster.autoscaler import RayAutoscalerProvider
from datacenter_agent.ray_cluster.groups import (
    group_name,
    place_group,
    remove_group,
    remove_named_group,
    site_groups,
    submission_id,
)
from datacenter_agent.ray_cluster.launch import submit_job
from datacenter_agent.ray_cluster.record import TaskRecord, save_record
from datacenter_agent.ray_cluster.task_data import RayTaskData, has_data, task_folder
from datacenter_agent.ray_cluster.tasks import Held, RayTask, accepted, on_node
from datacenter_agent.ray_cluster.verdict import NODE_VERDICT_S, may_be_lost, node_lost
from datacenter_agent.ray_cluster.view import bundles_on, device_ids, ray_nodes, requested_bundle
from federation.agent.commits import commit_key, epoch_problem, refused, settled, started
from federation.agent.config import RaySettings
from federation.agent.core import ChangeCallback, StatusCallback, gang_refusal
from federation.agent.elastic import Elastic, LaunchError
from federation.agent.node_fit import qualifying_nodes, task_problem
from federation.agent.packing import Usage, place
from federation.agent.reports import Reports
from federation.agent.task_data import TaskData
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common.keys import RunKey
from federation.placement.compat import CompatTable, load_table_files
from federation.stop_after import announce_stop

log = structlog.get_logger()

_DEFAULT_LEASE_S = 10.0
_TAIL_CHARS = 4000
_SETTLE_ON_CLOSE_S = 30.0
"""How long closing waits for ended jobs still storing their outputs and last checkpoint: a
next agent adopts running jobs only, so an end not reported by then is lost."""


class RayCore:
    """Delegates tasks to a Ray cluster; satisfies ``LocalCore``. ``start`` it before use.

    Args:
        settings: The head's addresses, namespace, device descriptions, timings.
        site: This site's name, carried by every group and job.
        work_dir: Task folders (``JOB/TASK/EPOCH``); the Ray nodes must see it too.
        on_status: Called with a task's report when it starts running and when it ends.
        on_change: Called whenever the view or the queue changes.
        kill_grace_s: Time between SIGTERM and SIGKILL when a task is cancelled.
        compat: The software compatibility table requirements are read through.
        elastic: The launch state of the site's node types, launched by ``autoscaler``.
        data: Stages tasks' inputs and stores their outputs and checkpoints; default: a site
            without an object store.
    """

    name = "ray"
    node_verdict_s = NODE_VERDICT_S
    """How long a job that failed as its replica's actor died waits for Ray's word on its
    launched node (``verdict``)."""

    def __init__(
        self,
        settings: RaySettings,
        *,
        site: str,
        work_dir: Path,
        on_status: StatusCallback,
        on_change: ChangeCallback,
        kill_grace_s: float = 5.0,
        compat: CompatTable | None = None,
        elastic: Elastic | None = None,
        autoscaler: RayAutoscalerProvider | None = None,
        data: TaskData | None = None,
    ) -> None:
        if (elastic is None) != (autoscaler is None):
            raise ValueError("an elastic Ray site needs both its Elastic and its autoscaler")
        self._elastic, self._autoscaler = elastic, autoscaler
        if elastic is not None:
            elastic.on_taken_back(self._node_taken_back)
        self._idle_releases: asyncio.Task[None] | None = None
        self._stops: set[asyncio.Task[None]] = set()
        """Releases and stops for nodes taken back, under way."""
        self._settings = settings
        self.data = data or TaskData(None, site)
        self._site, self._work_dir = site, work_dir.absolute()
        self._reports = Reports(on_status, on_change)
        self._kill_grace_s = kill_grace_s
        self._compat = compat or load_table_files()
        self._nodes: list[resources_pb2.Node] = []
        self._held: dict[str, Held] = {}
        self._tasks: dict[RunKey, RayTask] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._jobs: Any = None

    async def start(self) -> None:
        """Connects to the head, adopts this site's jobs, then follows Ray in the background."""

        def connect() -> Any:
            import ray
            from ray.job_submission import JobSubmissionClient

            if not ray.is_initialized():
                ray.init(
                    address=self._settings.address,
                    namespace=self._settings.namespace,
                    logging_level=logging.ERROR,
                    log_to_driver=False,
                )
            return JobSubmissionClient(self._settings.dashboard)

        self._jobs = await asyncio.to_thread(connect)
        if self._elastic is not None and self._autoscaler is not None:
            # Launched for the agent before this one: they run, until idle long enough.
            names = [node.name for node in self._elastic.nodes()]
            self._elastic.running(await self._autoscaler.adopt(names))
        await self._adopt()
        await self.refresh()
        self._poller = asyncio.create_task(self._poll())
        if self._elastic is not None:
            self._idle_releases = asyncio.create_task(
                self._elastic.run(self._busy_nodes, self._changed)
            )

    # The view ------------------------------------------------------------------------------

    def image_policy(self) -> tuple[str, list[str]]:
        """Ray sites run no images yet: placement sends tasks that name one elsewhere."""
        return "this site does not run containers: its scheduler is Ray", []

    def nodes(self) -> list[resources_pb2.Node]:
        """Ray's nodes less what this core's groups hold."""
        usage = self._usage()
        views = []
        for base in self._nodes:
            node = resources_pb2.Node()
            node.CopyFrom(base)
            node.cpu_free = max(0.0, node.cpu_cores - usage.cpu[node.name])
            node.memory_free_mib = max(0, node.memory_mib - usage.memory_mib[node.name])
            for pos, device in enumerate(node.devices):
                device.allocated = (node.name, pos) in usage.devices
            if self._elastic is not None:
                self._elastic.decorate(node)
            views.append(node)
        return views

    def queue(self) -> resources_pb2.QueueState:
        """This core's reservations and jobs (Ray keeps no queue of other users' work here)."""
        active = [t for t in self._tasks.values() if t.is_active]
        return resources_pb2.QueueState(
            pending_tasks=len(self._held)
            + sum(t.state == jobs_pb2.JOB_STATE_DELEGATED for t in active),
            running_tasks=sum(t.state == jobs_pb2.JOB_STATE_RUNNING for t in active),
        )

    def tasks(self) -> list[site_link_service_pb2.TaskReport]:
        return [task.report() for task in self._tasks.values()]

    def _usage(self) -> Usage:
        held = [slot for h in self._held.values() for slot in h.slots]
        held += [slot for t in self._tasks.values() if t.is_active for slot in t.slots]
        return Usage.of(held)

    def _busy_nodes(self) -> set[str]:
        """Nodes a reservation or an active task holds: not idle. A task adopted from an
        agent that kept no record of it holds nodes it does not name: then every launched node
        is busy."""
        busy = {slot.node for h in self._held.values() for slot in h.slots}
        active = [t for t in self._tasks.values() if t.is_active]
        busy |= {slot.node for t in active for slot in t.slots}
        if self._autoscaler is not None and any(not t.slots for t in active):
            busy |= set(self._autoscaler.names().values())
        return busy

    # Negotiation ---------------------------------------------------------------------------

    async def offer(self, offer: site_link_service_pb2.Offer) -> site_link_service_pb2.OfferAnswer:
        """Places a group for the task's replicas in Ray, or declines with Ray's reason."""
        key: RunKey = (offer.job_id, offer.task, offer.epoch)
        lease_s = offer.lease_s if offer.lease_s > 0 else _DEFAULT_LEASE_S
        name = group_name(self._site, key)
        async with self._lock:
            held = self._held.get(name)
            if held is not None:  # a repeated offer: the same group, its lease renewed
                held.deadline = time.monotonic() + lease_s
                return accepted(name, lease_s, held.expected_start_s)
            problem = self._problem(offer)
            expected_start_s = 0.0
            if not problem:
                answer = await self._reserve(offer, key, name, lease_s)
                if isinstance(answer, str):
                    problem = answer
                else:
                    expected_start_s = answer.expected_start_s
                    answer.tenant = offer.tenant
                    answer.restore = offer.restore if offer.HasField("restore") else None
        if problem:
            log.info("offer_declined", job_id=key[0], task=key[1], epoch=key[2], reason=problem)
            return site_link_service_pb2.OfferAnswer(accepted=False, reason=problem)
        self._changed()
        self._wake.set()  # the poller now watches this lease
        return accepted(name, lease_s, expected_start_s)

    def _problem(self, offer: site_link_service_pb2.Offer) -> str:
        if problem := task_problem(offer):
            return problem
        spec = offer.spec
        acc = spec.resources.accelerator
        if spec.kind == jobs_pb2.TASK_KIND_SERVICE:
            return "services are not run on this Ray site, which takes work that ends"
        if acc.fraction or acc.partition:
            return "this Ray site gives whole devices only (no fractions or MIG partitions)"
        if spec.spread.all_or_nothing:
            return gang_refusal("Ray")
        if spec.image:  # declined, rather than run without its image
            return "this Ray site does not run images: its tasks run as processes on Ray's nodes"
        return epoch_problem(offer, (h.key for h in self._held.values()), self._tasks)

    async def _reserve(
        self, offer: site_link_service_pb2.Offer, key: RunKey, name: str, lease_s: float
    ) -> Held | str:
        spec = offer.spec
        replicas = spec.replicas or 1
        nodes = qualifying_nodes(self.nodes(), offer, self._compat)
        if isinstance(nodes, str):
            return nodes
        placed = self._place(nodes, spec)
        if isinstance(placed, str) and self._elastic is not None:
            # No group to ask Ray about: Ray's autoscaler would launch nodes for it.
            return placed
        if not isinstance(placed, str) and (to_launch := self._to_launch(placed)):
            return self._hold_for_launch(offer, key, name, lease_s, placed, to_launch)
        selectors: list[dict[str, str]] = []
        if isinstance(placed, str):
            # Ask Ray all the same, so the decline carries Ray's own word on the request.
            bundles = [requested_bundle(spec, self._settings.devices)] * replicas
            slots: tuple[Slot, ...] = ()
        else:
            slots = placed
            bundles, selectors = bundles_on(self._nodes, slots, spec, self._ray_node)
        strategy = "STRICT_PACK" if len({s.node for s in slots}) == 1 else "PACK"
        group, state = await asyncio.to_thread(
            place_group,
            name,
            bundles,
            strategy,
            expect_room=not isinstance(placed, str),
            selectors=selectors,
        )
        if state:
            why = f"Ray cannot place the group ({strategy}, {bundles}): {state}"
            if isinstance(placed, str):
                why += f"; {placed}"
            return why
        devices = device_ids(self._nodes, slots)
        held = Held(
            key,
            name,
            group,
            slots,
            devices,
            bundles,
            time.monotonic() + lease_s,
            offer.stop_after_disconnect_s,
            spec,
        )
        self._held[name] = held
        log.info("offer_accepted", job_id=key[0], task=key[1], epoch=key[2], group=name)
        return held

    def _place(self, nodes: list[resources_pb2.Node], spec: jobs_pb2.TaskSpec) -> Any:
        """Slots for the task: on running nodes where they have room, else (an elastic site)
        with nodes still to launch; or why not."""
        usage = self._usage()
        if self._elastic is None:
            return place(nodes, spec, usage)
        running = [node for node in nodes if self._elastic.ready(node.name)]
        placed = place(running, spec, usage) if running else ""
        return place(nodes, spec, usage) if isinstance(placed, str) else placed

    def _to_launch(self, slots: tuple[Slot, ...]) -> set[str]:
        """The nodes of ``slots`` that do not run yet."""
        if self._elastic is None:
            return set()
        return {slot.node for slot in slots if not self._elastic.ready(slot.node)}

    def _hold_for_launch(
        self,
        offer: site_link_service_pb2.Offer,
        key: RunKey,
        name: str,
        lease_s: float,
        slots: tuple[Slot, ...],
        to_launch: set[str],
    ) -> Held:
        """A reservation on nodes to launch: no group yet (they are not in Ray), the slots
        held in the view; expected to start after the slowest launch (its p50)."""
        assert self._elastic is not None
        by_name = {node.name: node for node in self._nodes}
        expected = max(
            self._elastic.delays(by_name[node].labels["node_type"])[0] for node in to_launch
        )
        held = Held(
            key,
            name,
            None,
            slots,
            device_ids(self._nodes, slots),
            [],
            time.monotonic() + lease_s,
            offer.stop_after_disconnect_s,
            offer.spec,
            expected_start_s=expected,
        )
        self._held[name] = held
        log.info(
            "offer_accepted",
            job_id=key[0],
            task=key[1],
            epoch=key[2],
            group=name,
            to_launch=sorted(to_launch),
            expected_start_s=round(expected, 1),
        )
        return held

    def _ray_node(self, node: str) -> str:
        """The Ray node id of a launched node; "" for a node of Ray's own."""
        launched = self._autoscaler.ray_node(node) if self._autoscaler is not None else None
        return launched or ""

    async def release(self, reservation_id: str) -> None:
        """Removes an uncommitted group; a no-op when it is unknown."""
        held = self._held.pop(reservation_id, None)
        if held is not None:
            if held.group is not None:
                await asyncio.to_thread(remove_group, held.group)
            log.info("reservation_released", group=reservation_id)
            self._changed()

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        """Submits the task's Ray job into its group."""
        key = commit_key(commit)
        held = settled(commit, self._tasks.get(key), self._held.get(commit.reservation_id))
        if isinstance(held, site_link_service_pb2.CommitAnswer):
            return held
        del self._held[held.name]
        sid = submission_id(self._site, key)
        task = RayTask(
            key, sid, held.name, held.slots, [d for r in held.replica_devices for d in r]
        )
        task.stop_after_s = held.stop_after_s
        if has_data(held.spec, commit):
            task.data = RayTaskData(
                self.data,
                key,
                held.spec,
                tenant=held.tenant,
                folder=task_folder(self._work_dir, key),
                replicas=held.spec.replicas or 1,
                restore=held.restore,
                commit=commit,
                on_checkpoint=lambda: self._checkpointed(task),
            )
        self._tasks[key] = task
        if task.data is not None and task.data.stages:
            # Downloads take long: the commit is answered now, and the task stays DELEGATED
            # until every input is in place and its job submitted.
            task.submitted = False
            task.starting = asyncio.create_task(self._stage_then_submit(task, held))
            self._changed()
            return started()
        if held.group is None:
            # Launches take long: the commit is answered now, and the task stays DELEGATED
            # until its nodes run, its group is placed on them and its job submitted.
            task.submitted = False
            task.starting = asyncio.create_task(self._launch_then_submit(task, held))
            log.info("task_launching_nodes", job_id=key[0], task=key[1], epoch=key[2])
            self._changed()
            return started()
        try:
            await asyncio.to_thread(self._submit, held, sid)
        except Exception as err:
            del self._tasks[key]
            await asyncio.to_thread(remove_group, held.group)
            self._changed()
            return refused(key, f"Ray would not take job {sid}: {err}", warning=True)
        log.info("task_submitted", job_id=key[0], task=key[1], epoch=key[2], ray_job=sid)
        self._changed()
        self._wake.set()
        return started()

    async def _stage_then_submit(self, task: RayTask, held: Held) -> None:
        """Stages the task's inputs into its replicas' folders, then launches its nodes (an
        elastic site) or submits its job; an input that cannot be had ends it FAILED before
        any replica ran, and its group goes."""
        assert task.data is not None
        try:
            problem = await task.data.stage()
        except asyncio.CancelledError:  # stopped while staging: nothing ran
            if held.group is not None:
                await asyncio.to_thread(remove_group, held.group)
            raise
        if problem is not None:
            if held.group is not None:
                await asyncio.to_thread(remove_group, held.group)
            self._end_unsubmitted(task, jobs_pb2.JOB_STATE_FAILED, problem)
            return
        task.reason = task.data.note
        if held.group is None:
            log.info("task_launching_nodes", job_id=task.key[0], task=task.key[1])
            await self._launch_then_submit(task, held)
            return
        await self._submit_staged(task, held)

    async def _launch_then_submit(self, task: RayTask, held: Held) -> None:
        """Launches the task's nodes not running, places its group on them, submits its job;
        a failure on the way ends it FAILED with the reason, before any replica ran."""
        assert self._elastic is not None
        try:
            await self._elastic.ensure_running(self._to_launch(held.slots), self._changed)
        except LaunchError as err:
            self._end_unsubmitted(task, jobs_pb2.JOB_STATE_FAILED, str(err))
            return
        await self.refresh()  # the launched nodes, as Ray has them
        async with self._lock:
            bundles, selectors = bundles_on(self._nodes, held.slots, held.spec, self._ray_node)
            strategy = "STRICT_PACK" if len({s.node for s in held.slots}) == 1 else "PACK"
            group, state = await asyncio.to_thread(
                place_group, held.name, bundles, strategy, expect_room=True, selectors=selectors
            )
        if state:
            why = f"Ray cannot place the group on the launched nodes ({bundles}): {state}"
            self._end_unsubmitted(task, jobs_pb2.JOB_STATE_FAILED, why)
            return
        held.group, held.bundles = group, bundles
        held.replica_devices = device_ids(self._nodes, held.slots)
        task.devices = [d for r in held.replica_devices for d in r]
        await self._submit_staged(task, held)

    async def _submit_staged(self, task: RayTask, held: Held) -> None:
        """Submits the job of a task answered before (its inputs staged, its nodes
        launched); Ray's refusal ends it FAILED and its group goes."""
        submitting = asyncio.ensure_future(
            asyncio.to_thread(self._submit, held, task.submission_id)
        )
        try:
            await asyncio.shield(submitting)
        except asyncio.CancelledError:
            # Stopped while Ray takes the job: its thread goes on. A job Ray took is stopped
            # as any other (``_stop`` finds it submitted), never left running untracked.
            await asyncio.wait([submitting])
            if submitting.exception() is None:
                task.submitted = True
            else:
                await asyncio.to_thread(remove_group, held.group)
            raise
        except Exception as err:
            await asyncio.to_thread(remove_group, held.group)
            why = f"Ray would not take job {task.submission_id}: {err}"
            self._end_unsubmitted(task, jobs_pb2.JOB_STATE_FAILED, why)
            return
        task.submitted = True
        key = task.key
        log.info(
            "task_submitted", job_id=key[0], task=key[1], epoch=key[2], ray_job=task.submission_id
        )
        self._changed()
        self._wake.set()

    def _end_unsubmitted(self, task: RayTask, state: int, reason: str) -> None:
        if task.data is not None:
            task.data.stop()
        task.state, task.reason = state, reason
        log.info("task_ended", job_id=task.key[0], task=task.key[1], state=state, reason=reason)
        task.finished.set()
        self._report(task)

    def _submit(self, held: Held, sid: str) -> None:
        key = held.key
        folder = task_folder(self._work_dir, key)
        folder.mkdir(parents=True, exist_ok=True)
        known = self._tasks.get(key)
        data = known.data if known is not None else None
        data_env = {}
        if data is not None:
            data.make_folders()
            data_env = data.env()
        save_record(  # for an agent that adopts the job
            folder,
            TaskRecord(
                held.tenant,
                held.spec,
                data.restored if data is not None else None,
                held.stop_after_s,
                held.slots,
                tuple(self._ray_node(s.node) for s in held.slots),
            ),
        )
        submit_job(
            self._jobs,
            held,
            sid,
            folder,
            settings=self._settings,
            site=self._site,
            env=data_env,
            kill_grace_s=self._kill_grace_s,
        )

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        return site_link_service_pb2.ChangeAnswer(
            accepted=False, reason="a Ray site runs no services, so none can change in place"
        )

    # Running tasks -------------------------------------------------------------------------

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None:
        """Stops the task's job (SIGTERM, SIGKILL after the grace) and waits for its end."""

        def targeted(key: RunKey) -> bool:
            return key[:2] == (job_id, task) and epoch in (0, key[2])

        for held in [h for h in self._held.values() if targeted(h.key)]:
            await self.release(held.name)
        victims = [t for key, t in self._tasks.items() if targeted(key) and t.is_active]
        await asyncio.gather(*(self._stop(v, reason) for v in victims))

    async def stop_cut_off(self, cut_off_s: float) -> None:
        """Stops every task whose job asks for it after ``cut_off_s`` seconds cut off from every
        coordinator, and waits for their end: CANCELLED, reported interrupted."""
        victims = [
            t
            for t in self._tasks.values()
            if t.is_active and t.cancel_reason is None and 0 < t.stop_after_s <= cut_off_s
        ]
        stops = []
        for victim in victims:
            victim.interrupted = True
            reason = announce_stop(
                victim.key, cut_off_s, victim.stop_after_s, ray_job=victim.submission_id
            )
            stops.append(self._stop(victim, reason))
        await asyncio.gather(*stops)

    async def _stop(self, task: RayTask, reason: str) -> None:
        task.cancel_reason = reason
        if not task.submitted and task.starting is not None:
            # Still launching its nodes: no job to stop (the launches go on; the nodes, idle,
            # are released in time).
            task.starting.cancel()
            await asyncio.gather(task.starting, return_exceptions=True)
            if not task.submitted:
                self._end_unsubmitted(task, jobs_pb2.JOB_STATE_CANCELLED, reason)
                return
        await asyncio.to_thread(self._jobs.stop_job, task.submission_id)
        log.info("task_signalled", ray_job=task.submission_id, signal="TERM")
        self._wake.set()
        try:
            async with asyncio.timeout(self._kill_grace_s + 30.0):
                await task.finished.wait()
        except TimeoutError:
            log.warning("task_still_ending", ray_job=task.submission_id)

    def _node_taken_back(self, node: str, why: str) -> None:
        """A launched node Ray lost, launchable again: its reservations are released and the
        tasks on it stopped, CANCELLED and reported interrupted, so the coordinator places them
        again. (A task adopted with no record names no nodes: Ray's word on its job stands.)"""
        stops = [self.release(h.name) for h in self._held.values() if on_node(h.slots, node)]
        reason = f"node {node} was taken back by its provider: {why}"
        for task in self._tasks.values():
            if task.is_active and task.cancel_reason is None and on_node(task.slots, node):
                task.interrupted, task.cancel_reason = True, reason
                task.taken_back.set()
                stops.append(self._stop(task, reason))
        for stop in stops:
            spawned = asyncio.ensure_future(stop)
            self._stops.add(spawned)
            spawned.add_done_callback(self._stops.discard)

    def forget(self, job_id: str, task: str, epoch: int) -> None:
        known = self._tasks.get((job_id, task, epoch))
        if known is not None and not known.is_active:
            del self._tasks[known.key]

    # Following Ray -------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            now = time.monotonic()
            wait = self._settings.poll_interval_s
            if self._held:
                wait = max(0.0, min(wait, min(h.deadline for h in self._held.values()) - now))
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._lapse()
                await self.refresh()
            except Exception:
                log.exception("ray_refresh_failed")

    async def _lapse(self) -> None:
        now = time.monotonic()
        for held in [h for h in self._held.values() if h.deadline <= now]:
            if self._held.pop(held.name, None) is not None:
                if held.group is not None:
                    await asyncio.to_thread(remove_group, held.group)
                log.info("reservation_lapsed", group=held.name)
                self._changed()

    async def refresh(self) -> None:
        """Reads Ray's nodes and the state of every active job once."""
        import ray

        read_at = time.monotonic()
        records = await asyncio.to_thread(ray.nodes)
        if self._elastic is None or self._autoscaler is None:
            self._nodes = ray_nodes(records, self._settings.devices)
        else:
            await self._autoscaler.lost(records, read_at)  # each taken back: _node_taken_back
            names = self._autoscaler.names()
            nodes = ray_nodes(self._autoscaler.visible(records), self._settings.devices, names)
            templates = {node.name: node for node in self._elastic.nodes()}
            for node in nodes:
                if (template := templates.pop(node.name, None)) is not None:
                    node.labels["node_type"] = template.labels["node_type"]
            # The nodes not running (or not yet in Ray): as their type describes them.
            self._nodes = nodes + list(templates.values())
        for task in [t for t in self._tasks.values() if t.is_active and t.submitted]:
            if task.settling is not None:
                continue
            try:
                await self._follow(task)
            except Exception as err:  # one job Ray cannot describe does not stop the others
                log.warning("ray_job_unreadable", ray_job=task.submission_id, error=str(err))
        self._changed()

    async def _follow(self, task: RayTask) -> None:
        info = await asyncio.to_thread(self._jobs.get_job_info, task.submission_id)
        status = status_of(info)
        if status == "RUNNING" and task.state != jobs_pb2.JOB_STATE_RUNNING:
            task.state = jobs_pb2.JOB_STATE_RUNNING
            if task.data is not None:
                task.data.started(time.time())
            log.info("task_running", ray_job=task.submission_id)
            self._report(task)
        elif status in FINAL:
            logs = await asyncio.to_thread(self._jobs.get_job_logs, task.submission_id)
            task.output_tail = logs[-_TAIL_CHARS:]
            code = info.driver_exit_code
            task.exit_code = int(code) if code is not None else 0
            state, reason = jobs_pb2.JOB_STATE_SUCCEEDED, task.reason
            if task.cancel_reason is not None or status == "STOPPED":
                state, reason = jobs_pb2.JOB_STATE_CANCELLED, task.cancel_reason or "stopped in Ray"
            elif status != "SUCCEEDED":
                state = jobs_pb2.JOB_STATE_FAILED
                reason = info.message or f"exit code {task.exit_code}"
            await asyncio.to_thread(remove_named_group, task.reservation_id)
            suspect = self._may_be_lost(task, state)
            if task.data is None and not suspect:
                self._end(task, status, state, reason)
            else:  # Ray's word on its node, its outputs and last checkpoint first, off the poller
                settling = self._settle(task, status, state, reason, suspect=suspect)
                task.settling = asyncio.create_task(settling)

    def _may_be_lost(self, task: RayTask, state: int) -> bool:
        launched = self._autoscaler.names().values() if self._autoscaler is not None else ()
        return may_be_lost(task, state, set(launched))

    async def _settle(
        self, task: RayTask, status: str, state: int, reason: str, *, suspect: bool
    ) -> None:
        """Ends the task once Ray's word on its node has come, if its failure ``suspect``s a
        lost node, and its data has settled."""
        if suspect and await node_lost(task, self.node_verdict_s):
            state, reason = jobs_pb2.JOB_STATE_CANCELLED, task.cancel_reason or reason
        if task.data is not None:
            try:
                state, reason = await task.data.settle(state, reason)
            except Exception as exc:  # a bug must not leave the task unended for ever
                log.exception("task_data_not_settled", ray_job=task.submission_id)
                why = f"outputs not stored: {type(exc).__name__}"
                state, reason = jobs_pb2.JOB_STATE_FAILED, why
            task.data.stop()
        self._end(task, status, state, reason)

    def _end(self, task: RayTask, status: str, state: int, reason: str) -> None:
        task.state, task.reason = state, reason
        log.info("task_ended", ray_job=task.submission_id, status=status, exit_code=task.exit_code)
        task.finished.set()
        self._report(task)
        self._changed()

    def _checkpointed(self, task: RayTask) -> None:
        """A task completed a checkpoint (uploaded, at a site with a store): reported while
        the task has not ended."""
        if task.is_active:
            self._report(task)

    async def _adopt(self) -> None:
        """Takes back this site's unfinished jobs, with their data and nodes as their folders
        tell; removes its groups that no job uses."""
        names = self._autoscaler.names() if self._autoscaler is not None else {}
        for job in await asyncio.to_thread(self._jobs.list_jobs):
            found = unfinished(job, self._site)
            if found is not None and found.key not in self._tasks:
                task = await adopted_task(
                    found, self._work_dir, self.data, names, self._checkpointed
                )
                self._tasks[found.key] = task
        used = {t.reservation_id for t in self._tasks.values()}
        for name in await asyncio.to_thread(site_groups, self._site):
            if name not in used:
                await asyncio.to_thread(remove_named_group, name)
                log.info("stale_reservation_removed", group=name)

    # Plumbing ------------------------------------------------------------------------------

    def _report(self, task: RayTask) -> None:
        self._reports.status(task.report())

    def _changed(self) -> None:
        self._reports.view(self.nodes(), self.queue())

    async def close(self) -> None:
        """Stops following Ray and removes uncommitted groups; jobs stay with Ray."""
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        if self._idle_releases is not None:
            self._idle_releases.cancel()
            await asyncio.gather(self._idle_releases, return_exceptions=True)
            self._idle_releases = None
        for stop in list(self._stops):
            stop.cancel()
        await asyncio.gather(*self._stops, return_exceptions=True)
        if settling := [t.settling for t in self._tasks.values() if t.settling is not None]:
            await asyncio.wait(settling, timeout=_SETTLE_ON_CLOSE_S)
        for task in self._tasks.values():
            if task.data is not None and task.settling is None:
                task.data.stop()
        starting = [t.starting for t in self._tasks.values() if t.starting and not t.submitted]
        for launching in starting:
            launching.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        for name in list(self._held):
            await self.release(name)

    async def shutdown(self, grace_s: float) -> None:
        """Lets go of Ray for agent exit: committed jobs keep running, as under Slurm."""
        await self.close()
