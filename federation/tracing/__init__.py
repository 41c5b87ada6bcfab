"""Optional OpenTelemetry spans along each job's path, exported over OTLP.

Off unless a daemon's ``otlp_endpoint`` is set; then ``configure`` loads the SDK (the
``tracing`` extra) and every ``record`` call becomes a span. While off, ``record`` returns at
its first line and nothing of OpenTelemetry is imported.

One trace per job, with no ids carried in our messages: the trace id is the first 16 bytes of
the SHA-256 of the job id, and ``job.submit`` (the coordinator's) is its root with the next 8
bytes as span id. Every other span of the job, in whichever process, names that root as its
parent, so a backend puts the coordinator's and the sites' spans of a job in one tree.

Spans are recorded whole, once their end is known (``record(name, job_id, start_ns, ...)``):
the job's path crosses batches, awaits and processes, and no span stays open across them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from federation.config import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from federation.tracing.sdk import Recorder

ROOT = "job.submit"
"""The span every trace starts with, and the one whose id ``job_trace`` derives."""

JOB_ID = "federation.job_id"
TASK = "federation.task"
SITE = "federation.site"
EPOCH = "federation.epoch"

Value = str | bool | int | float | list[str] | list[float]
"""What an attribute may hold."""

_recorder: Recorder | None = None


def on() -> bool:
    """Whether spans are recorded; call sites check it before gathering costly attributes."""
    return _recorder is not None


def now_ns() -> int:
    """Wall-clock time as spans take it."""
    return time.time_ns()


def job_trace(job_id: str) -> tuple[int, int]:
    """The trace id of ``job_id``'s trace and the span id of its root (``job.submit``)."""
    digest = hashlib.sha256(job_id.encode()).digest()
    return int.from_bytes(digest[:16]) or 1, int.from_bytes(digest[16:24]) or 1  # never 0


def record(
    name: str,
    job_id: str,
    start_ns: int,
    end_ns: int = 0,
    *,
    task: str = "",
    site: str = "",
    epoch: int = 0,
    error: str = "",
    attributes: Mapping[str, Value] | None = None,
) -> None:
    """One finished span of ``job_id``'s trace, from ``start_ns`` to ``end_ns`` (0: now).

    ``task``, ``site`` and ``epoch`` become the ``federation.*`` attributes where given, and
    ``attributes`` (named ``federation.…``) join them; ``error`` marks the span failed with
    that description.
    """
    if _recorder is None:
        return
    known: dict[str, Value] = {JOB_ID: job_id, **(attributes or {})}
    if task:
        known[TASK] = task
    if site:
        known[SITE] = site
    if epoch:
        known[EPOCH] = epoch
    _recorder.record(name, job_id, start_ns, end_ns or now_ns(), known, error)


def configure(
    endpoint: str,
    service: str,
    *,
    instance: str = "",
    exporter: SpanExporter | None = None,
) -> None:
    """Start recording: spans go to the OTLP/gRPC collector at ``endpoint`` (``http://`` in
    the clear, ``https://`` over TLS), or to ``exporter`` when given (tests). ``service``
    and ``instance`` name this process in the spans' resource.

    Raises:
        ConfigError: The ``tracing`` extra is not installed.
    """
    global _recorder
    try:
        from federation.tracing.sdk import Recorder
    except ImportError as err:
        raise ConfigError(
            f"otlp_endpoint is set but OpenTelemetry is not installed ({err.name} is missing). "
            "To fix: pip install 'fedplane[tracing]', or leave otlp_endpoint empty"
        ) from None
    shutdown()
    _recorder = Recorder(endpoint, service, instance, exporter)


def shutdown() -> None:
    """Send what is buffered and stop recording (a no-op while off)."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.shutdown()
