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

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from federation.config import ConfigError
from federation.tracing.spans import EPOCH as EPOCH
from federation.tracing.spans import JOB_ID as JOB_ID
from federation.tracing.spans import ROOT as ROOT
from federation.tracing.spans import SITE as SITE
from federation.tracing.spans import TASK as TASK
from federation.tracing.spans import Value as Value
from federation.tracing.spans import job_trace as job_trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from federation.tracing.sdk import Recorder

_recorder: Recorder | None = None


def on() -> bool:
    """Whether spans are recorded; call sites check it before gathering costly attributes."""
    return _recorder is not None


def now_ns() -> int:
    """Wall-clock time as spans take it."""
    return time.time_ns()


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
