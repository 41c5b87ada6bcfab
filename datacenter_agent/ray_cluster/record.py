"""What an agent that adopts a task's Ray job needs of it, kept in the task's folder.

The offer and the commit are gone once the agent restarts, and Ray keeps only the job's
entrypoint and metadata. So at its submission the task's folder (``work_dir/JOB/TASK/EPOCH``)
also gets ``RECORD_FILE``: its tenant, the part of its spec its data needs (outputs,
checkpoint policy, replicas), the checkpoint it restores from (where it was staged, with the
progress it holds), its stop-after-disconnect and the slots it holds, each with the Ray node id
of a launched node. An agent that adopts the job rebuilds its data (checkpoints watched from
the job's start, outputs stored once it succeeds) and knows its nodes again, under the names it
gives their Ray nodes now.

Written whole (a partial file renamed over it) and readable by the agent's account only.
Blocking: call these through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from google.protobuf import json_format

from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2
from federation.durable import write_private_file

log = structlog.get_logger()

RECORD_FILE = "task-record.json"


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One committed task as an agent adopting its job needs it."""

    tenant: str
    spec: jobs_pb2.TaskSpec
    """Its outputs, checkpoint policy and replicas (nothing else of its spec is kept)."""
    restore: jobs_pb2.CheckpointRecord | None
    """The checkpoint it restores from, its path where the replicas read it; None: none."""
    stop_after_s: float
    slots: tuple[Slot, ...]
    ray_nodes: tuple[str, ...]
    """Per slot: the Ray node id of the launched node it is on; "" for a node of Ray's own."""

    def slots_now(self, names: Mapping[str, str]) -> tuple[Slot, ...]:
        """Its slots on the nodes as this agent names them: a launched node under the name
        ``names`` (Ray node id → node) gives its Ray node now; a slot whose launched node is
        not the site's any more (no longer alive) is left out."""
        slots = []
        for slot, ray_id in zip(self.slots, self.ray_nodes, strict=True):
            if not ray_id:
                slots.append(slot)
            elif (node := names.get(ray_id)) is not None:
                slots.append(Slot(node, slot.cpu, slot.memory_mib, slot.device_positions))
        return tuple(slots)


def kept_spec(spec: jobs_pb2.TaskSpec) -> jobs_pb2.TaskSpec:
    """The part of ``spec`` a record keeps."""
    kept = jobs_pb2.TaskSpec(outputs=spec.outputs, replicas=spec.replicas)
    if spec.HasField("checkpoint"):
        kept.checkpoint.CopyFrom(spec.checkpoint)
    return kept


def save_record(folder: Path, record: TaskRecord) -> None:
    """Writes ``record`` in the task's folder, whole and private to the agent's account."""
    data = {
        "tenant": record.tenant,
        "spec": json_format.MessageToDict(kept_spec(record.spec)),
        "restore": None if record.restore is None else json_format.MessageToDict(record.restore),
        "stop_after_s": record.stop_after_s,
        "slots": [
            {
                "node": slot.node,
                "cpu": slot.cpu,
                "memory_mib": slot.memory_mib,
                "device_positions": list(slot.device_positions),
                "ray_node": ray_id,
            }
            for slot, ray_id in zip(record.slots, record.ray_nodes, strict=True)
        ],
    }
    write_private_file(folder / RECORD_FILE, json.dumps(data).encode())


def read_record(folder: Path) -> TaskRecord | None:
    """The record of the task in ``folder``; None when there is none (a job submitted by an
    agent that kept none) or it cannot be read (logged)."""
    try:
        data: dict[str, Any] = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
        spec = json_format.ParseDict(data["spec"], jobs_pb2.TaskSpec())
        restore = None
        if data.get("restore") is not None:
            restore = json_format.ParseDict(data["restore"], jobs_pb2.CheckpointRecord())
        slots: Sequence[dict[str, Any]] = data["slots"]
        return TaskRecord(
            tenant=str(data["tenant"]),
            spec=spec,
            restore=restore,
            stop_after_s=float(data["stop_after_s"]),
            slots=tuple(
                Slot(
                    str(s["node"]),
                    float(s["cpu"]),
                    int(s["memory_mib"]),
                    tuple(int(p) for p in s["device_positions"]),
                )
                for s in slots
            ),
            ray_nodes=tuple(str(s.get("ray_node") or "") for s in slots),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, json_format.ParseError) as err:
        log.warning("task_record_unreadable", folder=str(folder), error=str(err))
        return None
