"""The server interceptor: translate errors, authenticate, authorize, bind log context.

Identity comes from the peer certificate, never from metadata. Each method lists the roles that
may call it; a method missing from the table is refused (deny by default).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from federation.errors import (
    DOMAIN,
    FederationError,
    FieldViolation,
    InvalidArgumentError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from federation.security.identity import Identity, InvalidIdentityError, Role
from federation.security.revocation import (
    OpenStream,
    PeerCertificate,
    RevocationBook,
    peer_certificate_of,
)
from federation.security.throttle import RateLimitedError, Throttle
from federation.security.tls import peer_certificate

log = structlog.get_logger()

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("caller")
_PEER: contextvars.ContextVar[PeerCertificate] = contextvars.ContextVar("peer")


def current_caller() -> Identity:
    """The authenticated identity of the RPC being served."""
    return _CALLER.get()


MAX_MESSAGE_CHARS = 1024
"""Longest status message sent: messages may quote what a client sent, and the status travels
in HTTP/2 trailers, which gRPC caps at 8 KiB by default."""
MAX_DETAIL_CHARS = 256
"""Longest field path, description or metadata value in the details."""
MAX_VIOLATIONS = 20
"""Field violations sent; the message counts the rest."""


def clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked where it was cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _packed(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status(err: FederationError) -> grpc.Status:
    """A ``FederationError`` as a status with ``ErrorInfo`` (and ``BadRequest``) details.

    Everything a client may have sent is clipped, so an error about a huge field stays small.
    """
    metadata = {key: clip(value) for key, value in err.metadata.items()}
    details = [
        _packed(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=metadata))
    ]
    if isinstance(err, InvalidArgumentError):
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=clip(v.field), description=clip(v.description)
                )
                for v in err.violations[:MAX_VIOLATIONS]
            ]
        )
        details.append(_packed(bad))
    if isinstance(err, RateLimitedError):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, round(err.retry_after_s * 1000)))
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    return rpc_status.to_status(
        status_pb2.Status(
            code=err.status.value[0], message=clip(str(err), MAX_MESSAGE_CHARS), details=details
        )
    )


INTERNAL = rpc_status.to_status(status_pb2.Status(code=code_pb2.INTERNAL, message="internal error"))


@asynccontextmanager
async def translate_errors(
    context: grpc.aio.ServicerContext[Any, Any], method: str
) -> AsyncIterator[None]:
    """Answer federation errors with their status and anything else with a bare INTERNAL."""
    try:
        yield
    except FederationError as err:
        await context.abort_with_status(to_status(err))
    except grpc.aio.AbortError:
        raise
    except Exception:
        log.exception("rpc_failed", rpc=method)
        await context.abort_with_status(INTERNAL)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the request deserializer returns for bytes that are not the expected message."""

    message: str
    size: int
    """The bytes it came in: refused or not, they were received, and the byte rate counts them."""


@dataclass(frozen=True, slots=True)
class _Received:
    """A request message and the bytes it came in (what the byte rate counts)."""

    message: Any
    size: int


def _lenient(
    deserializer: Callable[[bytes], Any] | None, max_bytes: int
) -> Callable[[bytes], Any] | None:
    """A deserializer that returns ``Undecodable`` where gRPC would answer UNKNOWN, naming a
    Python exception class, so the handler can answer INVALID_ARGUMENT instead; and for a
    request over ``max_bytes`` (0: none), before spending anything on it."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        if max_bytes and len(data) > max_bytes:
            return Undecodable(
                f"the request is {len(data)} bytes; at most {max_bytes} allowed", len(data)
            )
        try:
            return _Received(deserializer(data), len(data))
        except Exception:
            return Undecodable("the request is not a valid message for this method", len(data))

    return deserialize


def _decoded(request: Any) -> _Received:
    if isinstance(request, Undecodable):
        raise InvalidArgumentError([FieldViolation("request", request.message)])
    assert isinstance(request, _Received)
    return request


async def _decoded_stream(
    requests: AsyncIterator[Any], watched: OpenStream | None
) -> AsyncIterator[Any]:
    async for request in requests:
        if watched is not None and watched.revoked is not None:
            raise watched.refusal()  # each message is checked, not just the stream's start
        yield _decoded(request).message


JobCount: TypeAlias = Callable[[Any], int]
"""How many jobs a request submits, for the job rate limit."""
THROTTLED_ROLES = frozenset({Role.TENANT, Role.OPERATOR})


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler with error translation and, where asked, certificate auth and
    per-identity limits."""

    def __init__(
        self,
        roles: Mapping[str, Collection[Role]] | None,
        *,
        open_methods: Collection[str] = (),
        throttle: Throttle | None = None,
        job_counts: Mapping[str, JobCount] | None = None,
        max_request_bytes: int = 0,
        large_methods: Collection[str] = (),
        revocations: RevocationBook | None = None,
        renew_methods: Collection[str] = (),
        issuer_check: Callable[[bytes], None] | None = None,
    ) -> None:
        """Create the interceptor.

        Args:
            roles: Method -> roles allowed to call it; None serves without client
                certificates (the join port), where only ``open_methods`` are reachable.
            open_methods: Methods any caller may use (health checks, reflection, Join).
            throttle: Per-identity request, job and stream limits for tenants and operators.
            job_counts: Method -> how many jobs a request of it submits (for ``throttle``).
            max_request_bytes: Largest request message of any method but ``large_methods``
                (0: gRPC's own limit only), refused before it is parsed.
            large_methods: Methods whose messages may be as large as gRPC allows (Connect).
            revocations: Revoked certificates, refused on every call; a stream of one is
                ended when its revocation arrives.
            renew_methods: Methods a superseded certificate may still call after its overlap
                (to repeat the renewal whose reply it lost).
            issuer_check: Raises for a peer certificate of a retired CA, on every call.
        """
        self._roles = roles
        self._open = frozenset(open_methods)
        self._throttle = throttle
        self._job_counts = dict(job_counts or {})
        self._max_request_bytes = max_request_bytes
        self._large = frozenset(large_methods)
        self._revocations = revocations
        self._renew_methods = frozenset(renew_methods)
        self._issuer_check = issuer_check

    def _authorize(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> PeerCertificate | None:
        if method in self._open and self._roles is None:
            return None
        if self._roles is None:
            raise PermissionDeniedError(f"{method} is not served on this port")
        pem = peer_certificate(context)  # auth_context() builds a dict: asked once per call
        cert = _peer(pem)
        if cert is not None and self._revocations is not None:
            # Open methods too: a revoked peer gets nothing.
            self._revocations.check(cert, renewing=method in self._renew_methods)
        if pem is not None and self._issuer_check is not None:
            self._issuer_check(pem)
        if method in self._open:
            return cert
        if cert is None:
            raise UnauthenticatedError("a client certificate from the federation CA is required")
        if cert.identity.role not in self._roles.get(method, ()):
            raise PermissionDeniedError(f"{cert.identity} may not call {method.rsplit('/', 1)[-1]}")
        return cert

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        authorize = self._authorize
        throttle = self._throttle
        revocations = self._revocations
        job_count = self._job_counts.get(method)

        async def enter(
            context: grpc.aio.ServicerContext[Any, Any],
            request: Any,
            size: int = 0,
            stream: bool = False,
        ) -> Identity | None:
            cert = authorize(method, context)
            identity = cert.identity if cert is not None else None
            if cert is not None:
                _PEER.set(cert)
            if identity is not None:
                _CALLER.set(identity)
            structlog.contextvars.bind_contextvars(
                rpc=method.rsplit("/", 1)[-1], peer=str(identity) if identity else "anonymous"
            )
            if throttle is None or identity is None or identity.role not in THROTTLED_ROLES:
                return None
            jobs = job_count(request) if job_count is not None and request is not None else 0
            try:
                throttle.admit(identity, jobs, size)
                if stream:
                    throttle.open_stream(identity)
            except RateLimitedError as refusal:
                raise await throttle.hold(refusal) from None
            return identity

        max_bytes = 0 if method in self._large else self._max_request_bytes
        deserialize = _lenient(handler.request_deserializer, max_bytes)
        if handler.unary_unary:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                async with translate_errors(context, method):
                    if isinstance(request, Undecodable):
                        # Charged too: a client that sends oversized requests over and over
                        # is held back by its byte rate like any other.
                        await enter(context, None, request.size)
                    received = _decoded(request)
                    holder = await enter(context, received.message, received.size)
                    response = await inner_uu(received.message, context)
                    if throttle is not None and holder is not None:
                        throttle.charge_reply(holder, response.ByteSize())
                    return response
                return None  # unreachable: translate_errors aborts

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, deserialize, handler.response_serializer
            )
        if handler.unary_stream or handler.stream_stream:
            inner_s: Any = handler.unary_stream or handler.stream_stream
            unary_request = bool(handler.unary_stream)

            async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                async with translate_errors(context, method):
                    if unary_request:
                        if isinstance(request, Undecodable):
                            await enter(context, None, request.size)  # charged, as above
                        received = _decoded(request)
                        request = received.message
                        holder = await enter(context, request, received.size, stream=True)
                    else:
                        holder = await enter(context, None, stream=True)
                    cert = _PEER.get(None)
                    watched = (
                        revocations.open_stream(cert)
                        if revocations is not None and cert is not None
                        else None
                    )
                    if not unary_request:
                        request = _decoded_stream(request, watched)
                    try:
                        responses = inner_s(request, context)
                        if inspect.isawaitable(responses):
                            # A handler that writes with context.write (health's Watch) and
                            # returns nothing rather than yielding.
                            await responses
                            return
                        async for response in responses:
                            if watched is not None and watched.revoked is not None:
                                raise watched.refusal()
                            yield response
                    except asyncio.CancelledError:
                        if watched is None or watched.revoked is None:
                            raise
                        # Cancelled by the revocation, not by gRPC: answer it instead.
                        task = asyncio.current_task()
                        if task is not None:
                            task.uncancel()
                        raise watched.refusal() from None
                    finally:
                        if revocations is not None and watched is not None:
                            revocations.close_stream(watched)
                        if throttle is not None and holder is not None:
                            throttle.close_stream(holder)

            factory: Any = (
                grpc.unary_stream_rpc_method_handler
                if handler.unary_stream
                else grpc.stream_stream_rpc_method_handler
            )
            wrapped: Handler = factory(streaming, deserialize, handler.response_serializer)
            return wrapped
        return handler  # stream-unary: none in our API


def _peer(pem: bytes | None) -> PeerCertificate | None:
    try:
        return None if pem is None else peer_certificate_of(pem)
    except InvalidIdentityError as err:
        raise UnauthenticatedError(
            f"client certificate carries no federation identity: {err}"
        ) from None
