"""What the embedded core needs to adopt its tasks after an agent restart, kept in state_dir.

One JSON file per task (``tasks/<reservation id>.json``): written when the task has started,
rewritten with its final report when it ends, removed once the coordinator has acknowledged
that report. A file per task rather than a table in the journal: the core writes it, not the
session layer that owns the journal, a task's record is replaced whole (an atomic rename, no
schema), and one damaged file costs one task.

Beside them, ``tasks/agent`` names the agent that owns the tasks, ``PID START STATE``: an agent
writes ``running`` when it starts and ``leaving`` when it stops on purpose. Supervisors read it
when their agent exits (``federation.agent.supervisor``), and so does the next agent: a task
whose agent crashed is not adopted, it dies as it always did and the coordinator places it
again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from google.protobuf.message import DecodeError

from federation.agent.supervisor import (
    LEAVING,
    RUNNING,
    process_start,
    read_owner,
    write_atomically,
)
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey

log = structlog.get_logger()

OWNER_FILE = "agent"


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """A replica's supervisor, named for good by its pid and start time."""

    pid: int
    start_ticks: int


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A task of the embedded core as a later agent adopts it."""

    key: RunKey
    reservation_id: str
    spec: jobs_pb2.TaskSpec
    slots: tuple[Slot, ...]
    """What it holds: a restarted agent packs no other task onto it."""
    devices: list[str]
    tenant: str
    started_at: float
    """Wall-clock start, for its timeout and checkpoint progress."""
    restore: jobs_pb2.CheckpointRecord | None
    replicas: tuple[ReplicaRecord, ...]
    final: site_link_service_pb2.TaskReport | None = None
    """Its final report, once it has ended (kept until acknowledged)."""
    service: tuple[tuple[int, int, int], ...] = ()
    """A service's replicas: (port, restarts, revision) of each; empty for batch work."""
    revision: int = 0
    """The revision of ``spec`` (a service changed in place has a newer one)."""


class TaskRecords:
    """The records in one folder, and the owner file beside them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.owner = folder / OWNER_FILE

    def claim(self) -> tuple[int, int, str] | None:
        """Makes this process the owner; returns the owner before it (None: none known)."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        previous = read_owner(str(self.owner))
        self._write_owner(RUNNING)
        return previous

    def leave(self) -> None:
        """This agent stops on purpose: its tasks wait for the next one."""
        if read_owner(str(self.owner)) is not None:
            self._write_owner(LEAVING)

    def save(self, record: TaskRecord) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(str(self._path(record.reservation_id)), _encode(record))

    def drop(self, reservation_id: str) -> None:
        self._path(reservation_id).unlink(missing_ok=True)

    def load(self) -> list[TaskRecord]:
        """Every record; a damaged one is logged and removed, never adopted."""
        out = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                out.append(_decode(path.read_bytes()))
            except (OSError, ValueError, KeyError, TypeError, DecodeError) as err:
                log.warning("task_record_dropped", path=str(path), error=str(err))
                path.unlink(missing_ok=True)
        return out

    def _path(self, reservation_id: str) -> Path:
        return self.folder / f"{reservation_id}.json"

    def _write_owner(self, state: str) -> None:
        pid = os.getpid()
        write_atomically(str(self.owner), f"{pid} {process_start(pid)} {state}\n".encode())


def _b64(message: Any) -> str | None:
    return base64.b64encode(message.SerializeToString()).decode() if message is not None else None


def _encode(record: TaskRecord) -> bytes:
    return json.dumps(
        {
            "key": list(record.key),
            "reservation_id": record.reservation_id,
            "spec": _b64(record.spec),
            "slots": [dataclasses.asdict(slot) for slot in record.slots],
            "devices": record.devices,
            "tenant": record.tenant,
            "started_at": record.started_at,
            "restore": _b64(record.restore),
            "replicas": [[r.pid, r.start_ticks] for r in record.replicas],
            "final": _b64(record.final),
            "service": [list(replica) for replica in record.service],
            "revision": record.revision,
        }
    ).encode()


def _decode(data: bytes) -> TaskRecord:
    raw = json.loads(data)
    job_id, task, epoch = raw["key"]
    restore, final = raw["restore"], raw["final"]
    return TaskRecord(
        key=(str(job_id), str(task), int(epoch)),
        reservation_id=str(raw["reservation_id"]),
        spec=jobs_pb2.TaskSpec.FromString(base64.b64decode(raw["spec"])),
        slots=tuple(
            Slot(**{**slot, "device_positions": tuple(slot["device_positions"])})
            for slot in raw["slots"]
        ),
        devices=[str(d) for d in raw["devices"]],
        tenant=str(raw["tenant"]),
        started_at=float(raw["started_at"]),
        restore=(
            jobs_pb2.CheckpointRecord.FromString(base64.b64decode(restore)) if restore else None
        ),
        replicas=tuple(ReplicaRecord(int(pid), int(start)) for pid, start in raw["replicas"]),
        final=(
            site_link_service_pb2.TaskReport.FromString(base64.b64decode(final)) if final else None
        ),
        # Records from before revisions hold (port, restarts): revision 0.
        service=tuple(
            (int(port), int(restarts), int(rest[0]) if rest else 0)
            for port, restarts, *rest in raw.get("service", [])
        ),
        revision=int(raw.get("revision", 0)),
    )
