"""federation.tracing: one trace per job, derived from its id; nothing at all while off."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from federation import tracing
from federation.config import ConfigError

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure("", "test", instance="here", exporter=exporter)
    yield exporter
    tracing.shutdown()


def test_off_records_nothing_and_imports_nothing() -> None:
    # A fresh interpreter: this one's tests load the SDK.
    code = (
        "import sys; from federation import tracing; "
        "tracing.record('job.submit', 'j1', tracing.now_ns(), task='t'); "
        "assert not tracing.on(); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_trace_id_is_the_job_ids_hash() -> None:
    digest = hashlib.sha256(b"acme/train-7").digest()
    trace_id, root_id = tracing.job_trace("acme/train-7")
    assert trace_id == int.from_bytes(digest[:16])
    assert root_id == int.from_bytes(digest[16:24])
    assert tracing.job_trace("acme/train-8")[0] != trace_id


def test_a_jobs_spans_share_its_trace_under_the_submit_span(
    spans: InMemorySpanExporter,
) -> None:
    start = tracing.now_ns()
    tracing.record("job.submit", "acme/a", start, attributes={"federation.tenant": "acme"})
    tracing.record(
        "task.place", "acme/a", start, task="t", attributes={"federation.ranked": ["s1"]}
    )
    tracing.record("task.offer", "acme/a", start, task="t", site="s1", epoch=3)
    tracing.record("task.offer", "acme/b", start, task="t", site="s2", epoch=1, error="declined")
    tracing.shutdown()  # flushes the batch
    got = {(s.name, s.attributes[tracing.JOB_ID]): s for s in spans.get_finished_spans()}
    trace_a, root_a = tracing.job_trace("acme/a")
    submit, place = got["job.submit", "acme/a"], got["task.place", "acme/a"]
    offer = got["task.offer", "acme/a"]
    assert submit.context.trace_id == place.context.trace_id == offer.context.trace_id == trace_a
    assert submit.context.span_id == root_a
    assert submit.parent is None
    assert place.parent.span_id == offer.parent.span_id == root_a
    assert place.context.span_id != offer.context.span_id
    assert dict(offer.attributes) == {
        "federation.job_id": "acme/a",
        "federation.task": "t",
        "federation.site": "s1",
        "federation.epoch": 3,
    }
    assert list(place.attributes["federation.ranked"]) == ["s1"]
    other = got["task.offer", "acme/b"]
    assert other.context.trace_id == tracing.job_trace("acme/b")[0] != trace_a
    assert other.status.description == "declined"
    assert not other.status.is_ok
    assert submit.resource.attributes["service.name"] == "test"
    assert submit.resource.attributes["service.instance.id"] == "here"


def test_span_times_are_the_given_ones(spans: InMemorySpanExporter) -> None:
    tracing.record("task.run", "j", 1_000, 5_000, task="t")
    tracing.record("task.run", "k", 9_000, 8_000, task="t")  # a clock step: no negative span
    tracing.shutdown()
    by_job = {s.attributes["federation.job_id"]: s for s in spans.get_finished_spans()}
    assert (by_job["j"].start_time, by_job["j"].end_time) == (1_000, 5_000)
    assert (by_job["k"].start_time, by_job["k"].end_time) == (9_000, 9_000)


def test_without_the_sdk_an_endpoint_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "federation.tracing.sdk", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'fedplane\[tracing\]'"):
        tracing.configure("http://127.0.0.1:4317", "test")
    assert not tracing.on()
