"""One agent's Connect stream: hello, then views, heartbeats, answers and task reports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import structlog

from federation import __version__
from federation.api.v1 import site_link_service_pb2 as pb
from federation.coordinator.data.datasets import DatasetBook
from federation.coordinator.jobs.manager import JobManager
from federation.coordinator.sites.checks import check_envelope
from federation.coordinator.sites.live_view import PlannedDelta, plan_deltas
from federation.coordinator.sites.registry import SiteRegistry, SiteSession
from federation.envelopes import take_queued
from federation.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    FederationError,
    FieldViolation,
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
)
from federation.metrics import SITE_MESSAGES
from federation.security.identity import Identity
from federation.site_protocol import agreed_version

log = structlog.get_logger()

ANSWERS = frozenset(
    {
        "offer_answer",
        "commit_answer",
        "change_answer",
        "presign_answer",
        "replicate_answer",
        "describe_answer",
        "logs_answer",
    }
)
"""Agent messages that answer a coordinator request (matched by correlation id)."""

HELLO_TIMEOUT_S = 30.0
MISSED_HEARTBEATS = 3


class SiteLink:
    """Serves agents' Connect streams.

    Args:
        sites: Where sessions are attached and views applied.
        jobs: Applies task reports and reconciles a site's tasks on hello.
        heartbeat_interval_s: How often agents send a heartbeat (told in the welcome).
        missed_heartbeats: Heartbeats a session may miss before it is dropped and its site
            becomes UNREACHABLE.
        probe_endpoint: Where agents measure their link to the coordinator (told in the
            welcome); empty for nowhere.
        trust_bundle: The roots trusted now (told in the welcome, to catch up on a rollover).
        renewed_as: The fingerprint of the certificate a serial was renewed into, or "": a
            renewed certificate opens sessions while the interceptor still accepts it.
        datasets: Records the dataset copies sites keep or evict (``dataset_copy``).
    """

    def __init__(
        self,
        sites: SiteRegistry,
        jobs: JobManager,
        heartbeat_interval_s: float,
        missed_heartbeats: int = MISSED_HEARTBEATS,
        probe_endpoint: str = "",
        trust_bundle: Callable[[], bytes] = bytes,
        renewed_as: Callable[[str], str] = lambda serial: "",
        datasets: DatasetBook | None = None,
    ) -> None:
        self._sites = sites
        self._jobs = jobs
        self._datasets = datasets
        self._heartbeat_interval_s = heartbeat_interval_s
        self._missed_heartbeats = missed_heartbeats
        self._probe_endpoint = probe_endpoint
        self._trust_bundle = trust_bundle
        self._renewed_as = renewed_as

    async def connect(
        self,
        caller: Identity,
        certificate: str,
        peer: str,
        requests: AsyncIterator[pb.ConnectRequest],
        serial: str = "",
    ) -> AsyncIterator[pb.ConnectResponse]:
        """Serve one agent until it goes away or breaks the protocol (then raise).

        ``certificate`` is the fingerprint of the agent's certificate (``serial`` its serial):
        only the one the site got at its latest Join or renewal is accepted, and the one that
        renewal was renewed from while the interceptor still accepts it (a lost reply), so a
        join retires the old ones. ``peer`` is where the stream comes from, as gRPC names it:
        the only host the site may name as its probe endpoint.
        """
        try:
            envelope = await asyncio.wait_for(anext(requests), HELLO_TIMEOUT_S)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceededError(f"no hello within {HELLO_TIMEOUT_S:g}s") from None
        if not envelope.messages or envelope.messages[0].WhichOneof("body") != "hello":
            raise InvalidArgumentError(
                [FieldViolation("messages[0]", "the first message on Connect must be a hello")]
            )
        check_envelope(envelope.messages, peer, first=True)
        hello = envelope.messages[0].hello
        rest = list(envelope.messages[1:])
        _check_site(caller.name, hello.view.site, "hello.view.site")
        version = agreed_version(hello.protocol_version)
        entry = self._sites.get(caller.name)
        newest = entry.record.certificate_fingerprint
        if newest not in ("", certificate) and self._renewed_as(serial) != newest:
            raise PermissionDeniedError(
                f"site {caller.name} has joined again or renewed since this certificate was "
                "issued. "
                "To fix: use the newest certificate (restart the agent with its state_dir)"
            )
        hello.view.domain = entry.record.domain  # the domain is the one the site joined with
        session = SiteSession(
            caller.name,
            peer=peer,
            probe_endpoint=hello.view.probe_endpoint,
            protocol=version,
        )
        # Taken before the session is attached (no await in between), so a delegation made
        # over the new session is never mistaken for one the site lost.
        delegated = self._jobs.delegated_to(caller.name)
        previous = self._sites.attach(session, hello)
        if previous is not None:
            previous.close()
        log.info(
            "site_connected",
            site=caller.name,
            generation=hello.generation,
            agent_version=hello.agent_version or "unknown",
            protocol_version=version,
        )
        session.send(
            pb.CoordinatorMessage(
                welcome=pb.Welcome(
                    heartbeat_interval_s=self._heartbeat_interval_s,
                    probe_endpoint=self._probe_endpoint,
                    trust_bundle_pem=self._trust_bundle(),
                    coordinator_version=__version__,
                    protocol_version=version,
                )
            )
        )
        self._sites.announce_probe_peers()
        failure: list[FederationError] = []
        reader = asyncio.create_task(self._read(session, rest, requests, failure))
        try:
            await self._jobs.reconcile(caller.name, hello.tasks, delegated)
            # The registry keeps its own copy of the view: holding any part of the first
            # stream message for the session's life would hold all of it, a second view.
            del envelope, hello, rest
            silent_limit_s = self._missed_heartbeats * self._heartbeat_interval_s
            while True:
                # Checked before every wait, not only when the outbox is idle: a hung agent
                # that the coordinator keeps sending offers to must be dropped all the same.
                silent_s = time.monotonic() - self._sites.get(caller.name).last_seen
                if silent_s > silent_limit_s:
                    # A peer gone without closing the connection; free the site's tasks
                    # for fencing and its offers for other sites.
                    failure.append(UnavailableError(f"no heartbeat for {silent_s:.1f}s"))
                    break
                try:
                    wait_s = min(self._heartbeat_interval_s, silent_limit_s - silent_s + 0.01)
                    async with asyncio.timeout(wait_s):
                        message = await session.outbox.get()
                except TimeoutError:
                    continue
                if message is None:
                    if session.ended_by is not None:
                        failure.append(session.ended_by)
                    break
                messages, ended = take_queued(session.outbox, message)
                yield pb.ConnectResponse(messages=messages)
                if ended:
                    break
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            session.close()
            self._sites.detach(session)
            if session.said_goodbye:
                log.info("site_disconnected", site=caller.name)
            elif self._sites.session(caller.name) is not None:
                # A newer session took over (an agent reconnecting with a renewed certificate
                # opens it before it lets this one go): the site never went away.
                log.info("site_session_replaced", site=caller.name)
            else:
                log.warning("site_unreachable", site=caller.name)
        if failure:
            raise failure[0]

    async def _read(
        self,
        session: SiteSession,
        after_hello: list[pb.AgentMessage],
        requests: AsyncIterator[pb.ConnectRequest],
        failure: list[FederationError],
    ) -> None:
        site = session.site
        try:
            await self._handle_all(session, after_hello)
            after_hello.clear()  # parts of the first stream message: let it go (see connect)
            async for envelope in requests:
                # Each delta's node is compared with the view's once, for its checks and its
                # application both (nothing is awaited before the last delta is applied).
                plans = plan_deltas(self._sites.get(site).view, envelope.messages)
                check_envelope(envelope.messages, session.peer, first=False, plans=plans)
                self._sites.seen(site)
                await self._handle_all(session, envelope.messages, plans)
        except FederationError as err:
            log.warning("site_stream_refused", site=site, error=str(err))
            failure.append(err)
        except Exception:
            # A broken stream (the agent vanished) ends the session; nothing to tell anyone.
            log.debug("site_stream_broken", site=site, exc_info=True)
        finally:
            session.close()

    async def _handle_all(
        self,
        session: SiteSession,
        messages: Sequence[pb.AgentMessage],
        plans: Mapping[int, PlannedDelta] | None = None,
    ) -> None:
        """Handle one envelope in order, except that its task reports are applied together
        (reports of one job still in order), and a goodbye after them. ``plans``: what its
        deltas change (``plan_deltas``)."""
        reports: list[pb.TaskReport] = []
        goodbye: pb.AgentMessage | None = None
        kinds: Counter[str] = Counter()  # counted per envelope: a labelled inc is not free
        try:
            for i, message in enumerate(messages):
                body = message.WhichOneof("body")
                kinds[body or "empty"] += 1
                if body == "task_status":
                    reports.append(message.task_status)
                elif body == "goodbye":
                    goodbye = message
                elif body == "view":
                    self._view(session, message.view, plans.get(i) if plans else None)
                else:
                    await self._handle(session, message, body)
        finally:
            for kind, count in kinds.items():
                SITE_MESSAGES.labels(kind).inc(count)
        if reports:
            await self._jobs.apply_reports(session.site, reports)
        if goodbye is not None:
            await self._handle(session, goodbye, "goodbye")

    async def _handle(
        self, session: SiteSession, request: pb.AgentMessage, body: str | None
    ) -> None:
        site = session.site
        if body == "heartbeat":
            if not session.closed:
                # Answered, so the agent knows it is in touch: a cut-off agent stops the tasks
                # of jobs with disconnect.stop_after_s, counting from the last message it heard.
                session.send(pb.CoordinatorMessage(heartbeat=request.heartbeat))
            return
        if body in ANSWERS:
            if not session.resolve(request):
                log.info("late_answer_dropped", site=site, correlation=request.correlation_id)
                answer = request.offer_answer
                if body == "offer_answer" and answer.accepted:
                    # Nobody waits for this reservation any more: give the capacity back.
                    session.send(
                        pb.CoordinatorMessage(
                            release=pb.Release(reservation_id=answer.reservation_id)
                        )
                    )
            return
        if body == "stage_progress":
            await self._jobs.note_staging(site, request.stage_progress)
            return
        if body == "dataset_copy":
            if self._datasets is not None:
                await self._datasets.site_copy(site, request.dataset_copy)
            return
        if body == "goodbye":
            log.info("site_said_goodbye", site=site, reason=request.goodbye.reason)
            session.said_goodbye = True
            session.close()  # ends the stream with OK; the agent does not come back to it
            return
        if body == "hello":
            raise InvalidArgumentError([FieldViolation("hello", "hello may be sent only once")])
        raise InvalidArgumentError([FieldViolation("body", "empty or unknown message")])

    def _view(self, session: SiteSession, update: pb.ViewUpdate, plan: PlannedDelta | None) -> None:
        site = session.site
        if update.HasField("full"):
            _check_site(site, update.full.site, "view.full.site")
            update.full.domain = self._sites.get(site).record.domain
            session.probe_endpoint = update.full.probe_endpoint  # checked with the write
        try:
            self._sites.apply_view(site, update, plan)
        except FailedPreconditionError as err:
            session.send(pb.CoordinatorMessage(resync=pb.ResyncRequest(reason=str(err))))


def _check_site(site: str, claimed: str, field: str) -> None:
    if claimed != site:
        raise PermissionDeniedError(
            f"{field}: site {site!r} may speak only for itself, not for {claimed!r}"
        )
