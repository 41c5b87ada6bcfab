"""A service's replicas kept running: each restarted by the service's policy when it ends,
its readiness checked, an autoscaled one's load read, and one being taken away drained."""

from __future__ import annotations

import asyncio
import time

import structlog

from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.task import Task
from federation.agent.embedded.task_book import TaskBook
from federation.agent.process import ReplicaProcess, ReplicaStartError, describe_exit
from federation.agent.service import is_ready, read_load
from federation.service_policy import RestartPolicy

log = structlog.get_logger()

DEFAULT_DRAIN_TIMEOUT_S = 30.0
"""How long a replica taken away from an autoscaled service may take to finish what it has
in flight (ServicePolicy.autoscale.drain_timeout_s 0)."""


class ReplicaKeeper:
    """Keeps services' replicas running and says how each is doing.

    Args:
        launcher: Starts a replica again.
        book: Records and reports the task as its replicas move.
        folders: Where each replica runs (its readiness check runs there too).
        address: Where the replicas are reached (every one runs on this machine).
    """

    def __init__(
        self, launcher: ReplicaLauncher, book: TaskBook, folders: TaskFolders, address: str
    ) -> None:
        self._launcher = launcher
        self._book = book
        self._folders = folders
        self._address = address

    async def keep(self, task: Task, replica: int) -> None:
        """Restarts one replica of a service each time it ends, by the task's policy: after
        a backoff that doubles with each short run in a row, crash-looping after enough."""
        assert task.service is not None
        state = task.service[replica]
        policy = RestartPolicy.of(task.spec.service)
        job_id, name, epoch = task.key
        while True:
            process = task.replicas[replica]
            checker = asyncio.create_task(self._check_readiness(task, replica, process))
            loads = (
                asyncio.create_task(self._watch_load(task, replica, process))
                if task.spec.service.HasField("autoscale")
                else None
            )
            try:
                try:
                    code = await asyncio.wait_for(process.wait(), policy.min_run_s)
                    short = True
                except TimeoutError:
                    if state.short_runs:  # a long run: no more backoff, no more crash loop
                        state.short_runs = 0
                        self._book.report(task)
                    code, short = await process.wait(), False
            finally:
                checker.cancel()
                if loads is not None:
                    loads.cancel()
            state.ready, state.checked = False, True
            if not policy.restarts(code):
                state.down = True
                log.info("replica_stays_down", job_id=job_id, task=name, replica=replica)
                self._book.report(task)
                return
            while True:
                state.short_runs = state.short_runs + 1 if short else 0
                delay_s = policy.delay_s(state.short_runs)
                log.info(
                    "replica_restarting",
                    job_id=job_id,
                    task=name,
                    epoch=epoch,
                    replica=replica,
                    exit=describe_exit(code),
                    in_s=delay_s,
                    crash_looping=policy.crash_looping(state.short_runs),
                )
                self._book.report(task)
                await asyncio.sleep(delay_s)
                try:
                    await self._launcher.start_replica(task, replica, self._launcher.account(task))
                    break
                except ReplicaStartError as exc:
                    log.warning("replica_restart_failed", job_id=job_id, task=name, error=str(exc))
                    code, short = exc.exit_code, True
            state.restarts += 1
            self._book.save(task)
            self._book.report(task)

    async def _check_readiness(self, task: Task, replica: int, process: ReplicaProcess) -> None:
        """Checks a running replica every period from its initial delay; reports each change
        of its readiness. Without a check, a replica is ready once it runs."""
        assert task.service is not None
        state = task.service[replica]
        if not task.spec.service.HasField("readiness"):
            state.ready = state.checked = True
            self._book.report(task)
            return
        check = task.spec.service.readiness
        await asyncio.sleep(check.initial_delay_s)
        env = self._launcher.replica_env(task, replica)
        cwd = self._folders.task_dir(task.key) / str(replica)
        account = self._launcher.account(task)
        while not process.exited:
            ready = await is_ready(
                check, address=self._address, port=state.port, env=env, cwd=cwd, account=account
            )
            if process.exited:
                break
            first, state.checked = not state.checked, True
            ready = ready and not state.draining
            if ready != state.ready or first:
                state.ready = ready
                self._book.report(task)
            await asyncio.sleep(check.period_s or 1.0)

    async def _watch_load(self, task: Task, replica: int, process: ReplicaProcess) -> None:
        """Reads an autoscaled replica's load every readiness period; reports each change (to
        a hundredth). A replica that does not answer keeps its last reading."""
        assert task.service is not None
        state = task.service[replica]
        period_s = task.spec.service.readiness.period_s or 1.0
        while not process.exited:
            load = await read_load(
                task.spec.service.autoscale,
                address=self._address,
                port=state.port,
                timeout_s=task.spec.service.readiness.timeout_s or 1.0,
            )
            if load is not None and round(load, 2) != round(state.load, 2):
                state.load = load
                self._book.report(task)
            await asyncio.sleep(period_s)

    async def drain(self, task: Task, replica: int) -> None:
        """Waits until a replica being taken away has nothing in flight: shown draining (so
        whoever follows the endpoints stops sending to it) for at least two readiness periods,
        then until its load reads 0, or drain_timeout_s."""
        assert task.service is not None
        scale = task.spec.service.autoscale
        state, process = task.service[replica], task.replicas[replica]
        period_s = task.spec.service.readiness.period_s or 1.0
        state.ready, state.draining = False, True
        self._book.report(task)
        started = time.monotonic()
        timeout_s = scale.drain_timeout_s or DEFAULT_DRAIN_TIMEOUT_S
        await asyncio.sleep(min(2 * period_s, timeout_s))
        while not process.exited and time.monotonic() - started < timeout_s:
            load = await read_load(scale, address=self._address, port=state.port, timeout_s=1.0)
            if load == 0:
                return
            await asyncio.sleep(period_s)
        if not process.exited:
            log.warning(
                "replica_drain_timed_out",
                job_id=task.key[0],
                task=task.key[1],
                replica=replica,
                after_s=timeout_s,
            )
