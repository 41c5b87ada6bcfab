"""Fuzzing a running coordinator over mTLS: job specs built field by field, raw bytes as request
bodies, and agent messages on a real Connect stream.

Every answer is OK or a precise refusal (never UNKNOWN or INTERNAL), INVALID_ARGUMENT names the
fields, no status message carries a traceback, a refused batch stores nothing, the coordinator
stays up, and another site keeps its session and its running job throughout. The thorough runs
(10,000 cases in all) are in the ``fuzz`` group, which ``make test`` runs once on its own.
"""

from __future__ import annotations

import asyncio
import math
import queue
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    resources_pb2,
    site_link_service_pb2,
    site_link_service_pb2_grpc,
)
from federation.local import LocalFederation, SiteSpec
from federation.security.tls import TlsFiles, channel_credentials

from .conftest import python_task, running, spec, wait_for_job
from .test_refusals import enrol_ghost

pytestmark = pytest.mark.xdist_group("e2e-fuzz")

CONFIG = """\
client_requests_per_s = 0.0
client_jobs_per_s = 0.0
client_bytes_per_s = 0.0
max_unfinished_jobs_per_tenant = 0
preemption_min_run_s = 1000000.0
reclaim_min_run_s = 1000000.0
[priority_classes.steady]
value = 1000
preemptible = false
"""
"""No rate limits (the fuzzer is one identity sending as fast as it can), and the steady job
can be preempted by nothing the fuzzer submits."""
STEADY = SiteSpec("steady", "datacenter", nodes=[{"name": "n", "cpu_cores": 8}])
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""What a refusal of a spec or an agent message may be: never UNKNOWN, INTERNAL or UNAVAILABLE."""
FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Fuzzed:
    """The federation under fuzz, with blocking stubs for the fuzzer."""

    def __init__(self, fed: LocalFederation, ghost: TlsFiles, steady_job: str) -> None:
        self.fed = fed
        self.steady_job = steady_job
        self.outcomes: Counter[str] = Counter()
        """How each case ended, by kind and status: printed, so a run shows what it covered."""
        self.operator = grpc.secure_channel(fed.address, channel_credentials(fed.operator().tls))
        self.ghost = grpc.secure_channel(fed.address, channel_credentials(ghost))
        self.jobs = job_service_pb2_grpc.JobServiceStub(self.operator)
        self.admin = admin_service_pb2_grpc.AdminServiceStub(self.operator)
        self.link = site_link_service_pb2_grpc.SiteLinkServiceStub(self.ghost)
        self.raw_submit = self.operator.unary_unary(
            "/federation.api.v1.JobService/SubmitJobs",
            request_serializer=None,
            response_deserializer=job_service_pb2.SubmitJobsResponse.FromString,
        )

    def stored(self) -> int:
        status = self.admin.GetFederationStatus(admin_service_pb2.GetFederationStatusRequest())
        return sum(status.jobs_by_state.values())

    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))

    def check_steady(self) -> None:
        """The coordinator is up, the steady site connected and its job running there."""
        assert self.fed.processes["coordinator"].poll() is None, "the coordinator exited"
        sites = self.admin.ListSites(admin_service_pb2.ListSitesRequest())
        states = {s.name: s.state for s in sites.sites}
        assert states["steady"] == admin_service_pb2.SITE_STATE_CONNECTED
        job = self.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=self.steady_job)).job
        assert job.state == jobs_pb2.JOB_STATE_RUNNING
        assert job.tasks[0].site == "steady"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    root = tmp_path_factory.mktemp("fuzz")
    config = root / "coordinator.toml"
    config.write_text(CONFIG)
    (root / "ghost").mkdir()
    with running(root / "fed", [STEADY], ["--config", str(config)]) as fed:

        async def prepare() -> tuple[TlsFiles, str]:
            ghost = await enrol_ghost(fed, "fuzz-ghost", root / "ghost")
            sleeper = python_task("sleep", "import time; time.sleep(3600)", resources={"cpu": 1})
            job = spec("steady", [sleeper], priority_class="steady")
            async with fed.operator().channel() as channel:
                stub = job_service_pb2_grpc.JobServiceStub(channel)
                reply = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
                await wait_for_job(
                    channel, reply.job.id, until=frozenset({jobs_pb2.JOB_STATE_RUNNING})
                )
            return ghost, reply.job.id

        ghost, steady_job = asyncio.run(prepare())
        made = Fuzzed(fed, ghost, steady_job)
        made.check_steady()
        try:
            yield made
        finally:
            made.operator.close()
            made.ghost.close()


def check_refusal(err: grpc.RpcError, *, prefix: str = "") -> str:
    """A precise status, with field violations for INVALID_ARGUMENT and no traceback; returns
    the status's name."""
    code = err.code()  # type: ignore[attr-defined]
    message = err.details() or ""  # type: ignore[attr-defined]
    assert code in PRECISE, (code, message)
    assert "Traceback" not in message, message
    assert 'File "' not in message, message
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "the refusal carries no rich status"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        fields = []
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                fields += [v.field for v in bad.field_violations]
        assert fields, f"INVALID_ARGUMENT without field violations: {message}"
        assert all(f.startswith(prefix) for f in fields), (prefix, fields)
    return str(code.name)


# Strategies: every field of a JobSpec, with the awkward values as likely as the good ones.

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -1.0, 0.5, 1.0, 1e308, -1e308, math.nan, math.inf]),
)
MOSTLY_SANE = st.one_of(st.floats(0, 1e4), st.floats(0, 1e4), st.floats(0, 1e4), NUMBERS)
UINT64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 128, 2**63]))
UINT32 = st.integers(0, 2**32 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "a", "t", "x" * 300, "../..", "\x00"]))
NAMES = st.one_of(st.sampled_from(["t", "u", "v", "", "T!", "a" * 80]), st.text(max_size=12))
COMMAND = st.lists(
    st.one_of(st.just("/nonexistent/fuzz"), st.just(""), TEXT.map(lambda s: "/nonexistent/" + s)),
    max_size=3,
).map(lambda argv: argv[:1] + [f"arg-{a}" for a in argv[1:]])
"""argv whose program never exists: an accepted spec may be placed, but runs nothing."""
STRING_MAPS = st.dictionaries(TEXT, TEXT, max_size=3)


@st.composite
def accelerators(draw: st.DrawFn) -> jobs_pb2.AcceleratorRequest:
    return jobs_pb2.AcceleratorRequest(
        kind=draw(st.integers(0, 8)),  # type: ignore[arg-type]
        count=draw(st.one_of(st.integers(0, 4), UINT32)),
        models=draw(st.lists(TEXT, max_size=2)),
        min_memory_mib=draw(UINT64),
        vendor=draw(st.sampled_from(["", "nvidia", "amd"]) | TEXT),
        fraction=draw(NUMBERS),
        partition=draw(st.sampled_from(["", "1g.10gb"]) | TEXT),
        selector=draw(st.sampled_from(["", "device.memory_gib >= 1", "1 +", "true"]) | TEXT),
        same_interconnect=draw(st.booleans()),
        memory_mib=draw(UINT64),
    )


@st.composite
def tasks(draw: st.DrawFn, names: list[str]) -> jobs_pb2.TaskSpec:
    task = jobs_pb2.TaskSpec(
        name=draw(st.sampled_from(names) | NAMES),
        command=draw(COMMAND),
        env=draw(STRING_MAPS),
        replicas=draw(st.one_of(st.integers(0, 3), UINT32)),
        estimated_duration_s=draw(NUMBERS),
        timeout_s=draw(NUMBERS),
        requires=draw(st.dictionaries(st.sampled_from(["cuda", "torch", "arch"]) | TEXT, TEXT)),
        output_bytes=draw(UINT64),
        depends_on=draw(st.lists(st.sampled_from(names) | NAMES, max_size=3)),
        workload_class=draw(st.sampled_from(["", "training", "inference"]) | TEXT),
        speed=draw(st.dictionaries(TEXT, NUMBERS, max_size=2)),
    )
    if draw(st.booleans()):
        task.resources.cpu = draw(NUMBERS)
        task.resources.memory_mib = draw(UINT64)
        if draw(st.booleans()):
            task.resources.accelerator.CopyFrom(draw(accelerators()))
    for _ in range(draw(st.integers(0, 2))):
        task.inputs.add(dataset=draw(TEXT), bytes=draw(UINT64), site=draw(TEXT))
    if draw(st.booleans()):
        task.checkpoint.dir = draw(TEXT)
        task.checkpoint.interval_s = draw(NUMBERS)
    if draw(st.booleans()):
        task.retry.max_attempts = draw(st.one_of(st.integers(0, 5), UINT32))
        task.retry.backoff_s = draw(NUMBERS)
        task.retry.max_backoff_s = draw(NUMBERS)
    return task


@st.composite
def job_specs(draw: st.DrawFn) -> jobs_pb2.JobSpec:
    names = draw(st.lists(NAMES, min_size=1, max_size=3))
    job = jobs_pb2.JobSpec(
        id=draw(st.sampled_from(["", "", "fuzz-id", "j-1", "Bad Id"]) | TEXT),
        name=draw(st.sampled_from(["fuzz", ""]) | TEXT),
        tenant=draw(st.sampled_from(["", "team-a"]) | TEXT),
        priority=draw(st.one_of(st.integers(-1001, 1001), INT32)),
        tasks=draw(st.lists(tasks(names), max_size=4)),
        labels=draw(STRING_MAPS),
        queue=draw(st.sampled_from(["", "", "no-such-queue"]) | TEXT),
        priority_class=draw(st.sampled_from(["", "", "steady", "nope"])),
    )
    if draw(st.booleans()):
        job.constraints.domains.extend(draw(st.lists(st.integers(0, 6), max_size=3)))
        job.constraints.regions.extend(draw(st.lists(TEXT, max_size=2)))
        job.constraints.sites.extend(draw(st.lists(st.sampled_from(["steady"]) | TEXT, max_size=2)))
        job.constraints.node_labels.update(draw(STRING_MAPS))
    if draw(st.booleans()):
        job.objective.deadline_s = draw(NUMBERS)
        job.objective.max_cost_usd = draw(NUMBERS)
    if draw(st.booleans()):
        job.disconnect.lost_after_s = draw(NUMBERS)
        if draw(st.booleans()):
            job.disconnect.replace = draw(st.booleans())
        job.disconnect.reconcile = draw(st.integers(0, 5))  # type: ignore[assignment]
        job.disconnect.stop_after_s = draw(NUMBERS)
    return job


GOOD_TASK = jobs_pb2.TaskSpec(
    name="t", command=["/nonexistent/fuzz"], resources=jobs_pb2.ResourceRequest(cpu=1)
)


def blend(draw: st.DrawFn, good: Any, wild: Any) -> Any:
    """``good`` with about one field in thirty taken from ``wild``, so that most cases are near a
    valid message and a field's bad value is met on its own."""
    out = type(good)()
    out.CopyFrom(good)
    coin = draw(st.randoms())  # plain odds: hypothesis draws small integers far more often
    for field in good.DESCRIPTOR.fields:
        if coin.random() < 1 / 30:
            out.ClearField(field.name)
            if field.is_repeated:
                getattr(out, field.name).MergeFrom(getattr(wild, field.name))
            elif field.message_type is not None:
                if wild.HasField(field.name):
                    getattr(out, field.name).CopyFrom(getattr(wild, field.name))
            else:
                setattr(out, field.name, getattr(wild, field.name))
    return out


@st.composite
def near_valid_specs(draw: st.DrawFn) -> jobs_pb2.JobSpec:
    wild = draw(job_specs())
    job = blend(draw, jobs_pb2.JobSpec(name="fuzz", tasks=[GOOD_TASK]), wild)
    if job.tasks and wild.tasks:
        job.tasks[0].CopyFrom(blend(draw, job.tasks[0], wild.tasks[0]))
    assert isinstance(job, jobs_pb2.JobSpec)
    return job


def submit_batch(fuzzed: Fuzzed, send: Callable[[], Any], size: int, prefix: str) -> None:
    """Send one batch: accepted, it stored exactly ``size`` jobs (cancelled at once);
    refused, precisely, and it stored nothing."""
    before = fuzzed.stored()
    try:
        reply = send()
    except grpc.RpcError as err:
        fuzzed.outcomes[f"{prefix} {check_refusal(err, prefix=prefix)}"] += 1
        assert fuzzed.stored() == before, "a refused batch stored something"
        return
    fuzzed.outcomes[f"{prefix} OK"] += 1
    accepted = [job.id for job in reply.jobs]
    fuzzed.cancel(accepted)
    assert len(accepted) == size
    assert fuzzed.stored() == before + size


def check_spec_batches(fuzzed: Fuzzed, batch: list[jobs_pb2.JobSpec]) -> None:
    request = job_service_pb2.SubmitJobsRequest(specs=batch)
    submit_batch(fuzzed, lambda: fuzzed.jobs.SubmitJobs(request, timeout=30), len(batch), "specs")


def check_raw_bytes(fuzzed: Fuzzed, body: bytes) -> None:
    try:
        size = len(job_service_pb2.SubmitJobsRequest.FromString(body).specs)
    except Exception:
        size = -1  # not a valid request: it must be refused
    prefix = "specs" if size >= 0 else "request"
    submit_batch(fuzzed, lambda: fuzzed.raw_submit(body, timeout=30), size, prefix)


# Agent messages: a hello for the ghost site, then anything an agent could send.


@st.composite
def nodes(draw: st.DrawFn) -> resources_pb2.Node:
    node = resources_pb2.Node(
        name=draw(NAMES),
        arch=draw(st.sampled_from(["x86_64", "aarch64"]) | TEXT),
        cpu_cores=draw(MOSTLY_SANE),
        cpu_free=draw(MOSTLY_SANE),
        memory_mib=draw(UINT64),
        memory_free_mib=draw(UINT64),
        labels=draw(STRING_MAPS),
        schedulable=draw(st.booleans()),
    )
    for _ in range(draw(st.integers(0, 2))):
        node.devices.add(
            id=draw(TEXT),
            index=draw(UINT32),
            kind=draw(st.integers(0, 8)),  # type: ignore[arg-type]
            vendor=draw(TEXT),
            model=draw(TEXT),
            memory_total_mib=draw(UINT64),
            memory_free_mib=draw(UINT64),
            tflops_fp16=draw(MOSTLY_SANE),
            temperature_c=draw(MOSTLY_SANE),
            health=draw(st.integers(0, 5)),  # type: ignore[arg-type]
        )
    return node


def site_views(site: str) -> st.SearchStrategy[resources_pb2.SiteView]:
    return st.builds(
        lambda claimed, found, price, labels: resources_pb2.SiteView(
            site=claimed, nodes=found, price_per_device_hour=price, labels=labels
        ),
        st.sampled_from([site, site, "steady"]),
        st.lists(nodes(), max_size=3),
        NUMBERS,
        STRING_MAPS,
    )


@st.composite
def agent_messages(draw: st.DrawFn) -> site_link_service_pb2.AgentMessage:
    pb = site_link_service_pb2
    kind = draw(st.sampled_from(["full", "delta", "report", "heartbeat", "answer", "empty"]))
    message = pb.AgentMessage(correlation_id=draw(st.sampled_from(["", "c-1"]) | TEXT))
    if kind == "full":
        message.view.generation = draw(UINT64)
        message.view.full.CopyFrom(draw(site_views("fuzz-ghost")))
    elif kind == "delta":
        message.view.generation = draw(UINT64)
        delta = message.view.delta
        delta.upserted_nodes.extend(draw(st.lists(nodes(), max_size=2)))
        delta.removed_nodes.extend(draw(st.lists(NAMES, max_size=2)))
        delta.has_queue = draw(st.booleans())
        delta.queue.pending_tasks = draw(UINT32)
        delta.queue.estimated_wait_s = draw(NUMBERS)
        delta.has_links = draw(st.booleans())
        delta.links.add(peer_site=draw(TEXT), bandwidth_mbps=draw(NUMBERS), rtt_ms=draw(NUMBERS))
    elif kind == "report":
        message.task_status.CopyFrom(
            pb.TaskReport(
                job_id=draw(st.sampled_from(["", "j-unknown"]) | TEXT),
                task=draw(NAMES),
                epoch=draw(UINT64),
                state=draw(st.integers(0, 9)),  # type: ignore[arg-type]
                exit_code=draw(INT32),
                output_tail=draw(TEXT),
                reason=draw(TEXT),
                devices=draw(st.lists(TEXT, max_size=2)),
                interrupted=draw(st.booleans()),
            )
        )
    elif kind == "heartbeat":
        message.heartbeat.SetInParent()
    elif kind == "answer":
        message.offer_answer.SetInParent()
    return message


def envelope(*messages: site_link_service_pb2.AgentMessage) -> site_link_service_pb2.ConnectRequest:
    return site_link_service_pb2.ConnectRequest(messages=list(messages))


def check_stream(
    fuzzed: Fuzzed,
    hello_view: resources_pb2.SiteView,
    sent: list[site_link_service_pb2.AgentMessage],
) -> None:
    """One session of the ghost site: the hello, the fuzzed messages, a heartbeat to know they
    were handled, then goodbye. It ends OK or with a precise refusal."""
    pb = site_link_service_pb2
    writes: queue.Queue[pb.ConnectRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.ConnectRequest]:
        while (item := writes.get()) is not None:
            yield item

    call = fuzzed.link.Connect(requests(), timeout=30)
    writes.put(envelope(pb.AgentMessage(hello=pb.Hello(view=hello_view))))
    marker = pb.AgentMessage(heartbeat=pb.Heartbeat(generation=MARKER))
    try:
        welcomed = False
        for reply in call:
            kinds = [m.WhichOneof("body") for m in reply.messages]
            if "welcome" in kinds and not welcomed:
                welcomed = True
                writes.put(envelope(*sent))
                writes.put(envelope(marker))
            if any(m.heartbeat.generation == MARKER for m in reply.messages):
                writes.put(envelope(pb.AgentMessage(goodbye=pb.Goodbye(reason="fuzz"))))
        fuzzed.outcomes["stream OK" if welcomed else "stream ended before its welcome"] += 1
    except grpc.RpcError as err:
        fuzzed.outcomes[f"stream {check_refusal(err)}"] += 1
    finally:
        writes.put(None)


MARKER = 424242
"""The generation of the last heartbeat of a fuzzed session: its echo means all was handled."""
HELLO_VIEWS = st.one_of(
    st.just(resources_pb2.SiteView(site="fuzz-ghost")), site_views("fuzz-ghost")
)


def spec_batches() -> st.SearchStrategy[list[jobs_pb2.JobSpec]]:
    near = st.lists(near_valid_specs(), min_size=1, max_size=3)
    return st.one_of(near, near, st.lists(job_specs(), min_size=1, max_size=3))


def stream_cases() -> st.SearchStrategy[Any]:
    return st.tuples(HELLO_VIEWS, st.lists(agent_messages(), min_size=1, max_size=4))


@pytest.mark.parametrize("kind", ["specs", "bytes", "streams"])
def test_quick_fuzz(fuzzed: Fuzzed, kind: str) -> None:
    """A short run of each fuzzer, in the ordinary group."""
    run(fuzzed, kind, 70)


THOROUGH = {"specs": 2500, "bytes": 4000, "streams": 3500}
"""10,000 cases in all."""


@pytest.mark.slow
@pytest.mark.fuzz
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(THOROUGH))
def test_thorough_fuzz(fuzzed: Fuzzed, kind: str) -> None:
    """The long run of each fuzzer, in the fuzz group."""
    run(fuzzed, kind, THOROUGH[kind])


def run(fuzzed: Fuzzed, kind: str, examples: int) -> None:
    fuzzed.check_steady()
    chosen = settings(FUZZ_SETTINGS, max_examples=examples)
    if kind == "specs":
        given(spec_batches())(chosen(lambda batch: check_spec_batches(fuzzed, batch)))()
    elif kind == "bytes":
        given(st.binary(max_size=512))(chosen(lambda body: check_raw_bytes(fuzzed, body)))()
    else:
        given(stream_cases())(chosen(lambda case: check_stream(fuzzed, *case)))()
    fuzzed.check_steady()
    print(f"\n{kind}: {examples} cases:", dict(sorted(fuzzed.outcomes.items())))
    fuzzed.outcomes.clear()


def test_a_valid_spec_is_stored(fuzzed: Fuzzed) -> None:
    """The spec the fuzzer starts from is accepted, so its cases test more than one field."""
    check_spec_batches(fuzzed, [jobs_pb2.JobSpec(name="fuzz", tasks=[GOOD_TASK])])
    assert fuzzed.outcomes.pop("specs OK") == 1


def test_raw_bytes_that_are_no_message_are_refused(fuzzed: Fuzzed) -> None:
    """Bytes that do not parse as the request are INVALID_ARGUMENT on ``request``."""
    with pytest.raises(grpc.RpcError) as caught:
        fuzzed.raw_submit(b"\xff\xff\xff", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    check_refusal(caught.value)
