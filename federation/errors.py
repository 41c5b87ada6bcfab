"""The error tree: each error knows its gRPC status, a stable reason and its facts.

Code raises these; ``federation.security.interceptors`` translates them once, at the edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

DOMAIN = "federation"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad field of a request, as ``google.rpc.BadRequest`` reports it."""

    field: str
    """Path such as ``spec.tasks[0].command``."""
    description: str


class FederationError(Exception):
    """Base of every error that reaches a client as a status."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.metadata = metadata


class InvalidArgumentError(FederationError):
    """A request is malformed; ``violations`` names each bad field."""

    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        self.violations = tuple(violations)
        summary = "; ".join(f"{v.field}: {v.description}" for v in self.violations[:5])
        more = len(self.violations) - 5
        super().__init__(
            f"invalid request: {summary}" + (f" (and {more} more)" if more > 0 else "")
        )


class NotFoundError(FederationError):
    status = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class JobNotFoundError(NotFoundError):
    reason = "JOB_NOT_FOUND"

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job {job_id!r}. To fix: list jobs with 'fedctl jobs list'", job=job_id
        )


class QueueNotFoundError(NotFoundError):
    reason = "QUEUE_NOT_FOUND"

    def __init__(self, queue: str) -> None:
        super().__init__(
            f"no queue {queue[:64]!r}. To fix: list queues with 'fedctl queues list'", queue=queue
        )


class AlreadyExistsError(FederationError):
    status = grpc.StatusCode.ALREADY_EXISTS
    reason = "ALREADY_EXISTS"


class SiteNotFoundError(NotFoundError):
    reason = "SITE_NOT_FOUND"

    def __init__(self, site: str) -> None:
        super().__init__(f"no site {site!r}. To fix: list sites with 'fedctl sites'", site=site)


class UnauthenticatedError(FederationError):
    status = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDeniedError(FederationError):
    status = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class UnimplementedError(FederationError):
    """A request this coordinator cannot carry out yet."""

    status = grpc.StatusCode.UNIMPLEMENTED
    reason = "UNIMPLEMENTED"


class FailedPreconditionError(FederationError):
    status = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class ProtocolVersionError(FailedPreconditionError):
    """An agent and the coordinator speak site-link protocols too far apart to work together:
    final for the agent, which cannot fix it by retrying. ``agent`` and ``coordinator`` name
    the versions."""

    reason = "PROTOCOL_VERSION_UNSUPPORTED"


class ConflictError(FederationError):
    """A compare-and-swap lost a race; the caller may retry."""

    status = grpc.StatusCode.ABORTED
    reason = "CONFLICT"


class ResourceExhaustedError(FederationError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"


class DeadlineExceededError(FederationError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class UnavailableError(FederationError):
    status = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class NotLeaderError(UnavailableError):
    """This coordinator is a follower (or just stepped down): ask the leader instead.

    The ``leader`` metadata names the leader's advertised address and ``leader_join`` its
    join address, both empty while no leader is known.
    """

    reason = "NOT_LEADER"

    def __init__(self, leader: str = "", leader_join: str = "") -> None:
        where = f"the leader is {leader}" if leader else "no leader is known yet"
        super().__init__(
            f"this coordinator is not the leader ({where}). To fix: nothing, clients and "
            "agents given every coordinator's address move to the leader by themselves",
            leader=leader,
            leader_join=leader_join,
        )


class CertificateNotFoundError(NotFoundError):
    reason = "CERTIFICATE_NOT_FOUND"

    def __init__(self, serial_hex: str) -> None:
        super().__init__(
            f"no certificate with serial {serial_hex[:64]!r} was issued by the coordinator. "
            "To fix: list them with 'fedctl pki list'; revoke one issued offline by its "
            "identity (--tenant, --operator or --site)",
            serial=serial_hex,
        )


class CertificateRevokedError(UnauthenticatedError):
    """The peer's certificate is revoked: every call and stream of it is refused."""

    reason = "CERTIFICATE_REVOKED"

    def __init__(self, serial_hex: str, revoked_at: str, why: str) -> None:
        super().__init__(
            f"certificate {serial_hex} was revoked at {revoked_at} UTC: {why}. To fix: ask an "
            "operator for a new certificate",
            serial=serial_hex,
        )


class CertificateSupersededError(PermissionDeniedError):
    """The peer's certificate was renewed into a newer one, and its overlap is over."""

    reason = "CERTIFICATE_SUPERSEDED"

    def __init__(self, serial_hex: str, superseded_by: str) -> None:
        super().__init__(
            f"certificate {serial_hex} was renewed as {superseded_by} and is no longer "
            f"accepted. To fix: use the newer certificate {superseded_by}",
            serial=serial_hex,
            superseded_by=superseded_by,
        )


class CertificateAuthorityRetiredError(UnauthenticatedError):
    """The peer's certificate comes from an issuing CA that was retired in a CA rollover."""

    reason = "CERTIFICATE_AUTHORITY_RETIRED"

    def __init__(self, serial_hex: str, issuer: str) -> None:
        super().__init__(
            f"certificate {serial_hex} was issued by {issuer[:200]}, a CA retired in a CA "
            "rollover. To fix: get a certificate from the current CA ('fedctl pki issue' "
            "offline, or a new join token for a site) and the trust bundle "
            "('fedctl pki trust-bundle')",
            serial=serial_hex,
        )
