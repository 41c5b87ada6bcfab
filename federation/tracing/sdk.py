"""The OpenTelemetry SDK behind ``federation.tracing``: imported only once tracing is on."""

from __future__ import annotations

import contextvars
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from federation import __version__
from federation.tracing.spans import ROOT, Value, job_trace

_ROOT_IDS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "federation_trace_root", default=None
)
"""Set while ``job.submit`` is started: the ids ``_JobIds`` hands out for it."""


class _JobIds(IdGenerator):
    """Random ids, except for a job's root span, whose ids come from its job id."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        root = _ROOT_IDS.get()
        return root[1] if root else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        root = _ROOT_IDS.get()
        return root[0] if root else self._random.generate_trace_id()


class Recorder:
    """A tracer provider of its own (the global one is left to whoever embeds us), exporting
    in batches from a thread of the SDK's."""

    def __init__(
        self, endpoint: str, service: str, instance: str, exporter: SpanExporter | None
    ) -> None:
        attributes = {"service.name": service, "service.version": __version__}
        if instance:
            attributes["service.instance.id"] = instance
        self._provider = TracerProvider(
            resource=Resource.create(attributes), id_generator=_JobIds()
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint))
        )
        self._tracer = self._provider.get_tracer("federation", __version__)

    def record(
        self,
        name: str,
        job_id: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Value],
        error: str,
    ) -> None:
        trace_id, root_id = job_trace(job_id)
        if name == ROOT:
            token = _ROOT_IDS.set((trace_id, root_id))
            try:
                span = self._tracer.start_span(
                    name, context=Context(), attributes=attributes, start_time=start_ns
                )
            finally:
                _ROOT_IDS.reset(token)
        else:
            root = SpanContext(
                trace_id, root_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
            )
            parent = trace.set_span_in_context(NonRecordingSpan(root))
            span = self._tracer.start_span(
                name, context=parent, attributes=attributes, start_time=start_ns
            )
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(end_ns, start_ns))

    def shutdown(self) -> None:
        self._provider.shutdown()
