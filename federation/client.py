"""A Python client of the federation's job API, for scripts and services.

    import asyncio
    from federation.client import Client

    async def main() -> None:
        async with Client.from_pki("pki", "coord.example.org:7070", identity="tenant-vision") as c:
            job = await c.submit({"name": "hello", "tasks": [{"name": "t", "command": ["true"]}]})
            print(await c.wait([job.id]))          # {'vision:...': JOB_STATE_SUCCEEDED}

    asyncio.run(main())

Specs are ``JobSpec`` messages, dicts or YAML/JSON files with the short names ``fedctl``
takes (``kind: GPU``, ``kind: service``). Every call goes to the leader among the coordinators
given (``a:7070,b:7070``), following a follower's hint. A refused call raises the
``CallError`` subclass of its gRPC status (``InvalidArgument`` with ``violations``, the bad
fields; ``NotFound``, ``PermissionDenied``...), never a bare ``grpc`` error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.endpoints import Endpoints, call_leader, parse_endpoints
from federation.jobspec import job_spec_from_dict, load_job_specs
from federation.security.pki import PkiLayout
from federation.security.tls import TlsFiles, channel_credentials
from federation.watch import events_of

ENDED = frozenset(
    {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
)
"""The states a job ends in."""
LEADER_PATIENCE_S = 15.0
"""With several coordinators: how long a call keeps looking for the leader (an election)."""

Spec = jobs_pb2.JobSpec | Mapping[str, Any] | Path


class CallError(Exception):
    """A call the coordinator refused or could not answer, with its status and message."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, violations: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.violations: dict[str, str] = dict(violations or {})
        """Field path -> what is wrong with it (``InvalidArgument``'s details)."""


class InvalidArgument(CallError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CallError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(CallError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(CallError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(CallError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(CallError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(CallError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(CallError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(CallError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(CallError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[CallError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        Unauthenticated,
        ResourceExhausted,
        FailedPrecondition,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}


def call_error(err: grpc.aio.AioRpcError) -> CallError:
    """The ``CallError`` of a failed call, with its field violations when it has any."""
    violations: dict[str, str] = {}
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.update({v.field: v.description for v in bad.field_violations})
    error = _BY_CODE.get(err.code(), CallError)(f"{err.code().name}: {err.details()}", violations)
    error.code = err.code()  # the status itself, also where no subclass names it
    return error


def as_spec(spec: Spec) -> list[jobs_pb2.JobSpec]:
    """A ``JobSpec``, a dict with fedctl's short names, or a YAML/JSON file (which may hold
    several) as messages."""
    if isinstance(spec, jobs_pb2.JobSpec):
        return [spec]
    if isinstance(spec, Path):
        return load_job_specs(spec)
    return [job_spec_from_dict(spec)]


class Client:
    """A connection to a federation's coordinators, as one identity (its certificate)."""

    def __init__(self, coordinator: str, tls: TlsFiles) -> None:
        """Args:
        coordinator: ``host:port``, or several coordinators' as ``a:7070,b:7070``.
        tls: The federation's CA bundle and this identity's certificate and key.
        """
        self._endpoints = Endpoints(parse_endpoints(coordinator))
        self._credentials = channel_credentials(tls)
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def from_pki(
        cls, pki_dir: Path | str, coordinator: str, *, identity: str = "operator-admin"
    ) -> Client:
        """A client with the files ``fedctl pki init`` or ``fedctl pki issue`` wrote:
        ``identity`` is their name there, e.g. ``tenant-vision`` or ``operator-admin``."""
        layout = PkiLayout(Path(pki_dir))
        tls = TlsFiles(
            ca=layout.ca_cert, cert=layout.client_cert(identity), key=layout.client_key(identity)
        )
        for path in (tls.ca, tls.cert, tls.key):
            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist (from 'fedctl pki init/issue')")
        return cls(coordinator, tls)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _stub(self, address: str) -> job_service_pb2_grpc.JobServiceAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.secure_channel(address, self._credentials)
        return job_service_pb2_grpc.JobServiceStub(channel)

    async def _on_leader(self, method: str, request: Any) -> Any:
        patience = LEADER_PATIENCE_S if len(self._endpoints.addresses) > 1 else 0.0

        async def call(address: str) -> Any:
            return await getattr(self._stub(address), method)(request)

        try:
            return await call_leader(self._endpoints, call, patience_s=patience)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None

    async def submit(self, spec: Spec, *, dry_run: bool = False) -> jobs_pb2.Job:
        """Submit one job; ``dry_run``: check it and store nothing (see ``plan``)."""
        (one,) = as_spec(spec)
        request = job_service_pb2.SubmitJobRequest(spec=one, validate_only=dry_run)
        reply = await self._on_leader("SubmitJob", request)
        return reply.job  # type: ignore[no-any-return]

    async def submit_many(self, specs: Sequence[Spec]) -> list[jobs_pb2.Job]:
        """Submit several jobs in one commit: all stored, or none (the bad one named)."""
        messages = [m for spec in specs for m in as_spec(spec)]
        reply = await self._on_leader(
            "SubmitJobs", job_service_pb2.SubmitJobsRequest(specs=messages)
        )
        return list(reply.jobs)

    async def plan(self, spec: Spec) -> tuple[jobs_pb2.Job, list[jobs_pb2.TaskExplanation]]:
        """The job as it would be stored, and where each of its tasks would go now (as
        ``explain`` says it); nothing is stored."""
        (one,) = as_spec(spec)
        request = job_service_pb2.SubmitJobRequest(spec=one, validate_only=True)
        reply = await self._on_leader("SubmitJob", request)
        return reply.job, list(reply.placement)

    async def get(self, job_id: str) -> jobs_pb2.Job:
        reply = await self._on_leader("GetJob", job_service_pb2.GetJobRequest(job_id=job_id))
        return reply.job  # type: ignore[no-any-return]

    async def events(self, job_id: str) -> list[jobs_pb2.JobEvent]:
        """The job's events so far, oldest first."""
        request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
        return list((await self._on_leader("GetJob", request)).events)

    async def list_jobs(
        self,
        *,
        states: Collection[jobs_pb2.JobState.ValueType] = (),
        tenant: str = "",
        site: str = "",
        limit: int = 1000,
    ) -> list[jobs_pb2.Job]:
        """Jobs in the order they were submitted, page after page, at most ``limit``."""
        found: list[jobs_pb2.Job] = []
        token = ""
        while len(found) < limit:
            request = job_service_pb2.ListJobsRequest(
                states=list(states),
                tenant=tenant,
                site=site,
                page_size=min(limit - len(found), 1000),
                page_token=token,
            )
            reply = await self._on_leader("ListJobs", request)
            found += reply.jobs
            token = reply.next_page_token
            if not token:
                break
        return found

    async def cancel(self, job_id: str, reason: str = "") -> jobs_pb2.Job:
        request = job_service_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        return (await self._on_leader("CancelJob", request)).job  # type: ignore[no-any-return]

    async def explain(self, job_id: str) -> list[jobs_pb2.TaskExplanation]:
        request = job_service_pb2.ExplainJobRequest(job_id=job_id)
        return list((await self._on_leader("ExplainJob", request)).tasks)

    async def watch(self, job_ids: Collection[str] = ()) -> AsyncIterator[jobs_pb2.JobEvent]:
        """Events of these jobs (every job the identity may see, with none) as they happen,
        each job's current state first; for ever, unless the caller stops reading."""
        # A cheap call finds the leader first: a follower refuses streams too.
        await self._on_leader("ListJobs", job_service_pb2.ListJobsRequest(page_size=1))
        request = job_service_pb2.WatchJobsRequest(job_ids=list(job_ids), include_current=True)
        stub = self._stub(self._endpoints.current)
        try:
            async for event in events_of(stub.WatchJobs(request)):
                yield event
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None

    async def logs(
        self,
        job_id: str,
        task: str = "",
        *,
        replica: int = 0,
        follow: bool = False,
        tail: int = 0,
        since: datetime | None = None,
    ) -> AsyncIterator[jobs_pb2.LogLine]:
        """A replica's output lines from the site that ran it (``task`` may be left out for a
        job of one task); with ``follow``, new ones as they come until that run ends; ``tail``:
        only the last that many kept so far; ``since``: only lines from then on."""
        await self._on_leader("ListJobs", job_service_pb2.ListJobsRequest(page_size=1))
        request = job_service_pb2.StreamLogsRequest(
            job_id=job_id, task=task, replica=replica, follow=follow, tail_lines=tail
        )
        if since is not None:
            request.since.FromDatetime(since)
        stub = self._stub(self._endpoints.current)
        try:
            async for response in stub.StreamLogs(request):
                for line in response.lines:
                    yield line
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None

    async def wait(
        self,
        job_ids: Collection[str],
        on_event: Callable[[jobs_pb2.JobEvent], None] | None = None,
    ) -> dict[str, jobs_pb2.JobState.ValueType]:
        """Each job's final state, once all have ended (ids as ``get`` takes them); every
        event on the way goes to ``on_event``."""
        full = [(await self.get(job_id)).id for job_id in job_ids]
        waiting = set(full)
        ended: dict[str, jobs_pb2.JobState.ValueType] = {}
        async for event in self.watch(full):
            if on_event is not None:
                on_event(event)
            if event.job_id in waiting and event.job_state in ENDED:
                ended[event.job_id] = event.job_state
                waiting.discard(event.job_id)
                if not waiting:
                    break
        return ended
