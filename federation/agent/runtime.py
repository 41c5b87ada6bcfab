"""The site agent's session with the coordinator: one Connect stream, kept alive.

The agent opens the stream (so it works behind NAT), says hello with its full view and every
task it holds, then sends view deltas, heartbeats, answers and task reports. When the stream
breaks it reconnects with jittered backoff; tasks keep running meanwhile, except those of jobs
that ask to be stopped after ``disconnect.stop_after_s`` cut off (``CutOffWatch``). Given several
coordinators, it tries them in order and follows a follower's hint to the leader
(``federation.endpoints`` decides where to go next and how long to wait).

When the site's certificate is renewed (``credentials_renewed``) the agent makes before it
breaks: it opens a new session with the new certificate while the old one is still up, and
closes the old one once the new one is established (the coordinator, seeing the new hello,
ends the old stream too). The site never shows unreachable, and task reports keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
import structlog
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from federation import __version__, tracing
from federation.agent.config import AgentConfig, coordinator_endpoints
from federation.agent.core import LocalCore
from federation.agent.cut_off import CutOffWatch
from federation.agent.enroll import SiteCredentials, channel_options, expired_message
from federation.agent.journal import Journal, merge
from federation.agent.links import LinkMonitor
from federation.agent.owner_share import owner_share
from federation.agent.task_data import TaskData
from federation.agent.task_spans import TaskSpans
from federation.api.v1 import resources_pb2, site_link_service_pb2_grpc
from federation.api.v1 import site_link_service_pb2 as pb
from federation.durable import write_public_file
from federation.endpoints import Endpoints, error_info, is_not_leader, leader_hint
from federation.envelopes import envelopes
from federation.errors import ProtocolVersionError
from federation.jobspec import parse_domain
from federation.metrics import AGENT_TASKS_RUNNING
from federation.security.crypto_process import check_bundle_async
from federation.security.tls import channel_credentials
from federation.site_protocol import PROTOCOL_VERSION, STAGE_PROGRESS_PROTOCOL

log = structlog.get_logger()

NO_DATA = "this site's scheduler core does not stage inputs or store outputs"

AGENT_VERSION = __version__
FATAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def is_unsupported_version(err: grpc.aio.AioRpcError) -> bool:
    """Whether the coordinator refused this agent's protocol version (retrying cannot help)."""
    info = error_info(err)
    return info is not None and info.reason == ProtocolVersionError.reason


class AgentRejectedError(RuntimeError):
    """The coordinator refused this agent's identity; retrying cannot help."""


class CertificateExpiredError(AgentRejectedError):
    """The site's certificate expired: only a new join brings the site back."""


@dataclass
class _Stream:
    """One Connect stream and what serves it, so it can outlive its session's turn."""

    channel: grpc.aio.Channel
    call: grpc.aio.StreamStreamCall[pb.ConnectRequest, pb.ConnectResponse]
    outbox: asyncio.Queue[pb.AgentMessage | None]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.call.cancel()
        # A call the coordinator already ended (a follower's refusal) is not cancelled, so
        # end its request stream here rather than leave it waiting.
        self.outbox.put_nowait(None)
        await asyncio.gather(*self.tasks, return_exceptions=True)  # its errors are moot now
        await self.channel.close()


class AgentRuntime:
    """Owns the local core and keeps one session to the coordinator alive."""

    def __init__(
        self,
        config: AgentConfig,
        creds: SiteCredentials,
        core: LocalCore,
        *,
        links: LinkMonitor | None = None,
        probe_endpoint: str = "",
        journal: Journal | None = None,
        data: TaskData | None = None,
    ) -> None:
        """Prepare a session; ``run`` opens it.

        Args:
            config: The agent's settings.
            creds: The site's certificate and key.
            core: The local scheduler core that runs the work.
            links: Measures and declares this site's links; without it none are published.
            probe_endpoint: Where peers may measure their link to this site; empty for none.
            journal: Keeps final statuses across agent restarts until acknowledged.
            data: Signs URLs for the site's stored outputs; None: the core stores none (and
                tasks with outputs or staged inputs are declined).
        """
        self._config = config
        self._creds = creds
        self.core = core
        self._links = links
        self._probe_endpoint = probe_endpoint
        self._journal = journal
        self._data = data
        self._protocol = 1
        """The site-link protocol the coordinator speaks to this agent (its welcome says)."""
        if data is not None:
            data.on_progress = self.on_stage_progress
            data.on_copy = self.on_dataset_copy
        self._copies_unsent: list[pb.DatasetCopyReport] = (
            data.replicas.reports() if data is not None and data.replicas is not None else []
        )
        """Dataset copies to tell the coordinator once in touch: every copy kept at start (a
        coordinator may have missed some), then what changed while out of touch."""
        self._domain = parse_domain(config.domain)
        self._generation = 0
        self._sent_nodes: dict[str, bytes] = {}
        self._sent_links: list[bytes] = []
        self._sent_coordinator_link = b""
        self._outbox: asyncio.Queue[pb.AgentMessage | None] | None = None
        self._view_dirty = asyncio.Event()
        self._heartbeat_s = 3.0
        self._welcomed = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()
        self._bundles_received: deque[bytes] = deque()
        """Trust bundles received and not yet checked (``_keep_trust_bundle``)."""
        self._bundle_keeper: asyncio.Task[None] | None = None
        self._endpoints = Endpoints(coordinator_endpoints(config))
        self._leaving = False
        self._session_over = asyncio.Event()
        self._cut_off = CutOffWatch(core)
        self._channel: grpc.aio.Channel | None = None
        self._renewed = asyncio.Event()
        self._retiring: _Stream | None = None
        self.connected = asyncio.Event()
        self._spans = TaskSpans(config.site)
        self.recover: Callable[[str], Awaitable[bool]] | None = None
        """Repeats a renewal whose reply was lost, for a session refused with the old
        certificate; True if the new one is on disk (``CertificateRenewer.recover``)."""

    # Called by the core ----------------------------------------------------------------

    def on_status(self, report: pb.TaskReport) -> None:
        """Forward a task status now; if offline, the next hello carries it (core keeps it)."""
        if self._journal is not None:
            self._journal.record(report)  # before it leaves: an ack may come back at once
        if tracing.on():
            self._spans.status(report)
        if self._outbox is not None:
            self._outbox.put_nowait(pb.AgentMessage(task_status=report))

    def on_stage_progress(self, progress: pb.StageProgress) -> None:
        """Tell the coordinator how an input's stage-in goes, if it speaks protocol 5; one
        lost while offline is not sent again (the task's own report is what counts)."""
        if self._outbox is not None and self._protocol >= STAGE_PROGRESS_PROTOCOL:
            self._outbox.put_nowait(pb.AgentMessage(stage_progress=progress))

    def on_dataset_copy(self, report: pb.DatasetCopyReport) -> None:
        """Tell the coordinator of a dataset copy kept or evicted here; kept for the next
        session while out of touch."""
        if self._outbox is not None and self._protocol >= STAGE_PROGRESS_PROTOCOL:
            self._outbox.put_nowait(pb.AgentMessage(dataset_copy=report))
        else:
            self._copies_unsent.append(report)

    def on_change(self) -> None:
        AGENT_TASKS_RUNNING.set(self.core.queue().running_tasks)
        self._view_dirty.set()

    def on_links_change(self) -> None:
        """The published links changed: the next delta carries them."""
        self._view_dirty.set()

    def hello_tasks(self) -> list[pb.TaskReport]:
        """What the site says it holds: the core's tasks and unacknowledged journaled ones."""
        live = self.core.tasks()
        return merge(live, self._journal.pending()) if self._journal is not None else live

    # The view ----------------------------------------------------------------------------

    def full_view(self) -> resources_pb2.SiteView:
        c = self._config
        image_refusal, image_registries = self.core.image_policy()
        return resources_pb2.SiteView(
            site=c.site,
            domain=self._domain,
            region=c.region,
            nodes=self.core.nodes(),
            queue=self.core.queue(),
            price_per_device_hour=c.price_per_device_hour,
            labels=c.labels,
            scheduler=self.core.name,
            agent_version=AGENT_VERSION,
            links=self._current_links(),
            probe_endpoint=self._probe_endpoint,
            datasets=c.datasets,
            coordinator_link=self._coordinator_link(),
            owner_share=owner_share(c.owner_share) if c.owner_share.keep else None,
            object_store=self._data.store.where if self._data and self._data.store else "",
            topology_levels=c.topology_levels,
            store_unreachable=bool(self._data and self._data.store)
            and not c.object_store.reachable,
            image_refusal=image_refusal,
            image_registries=image_registries,
        )

    def _current_links(self) -> list[resources_pb2.Link]:
        return self._links.links() if self._links is not None else []

    def _coordinator_link(self) -> resources_pb2.Link | None:
        return self._links.coordinator_link() if self._links is not None else None

    def _mark_sent(self, view: resources_pb2.SiteView) -> None:
        self._sent_nodes = {n.name: n.SerializeToString(deterministic=True) for n in view.nodes}
        self._sent_links = _encode_links(view.links)
        self._sent_coordinator_link = view.coordinator_link.SerializeToString(deterministic=True)

    def _delta(self) -> pb.ViewUpdate:
        nodes = {n.name: n for n in self.core.nodes()}
        encoded = {name: n.SerializeToString(deterministic=True) for name, n in nodes.items()}
        upserted = [
            nodes[name] for name, data in encoded.items() if self._sent_nodes.get(name) != data
        ]
        removed = [name for name in self._sent_nodes if name not in nodes]
        self._sent_nodes = encoded
        delta = resources_pb2.SiteViewDelta(
            upserted_nodes=upserted,
            removed_nodes=removed,
            queue=self.core.queue(),
            has_queue=True,
        )
        links = self._current_links()
        encoded_links = _encode_links(links)
        if encoded_links != self._sent_links:  # links travel whole, and only when changed
            delta.links.extend(links)
            delta.has_links = True
            self._sent_links = encoded_links
        coordinator_link = self._coordinator_link() or resources_pb2.Link()
        encoded_link = coordinator_link.SerializeToString(deterministic=True)
        if encoded_link != self._sent_coordinator_link:
            delta.coordinator_link.CopyFrom(coordinator_link)
            delta.has_coordinator_link = True
            self._sent_coordinator_link = encoded_link
        self._generation += 1
        return pb.ViewUpdate(generation=self._generation, delta=delta)

    # The session -------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep a session up until cancelled or left; raise ``AgentRejectedError`` if refused.
        Meanwhile stop the tasks that must not outlive a cut (``CutOffWatch``)."""
        watch = asyncio.create_task(self._cut_off.run())
        try:
            await self._keep_session()
        finally:
            watch.cancel()
            await self._retire()

    async def session_channel(self) -> grpc.aio.Channel:
        """The channel of the established session, once there is one (for renewals)."""
        while True:
            await self.connected.wait()
            if self._channel is not None:
                return self._channel
            await asyncio.sleep(0.1)  # between a session's end and its `connected` cleared

    def credentials_renewed(self) -> None:
        """The certificate and key files hold a new pair: move the session onto it."""
        self._renewed.set()

    async def _keep_session(self) -> None:
        while not self._leaving:
            error: grpc.aio.AioRpcError | None = None
            coordinator = self._endpoints.current
            self._session_over.clear()
            handed_over = False
            try:
                handed_over = await self._session(coordinator)
            except grpc.aio.AioRpcError as err:
                if is_unsupported_version(err):
                    raise AgentRejectedError(f"{err.code().name}: {err.details()}") from None
                if err.code() in FATAL_CODES:
                    if self.recover is not None and await self.recover(coordinator):
                        continue  # at once, with the certificate the renewal got
                    raise AgentRejectedError(f"{err.code().name}: {err.details()}") from None
                if err.code() is grpc.StatusCode.UNAVAILABLE and (
                    expired := expired_message(self._creds, self._config.site)
                ):
                    raise CertificateExpiredError(expired) from None
                error = err
                if is_not_leader(err):
                    log.info(
                        "session_refused_not_leader",
                        coordinator=coordinator,
                        leader=leader_hint(err),
                    )
                else:
                    log.warning(
                        "session_lost",
                        coordinator=coordinator,
                        code=err.code().name,
                        details=err.details(),
                        **_field_violations(err),
                    )
            finally:
                self._outbox = None
                self._channel = None
                self._session_over.set()
            if self._leaving:
                return
            if handed_over:
                continue  # at once, with the new certificate; the old stream is still up
            if self.connected.is_set():
                self._endpoints.succeeded()  # it worked until now: come back quickly
                self.connected.clear()
            await asyncio.sleep(self._endpoints.failed(error))

    async def _session(self, coordinator: str) -> bool:
        """Serve one stream until it ends (raising its error), or until the certificate is
        renewed: then return True, leaving the stream open for the next session to retire."""
        outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._welcomed.clear()
        self._renewed.clear()  # this session presents the newest pair on disk
        view = self.full_view()
        self._generation += 1
        self._mark_sent(view)
        hello = pb.Hello(
            view=view,
            generation=self._generation,
            tasks=self.hello_tasks(),
            agent_version=AGENT_VERSION,
            protocol_version=PROTOCOL_VERSION,
        )
        outbox.put_nowait(pb.AgentMessage(hello=hello))
        channel = grpc.aio.secure_channel(
            coordinator,
            channel_credentials(self._creds.tls),
            options=channel_options(self._config),
        )
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        stream = _Stream(channel, stub.Connect(envelopes(outbox, _request)), outbox)
        self._outbox = outbox
        self._channel = channel
        reader = asyncio.create_task(self._read(stream, coordinator))
        stream.tasks += [
            asyncio.create_task(self._heartbeats(outbox)),
            asyncio.create_task(self._views(outbox)),
            reader,
        ]
        renewed = asyncio.create_task(self._renewed.wait())
        handed_over = False
        try:
            await asyncio.wait({reader, renewed}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                await self._retire()  # a renewal before the last one's handover ended
                self._retiring, handed_over = stream, True
                log.info("session_renewing", coordinator=coordinator)
                return True
            reader.result()  # the stream's error, if it ended with one
            return False
        finally:
            renewed.cancel()
            if not handed_over:
                await stream.close()

    async def _read(self, stream: _Stream, coordinator: str) -> None:
        async for envelope in stream.call:
            if stream is not self._retiring and self._retiring is not None:
                await self._retire()  # this session is established: the old one may go
            if not self.connected.is_set():
                self.connected.set()
                log.info("session_established", coordinator=coordinator)
            for message in envelope.messages:
                self._dispatch(message, stream.outbox)

    async def _retire(self) -> None:
        """Close the stream a renewal left open, if any."""
        retiring, self._retiring = self._retiring, None
        if retiring is not None:
            await retiring.close()
            log.info("session_retired")

    async def _heartbeats(self, outbox: asyncio.Queue[pb.AgentMessage | None]) -> None:
        # At the coordinator's pace, which its welcome tells: a short interval must not wait
        # out a first sleep at the default, or the session is dropped for silence.
        await self._welcomed.wait()
        while True:
            await asyncio.sleep(self._heartbeat_s)
            outbox.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(generation=self._generation)))

    def _keep_trust_bundle(self, bundle_pem: bytes) -> None:
        """Keep the roots the coordinator trusts as the agent's CA bundle: the next session
        (after a renewal, or once the coordinator serves a certificate of a new CA) verifies
        the coordinator against them. Each bundle is checked first, in a child process (the
        agent does not hold cryptography), one at a time in the order received."""
        if not bundle_pem:
            return
        self._bundles_received.append(bundle_pem)
        if self._bundle_keeper is None or self._bundle_keeper.done():
            self._bundle_keeper = task = asyncio.create_task(self._keep_bundles())
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _keep_bundles(self) -> None:
        while self._bundles_received:
            bundle_pem = self._bundles_received.popleft()
            try:
                if bundle_pem == self._creds.ca.read_bytes():
                    continue
                # Never replace a working bundle with a broken one.
                await check_bundle_async(bundle_pem)
                write_public_file(self._creds.ca, bundle_pem)
            except (OSError, ValueError) as err:
                log.warning("trust_bundle_not_kept", error=str(err))
                continue
            log.info("trust_bundle_kept", roots=bundle_pem.count(b"BEGIN CERTIFICATE"))

    async def _views(self, outbox: asyncio.Queue[pb.AgentMessage | None]) -> None:
        while True:
            await self._view_dirty.wait()
            await asyncio.sleep(0.02)  # coalesce a burst of changes into one delta
            self._view_dirty.clear()
            outbox.put_nowait(pb.AgentMessage(view=self._delta()))

    def _dispatch(
        self, message: pb.CoordinatorMessage, outbox: asyncio.Queue[pb.AgentMessage | None]
    ) -> None:
        body = message.WhichOneof("body")
        if body == "welcome":
            self._heartbeat_s = message.welcome.heartbeat_interval_s or self._heartbeat_s
            self._protocol = message.welcome.protocol_version or 1
            if self._links is not None:
                self._links.set_coordinator(message.welcome.probe_endpoint)
            self._keep_trust_bundle(message.welcome.trust_bundle_pem)
            if self._protocol >= STAGE_PROGRESS_PROTOCOL:
                unsent, self._copies_unsent = self._copies_unsent, []
                for report in unsent:
                    outbox.put_nowait(pb.AgentMessage(dataset_copy=report))
            self._welcomed.set()
            log.info(
                "welcomed",
                coordinator_version=message.welcome.coordinator_version or "unknown",
                protocol_version=message.welcome.protocol_version or 1,
            )
        elif body == "trust_bundle":
            self._keep_trust_bundle(message.trust_bundle.trust_bundle_pem)
        elif body == "resync":
            view = self.full_view()
            self._generation += 1
            self._mark_sent(view)
            outbox.put_nowait(
                pb.AgentMessage(view=pb.ViewUpdate(generation=self._generation, full=view))
            )
        elif body == "ack":
            ack = message.ack
            self.core.forget(ack.job_id, ack.task, ack.epoch)
            if tracing.on():
                self._spans.acked(ack)
            if self._journal is not None:
                self._journal.forget(ack.job_id, ack.task, ack.epoch)
        elif body == "probe_peers":
            if self._links is not None:
                self._links.set_peers(message.probe_peers.peers)
            else:
                log.debug("probe_peers_ignored", reason="no link monitor")
        elif body == "heartbeat":
            pass  # the answer to ours: a coordinator is there (heard, below)
        else:
            # Offers, commits, releases and cancels may be slow (a real scheduler answers
            # them): handle each in its own task so the stream keeps flowing.
            task = asyncio.create_task(self._answer(message, outbox))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        self._cut_off.heard(self._heartbeat_s)

    async def _answer(
        self, message: pb.CoordinatorMessage, outbox: asyncio.Queue[pb.AgentMessage | None]
    ) -> None:
        body = message.WhichOneof("body")
        cid = message.correlation_id
        try:
            if body == "offer":
                offer = message.offer
                if self._data is None and (offer.spec.outputs or offer.stages_inputs):
                    answer = pb.OfferAnswer(reason=NO_DATA)
                else:
                    answer = await self.core.offer(message.offer)
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, offer_answer=answer))
            elif body == "commit":
                if tracing.on():
                    self._spans.committed(message.commit)
                if self._data is None and message.commit.inputs:
                    started = pb.CommitAnswer(reason=NO_DATA)
                else:
                    started = await self.core.commit(message.commit)
                if tracing.on() and not started.started:
                    self._spans.not_started(message.commit)
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, commit_answer=started))
            elif body == "change":
                changed = await self.core.change(message.change)
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, change_answer=changed))
            elif body == "presign":
                if self._data is None:
                    signed = pb.PresignAnswer(error="this site stores no outputs")
                else:
                    signed = await self._data.sign(message.presign)
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, presign_answer=signed))
            elif body == "replicate":
                if self._data is None:
                    copied = pb.ReplicateAnswer(error="this site stores no checkpoints")
                else:
                    copied = await self._data.replicate(message.replicate)
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, replicate_answer=copied))
            elif body == "read_logs":
                read = getattr(self.core, "read_logs", None)
                logs = (
                    await read(message.read_logs)
                    if read is not None
                    else pb.LogsAnswer(error="this site's core keeps no logs")
                )
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, logs_answer=logs))
            elif body == "describe":
                if self._data is None:
                    described = pb.DescribeAnswer(error="this site has no object store")
                else:
                    described = await self._data.describe(message.describe)
                outbox.put_nowait(pb.AgentMessage(correlation_id=cid, describe_answer=described))
            elif body == "release":
                await self.core.release(message.release.reservation_id)
            elif body == "cancel":
                c = message.cancel
                await self.core.cancel(c.job_id, c.task, c.epoch, c.reason)
            else:
                log.warning("unknown_message_ignored", body=body)
        except Exception:
            log.exception("request_failed", body=body)

    async def leave(self, reason: str, timeout_s: float = 2.0) -> None:
        """Say goodbye and end the session, so the coordinator shows the site DISCONNECTED.

        Without a goodbye (a crash, a lost link) the site shows UNREACHABLE. Waits at most
        ``timeout_s`` for the coordinator to end the stream; never reconnects afterwards.
        """
        self._leaving = True
        outbox = self._outbox
        if outbox is None:
            return
        # Also while a session is being set up (its hello sent, no answer yet): the goodbye
        # follows the hello on the stream, and the site leaves rather than vanishes.
        outbox.put_nowait(pb.AgentMessage(goodbye=pb.Goodbye(reason=reason)))
        try:
            async with asyncio.timeout(timeout_s):
                await self._session_over.wait()
        except TimeoutError:
            log.warning("goodbye_unanswered", timeout_s=timeout_s)
        else:
            log.info("session_left", reason=reason)

    async def close(self) -> None:
        # The agent is going: tasks it stops from now on (stop_tasks_on_exit) are placed
        # again by the coordinator, which saw the site leave; their stops are not reports.
        self._journal = None
        for task in list(self._handlers):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._handlers, return_exceptions=True)


def _field_violations(err: grpc.aio.AioRpcError) -> dict[str, list[str]]:
    """``violations``: every bad field a refusal names (``field: why``), for the log; the
    status message lists only the first few. Empty for other errors."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    found = []
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += [f"{v.field}: {v.description}" for v in bad.field_violations]
    return {"violations": found} if found else {}


def _encode_links(links: Iterable[resources_pb2.Link]) -> list[bytes]:
    return [link.SerializeToString(deterministic=True) for link in links]


def _request(messages: list[pb.AgentMessage]) -> pb.ConnectRequest:
    return pb.ConnectRequest(messages=messages)
