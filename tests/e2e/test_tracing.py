"""Tracing over real processes: the coordinator and an agent, both pointed at an OTLP/gRPC
collector run by the test on loopback, send the spans of a job's path, and every one of them
lands in the trace its job id names: submit, place, offer and commit from the coordinator, run
and report from the site, in that order."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from federation import tracing
from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation
from federation.testing.cluster import cpu_site, until

from .conftest import jobs, python_task, spec, wait_for_job

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="the tracing extra is not installed",
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.xdist_group("e2e-tracing")

PATH = ["job.submit", "task.place", "task.offer", "task.commit", "task.run", "task.report"]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that keeps every span with its process's service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, Any]] = []  # (service, instance, span)

    async def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            names = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        (names["service.name"], names.get("service.instance.id", ""), span)
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, str]]:
    server = grpc.aio.server()
    received = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield received, f"http://127.0.0.1:{port}"
    await server.stop(None)


@pytest.fixture
def fed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalFederation]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the SDK's batch delay, in ms
    federation = LocalFederation(tmp_path / "fed", [])
    try:
        yield federation
    finally:
        federation.stop()


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        out[a.key] = list(v.string_value for v in value.values) if kind == "array_value" else value
    return out


async def test_a_jobs_spans_from_both_sides_share_the_trace_of_its_id(
    fed: LocalFederation, collector: tuple[Collector, str]
) -> None:
    received, endpoint = collector
    await fed.start_coordinator(args=["--otlp-endpoint", endpoint])
    await fed.start_site(cpu_site("edge-t", otlp_endpoint=endpoint))
    await fed.wait_connected(["edge-t"])
    async with fed.operator().channel() as channel:
        task = python_task("main", "print('hi')")
        request = job_service_pb2.SubmitJobRequest(spec=spec("traced", [task]))
        job_id = (await jobs(channel).SubmitJob(request)).job.id
        job = await wait_for_job(channel, job_id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED

    def of_job() -> dict[str, tuple[str, str, Any]]:
        return {
            span.name: (service, instance, span)
            for service, instance, span in received.spans
            if attributes(span).get(tracing.JOB_ID) == job_id
        }

    async def arrived() -> bool:
        return set(PATH) <= of_job().keys()

    await until(arrived, 20, f"the spans {PATH} of {job_id}")
    spans = of_job()
    trace_id, root_id = tracing.job_trace(job_id)
    for name in PATH:
        service, instance, span = spans[name]
        assert int.from_bytes(span.trace_id) == trace_id, name
        on_site = name in ("task.run", "task.report")
        assert service == ("fed-agent" if on_site else "fed-coordinator"), name
        if on_site:
            assert instance == "edge-t", name
    submit = spans["job.submit"][2]
    assert int.from_bytes(submit.span_id) == root_id
    assert not submit.parent_span_id
    for name in PATH[1:]:
        span = spans[name][2]
        assert int.from_bytes(span.parent_span_id) == root_id, name
    starts = [spans[name][2].start_time_unix_nano for name in PATH]
    assert starts == sorted(starts), list(zip(PATH, starts, strict=True))
    offer, commit, run = (
        attributes(spans[n][2]) for n in ("task.offer", "task.commit", "task.run")
    )
    assert offer[tracing.SITE] == commit[tracing.SITE] == run[tracing.SITE] == "edge-t"
    assert offer[tracing.EPOCH] == commit[tracing.EPOCH] == run[tracing.EPOCH]
    assert offer["federation.accepted"] is True
    assert run["federation.state"] == "JOB_STATE_SUCCEEDED"
    assert run["federation.exit_code"] == 0
    assert attributes(spans["task.place"][2])["federation.ranked"] == ["edge-t"]


async def test_with_no_collector_the_log_stays_json(fed: LocalFederation) -> None:
    """OpenTelemetry's exporter complains through the standard library when nothing listens at
    its endpoint: those lines are JSON like the rest, so a log shipper never chokes."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    try:
        await fed.start_coordinator(args=["--otlp-endpoint", endpoint])
        async with fed.operator().channel() as channel:
            request = job_service_pb2.SubmitJobRequest(
                spec=spec("untraced", [python_task("t", "")])
            )
            await jobs(channel).SubmitJob(request)
        log = fed.log_path("coordinator")

        async def exporter_complained() -> bool:
            return "exporting traces" in log.read_text()

        await until(exporter_complained, 30, "the exporter's complaint in the log")
    finally:
        closed.close()
    for line in log.read_text().splitlines():
        assert isinstance(json.loads(line), dict), line
