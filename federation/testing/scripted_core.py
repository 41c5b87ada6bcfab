"""Sites whose local scheduler core is scripted, run in this process over the real agent protocol.

A ``ScriptedCore`` stands in for a site's local core (embedded or Slurm) where a test or a
benchmark is about the coordinator: it declares one node of the capacity it is given, accepts
or declines each offer by a rule (when told to, only once a gate opens), records every offer,
commit and release it gets, and reports
each committed task RUNNING then SUCCEEDED at once (or keeps it running, listed in its hello,
until ``finish``). Everything else is real: the agent runtime,
its enrolment with a join token, and the mTLS session to the coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from federation.agent.config import AgentConfig
from federation.agent.core import StatusCallback
from federation.agent.enroll import ensure_enrolled
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.local import LocalFederation

OfferRule = Callable[[site_link_service_pb2.Offer], str]
"""Why the core declines an offer, or "" to accept it."""


def accept_all(offer: site_link_service_pb2.Offer) -> str:
    return ""


class ScriptedCore:
    """A local core with declared capacity whose committed tasks end the moment they start."""

    name = "scripted"

    def __init__(
        self, cpu: float = 1e6, decline: OfferRule = accept_all, *, finishes: bool = True
    ) -> None:
        self.cpu = cpu
        self.decline = decline
        self.finishes = finishes
        """Committed tasks report RUNNING then SUCCEEDED at once; False: they run, silent,
        until ``finish``, and every hello lists them RUNNING."""
        self.on_status: StatusCallback | None = None
        """Set by ``start_scripted_sites`` to the agent runtime's report callback."""
        self.gate: asyncio.Event | None = None
        """When set to an event, offers are answered only once it is set (a slow site)."""
        self.commit_gate: asyncio.Event | None = None
        """When set to an event, a commit starts its task at once but is answered only once
        it is set (an answer the coordinator waits for in vain)."""
        self.running: dict[tuple[str, str, int], site_link_service_pb2.Commit] = {}
        """Committed tasks that run until ``finish`` (``finishes`` False), by job, task, epoch."""
        self.offers: list[site_link_service_pb2.Offer] = []
        self.commits: list[site_link_service_pb2.Commit] = []
        self.releases: list[str] = []
        self._seq = 0

    def image_policy(self) -> tuple[str, list[str]]:
        """Any image: the script decides how each task ends, nothing is pulled."""
        return "", []

    def nodes(self) -> list[resources_pb2.Node]:
        return [
            resources_pb2.Node(
                name="scripted",
                cpu_cores=self.cpu,
                cpu_free=self.cpu,
                memory_mib=1 << 40,
                memory_free_mib=1 << 40,
                schedulable=True,
            )
        ]

    def queue(self) -> resources_pb2.QueueState:
        return resources_pb2.QueueState()

    async def offer(self, offer: site_link_service_pb2.Offer) -> site_link_service_pb2.OfferAnswer:
        self.offers.append(offer)
        if self.gate is not None:
            await self.gate.wait()
        if why := self.decline(offer):
            return site_link_service_pb2.OfferAnswer(accepted=False, reason=why)
        self._seq += 1
        return site_link_service_pb2.OfferAnswer(
            accepted=True, reservation_id=f"r{self._seq}", lease_s=offer.lease_s
        )

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        self.commits.append(commit)
        assert self.on_status is not None, "start the site with start_scripted_sites"
        if self.finishes:
            self.on_status(_report(commit, jobs_pb2.JOB_STATE_RUNNING))
            self.on_status(_report(commit, jobs_pb2.JOB_STATE_SUCCEEDED))
        else:
            self.running[(commit.job_id, commit.task, commit.epoch)] = commit
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        return site_link_service_pb2.CommitAnswer(started=True)

    def finish(self, job_id: str) -> None:
        """End every running task of ``job_id`` SUCCEEDED, reported at once."""
        assert self.on_status is not None, "start the site with start_scripted_sites"
        for key in [k for k in self.running if k[0] == job_id]:
            self.on_status(_report(self.running.pop(key), jobs_pb2.JOB_STATE_SUCCEEDED))

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        return site_link_service_pb2.ChangeAnswer(accepted=False, reason="scripted: no services")

    async def release(self, reservation_id: str) -> None:
        self.releases.append(reservation_id)

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None: ...

    async def stop_cut_off(self, cut_off_s: float) -> None: ...

    def tasks(self) -> list[site_link_service_pb2.TaskReport]:
        return [_report(c, jobs_pb2.JOB_STATE_RUNNING) for c in self.running.values()]

    def forget(self, job_id: str, task: str, epoch: int) -> None: ...

    async def close(self) -> None: ...

    async def shutdown(self, grace_s: float) -> None: ...


def _report(
    commit: site_link_service_pb2.Commit, state: jobs_pb2.JobState.ValueType
) -> site_link_service_pb2.TaskReport:
    return site_link_service_pb2.TaskReport(
        job_id=commit.job_id, task=commit.task, epoch=commit.epoch, state=state
    )


async def start_scripted_sites(
    fed: LocalFederation, cores: dict[str, ScriptedCore], timeout_s: float = 120.0
) -> list[asyncio.Task[None]]:
    """Join one datacenter site per core to ``fed`` and run their agents in this process until
    the returned tasks are cancelled; returns once every site is connected."""
    runners = []
    for name, core in cores.items():
        token = await fed.create_token(name, "datacenter")
        runners.append(await _run_site(fed, name, core, token))
    await fed.wait_connected(list(cores), timeout_s=timeout_s)
    return runners


async def restart_scripted_site(
    fed: LocalFederation, name: str, runner: asyncio.Task[None], core: ScriptedCore
) -> asyncio.Task[None]:
    """Stop a site's agent (``runner``) and start it again, enrolled as it was, with ``core``:
    the new session's hello reports only what ``core`` holds (nothing, for a new one)."""
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    restarted = await _run_site(fed, name, core, token="")
    await fed.wait_connected([name])
    return restarted


async def _run_site(
    fed: LocalFederation, name: str, core: ScriptedCore, token: str
) -> asyncio.Task[None]:
    config = AgentConfig(
        site=name,
        domain="datacenter",
        coordinator=fed.address,
        ca=fed.pki.ca_cert,
        state_dir=fed.root / "sites" / name,
        token=token,
        join_address=fed.join_address,
    )
    runtime = AgentRuntime(config, await ensure_enrolled(config), core)
    core.on_status = runtime.on_status
    return asyncio.create_task(runtime.run())
