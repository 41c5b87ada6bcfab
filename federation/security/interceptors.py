"""The server interceptor: translate errors, authenticate, authorize, bind log context.

Identity comes from the peer certificate, never from metadata. Each method lists the roles that
may call it; a method missing from the table is refused (deny by default).
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from federation.errors import (
    DOMAIN,
    FederationError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from federation.security.identity import Identity, InvalidIdentityError, Role
from federation.security.tls import peer_identity

log = structlog.get_logger()

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("caller")


def current_caller() -> Identity:
    """The authenticated identity of the RPC being served."""
    return _CALLER.get()


def to_status(err: FederationError) -> grpc.Status:
    """A ``FederationError`` as a status with ``ErrorInfo`` (and ``BadRequest``) details."""
    details = []
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata))
    details.append(info)
    if isinstance(err, InvalidArgumentError):
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description
                )
                for v in err.violations
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    return rpc_status.to_status(
        status_pb2.Status(code=err.status.value[0], message=str(err), details=details)
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


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler with error translation and, where asked, certificate auth."""

    def __init__(
        self,
        roles: Mapping[str, Collection[Role]] | None,
        *,
        open_methods: Collection[str] = (),
    ) -> None:
        """Create the interceptor.

        Args:
            roles: Method -> roles allowed to call it; None serves without client
                certificates (the join port), where only ``open_methods`` are reachable.
            open_methods: Methods any caller may use (health checks, reflection, Join).
        """
        self._roles = roles
        self._open = frozenset(open_methods)

    def _authorize(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Identity | None:
        if method in self._open:
            return _peer(context) if self._roles is not None else None
        if self._roles is None:
            raise PermissionDeniedError(f"{method} is not served on this port")
        identity = _peer(context)
        if identity is None:
            raise UnauthenticatedError("a client certificate from the federation CA is required")
        if identity.role not in self._roles.get(method, ()):
            raise PermissionDeniedError(f"{identity} may not call {method.rsplit('/', 1)[-1]}")
        return identity

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

        def enter(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            identity = authorize(method, context)
            if identity is not None:
                _CALLER.set(identity)
            structlog.contextvars.bind_contextvars(
                rpc=method.rsplit("/", 1)[-1], peer=str(identity) if identity else "anonymous"
            )

        if handler.unary_unary:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                async with translate_errors(context, method):
                    enter(context)
                    return await inner_uu(request, context)
                return None  # unreachable: translate_errors aborts

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream or handler.stream_stream:
            inner_s: Any = handler.unary_stream or handler.stream_stream

            async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                async with translate_errors(context, method):
                    enter(context)
                    responses = inner_s(request, context)
                    if inspect.isawaitable(responses):
                        # A handler that writes with context.write (health's Watch) and
                        # returns nothing rather than yielding.
                        await responses
                        return
                    async for response in responses:
                        yield response

            factory: Any = (
                grpc.unary_stream_rpc_method_handler
                if handler.unary_stream
                else grpc.stream_stream_rpc_method_handler
            )
            wrapped: Handler = factory(
                streaming, handler.request_deserializer, handler.response_serializer
            )
            return wrapped
        return handler  # stream-unary: none in our API


def _peer(context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
    try:
        return peer_identity(context)
    except InvalidIdentityError as err:
        raise UnauthenticatedError(
            f"client certificate carries no federation identity: {err}"
        ) from None
