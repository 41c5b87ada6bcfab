"""A job's record as stored (one ``JobRecord`` a job, its events kept beside it), the changes a
mutation makes to it, where a waiting job stands in line, and the ids the coordinator makes."""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import (
    Callable,
    Iterable,
)
from dataclasses import dataclass

from google.protobuf import timestamp_pb2

from federation.api.v1 import jobs_pb2, records_pb2
from federation.common import job_state
from federation.errors import (
    JobNotFoundError,
)

JOBS = "/jobs/"
MAX_EVENTS_KEPT = 1000
"""Events a job record keeps, the newest: a job that moves for ever (a site that keeps losing
it) must not grow a value that every transition rewrites. Sequence numbers show the gap."""


OLD_EVENTS = "/events/"
"""Where key layout 1 stored each event, beside a job stored alone: every job it created has
its first event there. Layout 2 stores one ``JobRecord`` per job; a leading coordinator
migrates a store of layout 1 before it loads jobs (``federation.coordinator.layout``)."""


def job_key(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def read_record(value: bytes) -> records_pb2.JobRecord:
    """A stored job record (see ``JobRecord``)."""
    return records_pb2.JobRecord.FromString(value)


def _field(number: int, payload: bytes) -> bytes:
    """``payload`` as a length-delimited field ``number`` of a message, in the wire format."""
    size = len(payload)
    head = bytearray([number << 3 | 2])
    while size > 0x7F:
        head.append(size & 0x7F | 0x80)
        size >>= 7
    head.append(size)
    return bytes(head) + payload


def encoded_events(events: Iterable[jobs_pb2.JobEvent]) -> list[bytes]:
    """Each event as a ``JobRecord.events`` entry, ready to append to a record."""
    return [_field(2, event.SerializeToString()) for event in events]


def job_bytes(record: bytes) -> bytes:
    """The encoded job of a stored record, its events left undecoded: ``record_value`` writes
    the job as the record's first field."""
    if record[:1] == b"\x0a":  # field 1, length-delimited
        size = shift = 0
        at = 1
        while at < len(record):
            byte = record[at]
            at += 1
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if at + size <= len(record):
                    return record[at : at + size]
                break
            shift += 7
    return read_record(record).job.SerializeToString()


def record_value(job: jobs_pb2.Job, events: list[bytes]) -> bytes:
    """A serialized ``JobRecord`` of ``job`` and its already encoded events."""
    return b"".join((_field(1, job.SerializeToString()), *events))


def now_timestamp() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(time.time_ns())  # GetCurrentTime goes through datetime: slower
    return ts


@dataclass(frozen=True, slots=True)
class Change:
    """A task's transition, before it gets a sequence number."""

    task: str
    state: jobs_pb2.JobState.ValueType
    reason: str
    site: str = ""
    moved_from: str = ""
    """Set when the change moves the task away from this site."""


def find_task(job: jobs_pb2.Job, name: str) -> jobs_pb2.TaskStatus:
    for task in job.tasks:
        if task.name == name:
            return task
    raise JobNotFoundError(f"{job.id}/{name}")


def find_spec(job: jobs_pb2.Job, name: str) -> jobs_pb2.TaskSpec:
    """The spec of task ``name`` of ``job``."""
    for spec in job.spec.tasks:
        if spec.name == name:
            return spec
    raise JobNotFoundError(f"{job.id}/{name}")


def transition(
    job: jobs_pb2.Job,
    task_name: str,
    state: jobs_pb2.JobState.ValueType,
    reason: str,
    *,
    taking_back: bool = False,
) -> Change:
    """Move one task of ``job`` (in place) to ``state``; returns the change to record.

    ``taking_back`` allows the transitions of taking back a kept original copy.
    """
    task = find_task(job, task_name)
    job_state.check_transition(task.state, state, taking_back=taking_back)
    task.state = state
    task.reason = reason
    if state == job_state.RUNNING and not task.HasField("started_at"):
        task.started_at.CopyFrom(now_timestamp())
    if job_state.is_terminal(state):
        task.finished_at.CopyFrom(now_timestamp())
    return Change(task_name, state, reason, task.site)


def next_epoch(task: jobs_pb2.TaskStatus) -> None:
    """Give the task a new fencing token; one is never reused, even if it was given up."""
    task.issued_epoch = max(task.epoch, task.issued_epoch) + 1
    task.epoch = task.issued_epoch


def unplace(task: jobs_pb2.TaskStatus) -> None:
    """Forget the site and reservation a task had (it is about to be placed again)."""
    task.site = ""
    task.reservation_id = ""
    del task.endpoints[:]


def forget_devices(task: jobs_pb2.TaskStatus) -> None:
    """Forget the nodes and devices a site gave the task (it is to run elsewhere, or anew)."""
    del task.devices[:]
    del task.nodes[:]
    del task.models[:]


Mutation = Callable[[jobs_pb2.Job], list[Change]]


def new_event(
    job: jobs_pb2.Job,
    sequence: int,
    change: Change,
    state_after: jobs_pb2.JobState.ValueType | None = None,
    time: timestamp_pb2.Timestamp | None = None,
) -> jobs_pb2.JobEvent:
    return jobs_pb2.JobEvent(
        job_id=job.id,
        sequence=sequence,
        time=time if time is not None else now_timestamp(),
        state=change.state,
        task=change.task,
        site=change.site,
        reason=change.reason,
        job_state=job.state if state_after is None else state_after,
        moved_from=change.moved_from,
    )


LineKey = tuple[int, int, str]


def line_order(job: jobs_pb2.Job) -> LineKey:
    """Where a waiting job stands in line: higher priority first, then the earlier submitted,
    then by id. Never by retry timers: a job that waited longer is not overtaken by one that
    happened to be looked at when capacity freed."""
    return (-job.spec.priority, job.created_at.ToNanoseconds(), job.id)


MADE_ID = "j-"
"""How the ids the coordinator makes begin; no one may choose such an id."""


_ID_SUFFIXES: deque[str] = deque()
"""Random parts of made ids not used yet (``new_job_id``)."""


_ID_LOCK = threading.Lock()


_ID_MILLISECOND = [0]


_ID_TAKEN: set[str] = set()
"""The random parts used in ``_ID_MILLISECOND``: 24 random bits alone collide within a batch
of a few thousand jobs made in one millisecond (a birthday bound of about 3% at 1,000)."""


def new_job_id() -> str:
    """Time-ordered, so listing by key lists jobs in submission order. The random part is 3
    bytes from the system's CSPRNG, drawn for a thousand ids at a time (a system call per id
    was a sixth of a submission's CPU), and never repeated within one millisecond."""
    with _ID_LOCK:
        millisecond = int(time.time() * 1000)
        if millisecond != _ID_MILLISECOND[0]:
            _ID_MILLISECOND[0] = millisecond
            _ID_TAKEN.clear()
        while True:
            if not _ID_SUFFIXES:
                block = secrets.token_bytes(3 * 1024).hex()
                _ID_SUFFIXES.extend(block[at : at + 6] for at in range(0, len(block), 6))
            suffix = _ID_SUFFIXES.popleft()
            if suffix not in _ID_TAKEN:
                break
        _ID_TAKEN.add(suffix)
    return f"{MADE_ID}{millisecond:011x}-{suffix}"
